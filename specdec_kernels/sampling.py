"""Batched speculative verification: rejection sampling and first-rejection search.

Public ops (all dispatch on ``backend=``, see `specdec_kernels._backend`):

- `rejection_sample`: verify K drafted tokens per row against the target
  probabilities (Leviathan et al. 2022, Algorithm 1; Chen et al. 2023) and emit
  the accepted prefix plus one corrected or bonus token.
- `rejection_sample_logits`: the same from logits, with temperature / top-k /
  top-p applied identically to target and draft (`process_logits`).
- `first_rejection_index`: per row, the first rejected draft position.
- `process_logits` / `sample_logits`: the one definition of temperature, top-k
  and top-p, and a sync-free sampler of exactly that distribution.

Semantics, shared by every backend:

- Draft i of row b is accepted iff ``u * q_i(x_i) <= p_i(x_i)`` with
  ``u ~ U(0, 1]``; ``q_i(x_i) == 0`` rejects. Without draft probabilities the
  draft distribution is one-hot at the draft token.
- The first rejected position j is resampled from ``normalize(max(p_j - q_j, 0))``.
  If rounding leaves that residual with no mass at all (every entry ``<= 0``,
  e.g. ``p_j == q_j`` bit for bit), the token is sampled from ``p_j`` instead:
  the residual is then the zero measure and ``p_j`` is what the target alone
  would have produced. When all ``n_b`` drafts are accepted a bonus token is
  sampled from ``p_{n_b}``.
- Greedy rows accept while the draft equals ``argmax p_i`` (first maximum) and
  emit ``argmax p_j`` at the first mismatch, or at the bonus position.
- No random number is ever clamped; emitted ids are always in ``[0, V)``, even
  for invalid inputs passed with ``validate=False``.

Randomness (see `RejectionNoise`): the reference and torch backends consume an
acceptance uniform per draft and two uniforms per row (a two-level
inverse-CDF draw: first a chunk of 256 vocabulary entries, then an entry). The
Triton kernel draws its uniforms in registers with a counter-based RNG and
samples by the exponential race ``argmax w / E``; tests pass ``exponential``
noise explicitly to compare it with the reference token for token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._backend import device_check, is_int, resolve_backend

__all__ = [
    "RejectionNoise",
    "RejectionOutput",
    "first_rejection_index",
    "make_rejection_noise",
    "process_logits",
    "rejection_sample",
    "rejection_sample_logits",
    "sample_logits",
]

#: Vocabulary entries per chunk in the two-level inverse-CDF sampler of the torch paths.
SAMPLE_CHUNK = 256

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK32 = 0xFFFFFFFF


class RejectionOutput(NamedTuple):
    """Result of `rejection_sample` / `rejection_sample_logits`.

    Attributes:
        token_ids: ``[B, K+1]`` int64: the accepted drafts, then one corrected or bonus token,
            then ``-1`` padding.
        num_accepted: ``[B]`` int64: accepted drafts per row (``0..n_b``); each row emits
            ``num_accepted + 1`` tokens.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


class RejectionNoise(NamedTuple):
    """Explicit random inputs of the rejection sampler, for reproducible and exact tests.

    Attributes:
        accept: ``[B, K]`` float32 in ``(0, 1]``: the acceptance uniform of each draft position.
        uniform: ``[B, 2]`` float32 in ``[0, 1)``, or None: the two uniforms of the two-level
            inverse-CDF draw (chunk, then entry) consumed by the ``"reference"`` and ``"torch"``
            backends.
        exponential: ``[B, V]`` float32 ``> 0``, or None: Exp(1) variables of the exponential race
            (``argmax w / E``) consumed by the ``"triton"`` backend. The reference uses the race
            when this is given, and the two-level draw otherwise.
    """

    accept: torch.Tensor
    uniform: torch.Tensor | None = None
    exponential: torch.Tensor | None = None


