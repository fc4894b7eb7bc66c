"""Drafts: where the speculative tokens come from.

A draft is either a model that follows the model protocol and shares the target's vocabulary
(`specdec_kernels.Llama.truncated` gives the target's first layers), or a model-free proposer
such as `PromptLookupDraft`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_lengths_tensor, device_check, is_int


@dataclass
class PromptLookupDraft:
    """Model-free draft: propose the tokens that followed the most recent earlier occurrence of
    the context's last n-gram (prompt lookup decoding). Tries n = max_ngram down to min_ngram;
    rows without a match propose nothing that step. Proposals are deterministic (no draft
    probabilities), so verification accepts a draft exactly when the target would sample it."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not (is_int(self.min_ngram) and is_int(self.max_ngram) and 1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(f"min_ngram and max_ngram must be ints with 1 <= min_ngram <= max_ngram, got "
                             f"{self.min_ngram!r}, {self.max_ngram!r}")

    def propose(self, context: torch.Tensor, context_lengths: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose up to ``k`` tokens per row, sync-free.

        Args:
            context: [B, L] int64 token history; row b's first ``context_lengths[b]`` are real.
            context_lengths: [B] int64.
            k: tokens to propose at most.

        Returns:
            (draft_token_ids [B, k] int64, zero-padded; num_draft_tokens [B] int64 in [0, k]).

        Raises:
            ValueError: bad shapes or dtypes, ``k`` not an int >= 1; a length outside ``0 .. L``
                (`DeviceCheckError` on CPU, a device assert on CUDA).
        """
        if not is_int(k) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if not isinstance(context, torch.Tensor) or context.dim() != 2 or context.dtype != torch.int64:
            is_tensor = isinstance(context, torch.Tensor)
            got = f"{context.dtype} {tuple(context.shape)}" if is_tensor else type(context).__name__
            raise ValueError(f"context must be a [B, L] int64 tensor, got {got}")
        B, L = context.shape
        if L < 1:
            raise ValueError("context must have at least one column")
        device = context.device
        check_lengths_tensor("context_lengths", context_lengths, B, device, on=f"{device} like context")
        device_check(((context_lengths >= 0) & (context_lengths <= L)).all(),
                     f"context_lengths must lie in 0..L={L} for every row")
        k = int(k)
        found = torch.zeros(B, dtype=torch.bool, device=device)
        start = torch.zeros(B, dtype=torch.int64, device=device)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n >= L:
                continue
            tail = context.gather(1, (context_lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0))
            windows = context.unfold(1, n, 1)  # [B, L - n + 1, n]
            match = (windows == tail[:, None, :]).all(-1)
            # A match must end before the tail itself, so that a continuation exists.
            starts = torch.arange(L - n + 1, device=device)
            match &= starts[None, :] + n < context_lengths[:, None]
            match &= (context_lengths >= n + 1)[:, None]
            latest = torch.where(match, starts[None, :], -1).amax(1)  # most recent occurrence
            take = (latest >= 0) & ~found
            start = torch.where(take, latest + n, start)
            found |= take
        num = torch.where(found, (context_lengths - start).clamp(max=k), 0)
        offsets = torch.arange(k, device=device)
        ids = context.gather(1, (start[:, None] + offsets).clamp(max=L - 1))
        return torch.where(offsets < num[:, None], ids, 0), num
