"""Random inputs of the samplers: a counter-based RNG, Exp(1) draws and `make_rejection_noise`.

Imports torch only (and the shared types and checks), so that the reference draws its noise with
the very function the torch path uses, without importing the torch path.
"""

from __future__ import annotations

import torch

from ._checks import check_generator_and_seed, is_int
from ._types import RejectionNoise

_MASK32 = 0xFFFFFFFF


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


def exponential_noise(
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
    check_generator_and_seed(generator, seed, batch, device, on=None)  # a seed tensor is moved to ``device``
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
            exponential = exponential_noise((batch, vocab), generator, device)
    return RejectionNoise(accept.contiguous(), uniform.contiguous(), exponential)
