"""Causal attention over a ragged KV cache: decode (T = 1) and speculative verification (T = K + 1).

``ragged_attention(q, k_cache, v_cache, cache_seqlens, q_seqlens)`` attends T new queries per row
to that row's own cache prefix. The convention is FlashAttention's ``flash_attn_with_kvcache``:
``cache_seqlens`` counts the valid keys of a row *including* its new tokens (they were appended
before the call), and the queries sit at the end of that prefix, causal among themselves
(bottom-right aligned). A row may have fewer real queries than T (``q_seqlens``); its padding
rows come out as zeros.

Backends (see `specdec_kernels._backend`):

- ``"reference"``: `specdec_kernels.reference.attention`, row by row in fp32;
- ``"torch"``: vectorized and sync-free (no Python loop over rows, no host read of a length):
  the G query heads of a KV head and the T queries of a row are packed into one matrix, so each
  KV head's cache is multiplied once; a boolean mask built on device covers causality and the
  ragged lengths, V's entries beyond each length are zeroed bitwise (a NaN there would survive a
  zero weight), padding rows are zeroed at the end. Half-precision inputs are computed in fp32;
- ``"triton"``: `specdec_kernels.kernels.attention`, split-KV (flash-decoding) with a
  log-sum-exp merge; the split count is chosen per row on the device.

Value checks (``cache_seqlens`` within ``q_seqlens .. Lmax``, ``q_seqlens`` within ``1 .. T``)
are made without a host synchronization through ``torch._assert_async``: on CPU tensors a bad
value raises `DeviceCheckError` (a ``ValueError``) at once; on CUDA it is a device-side assert,
reported at the next synchronization.
"""

from __future__ import annotations

import math

import torch

