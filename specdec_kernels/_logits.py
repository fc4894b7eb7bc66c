"""Logits processing: temperature, top-k and top-p, defined once for target and draft.

- `process_logits`: the probabilities after temperature, top-k and top-p;
- `logit_thresholds`: the smallest kept scaled logit of each row (the filters as one number per
  row, which the Triton kernels compute without sorting);
- `sample_logits`: a sync-free sampler of exactly `process_logits`' distribution (plain decoding).
"""

from __future__ import annotations

import torch

from ._checks import check_generator, check_tensor, device_check
from ._noise import exponential_noise
from ._sampling_checks import check_sampling_params
from ._types import FLOAT_DTYPES

_NO_ARGMAX = ("logits must have a finite maximum in every greedy row (a row holds NaN or +inf, or only -inf): "
              "no token is the argmax")


def temperature_rows(
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
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    B = logits.shape[0]
    temperature = check_sampling_params(temperature, top_k, top_p, B, logits.device)
    divisor, greedy = temperature_rows(temperature, B, logits.device)
    scaled = logits.float() / _broadcast_rows(divisor, logits.ndim)
    thr = logit_thresholds(scaled, top_k, top_p)
    if thr is not None:
        scaled = scaled.masked_fill(scaled < thr[..., None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if isinstance(temperature, torch.Tensor) or temperature == 0:
        # A greedy row without a finite maximum has no argmax: its distribution is NaN, as the
        # softmax of such a row is, for the caller to refuse where it reads it.
        top, argmax = logits.max(-1, keepdim=True)
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax, 1.0).masked_fill_(~torch.isfinite(top), float("nan"))
        probs = torch.where(_broadcast_rows(greedy, logits.ndim), one_hot, probs)
    return probs


def sample_logits(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0, top_k: int | None = None,
                  top_p: float | None = None, *, generator: torch.Generator | None = None) -> torch.Tensor:
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
    check_tensor("logits", logits, 2)
    if logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocabulary of V >= 1 entries, got shape {tuple(logits.shape)}")
    check_generator(generator, logits.device)
    temperature = check_sampling_params(temperature, top_k, top_p, logits.shape[0], logits.device)
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        top, token = logits.max(-1)  # greedy: filters keep the argmax, no randomness to draw
        device_check(torch.isfinite(top).all(), _NO_ARGMAX)
        return token
    probs = process_logits(logits, temperature, top_k, top_p)
    E = exponential_noise(tuple(probs.shape), generator, probs.device)
    scores = torch.where(probs > 0, probs / E, torch.full_like(probs, -1.0))
    best, token = scores.max(-1)
    device_check((best > 0).all(), "logits must give every row a token of positive probability "
                                   "(a row holds NaN or +inf, or only -inf, or a temperature so small "
                                   "that logits / temperature overflows)")
    return token
