"""Test harness: tolerances, NaN poisoning, traffic meter, sync counter, GPU compile check.

Used by ``tests/`` and ``benchmarks/``; importable by anyone who extends the
package. Nothing here imports triton at module import time.

- `TOLERANCES` / `assert_close`: the one tolerance table per dtype.
- `poison_empty`: ``torch.empty`` and friends return NaN-filled (float) or
  sentinel-filled (integer) tensors, so an element a kernel forgets to write fails.
- `TrafficMeter`: under the Triton interpreter, counts the bytes every kernel
  launch loads and stores (masked-off lanes cost nothing).
- `SyncCounter`: counts host synchronizations (``item``, ``bool(tensor)``,
  ``tolist``, ``nonzero``, boolean-mask indexing, device-to-host copies...).
- `OracleDraft`: a drafter that knows the continuation (the target's own greedy output): every
  draft is accepted, which measures the decoding loop against its physical limit.
- `compile_check` / `run_compile_check`: compile registered kernel
  specializations for real GPU targets (sm_80, sm_90) without a GPU, read
  registers and spills from the cubin and shared memory from the compile metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# --------------------------------------------------------------------------- oracle drafter

class OracleDraft:
    """A `specdec_kernels.Drafter` proposing a known continuation of each row.

    Args:
        continuation: [B, N] int64, the tokens each row will generate (e.g. ``generate(...,
            temperature=0).tokens`` with N at least max_new_tokens + K, so that no proposal runs
            past it; past the end it repeats the last column).

    Example::

        truth = generate(target, ids, max_new_tokens=64 + 4, temperature=0).tokens
        out = speculative_generate(target, OracleDraft(truth), ids, max_new_tokens=64, temperature=0)
        assert out.stats.acceptance_rate == 1.0
    """

    def __init__(self, continuation: torch.Tensor) -> None:
        self.continuation = continuation

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int) -> None:
        self.rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        self.committed = torch.zeros(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)

    def propose(self, num_tokens: int, sample):
        from .drafts import DraftProposal

        offsets = torch.arange(num_tokens, device=self.rows.device)
        columns = (self.committed[:, None] + offsets).clamp(max=self.continuation.shape[1] - 1)
        return DraftProposal(self.continuation[self.rows].gather(1, columns))

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor) -> None:
        self.committed = self.committed + num_tokens

    def select(self, rows: torch.Tensor) -> None:
        self.rows, self.committed = self.rows[rows], self.committed[rows]


# --------------------------------------------------------------------------- tolerances

#: One tolerance table per dtype, used by every correctness test.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 msg: str = "") -> None:
    """``torch.testing.assert_close`` with the tolerance of ``dtype`` (default: ``actual.dtype``).

    Both tensors are compared in float32, so a low-precision result can be
    checked against an fp32 reference. NaN anywhere fails.
    """
    dtype = dtype or actual.dtype
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {list(TOLERANCES)}")
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), equal_nan=False,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None, **TOLERANCES[dtype])


# --------------------------------------------------------------------------- NaN poisoning

#: What `poison_empty` fills integer tensors with: far outside any valid id or length.
INT_POISON = -(2**30) + 7


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    if t.dtype in (torch.uint8,):
        return t.fill_(251)
    if t.dtype == torch.int8:
        return t.fill_(-117)
    return t.fill_(INT_POISON if t.dtype != torch.int16 else -30001)


@contextlib.contextmanager
def poison_empty() -> Iterator[None]:
    """Within the block, ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return
    poisoned memory (NaN for floats, `INT_POISON` for integers) instead of whatever was there."""
    originals = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
    empty, empty_like, new_empty = originals
    torch.empty = lambda *a, **k: _poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: _poison(empty_like(*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: _poison(new_empty(self, *a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = originals


# --------------------------------------------------------------------------- traffic meter

@dataclasses.dataclass
class Launch:
    """Bytes one kernel launch moved (counted by `TrafficMeter`)."""

    kernel: str
    grid: tuple[int, ...] = ()
    bytes_loaded: int = 0
    bytes_stored: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_loaded + self.bytes_stored


class TrafficMeter:
    """Count the bytes each Triton kernel launch loads and stores, under the interpreter.

    Every ``tl.load`` / ``tl.store`` costs (active lanes) x (element size); masked-off
    lanes are free, repeated loads of one address are counted each time (no cache is
    assumed, so the count is an upper bound of DRAM traffic). Atomics are not counted.

    Example::

        with TrafficMeter() as meter:
            op(...)
        assert meter.bytes_moved <= 1.15 * analytic_minimum
        assert meter.num_launches <= 2
    """

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    @property
    def num_launches(self) -> int:
        return len(self.launches)

    @property
    def bytes_loaded(self) -> int:
        return sum(launch.bytes_loaded for launch in self.launches)

    @property
    def bytes_stored(self) -> int:
        return sum(launch.bytes_stored for launch in self.launches)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_loaded + self.bytes_stored

    def __enter__(self) -> TrafficMeter:
        import numpy as np
        from triton.runtime import interpreter as interp

        from specdec_kernels._backend import interpreter_enabled

        if not interpreter_enabled():
            raise RuntimeError("TrafficMeter needs the Triton interpreter (TRITON_INTERPRET=1)")
        builder_cls, executor_cls = interp.InterpreterBuilder, interp.GridExecutor
        self._originals = (builder_cls.create_masked_load, builder_cls.create_masked_store,
                           executor_cls.__call__)
        masked_load, masked_store, grid_call = self._originals
        meter = self

        def active_bytes(ptrs, mask) -> int:
            itemsize = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
            active = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data))
            return int(active.sum()) * itemsize

        def current() -> Launch:
            if not meter.launches:  # a load outside any launch (should not happen)
                meter.launches.append(Launch("<unknown>"))
            return meter.launches[-1]

        def load(builder, ptrs, mask, other, cache_policy, is_volatile):
            current().bytes_loaded += active_bytes(ptrs, mask)
            return masked_load(builder, ptrs, mask, other, cache_policy, is_volatile)

        def store(builder, ptrs, value, mask, cache_policy):
            current().bytes_stored += active_bytes(ptrs, mask)
            return masked_store(builder, ptrs, value, mask, cache_policy)

        def launch(executor, *args, **kwargs):
            grid = executor.grid if isinstance(executor.grid, tuple) else ()
            meter.launches.append(Launch(executor.fn.__name__, tuple(grid)))
            return grid_call(executor, *args, **kwargs)

        builder_cls.create_masked_load = load
        builder_cls.create_masked_store = store
        executor_cls.__call__ = launch
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import interpreter as interp

        (interp.InterpreterBuilder.create_masked_load, interp.InterpreterBuilder.create_masked_store,
         interp.GridExecutor.__call__) = self._originals

    def __repr__(self) -> str:
        rows = ", ".join(f"{x.kernel}: {x.bytes_loaded} B in / {x.bytes_stored} B out" for x in self.launches)
        return f"TrafficMeter({rows or 'no launches'})"


# --------------------------------------------------------------------------- sync counter

@dataclasses.dataclass(frozen=True)
class SyncEvent:
    """One host synchronization seen by `SyncCounter`: what it was and where it came from."""

    kind: str
    where: str


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" not in path and not path.endswith("specdec_kernels/testing.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "<unknown>"


class SyncCounter(TorchDispatchMode):
    """Count host synchronizations performed inside the block.

    Counted: reading a device value on the host (``item``, ``int()``/``float()``/``bool()``
    of a tensor, ``if tensor:``, ``tolist``, ``numpy``), ops whose output shape depends
    on values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
    ``repeat_interleave`` without ``output_size``), and device-to-host copies. On a CPU
    tensor none of these wait for anything, but each would stall a GPU pipeline, so an
    op that is sync-free on CPU under this counter is sync-free on GPU.

    Example::

        with SyncCounter() as syncs:
            op(...)
        assert syncs.count == 0, syncs.events
    """

    _VALUE_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                        "unique_consecutive", "equal", "is_nonzero", "_local_scalar_dense"}

    def __init__(self) -> None:
        super().__init__()
        self.events: list[SyncEvent] = []

    @property
    def count(self) -> int:
        return len(self.events)

    def _record(self, kind: str) -> None:
        self.events.append(SyncEvent(kind, _caller()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in self._VALUE_DEPENDENT:
            self._record(name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in (args[1] if len(args) > 1 else ())):
            self._record("boolean-mask indexing")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and not (
                len(args) > 2 and args[2] is not None):
            self._record("repeat_interleave without output_size")
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_device = args[0].device if name == "copy_" else kwargs.get("device")
            if (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None
                    and torch.device(dst_device).type == "cpu"):
                self._record("device-to-host copy")
        return func(*args, **kwargs)

    def __enter__(self) -> SyncCounter:
        self._patched = (torch.Tensor.tolist, torch.Tensor.numpy)
        tolist, numpy = self._patched
        counter = self

        def counted_tolist(tensor, *a, **k):
            counter._record("tolist")
            return tolist(tensor, *a, **k)

        def counted_numpy(tensor, *a, **k):
            counter._record("numpy")
            return numpy(tensor, *a, **k)

        torch.Tensor.tolist, torch.Tensor.numpy = counted_tolist, counted_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._patched
        return super().__exit__(*exc)


# --------------------------------------------------------------------------- GPU compile check

#: GPU targets every kernel must compile for: (backend, compute capability, warp size).
COMPILE_TARGETS = (("cuda", 80, 32), ("cuda", 90, 32))
#: Most shared memory one program may use, in bytes, by compute capability (the opt-in maximum
#: per block in NVIDIA's CUDA C++ Programming Guide, "Technical Specifications per Compute
#: Capability": 163 KB on 8.0, 99 KB on 8.6 and 8.9, 227 KB on 9.0).
SHARED_MEMORY_LIMITS = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclasses.dataclass
class CompileReport:
    """Result of compiling one kernel specialization for one GPU target."""

    name: str
    arch: str
    registers: int | None = None
    stack_bytes: int | None = None  # per-thread stack frame: where ptxas puts spilled registers
    local_bytes: int | None = None  # per-thread local memory
    shared_bytes: int | None = None  # shared memory per program
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Compiled, spills nothing, and fits the target's shared memory."""
        limit = SHARED_MEMORY_LIMITS.get(int(self.arch[3:]))  # None: a target this table lacks
        fits = self.shared_bytes is None or limit is None or self.shared_bytes <= limit
        return self.error is None and not self.stack_bytes and not self.local_bytes and fits


