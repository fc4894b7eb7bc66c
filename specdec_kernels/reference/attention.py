"""Reference causal attention over a ragged KV cache: one row and one head at a time, in fp32.

Same signature as `specdec_kernels.ragged_attention` (without ``backend``; inputs are assumed
checked, as the op does before it dispatches). It reads like the definition: query i of row b
sits at position ``cache_seqlens[b] - q_seqlens[b] + i`` and attends, with an explicit boolean
mask, to keys ``0 .. position`` of its own row (the last ``sliding_window`` of them, with a
window; with a ``tree_mask``, to the keys before the row's new tokens and to new token j iff
``tree_mask[b, i, j]``); rows ``i >= q_seqlens[b]`` are zero. Only the
valid prefix of each cache row is ever sliced, so whatever lies beyond ``cache_seqlens[b]``
cannot reach the output. Speed is not a goal. Imports torch and einops only.
"""

from __future__ import annotations

import math

import torch
from einops import einsum, rearrange


def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None = None, *,
                     scale: float | None = None, sliding_window: int | None = None,
                     tree_mask: torch.Tensor | None = None, plan: object = None) -> torch.Tensor:
    """Causal (bottom-right aligned) GQA attention of T new queries per row over a ragged cache.

    Args:
        q: [B, T, Hq, D] float32 / float16 / bfloat16.
        k_cache, v_cache: [B, Lmax, Hkv, D], same dtype and device as ``q``; Hq = G * Hkv and
            query head ``j`` reads KV head ``j // G``.
        cache_seqlens: [B] integer, valid keys per row including the new tokens, in
            ``q_seqlens[b] .. Lmax``.
        q_seqlens: [B] integer in ``1 .. T`` (real queries per row), or None for T.
        scale: softmax scale, default ``1 / sqrt(D)``.
        sliding_window: W >= 1: the query at position p sees only keys ``p - W + 1 .. p``;
            None: keys ``0 .. p``.
        tree_mask: [B, T, T] bool or None: query i of row b sees every key before the row's
            ``q_seqlens[b]`` new tokens (the last keys of its prefix) and new token j iff
            ``tree_mask[b, i, j]`` (None: j <= i, causal). Not with ``sliding_window``.
        plan: the op's `RaggedAttentionPlan`; unused (the reference builds its masks row by row).

    Returns:
        [B, T, Hq, D] in ``q.dtype`` (computed in float32); rows ``i >= q_seqlens[b]`` are zero.
    """
    B, T, Hq, D = q.shape
    G = Hq // k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.zeros(B, T, Hq, D, dtype=q.dtype, device=q.device)
    for b in range(B):
        length = int(cache_seqlens[b])
        n = T if q_seqlens is None else int(q_seqlens[b])
        # Query head h * G + g reads KV head h: the G query heads of a KV head form a group.
        qb = rearrange(q[b, :n].float(), "t (h g) d -> h g t d", g=G)
        kb, vb = k_cache[b, :length].float(), v_cache[b, :length].float()      # [L, Hkv, D]
        positions = length - n + torch.arange(n, device=q.device)               # [n]
        keys = torch.arange(length, device=q.device)[None, :]
        mask = keys <= positions[:, None]                                        # [n, L]
        if tree_mask is not None:  # the new tokens (keys length - n ..) as the tree says
            mask = torch.cat([mask[:, : length - n], tree_mask[b, :n, :n].to(q.device)], 1)
        if sliding_window is not None:
            mask &= keys > positions[:, None] - sliding_window
        scores = einsum(qb, kb, "h g t d, l h d -> h g t l") * scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        heads = einsum(probs, vb, "h g t l, l h d -> h g t d")
        out[b, :n] = rearrange(heads, "h g t d -> t (h g) d").to(q.dtype)
    return out
