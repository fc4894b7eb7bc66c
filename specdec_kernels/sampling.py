"""Batched speculative verification: rejection sampling and first-rejection search.

Terms, used the same way in every module of the sampler:

- **draft tokens** ``x_0 .. x_{n_b-1}``: the ``n_b <= K`` tokens row b's draft proposed
  (``draft_token_ids``, ``num_draft_tokens``), with draft probabilities ``q_i`` (or one-hot at
  ``x_i`` when drafts were proposed deterministically) and target probabilities ``p_i``
  (``i = 0 .. K``: the target scored one position more than was drafted);
- **accepted**: draft i is accepted iff ``u_i * q_i(x_i) <= p_i(x_i)``, ``u_i ~ U(0, 1]``;
  ``q_i(x_i) == 0`` rejects. A row keeps its drafts up to the first rejection;
- **num_accepted** ``j``: the accepted prefix length, ``0 .. n_b``;
- **recovered token**: at a rejection (``j < n_b``), drawn from ``normalize(max(p_j - q_j, 0))``.
  If rounding leaves that residual with no mass at all (every entry ``<= 0``, e.g. ``p_j == q_j``
  bit for bit), it is drawn from ``p_j``: the residual is then the zero measure and ``p_j`` is
  what the target alone would have produced;
- **bonus token**: when all ``n_b`` drafts are accepted, drawn from ``p_{n_b}``;
- **emitted tokens**: the accepted drafts and then the recovered or bonus token, ``j + 1`` per
  row (`RejectionOutput.token_ids`, padded with -1);
- **greedy rows**: accept while the draft equals ``argmax p_i`` (first maximum) and emit
  ``argmax p_j`` at the first mismatch, or at the bonus position.

This is Leviathan et al. 2022, Algorithm 1 (Chen et al. 2023), batched: the emitted tokens are
distributed exactly as tokens sampled from the target alone. No random number is ever clamped.
Emitted ids are always in ``[0, V)``: finite invalid inputs passed with ``validate=False`` get
index guards, and a value read that no token can come from (NaN or inf; a logits row of only
-inf) raises `DeviceCheckError` on every backend, checked on the device without a host sync.

Public ops (each dispatches on ``backend=``, see `specdec_kernels._backend`):

- `rejection_sample`: verification from probabilities;
- `rejection_sample_logits`: the same from logits, with temperature / top-k / top-p applied
  identically to target and draft (`process_logits`);
- `first_rejection_index`: per row, the first rejected draft position.

Randomness (see `RejectionNoise`): the reference and torch backends consume an acceptance uniform
per draft and two uniforms per row (a two-level inverse-CDF draw: first a chunk of 256 vocabulary
entries, then an entry). The Triton kernel draws its uniforms in registers with a counter-based
RNG and samples by the exponential race ``argmax w / E``; tests pass ``exponential`` noise
explicitly to compare it with the reference token for token.

Where the rest lives: shared types `specdec_kernels._types`, random inputs `specdec_kernels._noise`,
input checks `specdec_kernels._sampling_checks`, logits processing `specdec_kernels._logits`, the
torch backend `specdec_kernels._sampling_torch`, the reference `specdec_kernels.reference.sampling`
and the kernels ``kernels/sampling.py``.
"""

from __future__ import annotations

import torch

from ._backend import Dispatch, resolve_backend
from ._checks import check_tensor, device_check
from ._logits import logit_thresholds, process_logits, sample_logits
from ._noise import make_rejection_noise
from ._sampling_checks import check_counts, check_sampler_inputs, check_sampling_params, require_logit_rows
from ._sampling_torch import first_rejection_index_torch, rejection_sample_logits_torch, rejection_sample_torch
from ._types import SAMPLE_CHUNK, RejectionNoise, RejectionOutput

__all__ = [
    "SAMPLE_CHUNK",
    "RejectionNoise",
    "RejectionOutput",
    "first_rejection_index",
    "logit_thresholds",
    "make_rejection_noise",
    "process_logits",
    "rejection_sample",
    "rejection_sample_logits",
    "sample_logits",
]

