"""Registry of the Triton kernel specializations the package launches.

Every kernel module registers, at import time, each specialization its launcher
can pick (dtypes and constexprs), so the GPU compile check
(`specdec_kernels.testing.compile_check`) compiles exactly what users run. A
new kernel joins the check by calling `register` next to its launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelSpec:
    """One compile-time specialization of a ``@triton.jit`` kernel.

    Attributes:
        name: readable id, e.g. ``"rejection_sample[fp16,BV=1024]"``.
        kernel: the ``@triton.jit`` function.
        signature: argument name -> Triton type (``"*fp32"``, ``"i32"``, ``"constexpr"``...),
            in the kernel's argument order.
        constexprs: values of the ``constexpr`` arguments.
        num_warps, num_stages: launch options the launcher uses for this specialization.
        options: any other compiler options it launches with (e.g. ``{"sched4reg": True}``).
        aligned: names of pointer / integer arguments that are multiples of 16 (bytes for
            pointers) in the launches this spec stands for, as Triton's JIT would specialize
            them (torch allocations are 16-byte aligned). Without them the compiler must assume
            unaligned scalar accesses, and register counts are not those of real launches.
    """

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    options: dict[str, Any] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()

    def compile_attrs(self) -> dict[tuple[int], list[list]]:
        """``ASTSource`` attributes that mark `aligned` arguments as divisible by 16."""
        names = list(self.signature)
        unknown = [name for name in self.aligned if name not in names]
        if unknown:
            raise ValueError(f"{self.name}: aligned names {unknown} are not kernel arguments")
        return {(names.index(name),): [["tt.divisibility", 16]] for name in self.aligned}


_SPECS: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    """Add ``spec`` to the registry (names must be unique)."""
    if spec.name in _SPECS and _SPECS[spec.name] != spec:
        raise ValueError(f"kernel spec {spec.name!r} registered twice with different contents")
    _SPECS[spec.name] = spec
    return spec


def registered_specs() -> list[KernelSpec]:
    """All registered specializations, in registration order."""
    return list(_SPECS.values())


def torch_dtype_to_triton(dtype) -> str:
    """Triton signature type of a pointer to ``dtype`` elements, e.g. ``torch.float16 -> "*fp16"``."""
    import torch

    names = {
        torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
        torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
    }
    if dtype not in names:
        raise ValueError(f"no Triton pointer type for dtype {dtype}")
    return "*" + names[dtype]
