"""The samplers' torch backend: vectorized and sync-free, what runs on CPU tensors.

Each entry point takes the public op's arguments (see `specdec_kernels.sampling`), so the ops
dispatch to it like to the reference and the Triton kernels. Rows are sampled by a two-level
inverse CDF over `SAMPLE_CHUNK`-entry chunks, from ``RejectionNoise.uniform``: the full row is
read once for its chunk sums, then one chunk is read again.

Without validation, values read that no token can come from are refused on the device
(`refuse_rows_without_token`), with flags taken from what the sampler computes anyway: the greedy
rows' maxima, the sampled row's chunk sums, the drafted tokens' probabilities.
"""

from __future__ import annotations

import torch

from ._checks import ValueChecks
from ._logits import process_logits
from ._noise import make_rejection_noise
from ._sampling_checks import LOGITS_ARGS, PROBS_ARGS, refuse_rows_without_token, require_values_read
from ._types import SAMPLE_CHUNK, RejectionNoise, RejectionOutput


def first_rejection_index_torch(accepted: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` bool, ``[B]`` int64 counts in ``[0, K]`` -> ``[B]`` int64: the first position
    ``< n_b`` that is not accepted, else ``n_b``."""
    B, K = accepted.shape
    if K == 0:
        return torch.zeros(B, dtype=torch.int64, device=accepted.device)
    pos = torch.arange(K, device=accepted.device)
    rejected = ~accepted & (pos < n[:, None])
    return torch.where(rejected, pos, n[:, None]).amin(-1)


def rejection_sample_torch(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor,
                           num_draft_tokens: torch.Tensor | None = None, *, greedy: bool | torch.Tensor = False,
                           generator: torch.Generator | None = None, seed: int | torch.Tensor | None = None,
                           noise: RejectionNoise | None = None, checks: ValueChecks | None = None) -> RejectionOutput:
    """`specdec_kernels.rejection_sample` on the torch backend, for checked shapes. With ``checks``,
    the values it reads are added to them (`require_values_read`), from sums and minima of the rows
    it has in hand anyway; without, NaN or inf among them raises (`refuse_rows_without_token`)."""
    return _verify(target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, generator, seed, noise,
                   checks, refuse_as=PROBS_ARGS if checks is None else None)


def rejection_sample_logits_torch(target_logits: torch.Tensor, draft_logits: torch.Tensor | None,
                                  draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor | None = None, *,
                                  temperature: float | torch.Tensor = 1.0, top_k: int | None = None,
                                  top_p: float | None = None, greedy: bool | torch.Tensor = False,
                                  generator: torch.Generator | None = None, seed: int | torch.Tensor | None = None,
                                  noise: RejectionNoise | None = None, checks: ValueChecks | None = None
                                  ) -> RejectionOutput:
    """`specdec_kernels.rejection_sample_logits` on the torch backend, for checked inputs:
    `process_logits` on both models' logits, then `rejection_sample_torch`'s verification. Without
    ``checks`` (the op's validation of every logits row it may read), rows read that leave no token
    raise: `process_logits` turns them into NaN rows, which the verification refuses."""
    if isinstance(temperature, torch.Tensor):
        greedy = (temperature == 0) | greedy
    elif temperature == 0:
        greedy = True
    if greedy is True:  # known on the host: only argmaxes of the target are taken
        # At temperature 0 process_logits' one-hot sits at the raw logits' argmax; otherwise the
        # processed probabilities decide (softmax rounding can tie logits that differ).
        target_probs = target_logits if temperature == 0 else process_logits(target_logits, temperature, top_k, top_p)
        draft_probs = None
    else:
        target_probs = process_logits(target_logits, temperature, top_k, top_p)
        draft_probs = process_logits(draft_logits, temperature, top_k, top_p) if draft_logits is not None else None
    return _verify(target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, generator, seed, noise,
                   None, refuse_as=LOGITS_ARGS if checks is None else None)


def _verify(target: torch.Tensor, draft: torch.Tensor | None, draft_token_ids: torch.Tensor,
            num_draft_tokens: torch.Tensor | None, greedy: bool | torch.Tensor, generator: torch.Generator | None,
            seed: int | torch.Tensor | None, noise: RejectionNoise | None, checks: ValueChecks | None,
            refuse_as: tuple[str, str] | None) -> RejectionOutput:
    """`rejection_sample_torch` on ``target`` / ``draft`` rows (probabilities, or raw logits where
    every row is greedy at temperature 0); ``refuse_as``: the arguments to name when a value read
    leaves no token (None: the op validates them instead)."""
    B, K1, _ = target.shape
    K = K1 - 1
    ids, n = _sanitize(draft_token_ids, num_draft_tokens, B, K)
    ragged = num_draft_tokens is not None
    if greedy is True:  # every row verifies by argmax: no noise, no residuals
        return _greedy_verify(target, ids, n, checks, ragged, refuse_as)
    if noise is None:
        noise = make_rejection_noise(B, K, generator=generator, seed=seed, device=target.device)
    elif noise.uniform is None:
        raise ValueError("the torch backend consumes noise.uniform ([B, 2] float32); it is None")
    greedy_rows = greedy if isinstance(greedy, torch.Tensor) else None
    return _rejection_sample(target, draft, ids, n, greedy_rows, noise, checks, ragged, refuse_as)


def _sanitize(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor | None, B: int, K: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ids and ``[B]`` int64 draft counts.

    Counts outside ``[0, K]`` (possible only with ``validate=False``) are brought into range so
    that no index leaves its tensor; that is an index guard, not a change of randomness.
    """
    device = draft_token_ids.device
    ids = draft_token_ids.to(torch.int64)
    if num_draft_tokens is None:
        n = torch.full((B,), K, dtype=torch.int64, device=device)
    else:
        n = num_draft_tokens.to(torch.int64).clamp(0, K)
    return ids, n


def _chunk_sums(w: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` -> ``[B, ceil(V / C)]`` float32 sums of consecutive chunks of `SAMPLE_CHUNK` entries
    (the last chunk may be shorter). No copy of ``w`` is made."""
    B, V = w.shape
    C = SAMPLE_CHUNK
    full = V // C
    parts = [w[:, : full * C].reshape(B, full, C).sum(-1)] if full else []
    if full * C < V:
        parts.append(w[:, full * C :].sum(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _pick(cdf: torch.Tensor, u: torch.Tensor, size: int) -> torch.Tensor:
    """First index whose prefix sum exceeds ``u * total`` (``u`` in [0, 1)), ``[B, 1]`` int64.

    An entry of weight 0 is never picked. Rows without mass (all zero or negative: possible only
    without validation) get an index guard, so the result stays in ``[0, size)``; non-finite rows
    never get here (`refuse_rows_without_token` raises first).
    """
    return torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True).clamp_max(size - 1)


def _rejection_sample(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    ids: torch.Tensor,
    n: torch.Tensor,
    greedy: torch.Tensor | None,
    noise: RejectionNoise,
    checks: ValueChecks | None,
    ragged: bool,
    refuse_as: tuple[str, str] | None,
) -> RejectionOutput:
    """Vectorized, sync-free rejection sampling (no Python loop over rows). ``greedy``: ``[B]``
    bool rows verified by argmax, or None for none; ``ragged``: whether ``n`` came from the caller;
    ``refuse_as``: as in `_verify`."""
    B, K1, V = target.shape
    K = K1 - 1
    device = target.device
    rows = torch.arange(B, device=device)
    valid_id = (ids >= 0) & (ids < V)
    safe_ids = torch.where(valid_id, ids, torch.zeros_like(ids))
    # Acceptance: u * q(x) <= p(x), q(x) == 0 rejects.
    p_x = target[:, :K].gather(-1, safe_ids[..., None]).squeeze(-1).float()
    q_x = draft.gather(-1, safe_ids[..., None]).squeeze(-1).float() if draft is not None else None
    accepted = (noise.accept * q_x <= p_x) & (q_x > 0) if q_x is not None else noise.accept <= p_x
    accepted &= valid_id
    if greedy is not None:
        maxima, argmax = target.max(-1)  # [B, K+1], the first maximum's index; maxima serve the checks
        accepted = torch.where(greedy[:, None], ids == argmax[:, :K], accepted)
    j = first_rejection_index_torch(accepted, n)
    # Residual row at j (or the bonus row p_{n_b}), sampled by a two-level inverse CDF: chunk sums
    # of the full row, then one chunk of SAMPLE_CHUNK entries. Each full row is copied once and
    # updated in place; everything after the chunk sums is [B, nC] or [B, C].
    C = SAMPLE_CHUNK
    is_rejection = j < n
    # index_select on the flattened rows copies whole rows (memcpy); advanced indexing
    # target[rows, j] computes an offset per element, which is slower.
    w = target.reshape(B * K1, V).index_select(0, rows * K1 + j).float()  # p_j, a fresh copy
    chunk_p = _chunk_sums(w)
    p_row = q_row = None
    if checks is not None:  # the row's sum is its chunk sums' sum; NaN and inf reach it too
        p_row = (w.amin(-1), chunk_p.sum(-1))
    jd = j.clamp_max(K - 1) if K > 0 else j  # a valid row index; only used where j < n <= K
    q_sum = None
    if K > 0 and draft is not None:
        q_j = draft.reshape(B * K, V).index_select(0, rows * K + jd)
        if checks is not None or refuse_as is not None:
            # The clamp below hides +inf in q_j: its sum shows NaN and inf alike.
            q_sum = q_j.sum(-1) if q_j.dtype == torch.float32 else q_j.sum(-1, dtype=torch.float32)
        if checks is not None:
            q_row = (q_j.amin(-1), q_sum)
        w.sub_(q_j).clamp_min_(0.0)  # max(p_j - q_j, 0), in float32
    elif K > 0:
        x_j = safe_ids.gather(1, jd[:, None])
        w.scatter_(1, x_j, (w.gather(1, x_j) - 1.0).clamp_min_(0.0))  # q one-hot at the draft
    chunk_w = _chunk_sums(w) if K > 0 else chunk_p
    cdf_w, cdf_p = chunk_w.double().cumsum(-1), chunk_p.double().cumsum(-1)
    # Bonus rows sample p_{n_b}; a residual with no mass at all falls back to p_j.
    use_p = ~is_rejection | ~(cdf_w[:, -1] > 0)
    cdf = torch.where(use_p[:, None], cdf_p, cdf_w)
    nC = cdf.shape[1]
    c = _pick(cdf, noise.uniform[:, :1], nC)  # [B, 1]
    # The chosen chunk, gathered from the inputs (entries past V get weight 0).
    cols = c * C + torch.arange(C, device=device)
    inside = cols < V
    cols = cols.clamp_max(V - 1)
    p_c = target[rows[:, None], j[:, None], cols].float()
    if K > 0 and draft is not None:
        w_c = (p_c - draft[rows[:, None], jd[:, None], cols].float()).clamp_min(0.0)
    elif K > 0:
        w_c = torch.where(cols == x_j, (p_c - 1.0).clamp_min(0.0), p_c)
    else:
        w_c = p_c
    w_c = torch.where(use_p[:, None], p_c, w_c)
    w_c = torch.where(inside, w_c, torch.zeros_like(w_c))
    i = _pick(w_c.double().cumsum(-1), noise.uniform[:, 1:], C)
    token = (c * C + i).squeeze(1).clamp_max(V - 1)
    if greedy is not None:
        token = torch.where(greedy, argmax.gather(1, j[:, None]).squeeze(1), token)
    if checks is not None:
        require_values_read(checks, target.dtype, V, n, j, False if greedy is None else greedy, ragged=ragged,
                            p_x=p_x, q_x=q_x, p_row=p_row, q_row=q_row,
                            maxima=None if greedy is None else maxima)
    if refuse_as is not None:
        # Values read: the drafted tokens' probabilities up to the first rejection, then the row
        # sampled from (its chunk sums: NaN or inf in it reaches them), and q_j at a rejection.
        pos = torch.arange(K, device=device)
        tested = (pos <= j[:, None]) & (pos < n[:, None]) & valid_id
        bad_t = (~p_x.isfinite() & tested).any(-1) | ~cdf_p[:, -1].isfinite()
        bad_d = torch.zeros_like(bad_t)
        if q_x is not None:
            bad_d = (~q_x.isfinite() & tested).any(-1)
            if q_sum is not None:
                bad_d |= is_rejection & ~q_sum.isfinite()
        if greedy is not None:
            bad_t = torch.where(greedy, _greedy_rows_without_argmax(maxima, j), bad_t)
            bad_d &= ~greedy
        refuse_rows_without_token(torch.stack((bad_t, bad_d)), refuse_as)
    return _output(ids, j, token)


def _greedy_rows_without_argmax(maxima: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows whose maxima ``[B, K+1]`` (NaN wherever a NaN is in the row) are not
    finite at a position ``<= j``, the rows greedy verification read."""
    read = torch.arange(maxima.shape[1], device=maxima.device) <= j[:, None]
    return (~maxima.isfinite() & read).any(-1)


def _output(ids: torch.Tensor, j: torch.Tensor, token: torch.Tensor) -> RejectionOutput:
    """`RejectionOutput` from drafts ``ids`` [B, K], accepted counts ``j`` [B] and the emitted
    token [B]: ``token_ids`` holds the accepted drafts, the emitted token, then -1."""
    B, K = ids.shape
    pos = torch.arange(K + 1, device=ids.device)
    drafts = torch.cat([ids, ids.new_zeros(B, 1)], dim=1)
    token_ids = torch.where(
        pos < j[:, None], drafts, torch.where(pos == j[:, None], token[:, None], torch.full_like(drafts, -1))
    )
    return RejectionOutput(token_ids, j)


def _greedy_verify(target: torch.Tensor, ids: torch.Tensor, n: torch.Tensor, checks: ValueChecks | None,
                   ragged: bool, refuse_as: tuple[str, str] | None) -> RejectionOutput:
    """Every row greedy: drafts are kept while they equal the argmax (the first maximum) of
    ``target`` [B, K+1, V], the target's probabilities (or its raw logits at temperature 0, where
    process_logits' one-hot sits at their argmax), then the argmax is emitted; no noise. The
    maxima serve the checks and the refusal of rows without an argmax (NaN, +inf, only -inf)."""
    maxima, argmax = target.max(-1)  # [B, K+1], the first maximum's index
    j = first_rejection_index_torch(ids == argmax[:, : ids.shape[1]], n)
    if checks is not None:
        require_values_read(checks, target.dtype, target.shape[-1], n, j, True, ragged=ragged, maxima=maxima)
    if refuse_as is not None:
        bad_t = _greedy_rows_without_argmax(maxima, j)
        refuse_rows_without_token(torch.stack((bad_t, torch.zeros_like(bad_t))), refuse_as)
    return _output(ids, j, argmax.gather(1, j[:, None]).squeeze(1))