_REJECTION_SAMPLE = Dispatch(
    reference="specdec_kernels.reference.sampling:rejection_sample",
    torch=rejection_sample_torch,
    triton="specdec_kernels.kernels.sampling:rejection_sample_triton",
)
_REJECTION_SAMPLE_LOGITS = Dispatch(
    reference="specdec_kernels.reference.sampling:rejection_sample_logits",
    torch=rejection_sample_logits_torch,
    triton="specdec_kernels.kernels.sampling:rejection_sample_logits_triton",
)
_FIRST_REJECTION_INDEX = Dispatch(
    reference="specdec_kernels.reference.sampling:first_rejection_index",
    torch=first_rejection_index_torch,
    triton="specdec_kernels.kernels.sampling:first_rejection_index_triton",
)


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
    validate: bool | None = None,
    backend: str = "auto",
) -> RejectionOutput:
    """Batched lossless speculative verification from probabilities.

    Args:
        target_probs: ``[B, K+1, V]`` float32 / float16 / bfloat16; each row sums to 1.
        draft_probs: ``[B, K, V]`` same dtype, or None when drafts were proposed
            deterministically (n-gram, greedy draft): q is then one-hot at the draft token.
        draft_token_ids: ``[B, K]`` int64 (int32 accepted), in ``[0, V)``.
        num_draft_tokens: ``[B]`` integer, ``0 <= n_b <= K``: ragged proposals (positions
            ``>= n_b`` are ignored); None means K for every row.
        greedy: bool or ``[B]`` bool: those rows verify by argmax instead of sampling
            (``greedy=True``: the torch backend then draws no random numbers).
        generator: torch.Generator for the random draws; or ``seed``: an int (row b uses
            ``seed + b``) or ``[B]`` int64 per-row seeds (counter-based: reproducible, rows
            independent). None of both: torch's global generator.
        noise: explicit random inputs (`RejectionNoise`), for exact tests; overrides
            generator / seed.
        validate: check the values the sampler reads, with one host read: ids, counts and explicit
            noise in range; the drafted tokens' probabilities finite and in ``[0, 1]``; the row
            each token is drawn from (``p_j``, and ``q_j`` at a rejection) finite, non-negative and
            summing to 1; the largest entry of the rows greedy rows take the argmax of finite and in
            ``(0, 1]``. Rows the sampler never reads in full are not summed: that would cost more
            than the sampler. Default: True for CPU tensors, False otherwise. Without validation,
            emitted ids are still always in ``[0, V)``, and NaN or inf among the values read
            raises `DeviceCheckError` (sync-free; on CUDA a device-side assert).
        backend: ``"auto"`` | ``"reference"`` | ``"torch"`` | ``"triton"``.

    Returns:
        `RejectionOutput`: ``token_ids`` ``[B, K+1]`` int64 (accepted drafts, then one corrected
        or bonus token, then -1) and ``num_accepted`` ``[B]`` int64.

    Raises:
        TypeError, ValueError: naming the argument (bad type, shape, dtype, device, or value).
        DeviceCheckError: (a ValueError) without validation, a value read is NaN or inf.

    Example::

        >>> p = torch.softmax(torch.randn(2, 4, 10), -1)      # target: B=2 rows, K=3 drafts, V=10
        >>> q = torch.softmax(torch.randn(2, 3, 10), -1)      # draft
        >>> ids = torch.multinomial(q.view(-1, 10), 1).view(2, 3)
        >>> out = rejection_sample(p, q, ids, seed=0)
        >>> out.token_ids.shape, out.num_accepted.shape
        (torch.Size([2, 4]), torch.Size([2]))
    """
    check_tensor("target_probs", target_probs, 3)
    backend = resolve_backend(backend, target_probs.device)
    checks, *_ = check_sampler_inputs(target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy,
                                      generator, seed, noise, ("target_probs", "draft_probs"), validate)
    out = _REJECTION_SAMPLE[backend](target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy=greedy,
                                     generator=generator, seed=seed, noise=noise, checks=checks)
    if checks is not None:
        checks.raise_first_failure()
    return out


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
    validate: bool | None = None,
    backend: str = "auto",
) -> RejectionOutput:
    """Batched speculative verification from logits, with the softmax fused into the sampler.

    Target and draft distributions are ``process_logits(logits, temperature, top_k, top_p)``
    (the same processing for both). Rows with temperature 0, or flagged in ``greedy``, verify
    greedily by argmax; when every row does (known on the host), the torch backend draws no
    random numbers. On the Triton backend no ``[B, K+1, V]`` tensor is materialized: top-k /
    top-p thresholds (one float per row and position) come from one kernel launched before the
    sampler, two launches in all (its top-p mass is summed in another order than
    `logit_thresholds`' cumsum, so a row within rounding of ``top_p`` may keep one value more or less).

    Args:
        target_logits: ``[B, K+1, V]`` float32 / float16 / bfloat16.
        draft_logits: ``[B, K, V]`` same dtype, or None (deterministic drafts: q one-hot).
        draft_token_ids, num_draft_tokens, greedy, generator, seed, noise, backend:
            as in `rejection_sample`.
        temperature: float, or ``[B]`` float tensor; 0 means greedy for that row.
        top_k, top_p: as in `process_logits`.
        validate: check that every row of logits the sampler may read has a finite largest value,
            also after the temperature (no NaN, no +inf, not all -inf; -inf entries are allowed),
            and that ids, counts and explicit noise are in range; one host read. Default: True for
            CPU tensors. Without validation, such a row raises `DeviceCheckError` where the
            sampler reads it (sync-free; on CUDA a device-side assert).

    Returns:
        `RejectionOutput` (``token_ids`` ``[B, K+1]`` int64, ``num_accepted`` ``[B]`` int64).
    """
    check_tensor("target_logits", target_logits, 3)
    backend = resolve_backend(backend, target_logits.device)
    checks, B, *_ = check_sampler_inputs(target_logits, draft_logits, draft_token_ids, num_draft_tokens, greedy,
                                         generator, seed, noise, ("target_logits", "draft_logits"), validate)
    temperature = check_sampling_params(temperature, top_k, top_p, B, target_logits.device)
    if checks is not None:
        require_logit_rows(checks, target_logits, draft_logits, num_draft_tokens, temperature)
    out = _REJECTION_SAMPLE_LOGITS[backend](
        target_logits, draft_logits, draft_token_ids, num_draft_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, greedy=greedy, generator=generator, seed=seed, noise=noise, checks=checks,
    )
    if checks is not None:
        checks.raise_first_failure()
    return out


