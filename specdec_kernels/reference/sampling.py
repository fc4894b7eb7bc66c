"""Reference speculative verification: one row at a time, as in Leviathan et al. 2022, Algorithm 1.

Same signatures as `specdec_kernels.sampling` (without ``validate`` and ``backend``; both samplers
add ``checks=``, the op's validation, or None); slow on purpose (Python loops over rows and
positions, host reads everywhere). The random inputs come from `RejectionNoise`, so a fast path
that consumes the same noise must produce the same tokens. Without ``checks``, a value read that
no token can come from raises, as on every backend (`refuse_rows_without_token`).

Imports only torch and the modules the fast paths share with it (types, noise, input checks),
never a fast path: the oracle cannot share a bug with what it judges.
"""

from __future__ import annotations

import torch

from .._checks import ValueChecks
from .._noise import make_rejection_noise
from .._sampling_checks import (
    LOGITS_ARGS,
    PROBS_ARGS,
    effective_temperature,
    refuse_rows_without_token,
    require_values_read_after,
)
from .._types import SAMPLE_CHUNK, RejectionNoise, RejectionOutput


def process_logits(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """Reference of `specdec_kernels.process_logits`, written from the definitions rather than
    with thresholds: an entry survives top-k when fewer than k entries are strictly larger, and
    survives top-p when the (top-k renormalized) mass of the strictly larger entries is below
    top_p. Temperature-0 rows are one-hot at the first maximum. O(V^2) per row: small V only."""
    B, V = logits.shape[0], logits.shape[-1]
    temperature = effective_temperature(temperature)  # below float32's smallest normal: greedy
    temperature = (temperature.tolist() if isinstance(temperature, torch.Tensor) else [temperature] * B)
    out = torch.zeros(logits.shape, dtype=torch.float32)
    for b in range(B):
        rows = logits[b].float().cpu().reshape(-1, V)
        for r, row in enumerate(rows):
            if temperature[b] == 0:
                if torch.isfinite(row.max()):
                    out[b].view(-1, V)[r, int(row.argmax())] = 1.0
                else:  # no argmax: an undefined distribution, as the softmax of such a row
                    out[b].view(-1, V)[r] = float("nan")
                continue
            x = row / temperature[b]
            larger = x[None, :] > x[:, None]  # larger[i, j]: entry j is strictly larger than entry i
            keep = torch.ones(V, dtype=torch.bool)
            if top_k is not None:
                keep &= larger.sum(1) < top_k
            if top_p is not None and top_p < 1.0:  # 1.0 keeps every entry (rounding could drop tails)
                p = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
                keep &= (larger.float() * p[None, :]).sum(1) < top_p
            out[b].view(-1, V)[r] = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
    return out.to(logits.device)


def _sample_race(w: torch.Tensor, exponential: torch.Tensor) -> int:
    """Exponential race: ``argmax_v w_v / E_v`` over entries with ``w_v > 0`` (first maximum)."""
    scores = torch.where(w > 0, w / exponential, torch.full_like(w, -1.0))
    return int(scores.argmax())


def _sample_inverse_cdf(w: torch.Tensor, uniform: torch.Tensor) -> int:
    """Two-level inverse CDF: a chunk of `SAMPLE_CHUNK` consecutive entries (the last one may be
    shorter) with probability proportional to its mass, then an entry of that chunk proportional
    to its weight. Each level picks the first prefix sum above ``u * total``, ``u`` in [0, 1), so an
    entry of weight 0 is never picked."""
    V = w.shape[0]
    C = SAMPLE_CHUNK
    chunks = [w[start : start + C] for start in range(0, V, C)]
    full = [ch for ch in chunks if ch.numel() == C]
    sums = [torch.stack(full).sum(-1)] if full else []
    if len(full) < len(chunks):
        sums.append(chunks[-1].sum(-1, keepdim=True))
    chunk_cdf = torch.cat(sums).double().cumsum(0)
    c = int(torch.searchsorted(chunk_cdf, uniform[0].double() * chunk_cdf[-1], right=True))
    c = min(c, len(chunks) - 1)
    inner_cdf = chunks[c].double().cumsum(0)
    i = int(torch.searchsorted(inner_cdf, uniform[1].double() * inner_cdf[-1], right=True))
    return min(c * C + min(i, chunks[c].numel() - 1), V - 1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    *,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    noise: RejectionNoise | None = None,
    checks: ValueChecks | None = None,
) -> RejectionOutput:
    """Reference of `specdec_kernels.rejection_sample` (shapes are assumed checked).

    Shapes: target ``[B, K+1, V]``, draft ``[B, K, V]`` or None, ids ``[B, K]``, counts ``[B]``.
    Samples with the exponential race when ``noise.exponential`` is given, else with the
    two-level inverse CDF of ``noise.uniform``. With ``checks`` (``validate=True``), the values
    it read are added to them; without, NaN or inf among them raises. Returns `RejectionOutput`.
    """
    out, bad = _verify(target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, generator, seed, noise)
    if checks is not None:
        require_values_read_after(checks, target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, out)
    else:
        refuse_rows_without_token(bad, PROBS_ARGS)
    return out


def _finite(x: torch.Tensor) -> bool:
    return bool(x.isfinite().all())


def _verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    generator: torch.Generator | None,
    seed: int | torch.Tensor | None,
    noise: RejectionNoise | None,
) -> tuple[RejectionOutput, torch.Tensor]:
    """`rejection_sample` without its checks: the output, and ``[2, B]`` bool flags of the batch
    rows where a target (row 0) or draft (row 1) value read is NaN or inf: a greedy row's largest
    entries, a drafted token's probabilities, the row a token is drawn from (and q_j at a rejection)."""
    B, K1, V = target_probs.shape
    K = K1 - 1
    device = target_probs.device
    if noise is None:
        noise = make_rejection_noise(B, K, generator=generator, seed=seed, device=device)
    elif noise.uniform is None and noise.exponential is None:
        raise ValueError("the reference backend consumes noise.uniform ([B, 2] float32) or "
                         "noise.exponential ([B, V]); both are None")
    p_all = target_probs.float().cpu()
    q_all = draft_probs.float().cpu() if draft_probs is not None else None
    ids_all = draft_token_ids.long().cpu()
    counts = [K] * B if num_draft_tokens is None else [min(max(int(n), 0), K) for n in num_draft_tokens]
    greedy_rows = [bool(g) for g in greedy] if isinstance(greedy, torch.Tensor) else [greedy] * B
    accept_u = noise.accept.cpu()
    token_ids = torch.full((B, K1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    bad = torch.zeros(2, B, dtype=torch.bool)

    for b in range(B):
        p, ids, n = p_all[b], ids_all[b], counts[b]
        accepted = 0
        if greedy_rows[b]:
            # Accept while the draft is the target's argmax; emit the argmax where it is not.
            while accepted < n and int(ids[accepted]) == int(p[accepted].argmax()):
                accepted += 1
            token = int(p[accepted].argmax())
            bad[0, b] = not _finite(p[: accepted + 1].amax(-1))  # no argmax: NaN, +inf or only -inf
        else:
            rejected = False
            while accepted < n:
                x = int(ids[accepted])
                p_x = p[accepted, x] if 0 <= x < V else torch.tensor(0.0)
                q_x = q_all[b, accepted, x] if q_all is not None and 0 <= x < V else torch.tensor(1.0)
                bad[0, b] |= not _finite(p_x)
                bad[1, b] |= not _finite(q_x)
                if 0 <= x < V and q_x > 0 and accepted_by(accept_u[b, accepted], q_x, p_x):
                    accepted += 1
                else:
                    rejected = True
                    break
            if rejected:
                # Residual distribution normalize(max(p - q, 0)); q one-hot without draft probs.
                j = accepted
                if q_all is not None:
                    q = q_all[b, j]
                    bad[1, b] |= not _finite(q)
                else:
                    q = torch.zeros(V)
                    x = int(ids[j])
                    if 0 <= x < V:
                        q[x] = 1.0
                weights = torch.clamp(p[j] - q, min=0.0)
                if not weights.sum() > 0:  # rounding left no residual mass: sample from p_j
                    weights = p[j]
            else:
                weights = p[accepted]  # bonus token from p_{n_b}
            bad[0, b] |= not _finite(p[accepted])
            if noise.exponential is not None:
                token = _sample_race(weights, noise.exponential[b].cpu())
            else:
                token = _sample_inverse_cdf(weights, noise.uniform[b].cpu())
        token_ids[b, :accepted] = ids[:accepted]
        token_ids[b, accepted] = token
        num_accepted[b] = accepted
    return RejectionOutput(token_ids.to(device), num_accepted.to(device)), bad.to(device)


def accepted_by(u: torch.Tensor, q_x: torch.Tensor, p_x: torch.Tensor) -> bool:
    """Leviathan et al.'s test ``u <= p(x) / q(x)``, written without the division: ``u * q <= p``."""
    return bool(u * q_x <= p_x)


def rejection_sample_logits(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    noise: RejectionNoise | None = None,
    checks: ValueChecks | None = None,
) -> RejectionOutput:
    """Reference of `specdec_kernels.rejection_sample_logits`: `process_logits` on both models'
    logits, then `rejection_sample`; temperature-0 rows are greedy. ``checks``: the op's validation
    of every logits row it may read; without it, a row read that leaves no token (NaN, +inf, only
    -inf: a NaN row after `process_logits`) raises."""
    B = target_logits.shape[0]
    temperature = effective_temperature(temperature)
    if isinstance(temperature, torch.Tensor):
        greedy_rows = temperature == 0
        if isinstance(greedy, torch.Tensor):
            greedy_rows = greedy_rows | greedy
        elif greedy:
            greedy_rows = torch.ones(B, dtype=torch.bool, device=target_logits.device)
        greedy = greedy_rows
    elif temperature == 0:
        greedy = True
    target_probs = process_logits(target_logits, temperature, top_k, top_p)
    draft_probs = (
        process_logits(draft_logits, temperature, top_k, top_p) if draft_logits is not None else None
    )
    out, bad = _verify(target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, generator, seed, noise)
    if checks is None:
        refuse_rows_without_token(bad, LOGITS_ARGS)
    return out


def first_rejection_index(
    accepted: torch.Tensor, num_draft_tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference of `specdec_kernels.first_rejection_index`: ``[B, K]`` bool -> ``[B]`` int64."""
    B, K = accepted.shape
    out = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        n = K if num_draft_tokens is None else min(max(int(num_draft_tokens[b]), 0), K)
        i = 0
        while i < n and bool(accepted[b, i]):
            i += 1
        out[b] = i
    return out.to(accepted.device)