def _cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers, stack and local bytes per thread of the single function in ``cubin``.

    Triton inlines every function, so a non-zero stack or local size means spilled registers.
    """
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True,
                             text=True, check=True).stdout
    usage = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", out)
    if usage is None:
        raise RuntimeError(f"cannot read resource usage from cuobjdump output:\n{out}")
    return dict(zip(("registers", "stack_bytes", "local_bytes"), map(int, usage.groups()), strict=True))


def compile_check(specs: Sequence | None = None, targets: Sequence = COMPILE_TARGETS) -> list[CompileReport]:
    """Compile ``specs`` (default: every registered kernel specialization) for ``targets``.

    Runs in this process, so triton must not be in interpreter mode; use
    `run_compile_check` from tests, which starts a clean subprocess.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if specs is None:
        from specdec_kernels.kernels import import_all, registry

        import_all()
        specs = registry.registered_specs()
    reports = []
    for spec in specs:
        if not isinstance(spec.kernel, triton.runtime.JITFunction):
            raise RuntimeError(f"{spec.name}: kernel is not a JITFunction (is TRITON_INTERPRET set?)")
        for backend, capability, warp_size in targets:
            report = CompileReport(spec.name, f"sm_{capability}")
            try:
                source = ASTSource(spec.kernel, signature=spec.signature, constexprs=spec.constexprs,
                                   attrs=spec.compile_attrs())
                compiled = triton.compile(source, target=GPUTarget(backend, capability, warp_size),
                                          options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages,
                                                        **spec.options))
                for key, value in _cubin_resources(compiled.asm["cubin"]).items():
                    setattr(report, key, value)
                report.shared_bytes = compiled.metadata.shared
            except Exception as e:  # report every failure, keep checking the others
                report.error = f"{type(e).__name__}: {e}"
            reports.append(report)
    return reports


