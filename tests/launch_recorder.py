"""Record the Triton launches a launcher makes, without running them, and find the registered
specialization (`specdec_kernels.kernels.registry`) each launch is: the compile check compiles
only registered specs, so a launch that matches none was never compile-checked."""

from __future__ import annotations

import torch
from specdec_kernels.kernels.registry import KernelSpec, registered_specs, torch_dtype_to_triton


def _triton_defaults() -> dict[str, int]:
    """Warps and stages a launch gets when it passes none (Triton's CUDA options)."""
    from triton.backends.nvidia.compiler import CUDAOptions

    return {"num_warps": CUDAOptions.num_warps, "num_stages": CUDAOptions.num_stages}


class LaunchRecorder:
    """Replaces ``module.<name>`` kernels (with ``monkeypatch``) by stand-ins that record each
    launch's kernel, positional and keyword arguments; ``launches`` lists them in order."""

    def __init__(self, monkeypatch, module, *names: str) -> None:
        self.launches: list[tuple[object, tuple, dict]] = []
        for name in names:
            monkeypatch.setattr(module, name, _StandIn(getattr(module, name), self.launches))


class _StandIn:
    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def _argument_fits(kind: str, value) -> bool:
    if kind.startswith("*"):
        return isinstance(value, torch.Tensor) and torch_dtype_to_triton(value.dtype) == kind
    if kind == "i32":  # Triton types a Python int by its value (i32 only in range), a bool as u1
        return type(value) is int and -(2**31) <= value < 2**31
    if kind == "fp32":
        return isinstance(value, float)
    return False


def _same_constexpr(registered, launched) -> bool:
    return type(registered) is type(launched) and registered == launched  # True is not 1


def registered_specs_for(kernel, args: tuple, kwargs: dict) -> list[KernelSpec]:
    """The registered specializations one launch is: same kernel, argument types (pointer dtypes,
    int ranges, no bools), constexprs (value and type), warps, stages and other compiler options.
    Not checked: Triton's own value specializations (an int equal to 1, alignment to 16)."""
    defaults = _triton_defaults()
    found = []
    for spec in registered_specs():
        if spec.kernel is not kernel:
            continue
        names = list(spec.signature)
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in spec.signature})
        if len(args) > len(names) or set(bound) != set(names):
            continue
        fits = all(
            _same_constexpr(spec.constexprs.get(name), bound[name]) if kind == "constexpr"
            else _argument_fits(kind, bound[name])
            for name, kind in spec.signature.items())
        options = {k: v for k, v in kwargs.items() if k not in spec.signature and k not in defaults}
        if (fits and kwargs.get("num_warps", defaults["num_warps"]) == spec.num_warps
                and kwargs.get("num_stages", defaults["num_stages"]) == spec.num_stages and options == spec.options):
            found.append(spec)
    return found


def assert_all_registered(launches: list) -> set[str]:
    """Every recorded launch is exactly one registered spec; returns the names of those used."""
    used = set()
    for kernel, args, kwargs in launches:
        specs = registered_specs_for(kernel, args, kwargs)
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        assert len(specs) == 1, (getattr(kernel, "__name__", kernel), kwargs, dtypes, [s.name for s in specs])
        used.add(specs[0].name)
    return used
