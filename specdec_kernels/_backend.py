"""Backend selection shared by every op.

Each public op accepts ``backend=`` with one of:

- ``"reference"``: plain PyTorch that reads like the paper (the test oracle);
- ``"torch"``: the vectorized, sync-free PyTorch path (default for CPU tensors);
- ``"triton"``: the fused Triton kernels (default for CUDA tensors). On CPU
  tensors it runs under the Triton interpreter, which must be switched on with
  ``TRITON_INTERPRET=1`` before anything imports triton;
- ``"auto"``: ``"triton"`` for CUDA tensors when triton is installed, else ``"torch"``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import numbers
import os

import torch

BACKENDS = ("reference", "torch", "triton")

# Public ops that dispatch through `resolve_backend` (printed by `python -m specdec_kernels`).
OPS = ("rejection_sample", "rejection_sample_logits", "first_rejection_index", "ragged_attention",
       "KVCache.append")


@functools.cache
def triton_available() -> bool:
    """Whether the triton package can be imported (it ships for Linux only)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


#: Head dims the Triton attention and cache kernels are compiled for (``"auto"`` runs other head
#: dims on the torch path).
TRITON_HEAD_DIMS = (64, 80, 96, 128)


def auto_backend(device: torch.device | str, head_dim: int | None = None) -> str:
    """The backend ``backend="auto"`` picks for tensors on ``device`` (and, for the attention and
    cache ops, heads of ``head_dim`` channels)."""
    device = torch.device(device)
    triton_ok = device.type == "cuda" and triton_available()
    return "triton" if triton_ok and (head_dim is None or head_dim in TRITON_HEAD_DIMS) else "torch"


def resolve_backend(backend: str, device: torch.device | str, head_dim: int | None = None) -> str:
    """Validate ``backend`` for tensors on ``device`` and resolve ``"auto"`` (see `auto_backend`).

    Raises:
        ValueError: unknown backend name, or ``"triton"`` where it cannot run.
    """
    device = torch.device(device)
    if backend == "auto":
        return auto_backend(device, head_dim)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package (pip install triton, Linux only)")
        if device.type == "cpu" and not interpreter_enabled():
            raise ValueError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before importing triton, or use backend='torch' / 'auto'"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' supports CUDA (or CPU under the interpreter), got {device}")
    return backend


class DeviceCheckError(ValueError, RuntimeError):
    """A value check made on the device (``torch._assert_async``) failed on a CPU tensor.

    Subclasses both ``ValueError`` (bad input) and ``RuntimeError`` (what
    ``torch._assert_async`` raises on CPU), so callers may catch either.
    """


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


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real number (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.float()``, skipping the dispatch when it is already float32 (hot-loop helper)."""
    return x if x.dtype == torch.float32 else x.float()


def device_check(condition: torch.Tensor, message: str) -> None:
    """Assert the 0-d bool tensor ``condition`` without a host synchronization.

    On CPU a false ``condition`` raises `DeviceCheckError` carrying ``message`` immediately; on
    CUDA it is a device-side assert (the error surfaces at the next synchronization).
    """
    try:
        torch._assert_async(condition, message)
    except RuntimeError as e:
        raise DeviceCheckError(message) from e


def on_input_device(launcher):
    """Decorate a kernel launcher so it runs with its first tensor argument's CUDA device current:
    Triton launches on the current device, whatever device the tensors are on (a model on
    ``cuda:1`` would otherwise run its kernels on GPU 0 against GPU 1's memory)."""

    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return launcher(*args, **kwargs)

    return launch