def run_compile_check(modules: Sequence[str] = (), timeout: float = 1800) -> list[CompileReport]:
    """Run `compile_check` in a fresh interpreter with ``TRITON_INTERPRET`` unset.

    Args:
        modules: extra modules (dotted names or ``.py`` paths) to import first; the
            specializations they register are checked together with the package's own.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "specdec_kernels.testing", "compile-check", "--json", *modules]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"compile check crashed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [CompileReport(**r) for r in json.loads(proc.stdout)]


def _import_module(name: str) -> None:
    import importlib
    import importlib.util

    if name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(name).stem, name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        importlib.import_module(name)


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m specdec_kernels.testing")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("compile-check", help="compile every kernel specialization for sm_80 and sm_90")
    check.add_argument("modules", nargs="*", help="extra modules or .py files that register kernels")
    check.add_argument("--json", action="store_true", help="print reports as JSON")
    args = parser.parse_args(argv)

    for module in args.modules:
        _import_module(module)
    reports = compile_check()
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in reports]))
    else:
        for r in reports:
            status = "ok" if r.ok else "FAIL"
            print(f"{status:4} {r.arch} {r.name}: registers={r.registers} stack={r.stack_bytes} "
                  f"local={r.local_bytes} shared={r.shared_bytes}" + (f"\n     {r.error}" if r.error else ""))
        print(f"{sum(r.ok for r in reports)} of {len(reports)} specializations compiled without spills, "
              f"within their target's shared memory")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(_main())