def first_rejection_index(
    accepted: torch.Tensor, num_draft_tokens: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """Per row, the first draft position that is rejected, or ``n_b`` when none is.

    Args:
        accepted: ``[B, K]`` bool: whether each draft position passed its test.
        num_draft_tokens: ``[B]`` integer in ``[0, K]``, or None (K for every row). Positions
            ``>= n_b`` are ignored.
        backend: ``"auto"`` | ``"reference"`` | ``"torch"`` | ``"triton"``.

    Returns:
        ``[B]`` int64 in ``[0, n_b]``: the number of accepted drafts.
    """
    check_tensor("accepted", accepted, 2)
    if accepted.dtype != torch.bool:
        raise TypeError(f"accepted must be a bool tensor, got {accepted.dtype}")
    B, K = accepted.shape
    backend = resolve_backend(backend, accepted.device)
    if num_draft_tokens is None:
        n = torch.full((B,), K, dtype=torch.int64, device=accepted.device)
    else:
        check_counts(num_draft_tokens, B, accepted.device, "accepted")
        device_check(((num_draft_tokens >= 0) & (num_draft_tokens <= K)).all(),
                     f"num_draft_tokens must lie in [0, K={K}] for every row")
        n = num_draft_tokens.to(torch.int64)
    return _FIRST_REJECTION_INDEX[backend](accepted, n)
