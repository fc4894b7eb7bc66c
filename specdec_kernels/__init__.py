"""specdec_kernels: fast, lossless speculative decoding.

Fused Triton kernels for the hot spots of speculative decoding (rejection
sampling, first-rejection search, causal attention over a ragged KV cache),
a vectorized sync-free CPU path for each op, plain-PyTorch references that
prove them right, and a decoding API on top.

Every op takes ``backend="auto" | "reference" | "torch" | "triton"``; see
`specdec_kernels._backend`.
"""

from ._backend import BACKENDS, auto_backend, interpreter_enabled, resolve_backend, triton_available
from .attention import ragged_attention
from .cache import KVCache

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "KVCache",
    "__version__",
    "auto_backend",
    "interpreter_enabled",
    "ragged_attention",
    "resolve_backend",
    "triton_available",
]