# --------------------------------------------------------------------------- randomness


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` integer hash of int64 tensors holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Counter-based uniforms: ``[B]`` int64 seeds x ``[N]`` int64 counters -> ``[B, N]`` float32.

    Values are multiples of ``2**-24`` in ``[0, 1)``. Independent of any global state, so the
    same seed gives the same numbers on every device, and rows with different seeds are
    independent streams.
    """
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))[:, None]
    bits = _mix32(key ^ _mix32((counters * 0x85EBCA6B + 0x27D4EB2F) & _MASK32)[None, :])
    return (bits >> 8).to(torch.float32) * (2.0**-24)


def _row_seeds(seed: int | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """Per-row int64 seeds: a ``[B]`` tensor as given, or ``seed + b`` for an int ``seed``."""
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64)
    return torch.arange(batch, device=device, dtype=torch.int64) + seed


def _exponential(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Exp(1) float32 variables ``-log(u)``, ``u`` a float64 uniform in ``[0, 1)``.

    Never 0 (``u < 1`` keeps ``-log(u) >= 1.1e-16``, representable in float32), so no entry of an
    exponential race wins by a division by zero; ``u == 0`` (probability 2**-53) gives +inf, a
    score of 0. float32 ``exponential_`` can return exactly 0 with probability ~2**-24 per entry,
    which over a 50k vocabulary would bias a race by ~0.3%.
    """
    return (-torch.log(torch.rand(shape, dtype=torch.float64, device=device, generator=generator))).float()


def make_rejection_noise(
    batch: int,
    num_draft: int,
    vocab: int | None = None,
    *,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> RejectionNoise:
    """Draw the random inputs of one rejection-sampling call.

    Args:
        batch, num_draft: B and K.
        vocab: V; when given, ``exponential`` ``[B, V]`` noise for the Triton backend is drawn too.
        generator: torch generator on ``device`` (default: torch's global one).
        seed: instead of ``generator``: an int, or ``[B]`` int64 per-row seeds (counter-based, so
            row b depends on its own seed only; an int ``s`` means per-row seeds ``s + b``).

    Returns:
        `RejectionNoise` with ``accept`` ``[B, K]`` in ``(0, 1]``, ``uniform`` ``[B, 2]`` in
        ``[0, 1)`` and, if ``vocab`` is given, ``exponential`` ``[B, V]`` (all float32, > 0).
    """
    device = torch.device(device)
    for name, value in (("batch", batch), ("num_draft", num_draft)):
        if not is_int(value) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if vocab is not None and (not is_int(vocab) or vocab < 1):
        raise ValueError(f"vocab must be an int >= 1 or None, got {vocab!r}")
    batch, num_draft, vocab = int(batch), int(num_draft), None if vocab is None else int(vocab)
    _check_generator_and_seed(generator, seed, batch, device, on=None)  # a seed tensor is moved to ``device``
    exponential = None
    if seed is not None:
        seeds = _row_seeds(seed, batch, device)
        counters = torch.arange(num_draft + 2 + (vocab or 0), device=device, dtype=torch.int64)
        u = _counter_uniform(seeds, counters)
        accept, uniform = 1.0 - u[:, :num_draft], u[:, num_draft : num_draft + 2]
        if vocab is not None:
            # (k + 0.5) * 2**-24 lies in (0, 1) (exact in float64), so -log of it is finite and > 0.
            exponential = (-torch.log(u[:, num_draft + 2 :].double() + 2.0**-25)).float()
    else:
        accept = 1.0 - torch.rand(batch, num_draft, device=device, generator=generator)
        uniform = torch.rand(batch, 2, device=device, generator=generator)
        if vocab is not None:
            exponential = _exponential((batch, vocab), generator, device)
    return RejectionNoise(accept.contiguous(), uniform.contiguous(), exponential)


# --------------------------------------------------------------------------- validation


def _check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def _check_probs_values(name: str, t: torch.Tensor, used: torch.Tensor) -> None:
    """Value check (reads the tensor on the host): finite and non-negative everywhere, and the
    rows the sampler uses (``used``, [B, positions] bool) summing to 1 within rounding:
    max(1e-3, 4 eps) plus, for fp16, the absolute error of subnormal entries (2**-25 each)."""
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf (pass validate=False to skip this check)")
    if bool((t < 0).any()):
        raise ValueError(f"{name} contains negative probabilities (pass validate=False to skip this check)")
    sums = t.sum(-1, dtype=torch.float32)[used]
    if sums.numel():
        info = torch.finfo(t.dtype)
        tolerance = max(1e-3, 4 * info.eps) + t.shape[-1] * info.smallest_normal * info.eps / 2
        worst = float((sums - 1).abs().max())
        if worst > tolerance:
            raise ValueError(f"{name} rows must sum to 1 (within {tolerance:.3g}); one is off by {worst:.3g} "
                             "(pass validate=False to skip this check)")


def _rows_read(num_draft_tokens: torch.Tensor | None, B: int, K: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions the sampler reads: target [B, K+1] (``j <= n_b``) and draft [B, K]
    (``j < n_b``) bool masks, from counts already checked to lie in ``[0, K]``."""
    counts = torch.full((B, 1), K, device=device) if num_draft_tokens is None else num_draft_tokens.view(B, 1)
    positions = torch.arange(K + 1, device=device)
    return positions <= counts, positions[:K] < counts


def _check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """``generator`` is None or a torch.Generator for ``device``'s kind (cpu / cuda)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is a {generator.device.type} generator but the tensors are on {device}")


def _check_generator_and_seed(generator: torch.Generator | None, seed: int | torch.Tensor | None, B: int,
                              device: torch.device, on: str | None) -> None:
    """Not both given; ``generator`` is for ``device``'s kind; ``seed`` is an int or a ``[B]``
    int64 / int32 tensor, on ``device`` (where ``on`` lives) unless ``on`` is None (moved there)."""
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    _check_generator(generator, device)
    if seed is None:
        return
    if isinstance(seed, torch.Tensor):
        _check_tensor("seed", seed, 1)
        if seed.shape[0] != B or seed.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"seed must be an int or a [B] = [{B}] int64 tensor, got {seed.dtype} {tuple(seed.shape)}")
        if on is not None and seed.device != device:
            raise ValueError(f"seed is on {seed.device} but {on} is on {device}")
    elif not is_int(seed):
        raise TypeError(f"seed must be an int or a [B] int64 tensor, got {type(seed).__name__}")
    elif not -(2**63) <= seed < 2**63 - B:
        raise ValueError(f"seed must fit int64 (per-row seeds are seed + b), got {seed}")


def _validate_common(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    generator: torch.Generator | None,
    seed: int | torch.Tensor | None,
    noise: RejectionNoise | None,
    names: tuple[str, str],
    validate: bool | None,
    backend: str,
) -> tuple[str, bool, int, int, int]:
    """Checks shared by both samplers: shapes, dtypes and devices always, values when ``validate``
    (None: True for CPU tensors). Returns ``(backend resolved, validate, B, K, V)``."""
    tname, dname = names
    _check_tensor(tname, target, 3)
    backend = resolve_backend(backend, target.device)
    if validate is None:
        validate = target.device.type == "cpu"
    B, K1, V = target.shape
    if K1 < 1:
        raise ValueError(f"{tname} must have K+1 >= 1 positions, got shape {tuple(target.shape)}")
    if V < 1:
        raise ValueError(f"{tname} must have a non-empty vocabulary, got shape {tuple(target.shape)}")
    K = K1 - 1
    if target.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{tname} must be float32, float16 or bfloat16, got {target.dtype}")
    device = target.device
    if draft is not None:
        _check_tensor(dname, draft, 3)
        if tuple(draft.shape) != (B, K, V):
            raise ValueError(
                f"{dname} must have shape [B, K, V] = {(B, K, V)} to match {tname} "
                f"{tuple(target.shape)}, got {tuple(draft.shape)}"
            )
        if draft.dtype != target.dtype:
            raise TypeError(f"{dname} must have the dtype of {tname} ({target.dtype}), got {draft.dtype}")
        if draft.device != device:
            raise ValueError(f"{dname} is on {draft.device} but {tname} is on {device}")
    _check_tensor("draft_token_ids", draft_token_ids, 2)
    if tuple(draft_token_ids.shape) != (B, K):
        raise ValueError(
            f"draft_token_ids must have shape [B, K] = {(B, K)} to match {tname} "
            f"{tuple(target.shape)}, got {tuple(draft_token_ids.shape)}"
        )
    if draft_token_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"draft_token_ids must be int64 or int32, got {draft_token_ids.dtype}")
    if draft_token_ids.device != device:
        raise ValueError(f"draft_token_ids is on {draft_token_ids.device} but {tname} is on {device}")
    if num_draft_tokens is not None:
        _check_tensor("num_draft_tokens", num_draft_tokens, 1)
        if num_draft_tokens.shape[0] != B:
            raise ValueError(
                f"num_draft_tokens must have shape [B] = [{B}], got {tuple(num_draft_tokens.shape)}"
            )
        if num_draft_tokens.dtype.is_floating_point or num_draft_tokens.dtype == torch.bool:
            raise TypeError(f"num_draft_tokens must be an integer tensor, got {num_draft_tokens.dtype}")
        if num_draft_tokens.device != device:
            raise ValueError(f"num_draft_tokens is on {num_draft_tokens.device} but {tname} is on {device}")
    if isinstance(greedy, torch.Tensor):
        _check_tensor("greedy", greedy, 1)
        if greedy.shape[0] != B or greedy.dtype != torch.bool:
            raise ValueError(
                f"greedy must be a bool or a [B] = [{B}] bool tensor, got "
                f"{greedy.dtype} {tuple(greedy.shape)}"
            )
        if greedy.device != device:
            raise ValueError(f"greedy is on {greedy.device} but {tname} is on {device}")
    elif not isinstance(greedy, bool):
        raise TypeError(f"greedy must be a bool or a [B] bool tensor, got {type(greedy).__name__}")
    _check_generator_and_seed(generator, seed, B, device, on=tname)
    if noise is not None:
        if not isinstance(noise, RejectionNoise):
            raise TypeError(f"noise must be a RejectionNoise, got {type(noise).__name__}")
        _check_tensor("noise.accept", noise.accept, 2)
        if tuple(noise.accept.shape) != (B, K) or noise.accept.dtype != torch.float32:
            raise ValueError(
                f"noise.accept must be float32 [B, K] = {(B, K)}, got "
                f"{noise.accept.dtype} {tuple(noise.accept.shape)}"
            )
        for field, shape in (("uniform", (B, 2)), ("exponential", (B, V))):
            t = getattr(noise, field)
            if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32):
                raise ValueError(
                    f"noise.{field} must be float32 {list(shape)}, got {t.dtype} {tuple(t.shape)}"
                )
        for t in noise:
            if t is not None and t.device != device:
                raise ValueError(f"noise tensors must be on {device}, got {t.device}")
        if backend == "reference" and noise.uniform is None and noise.exponential is None:
            raise ValueError("the reference backend consumes noise.uniform ([B, 2] float32) or "
                             "noise.exponential ([B, V]); both are None")
    if validate:
        ranges = {"accept": ("(0, 1]", lambda t: (t > 0) & (t <= 1)),
                  "uniform": ("[0, 1)", lambda t: (t >= 0) & (t < 1)),
                  "exponential": ("(0, inf)", lambda t: (t > 0) & t.isfinite())}
        for field, (interval, inside) in ranges.items():
            t = None if noise is None else getattr(noise, field)
            if t is not None and not bool(inside(t).all()):
                raise ValueError(f"noise.{field} must lie in {interval} (pass validate=False to skip this check)")
        if num_draft_tokens is not None and bool(((num_draft_tokens < 0) | (num_draft_tokens > K)).any()):
            raise ValueError(f"num_draft_tokens must lie in [0, K] = [0, {K}]")
        if bool(((draft_token_ids < 0) | (draft_token_ids >= V)).any()):
            raise ValueError(f"draft_token_ids must lie in [0, V) = [0, {V})")
    return backend, validate, B, K, V


def _sanitize(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None,
    B: int,
    K: int,
    greedy: bool | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 ids, ``[B]`` int64 draft counts and ``[B]`` bool greedy flags.

    Counts outside ``[0, K]`` (possible only with ``validate=False``) are brought into range so
    that no index leaves its tensor; that is an index guard, not a change of randomness.
    """
    device = draft_token_ids.device
    ids = draft_token_ids.to(torch.int64)
    if num_draft_tokens is None:
        n = torch.full((B,), K, dtype=torch.int64, device=device)
    else:
        n = num_draft_tokens.to(torch.int64).clamp(0, K)
    g = (
        greedy
        if isinstance(greedy, torch.Tensor)
        else torch.full((B,), greedy, dtype=torch.bool, device=device)
    )
    return ids, n, g


# --------------------------------------------------------------------------- logits processing


def _check_sampling_params(
    temperature: float | torch.Tensor,
    top_k: int | None,
    top_p: float | None,
    batch: int,
    device: torch.device,
) -> None:
    if isinstance(temperature, torch.Tensor):
        if temperature.ndim != 1 or temperature.shape[0] != batch:
            raise ValueError(
                f"temperature must be a float or a [B] = [{batch}] tensor, got shape "
                f"{tuple(temperature.shape)}"
            )
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature must be a floating tensor, got {temperature.dtype}")
        if temperature.device != device:
            raise ValueError(f"temperature is on {temperature.device} but the logits are on {device}")
        device_check((torch.isfinite(temperature) & (temperature >= 0)).all(),
                     "temperature must be finite and >= 0 in every row")
    elif isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        try:
            finite = math.isfinite(temperature)
        except OverflowError:  # an int past the float range
            finite = False
        if not finite or temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    else:
        raise TypeError(f"temperature must be a float or a [B] tensor, got {type(temperature).__name__}")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None:
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool):
            raise TypeError(f"top_p must be a float or None, got {type(top_p).__name__}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def _temperature_rows(
    temperature: float | torch.Tensor, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` float32 divisor (1 where greedy) and ``[B]`` bool greedy mask (temperature == 0)."""
    t = (
        temperature.to(device=device, dtype=torch.float32)
        if isinstance(temperature, torch.Tensor)
        else torch.full((batch,), float(temperature), dtype=torch.float32, device=device)
    )
    greedy = t == 0
    return torch.where(greedy, torch.ones_like(t), t), greedy


def _broadcast_rows(x: torch.Tensor, ndim: int) -> torch.Tensor:
    return x.reshape(x.shape + (1,) * (ndim - 1))


def logit_thresholds(scaled: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor | None:
    """The smallest kept value of each row of temperature-scaled logits under top-k / top-p.

    Args:
        scaled: ``[..., V]`` float32 logits already divided by the temperature.

    Returns:
        ``[...]`` float32 thresholds (entries ``>= threshold`` are kept), or None when neither
        filter is set. Top-k keeps every entry tied with the k-th largest; top-p keeps the
        smallest set of largest entries whose probability reaches ``top_p`` (the largest entry
        is always kept). Top-k applies first, top-p to the top-k-renormalized distribution.
    """
    if top_k is None and top_p is None:
        return None
    V = scaled.shape[-1]
    thr = torch.full(scaled.shape[:-1], float("-inf"), dtype=torch.float32, device=scaled.device)
    if top_k is not None and top_k < V:
        thr = torch.topk(scaled, top_k, dim=-1).values[..., -1]
    if top_p is not None and top_p < 1.0:
        masked = scaled.masked_fill(scaled < thr[..., None], float("-inf"))
        sorted_logits = torch.sort(masked, dim=-1, descending=True).values
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = (mass_before < top_p).sum(-1, keepdim=True).clamp_min(1)
        thr = torch.maximum(thr, sorted_logits.gather(-1, keep - 1).squeeze(-1))
    return thr


def process_logits(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p: the one definition, for target and draft.

    Args:
        logits: ``[B, ..., V]`` float32 / float16 / bfloat16.
        temperature: float, or ``[B]`` tensor (one per leading row). Rows with temperature 0
            are greedy: their distribution is one-hot at the argmax of the raw logits (first
            maximum).
        top_k: keep the k largest logits (ties with the k-th are kept), or None.
        top_p: keep the smallest set of largest-probability tokens whose mass reaches top_p
            (after top-k), or None.

    Returns:
        ``[B, ..., V]`` float32 probabilities: ``softmax(where(l/T >= threshold, l/T, -inf))``.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.ndim < 2 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [B, ..., V] with V >= 1, got {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    B = logits.shape[0]
    _check_sampling_params(temperature, top_k, top_p, B, logits.device)
    divisor, greedy = _temperature_rows(temperature, B, logits.device)
    scaled = logits.float() / _broadcast_rows(divisor, logits.ndim)
    thr = logit_thresholds(scaled, top_k, top_p)
    if thr is not None:
        scaled = scaled.masked_fill(scaled < thr[..., None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if isinstance(temperature, torch.Tensor) or temperature == 0:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(_broadcast_rows(greedy, logits.ndim), one_hot, probs)
    return probs


def sample_logits(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row from exactly `process_logits`' distribution, without host syncs.

    Uses the exponential race ``argmax_v p_v / E_v`` with ``E ~ Exp(1)`` from ``generator``
    (tokens with probability 0 never win). Rows with temperature 0 return the argmax.

    Args:
        logits: ``[B, V]`` float32 / float16 / bfloat16.
        temperature, top_k, top_p: as in `process_logits`.
        generator: torch generator on the logits' device (default: the global one).

    Returns:
        ``[B]`` int64 token ids in ``[0, V)``.
    """
    _check_tensor("logits", logits, 2)
    if logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocabulary of V >= 1 entries, got shape {tuple(logits.shape)}")
    _check_generator(generator, logits.device)
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        _check_sampling_params(temperature, top_k, top_p, logits.shape[0], logits.device)
        return logits.argmax(-1)  # greedy: filters keep the argmax, no randomness to draw
    probs = process_logits(logits, temperature, top_k, top_p)
    E = _exponential(tuple(probs.shape), generator, probs.device)
    scores = torch.where(probs > 0, probs / E, torch.full_like(probs, -1.0))
    best, token = scores.max(-1)
    device_check((best > 0).all(), "logits must give every row a token of positive probability "
                                   "(a row is NaN or all -inf, or a temperature so small that "
                                   "logits / temperature overflows)")
    return token


