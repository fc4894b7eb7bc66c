"""Backend selection shared by every op.

Each public op accepts ``backend=`` with one of:

- ``"reference"``: plain PyTorch that reads like the paper (the test oracle);
- ``"torch"``: the vectorized, sync-free PyTorch path (default for CPU tensors);
- ``"triton"``: the fused Triton kernels (default for CUDA tensors). On CPU
  tensors it runs under the Triton interpreter, which must be switched on with
  ``TRITON_INTERPRET=1`` before anything imports triton;
- ``"auto"``: ``"triton"`` for CUDA tensors when triton is installed, else ``"torch"``.

An op resolves its ``backend`` argument with `resolve_backend` and runs the implementation a
`Dispatch` table holds for it; every implementation of one op takes the same arguments.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable

import torch

BACKENDS = ("reference", "torch", "triton")

# Public ops that dispatch through `resolve_backend` (printed by `python -m specdec_kernels`).
OPS = ("rejection_sample", "rejection_sample_logits", "tree_rejection_sample", "first_rejection_index",
       "ragged_attention", "KVCache.append")


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


class Dispatch:
    """One op's implementation per backend, looked up with the resolved backend name.

    Every implementation takes the same arguments, so an op calls ``TABLE[backend](...)`` instead of
    branching on the backend. An entry is a function, or ``"module:function"``, imported on first use:
    the kernels must not be imported before the first Triton call (importing ``specdec_kernels`` never
    imports triton), and the fast paths import neither the reference that judges them nor the kernels.

    Example::

        RAGGED_ATTENTION = Dispatch(reference="specdec_kernels.reference.attention:ragged_attention",
                                    torch=_ragged_attention_torch,
                                    triton="specdec_kernels.kernels.attention:ragged_attention_triton")
        out = RAGGED_ATTENTION[resolve_backend(backend, q.device)](q, k_cache, ...)
    """

    def __init__(self, *, reference: Callable | str, torch: Callable | str, triton: Callable | str) -> None:
        self._entries: dict[str, Callable | str] = {"reference": reference, "torch": torch, "triton": triton}

    def __getitem__(self, backend: str) -> Callable:
        entry = self._entries[backend]
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            entry = self._entries[backend] = getattr(importlib.import_module(module), name)
        return entry


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.float()``, skipping the dispatch when it is already float32 (hot-loop helper)."""
    return x if x.dtype == torch.float32 else x.float()


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