from ._backend import DeviceCheckError, device_check, resolve_backend

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_lengths_tensor(name: str, t: torch.Tensor, batch: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a [B] integer tensor, got {type(t).__name__}")
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {list(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")


def check_ragged_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None
                                  ) -> tuple[int, int, int, int, int, int]:
    """Validate the arguments of `ragged_attention`; return ``(B, T, Hq, D, Lmax, Hkv)``.

    Shapes, dtypes and devices are checked on the host (ValueError naming the argument, with
    expected and actual values); the values of ``cache_seqlens`` and ``q_seqlens`` are checked
    on the device with `device_check` (no host synchronization).
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "[B, T, Hq, D]" if name == "q" else "[B, Lmax, Hkv, D]"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {list(t.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    B, T, Hq, D = q.shape
    if B < 1 or T < 1 or D < 1:
        raise ValueError(f"q must have B, T, D >= 1, got shape {list(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, "
                         f"got {list(v_cache.shape)}")
    Bk, Lmax, Hkv, Dk = k_cache.shape
    if Bk != B:
        raise ValueError(f"k_cache must have batch size {B} like q, got shape {list(k_cache.shape)}")
    if Dk != D:
        raise ValueError(f"k_cache must have head_dim {D} like q, got shape {list(k_cache.shape)}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"q's heads Hq={Hq} must be a multiple of k_cache's heads Hkv={Hkv}")
    if Lmax < T:
        raise ValueError(f"k_cache must hold at least T={T} positions, got Lmax={Lmax}")
    _check_lengths_tensor("cache_seqlens", cache_seqlens, B, q.device)
    cache_message = (f"cache_seqlens must lie in {'q_seqlens' if q_seqlens is not None else f'T={T}'}"
                     f"..Lmax={Lmax} for every row (it counts the new tokens, already in the cache)")
    q_message = f"q_seqlens must lie in 1..T={T} for every row"
    if q_seqlens is None:
        device_check(((cache_seqlens >= T) & (cache_seqlens <= Lmax)).all(), cache_message)
        return B, T, Hq, D, Lmax, Hkv
    _check_lengths_tensor("q_seqlens", q_seqlens, B, q.device)
    q_ok = (q_seqlens >= 1) & (q_seqlens <= T)
    cache_ok = (cache_seqlens >= q_seqlens) & (cache_seqlens <= Lmax)
    try:  # one check on the hot path; on CPU a failure is then attributed to its argument
        device_check((q_ok & cache_ok).all(), f"{q_message}; {cache_message}")
    except DeviceCheckError:
        device_check(q_ok.all(), q_message)
        device_check(cache_ok.all(), cache_message)
        raise
    return B, T, Hq, D, Lmax, Hkv


def _ragged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None,
                            scale: float) -> torch.Tensor:
    """Vectorized, sync-free CPU path (works on any device). Shapes as in `ragged_attention`."""
    B, T, Hq, D = q.shape
    Lmax, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    lengths = cache_seqlens.view(B, 1)
    n = T if q_seqlens is None else q_seqlens.view(B, 1)
    steps = torch.arange(T, device=q.device)
    keys = torch.arange(Lmax, device=q.device)
    # Query t of row b sees keys 0 .. last[b, t]; padding rows (t >= n) reach past the row's
    # length (possibly NaN) and are zeroed at the end.
    last = lengths - n + steps                                                # [B, T]
    allowed = (keys <= last.unsqueeze(2)).unsqueeze(2)                         # [B, T, 1, Lmax]
    # Entries beyond a row's length are never trusted. A NaN key there gives a NaN score, which
    # the mask below replaces by -inf; a NaN value times a zero weight is NaN in P @ V, so each
    # KV head's V is copied with its tail zeroed right before its P @ V (still in cache): a
    # bitwise AND with keep = -1 or 0, exact for every valid value (torch.where took up to 10x
    # longer on CPU).
    keep = -(keys < lengths).view(torch.int8).unsqueeze(2)                     # [B, Lmax, 1]
    k, v = k_cache.float(), v_cache.float()
    # Packed rows r = t * G + g of KV head h: its G query heads times the row's T queries.
    q_packed = (q.float() * scale).view(B, T, Hkv, G, D).permute(2, 0, 1, 3, 4).reshape(Hkv, B, T * G, D)
    scores = q_packed.new_empty(Hkv, B, T * G, Lmax)
    # One batched matmul over all rows per KV head (K read in place: [B, D, Lmax] strided views).
    for q_h, k_h, s_h in zip(q_packed, k.permute(2, 0, 3, 1), scores, strict=True):
        torch.bmm(q_h, k_h, out=s_h)
    scores = scores.view(Hkv, B, T, G, Lmax)
    probs = torch.where(allowed, scores, float("-inf")).softmax(-1).view(Hkv, B, T * G, Lmax)
    out = q_packed.new_empty(Hkv, B, T * G, D)
    for p_h, v_h, o_h in zip(probs, v.permute(2, 0, 1, 3), out, strict=True):
        torch.bmm(p_h, (v_h.view(torch.int32) & keep).view(torch.float32), out=o_h)
    out = out.view(Hkv, B, T, G, D).permute(1, 2, 0, 3, 4)                    # [B, T, Hkv, G, D]
    if q_seqlens is not None:
        out = torch.where((steps < n).view(B, T, 1, 1, 1), out, 0.0)
    return out.reshape(B, T, Hq, D).to(q.dtype)


def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None = None, *,
                     scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Causal GQA attention of T new queries per row over a ragged KV cache.

    Query i of row b sits at position ``cache_seqlens[b] - q_seqlens[b] + i`` and attends to keys
    ``0 .. position`` of row b (causal, bottom-right aligned). Keys at or beyond
    ``cache_seqlens[b]`` are never used, whatever they hold (NaN included).

    Args:
        q: [B, T, Hq, D] float32 / float16 / bfloat16: T new query tokens per row (padded when a
            row has fewer).
        k_cache, v_cache: [B, Lmax, Hkv, D], same dtype and device as ``q``, Hq = G * Hkv for
            any G >= 1 (query head j reads KV head j // G).
        cache_seqlens: [B] integer: valid keys in row b, INCLUDING its new tokens (already
            appended), in ``q_seqlens[b] .. Lmax``.
        q_seqlens: [B] integer in ``1 .. T``: real queries per row; None means T for every row.
        scale: softmax scale, default ``1 / sqrt(D)``.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"reference"``, ``"torch"`` or
            ``"triton"``.

    Returns:
        [B, T, Hq, D] in ``q.dtype`` (accumulated in float32); rows ``i >= q_seqlens[b]`` are zero.

    Raises:
        ValueError: a shape, head count, dtype or device mismatch, naming the argument; on CPU
            also out-of-range lengths (`DeviceCheckError`); on CUDA those are device asserts.
    """
    backend = resolve_backend(backend, q.device if isinstance(q, torch.Tensor) else "cpu")
    if backend == "reference":
        from .reference.attention import ragged_attention as reference

        return reference(q, k_cache, v_cache, cache_seqlens, q_seqlens, scale=scale)
    D = check_ragged_attention_inputs(q, k_cache, v_cache, cache_seqlens, q_seqlens)[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if backend == "torch":
        return _ragged_attention_torch(q, k_cache, v_cache, cache_seqlens, q_seqlens, scale)
    from .kernels.attention import ragged_attention_triton

    return ragged_attention_triton(q, k_cache, v_cache, cache_seqlens, q_seqlens, scale)
