"""The bit layout of a tree mask, shared by the attention op and its Triton kernel (imports torch only)."""

from __future__ import annotations

import torch


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool -> [B, T, ceil(T / 32)] int32, the layout the Triton kernel reads: bit
    ``j % 32`` of word ``j // 32`` of query i's row is ``tree_mask[b, i, j]`` (bit 31 is the
    sign bit). No host synchronization."""
    B, T, _ = tree_mask.shape
    words = -(-T // 32)
    padded = torch.zeros(B, T, words * 32, dtype=torch.int64, device=tree_mask.device)
    padded[..., :T] = tree_mask
    weights = torch.ones(32, dtype=torch.int64, device=tree_mask.device) << torch.arange(32, device=tree_mask.device)
    packed = (padded.view(B, T, words, 32) * weights).sum(-1)                   # 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
