"""Argument checks shared by every op, by the references and by the kernels' launchers.

Imports torch only, so that a reference may use it without importing the fast paths it judges.
Two kinds of check:

- host checks (types, shapes, dtypes, devices) raise at once, naming the argument;
- value checks read tensor values: `device_check` asserts on the device without a host sync, and
  `ValueChecks` gathers several checks and decides them with one host read at the end.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch


def check_float_dtype(dtype: object) -> None:
    """``dtype`` is a floating-point torch.dtype (a string such as "float16" is refused by name)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype such as torch.float16, got {dtype!r}")


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real number (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    """``t`` itself, after checking that it is a tensor with ``ndim`` dimensions (TypeError /
    ValueError naming ``name`` otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def check_lengths_tensor(name: str, t: torch.Tensor, batch: int, device: torch.device, on: str) -> None:
    """Raise ValueError naming ``name`` unless ``t`` is a [batch] integer tensor on ``device``
    (``on`` describes that device in the message, e.g. ``"cpu like q"``)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a [B] integer tensor, got {type(t).__name__}")
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {list(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {on}, got {t.device}")


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """``generator`` is None or a torch.Generator for ``device``'s kind (cpu / cuda)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is a {generator.device.type} generator but the tensors are on {device}")


def check_generator_and_seed(generator: torch.Generator | None, seed: int | torch.Tensor | None, batch: int,
                             device: torch.device, on: str | None) -> None:
    """Not both given; ``generator`` is for ``device``'s kind; ``seed`` is an int or a ``[B]``
    int64 / int32 tensor, on ``device`` (where ``on`` lives) unless ``on`` is None (moved there)."""
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    check_generator(generator, device)
    if seed is None:
        return
    if isinstance(seed, torch.Tensor):
        check_tensor("seed", seed, 1)
        if seed.shape[0] != batch or seed.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"seed must be an int or a [B] = [{batch}] int64 tensor, got {seed.dtype} {tuple(seed.shape)}")
        if on is not None and seed.device != device:
            raise ValueError(f"seed is on {seed.device} but {on} is on {device}")
    elif not is_int(seed):
        raise TypeError(f"seed must be an int or a [B] int64 tensor, got {type(seed).__name__}")
    elif not -(2**63) <= seed < 2**63 - batch:
        raise ValueError(f"seed must fit int64 (per-row seeds are seed + b), got {seed}")


class DeviceCheckError(ValueError, RuntimeError):
    """A value check made on the device failed: `device_check` on a CPU tensor, or a flag the
    decoding loops read in their one transfer per step (model logits with NaN or infinities).

    Subclasses both ``ValueError`` (bad input) and ``RuntimeError`` (what
    ``torch._assert_async`` raises on CPU), so callers may catch either.
    """


def device_check(condition: torch.Tensor, message: str | Callable[[], str]) -> None:
    """Assert the 0-d bool tensor ``condition`` without a host synchronization.

    On CPU a false ``condition`` raises `DeviceCheckError` carrying ``message`` immediately; on
    CUDA it is a device-side assert (the error surfaces at the next synchronization, without the
    message). ``message`` may be a function returning the text: it is called only when the check
    fails on CPU, so it may read tensors to say which rows failed.
    """
    try:
        torch._assert_async(condition, message if isinstance(message, str) else "device_check failed")
    except RuntimeError as e:
        raise DeviceCheckError(message if isinstance(message, str) else message()) from e


class ValueChecks:
    """Value checks gathered without a host sync, then decided by one host read (`raise_first_failure`).

    Each check is a bool tensor that must be all true and the error it stands for. Only when one
    fails are the checks read one by one, in the order they were added, and the first failure's
    message built (a function, so that its numbers are read from the tensors only then)::

        checks = ValueChecks()
        checks.require(ids < V, f"draft_token_ids must lie in [0, V) = [0, {V})")
        ...  # the op runs, adding checks of the values it reads
        checks.raise_first_failure()
    """

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, str | Callable[[], str]]] = []

    def require(self, ok: torch.Tensor, message: str | Callable[[], str]) -> None:
        """Record that every entry of the bool tensor ``ok`` must be true; ``message`` (a string, or
        a function returning one) is the ValueError's message when it is not."""
        self._checks.append((ok, message))

    def raise_first_failure(self) -> None:
        """Raise ValueError with the message of the first failed check; one host read when all pass."""
        if not self._checks or bool(torch.cat([ok.reshape(-1) for ok, _ in self._checks]).all()):
            return
        for ok, message in self._checks:
            if not bool(ok.all()):
                raise ValueError(message if isinstance(message, str) else message())