# --------------------------------------------------------------------------- torch path


def _first_rejection_torch(accepted: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    B, K = accepted.shape
    if K == 0:
        return torch.zeros(B, dtype=torch.int64, device=accepted.device)
    pos = torch.arange(K, device=accepted.device)
    rejected = ~accepted & (pos < n[:, None])
    return torch.where(rejected, pos, n[:, None]).amin(-1)


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

    An entry of weight 0 is never picked. All-zero or NaN rows (possible only without
    validation) get an index guard, so the result stays in ``[0, size)``.
    """
    return torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True).clamp_max(size - 1)


def _rejection_sample_torch(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    ids: torch.Tensor,
    n: torch.Tensor,
    greedy: torch.Tensor,
    any_greedy: bool,
    noise: RejectionNoise,
) -> RejectionOutput:
    """Vectorized, sync-free rejection sampling (no Python loop over rows)."""
    B, K1, V = target.shape
    K = K1 - 1
    device = target.device
    rows = torch.arange(B, device=device)
    valid_id = (ids >= 0) & (ids < V)
    safe_ids = torch.where(valid_id, ids, torch.zeros_like(ids))
    # Acceptance: u * q(x) <= p(x), q(x) == 0 rejects.
    p_x = target[:, :K].gather(-1, safe_ids[..., None]).squeeze(-1).float()
    q_x = (
        draft.gather(-1, safe_ids[..., None]).squeeze(-1).float()
        if draft is not None
        else torch.ones_like(p_x)
    )
    accepted = (q_x > 0) & (noise.accept * q_x <= p_x) & valid_id
    if any_greedy:
        argmax = target.argmax(-1)  # [B, K+1]
        accepted = torch.where(greedy[:, None], ids == argmax[:, :K], accepted)
    j = _first_rejection_torch(accepted, n)
    # Residual row at j (or the bonus row p_{n_b}), sampled by a two-level inverse CDF: chunk sums
    # of the full row, then one chunk of SAMPLE_CHUNK entries. Each full row is copied once and
    # updated in place; everything after the chunk sums is [B, nC] or [B, C].
    C = SAMPLE_CHUNK
    is_rejection = j < n
    # index_select on the flattened rows copies whole rows (memcpy); advanced indexing
    # target[rows, j] computes an offset per element and is ~4x slower here.
    w = target.reshape(B * K1, V).index_select(0, rows * K1 + j).float()  # p_j, a fresh copy
    chunk_p = _chunk_sums(w)
    jd = j.clamp_max(K - 1) if K > 0 else j  # a valid row index; only used where j < n <= K
    if K > 0 and draft is not None:
        q_j = draft.reshape(B * K, V).index_select(0, rows * K + jd)
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
    if any_greedy:
        token = torch.where(greedy, argmax.gather(1, j[:, None]).squeeze(1), token)
    return _output(ids, j, token)


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


def _greedy_verify(target: torch.Tensor, ids: torch.Tensor, n: torch.Tensor) -> RejectionOutput:
    """Every row greedy: drafts are kept while they equal the argmax (the first maximum) of
    ``target`` [B, K+1, V], the target's probabilities (or its raw logits at temperature 0, where
    process_logits' one-hot sits at their argmax), then the argmax is emitted; no noise."""
    argmax = target.argmax(-1)  # [B, K+1]
    j = _first_rejection_torch(ids == argmax[:, : ids.shape[1]], n)
    return _output(ids, j, argmax.gather(1, j[:, None]).squeeze(1))


# --------------------------------------------------------------------------- public ops


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
        validate: check values (NaN, inf, negative probabilities, rows not summing to 1, ids,
            counts and explicit noise out of range); this reads tensors on the host. Default:
            True for CPU tensors, False otherwise.
            Without validation, emitted ids are still always in ``[0, V)``.
        backend: ``"auto"`` | ``"reference"`` | ``"torch"`` | ``"triton"``.

    Returns:
        `RejectionOutput`: ``token_ids`` ``[B, K+1]`` int64 (accepted drafts, then one corrected
        or bonus token, then -1) and ``num_accepted`` ``[B]`` int64.
    """
    backend, validate, B, K, V = _validate_common(
        target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, generator, seed, noise,
        ("target_probs", "draft_probs"), validate, backend,
    )
    if validate:  # counts are checked by now; rows past a row's count are never read
        target_read, draft_read = _rows_read(num_draft_tokens, B, K, target_probs.device)
        _check_probs_values("target_probs", target_probs, target_read)
        if draft_probs is not None:
            _check_probs_values("draft_probs", draft_probs, draft_read)
    if backend == "reference":
        from .reference.sampling import rejection_sample as reference

        return reference(
            target_probs,
            draft_probs,
            draft_token_ids,
            num_draft_tokens,
            greedy=greedy,
            generator=generator,
            seed=seed,
            noise=noise,
            validate=False,
        )
    if backend == "triton":
        from .kernels.sampling import rejection_sample_triton

        # Counts, greedy flags and seeds go to the kernel as given (it clamps counts to [0, K]).
        return rejection_sample_triton(
            target_probs,
            draft_probs,
            draft_token_ids.to(torch.int64),
            num_draft_tokens,
            greedy,
            generator=generator,
            seed=seed,
            noise=noise,
        )
    ids, n, g = _sanitize(draft_token_ids, num_draft_tokens, B, K, greedy)
    if greedy is True:  # every row verifies by argmax: no noise, no residuals
        return _greedy_verify(target_probs, ids, n)
    if noise is None:
        noise = make_rejection_noise(B, K, generator=generator, seed=seed, device=target_probs.device)
    elif noise.uniform is None:
        raise ValueError("the torch backend consumes noise.uniform ([B, 2] float32); it is None")
    return _rejection_sample_torch(target_probs, draft_probs, ids, n, g, greedy is not False, noise)


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
    sampler, two launches in all (see the README; its top-p mass is summed in another order than
    `logit_thresholds`' cumsum, so a row within rounding of ``top_p`` may keep one value more or less).

    Args:
        target_logits: ``[B, K+1, V]`` float32 / float16 / bfloat16.
        draft_logits: ``[B, K, V]`` same dtype, or None (deterministic drafts: q one-hot).
        draft_token_ids, num_draft_tokens, greedy, generator, seed, noise, backend:
            as in `rejection_sample`.
        temperature: float, or ``[B]`` float tensor; 0 means greedy for that row.
        top_k, top_p: as in `process_logits`.
        validate: check that every row of logits has a finite largest value, also after the
            temperature (no NaN, no +inf, not all -inf; -inf entries are allowed), that ids /
            counts and explicit noise are in range. Default: True for CPU tensors.

    Returns:
        `RejectionOutput` (``token_ids`` ``[B, K+1]`` int64, ``num_accepted`` ``[B]`` int64).
    """
    backend, validate, B, K, V = _validate_common(
        target_logits, draft_logits, draft_token_ids, num_draft_tokens, greedy, generator, seed, noise,
        ("target_logits", "draft_logits"), validate, backend,
    )
    _check_sampling_params(temperature, top_k, top_p, B, target_logits.device)
    if validate:
        # Every row needs a finite largest logit, also divided by its temperature: NaN, +inf, an
        # all -inf row or an overflowing logits / temperature would leave no distribution.
        divisor = (torch.where(temperature > 0, temperature, 1.0)[:, None] if isinstance(temperature, torch.Tensor)
                   else float(temperature) or 1.0)
        target_read, draft_read = _rows_read(num_draft_tokens, B, K, target_logits.device)
        for name, t, used in (("target_logits", target_logits, target_read),
                              ("draft_logits", draft_logits, draft_read)):
            if t is None or not t.numel():
                continue
            if not bool(((t.float().amax(-1) / divisor).isfinite() | ~used).all()):
                raise ValueError(f"{name} has a row with NaN, +inf or only -inf (or so small a temperature "
                                 "that logits / temperature overflows); pass validate=False to skip this check")
    if backend == "reference":
        from .reference.sampling import rejection_sample_logits as reference

        return reference(target_logits, draft_logits, draft_token_ids, num_draft_tokens, temperature=temperature,
                         top_k=top_k, top_p=top_p, greedy=greedy, generator=generator, seed=seed, noise=noise)
    if backend == "triton":
        from .kernels.sampling import rejection_sample_logits_triton

        # Temperature-0 rows are made greedy inside the kernel.
        return rejection_sample_logits_triton(
            target_logits,
            draft_logits,
            draft_token_ids.to(torch.int64),
            num_draft_tokens,
            greedy,
            temperature,
            top_k,
            top_p,
            generator=generator,
            seed=seed,
            noise=noise,
        )
    if isinstance(temperature, torch.Tensor):
        row_greedy = temperature == 0
        greedy = row_greedy | greedy
    elif temperature == 0:
        greedy = True
    if greedy is True:  # known on the host: rejection_sample only takes argmaxes, of the target
        # At temperature 0 process_logits' one-hot sits at the raw logits' argmax; otherwise the
        # processed probabilities decide (softmax rounding can tie logits that differ).
        target_probs = target_logits if temperature == 0 else process_logits(target_logits, temperature, top_k, top_p)
        draft_probs = None
    else:
        target_probs = process_logits(target_logits, temperature, top_k, top_p)
        draft_probs = process_logits(draft_logits, temperature, top_k, top_p) if draft_logits is not None else None
    return rejection_sample(
        target_probs,
        draft_probs,
        draft_token_ids,
        num_draft_tokens,
        greedy=greedy,
        generator=generator,
        seed=seed,
        noise=noise,
        validate=False,
        backend=backend,
    )


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
    _check_tensor("accepted", accepted, 2)
    if accepted.dtype != torch.bool:
        raise TypeError(f"accepted must be a bool tensor, got {accepted.dtype}")
    B, K = accepted.shape
    backend = resolve_backend(backend, accepted.device)
    if num_draft_tokens is not None:
        _check_tensor("num_draft_tokens", num_draft_tokens, 1)
        if num_draft_tokens.shape[0] != B:
            raise ValueError(
                f"num_draft_tokens must have shape [B] = [{B}], got {tuple(num_draft_tokens.shape)}"
            )
        if num_draft_tokens.dtype.is_floating_point or num_draft_tokens.dtype == torch.bool:
            raise TypeError(f"num_draft_tokens must be an integer tensor, got {num_draft_tokens.dtype}")
        if num_draft_tokens.device != accepted.device:
            raise ValueError(
                f"num_draft_tokens is on {num_draft_tokens.device} but accepted is on {accepted.device}"
            )
        device_check(((num_draft_tokens >= 0) & (num_draft_tokens <= K)).all(),
                     f"num_draft_tokens must lie in [0, K={K}] for every row")
    if backend == "reference":
        from .reference.sampling import first_rejection_index as reference

        return reference(accepted, num_draft_tokens)
    n = (
        torch.full((B,), K, dtype=torch.int64, device=accepted.device)
        if num_draft_tokens is None
        else num_draft_tokens.to(torch.int64)
    )
    if backend == "triton":
        from .kernels.sampling import first_rejection_index_triton

        return first_rejection_index_triton(accepted, n)
    return _first_rejection_torch(accepted, n)
