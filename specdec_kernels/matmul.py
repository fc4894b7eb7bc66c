"""The built-in model's CPU matmuls: ``x @ weight.T`` in the form this machine runs fastest.

Five forms compute the same product for ``x`` [..., in] and ``weight`` [out, in]:

- ``"linear"``: ``F.linear(x, weight)``;
- ``"weight_first"``: ``(weight @ x^T)^T`` with ``x`` made contiguous (one row is duplicated to
  two: MKL then runs its GEMM instead of its matrix-vector kernel); the result is a transposed
  view, which the element-wise ops that follow read in place;
- ``"mkl_packed"``: MKL's packed GEMM from a copy of the weight packed once (x86 builds);
- ``"onednn_packed"``: oneDNN's matmul from a copy of the weight in its blocked layout, made once
  (the ops torch's compiler uses for frozen CPU linears; builds with oneDNN);
- ``"panels"``: the package's own kernel (``panels.c``, built at first use by the system's C
  compiler) from a copy of the weight in panels of 16 outputs: it reads each weight once at
  any row count, so at the few rows of decoding and verification it runs at the memory's
  bandwidth, where the libraries' GEMMs slow down with each row (x86-64 Linux);

and the weight itself may be stored row-major (``[out, in]`` contiguous, as loaded) or
input-major (``weight.t()`` contiguous). Which is fastest depends on the row count and on the
machine (its BLAS kernels, threads and memory): on one 2-core x86 VM MKL's packed GEMM won from
2 rows on, on another ``weight_first`` won at 1-2 rows and oneDNN's above (the timings are in
``docs/performance.md``). So `measure_matmul_plan` times the forms on the model's own weights
and returns a `MatmulPlan` (a weight layout, and a form per row count); `Linear` follows it once
`Llama.pack_weights` has applied it. Without a plan, `linear` picks by row count alone.

Two more forms, ``"onednn_bfloat16"`` and ``"panels_bfloat16"`` (`ROUNDED_FORMS`), read a
bfloat16 copy of the weight: half the bytes, so faster where a matmul streams its weight from
memory, but not the same product. No measured plan holds them; `bfloat16_plan` applies them to
a draft model, whose proposals verification judges whatever they are (`FeatureHeadDraft`).

A plan serves the rest of the process, so what else the machine did while it was measured must
not decide it. While another process holds a core, every multi-threaded call waits for a
descheduled worker thread, a scheduler tick at a time: the timings then rank the forms by how
often they synchronize, and a form that is slower on a quiet machine can win by far. Two rules
keep such a load out of the plan:

- `measure_matmul_plan` times each matmul call on its own, in passes that each take every row
  count and form in turn (so that each call's passes spread over the whole measurement), and
  keeps each call's fastest pass (`fastest_calls`): a load that comes and goes spares some pass
  of every call, while it would spoil most whole passes.
- A load that lasts through the measurement spares none, and no measurement can tell then what a
  quiet machine would show. `measured_matmul_plan` therefore stores a plan on disk, keyed by the
  machine, only when nothing else used the CPU while it was measured (`cpu_seconds_elsewhere`),
  and every later process on that machine (loaded or not) reuses the stored plan.

The forms, their measurement and the plan store stay in one module: a plan is only as good as
the measurement that chose it, and the two are read together.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import _native
from ._checks import is_int


def weight_first(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` computed as ``(weight @ x^T)^T`` (``x`` [..., in], ``weight`` [out, in]).

    ``x`` is made contiguous so that MKL is handed ``x^T`` as a transposed view (it ran a
    contiguous ``x^T`` several times slower); a single row is duplicated to two (see the module
    docstring). Returns a transposed view [..., out]."""
    rows, width = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    x2 = x.reshape(rows, width).contiguous()
    if rows == 1:
        x2 = torch.cat((x2, x2))
    return torch.mm(weight, x2.t())[:, :rows].t().reshape(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` [..., in] and ``weight`` [out, in] (``F.linear`` without bias),
    without a measured plan: on the CPU, for 4 to 63 rows, by `weight_first`, the row counts
    where MKL ran it faster than ``F.linear`` on every machine measured (Intel and AMD;
    `benchmarks/test_bench_model.py::test_matmuls`)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if x.device.type != "cpu" or not 4 <= rows < 64:
        return F.linear(x, weight)
    return weight_first(x, weight)


# MKL and oneDNN choose the kernels of a packed weight from the row count given when packing:
# packed for 64 rows, their weights serve one-row decoding as well as verification and prefill
# widths, while packing for a few rows slows the wide calls.
_PACK_ROWS = 64


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM (the ``"mkl_packed"`` form): x86 builds do."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def mkl_pack(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed GEMM buffer of a CPU float32 ``weight`` [out, in] (an opaque tensor that can
    be neither copied nor pickled), packed for the current number of torch threads."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_ROWS)


def mkl_packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` from ``packed = mkl_pack(weight)``, for CPU float32 ``x`` [..., in]; the
    input width is not checked (MKL would read past ``x``)."""
    # The last argument must equal the input's row count, else torch's op falls back to an
    # unpacked matmul. MKL's buffer records its own layout and serves any row count (the hint
    # only picks the kernels); the tests compare it with F.linear at 0 to 130 rows.
    return torch.ops.mkl._mkl_linear(x, packed, weight, None, x.numel() // max(x.shape[-1], 1))


def onednn_packing_available() -> bool:
    """Whether this torch build has oneDNN's packed matmul (the ``"onednn_packed"`` form)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a CPU float32 ``weight`` [out, in] (an opaque tensor that can be
    neither copied nor pickled)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)


def onednn_packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` from ``packed = onednn_pack(weight)``, for CPU float32 ``x`` [..., in]
    (any strides); ``weight`` is not read."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def panels_available() -> bool:
    """Whether the ``"panels"`` form runs here: the package's C source built on this machine
    (x86-64 Linux with a C compiler; `specdec_kernels._native`, whose ``unavailable_reason`` says
    why not)."""
    return _native.library() is not None


def panels_pack(weight: torch.Tensor) -> torch.Tensor:
    """The ``"panels"`` form's copy of a CPU float32 ``weight`` [out, in]: [ceil(out / 16), in,
    16] float32, panel p holding rows 16 p .. 16 p + 15 column by column (zeros past ``out``)."""
    return _panels_pack(weight, _native.library().panels_pack, torch.float32)


def panels_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` from ``packed = panels_pack(weight)``, for CPU float32 ``x`` [..., in] (any
    strides); only ``weight``'s shape is read. Each weight is read once whatever the row count
    (``panels.c``): at the few rows of a decoding or verification step, memory's bandwidth."""
    return _panels_run(x, packed, weight, _native.library().panels_matmul, torch.float32)


def panels_bfloat16_pack(weight: torch.Tensor) -> torch.Tensor:
    """The ``"panels_bfloat16"`` form's copy of a CPU float32 ``weight`` [out, in]: rounded to
    bfloat16 (to nearest), in `panels_pack`'s layout."""
    return _panels_pack(weight, _native.library().panels_pack_bf16, torch.bfloat16)


def panels_bfloat16_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with the weight rounded to bfloat16, from ``packed =
    panels_bfloat16_pack(weight)``, for CPU float32 ``x`` [..., in]: half `panels_linear`'s bytes;
    ``x``, the products and the sums stay float32 (closer to float32's product than
    ``"onednn_bfloat16"``, which also rounds ``x`` and the result)."""
    return _panels_run(x, packed, weight, _native.library().panels_matmul_bf16, torch.bfloat16)


def _panels_pack(weight: torch.Tensor, pack, dtype: torch.dtype) -> torch.Tensor:
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ValueError(f"weight must be a CPU float32 [out, in] tensor, got {weight.dtype} "
                         f"{list(weight.shape)} on {weight.device}")
    n, k = weight.shape
    weight = weight.detach().to(dtype).contiguous()
    packed = weight.new_empty((n + 15) // 16, k, 16)
    pack(weight.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
    return packed


def _panels_run(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, matmul,
                packed_dtype: torch.dtype) -> torch.Tensor:
    n, k = weight.shape
    panels = (n + 15) // 16
    # The kernel reads raw memory: a wrong width, dtype or copy would read past the tensors.
    if (x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k
            or packed.dtype != packed_dtype or packed.shape != (panels, k, 16)):
        raise ValueError(f"x must be CPU float32 [..., {k}] and packed the {packed_dtype} [{panels}, {k}, 16] copy "
                         f"of the weight, got x {x.dtype} {list(x.shape)} on {x.device}, packed {packed.dtype} "
                         f"{list(packed.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    rows = x.numel() // k if k else 0
    out = x.new_empty(*x.shape[:-1], n) if rows else x.new_zeros(*x.shape[:-1], n)
    if rows:
        matmul(x.data_ptr(), rows, k, packed.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
    return out


@dataclass(frozen=True)
class _PackedForm:
    available: Callable[[], bool]
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, packed, weight)


#: The forms that run from a packed copy of the weight, by name.
PACKED_FORMS = {"mkl_packed": _PackedForm(mkl_packing_available, mkl_pack, mkl_packed_linear),
                "onednn_packed": _PackedForm(onednn_packing_available, onednn_pack, onednn_packed_linear),
                "panels": _PackedForm(panels_available, panels_pack, panels_linear)}
FORMS = ("linear", "weight_first", *PACKED_FORMS)


def bfloat16_matmuls_available() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX) and this torch build
    runs oneDNN's bfloat16 matmul: the ``"onednn_bfloat16"`` form. (oneDNN also runs bfloat16 on
    AVX-512 CPUs without those, emulated: not counted here.)"""
    native = any(bool(getattr(torch.cpu, check, lambda: False)())
                 for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    is_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return native and onednn_packing_available() and is_supported is not None and bool(is_supported())


def onednn_bfloat16_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a CPU float32 ``weight`` [out, in], rounded to bfloat16 (an
    opaque tensor, as `onednn_pack`'s)."""
    return onednn_pack(weight.detach().to(torch.bfloat16))


def onednn_bfloat16_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` from ``packed = onednn_bfloat16_pack(weight)`` for CPU float32 ``x``
    [..., in]: ``x`` rounded to bfloat16, products summed in float32 and rounded to bfloat16,
    returned as float32 (equal to ``F.linear(x.bfloat16(), weight.bfloat16()).float()``)."""
    return onednn_packed_linear(x.to(torch.bfloat16), packed, weight).to(x.dtype)


#: Forms that round to bfloat16: half the bytes of a float32 weight, products off from float32's
#: in their third significant digit. Never measured into a plan (a model's outputs must not
#: depend on which form won); a draft takes them by choice (`bfloat16_plan`), since verification
#: judges whatever it proposes.
ROUNDED_FORMS = {"onednn_bfloat16": _PackedForm(bfloat16_matmuls_available, onednn_bfloat16_pack,
                                                onednn_bfloat16_linear),
                 "panels_bfloat16": _PackedForm(panels_available, panels_bfloat16_pack, panels_bfloat16_linear)}


def _copied_form(name: str) -> _PackedForm:
    """The form ``name`` of `PACKED_FORMS` or `ROUNDED_FORMS` (read at each call, as tests
    replace their entries)."""
    return PACKED_FORMS[name] if name in PACKED_FORMS else ROUNDED_FORMS[name]


@dataclass(frozen=True)
class MatmulPlan:
    """How a prepared `Linear` computes ``x @ weight.T`` on the CPU in float32.

    Attributes:
        input_major: store the weights input-major (``weight.t()`` contiguous) instead of
            row-major.
        forms: ``(min_rows, form)`` pairs with ascending ``min_rows``, the first 1: inputs of
            ``rows`` rows run the form of the last pair with ``min_rows <= rows``; each form is
            one of `FORMS`.
    """

    input_major: bool
    forms: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.input_major, bool):
            raise ValueError(f"input_major must be a bool, got {self.input_major!r}")
        try:
            forms = tuple((start, form) for start, form in self.forms)
        except (TypeError, ValueError):
            raise ValueError(f"forms must be (min_rows, form) pairs, got {self.forms!r}") from None
        object.__setattr__(self, "forms", forms)  # a tuple, whatever sequence was given: hashable
        starts = [start for start, _ in forms]
        if not starts or not all(is_int(s) for s in starts) or starts[0] != 1 or starts != sorted(set(starts)):
            raise ValueError(f"forms must be (min_rows, form) pairs with strictly ascending int min_rows "
                             f"starting at 1, got {self.forms!r}")
        for _, form in self.forms:
            if form not in FORMS and form not in ROUNDED_FORMS:
                raise ValueError(f"form must be one of {(*FORMS, *ROUNDED_FORMS)}, got {form!r}")

    def form(self, rows: int) -> str:
        """The form that runs inputs of ``rows`` rows."""
        chosen = self.forms[0][1]
        for start, form in self.forms:
            if rows < start:
                break
            chosen = form
        return chosen

    @property
    def packed_forms(self) -> tuple[str, ...]:
        """The forms of `PACKED_FORMS` and `ROUNDED_FORMS` this plan runs (each keeps a packed
        copy of the weights)."""
        return tuple(dict.fromkeys(form for _, form in self.forms if form in PACKED_FORMS or form in ROUNDED_FORMS))

    @property
    def rounded(self) -> bool:
        """Whether this plan runs a form of `ROUNDED_FORMS` (not the float32 product: for drafts)."""
        return any(form in ROUNDED_FORMS for _, form in self.forms)

    def describe(self) -> str:
        """One line, e.g. ``"row-major weights; 1 row: weight_first, 65+ rows: linear"``."""
        ends = [start - 1 for start, _ in self.forms[1:]] + [None]
        spans = []
        for (start, form), end in zip(self.forms, ends, strict=True):
            rows = f"{start}+" if end is None else (str(start) if end == start else f"{start}-{end}")
            spans.append(f"{rows} row{'' if rows == '1' else 's'}: {form}")
        return f"{'input' if self.input_major else 'row'}-major weights; " + ", ".join(spans)


#: MKL's packed GEMM from 2 rows on, one row by ``F.linear`` from an input-major weight: what an
#: Intel Xeon's measurements favoured (``docs/performance.md``).
MKL_PACKED_PLAN = MatmulPlan(input_major=True, forms=((1, "linear"), (2, "mkl_packed")))

#: oneDNN's bfloat16 matmul at every row count (`ROUNDED_FORMS`): for drafts, not exact.
BFLOAT16_PLAN = MatmulPlan(input_major=False, forms=((1, "onednn_bfloat16"),))
#: The panels form from bfloat16 weights at a draft step's few rows, oneDNN's bfloat16 matmul
#: from 10 (on a draft head's weights oneDNN's won from 12 rows on a CPU with AMX, the panels up
#: to 8: docs/performance.md).
PANELS_BFLOAT16_PLAN = MatmulPlan(input_major=False, forms=((1, "panels_bfloat16"), (10, "onednn_bfloat16")))


def bfloat16_plan() -> MatmulPlan | None:
    """The plan a draft's bfloat16 matmuls follow on this machine: `PANELS_BFLOAT16_PLAN` where
    both forms run, the one form that runs alone at every row count, or None where neither does
    (no native bfloat16 for oneDNN, no built ``panels.c``)."""
    panels, onednn = panels_available(), bfloat16_matmuls_available()
    if panels and onednn:
        return PANELS_BFLOAT16_PLAN
    if panels:
        return MatmulPlan(input_major=False, forms=((1, "panels_bfloat16"),))
    return BFLOAT16_PLAN if onednn else None


# Row counts `measure_matmul_plan` times (decoding batches, verification widths: every count to 6,
# since a batch-1 verification of K + 1 tokens runs one of them each step and a count between two
# timed ones would take the smaller's form untimed); more rows (prefills) run the form of the last:
# a prefill runs once per call, and each row count adds seconds to measuring.
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 8, 16, 32, 64)

# The weights are stored input-major only when that layout's best forms are this much faster
# (product of the ratios over the row counts): a layout change also makes a tied embedding's
# lookups strided gathers (see `Llama.pack_weights`), and a close call is noise.
_INPUT_MAJOR_MARGIN = 1.05

#: What `measure_matmul_plan` times: (layout, form) pairs, the layout True for input-major
#: weights, False for row-major, None for the packed copies (they read neither).
Candidate = tuple[bool | None, str]


def measure_matmul_plan(weights: Sequence[torch.Tensor], *, row_counts: Sequence[int] = MEASURED_ROWS,
                        repeats: int = 3) -> MatmulPlan:
    """Time every form and weight layout on ``weights`` and return the fastest `MatmulPlan`
    (`choose_matmul_plan`).

    The candidates are ``"linear"`` and ``"weight_first"`` from row-major weights, ``"linear"``
    from input-major ones, and the packed forms this torch build has. Each of ``repeats``
    passes runs every row count of ``row_counts`` and, at each, every candidate over all of
    ``weights``, timing each matmul call on its own (after one untimed call each at one row). A
    candidate's time at a row count is the sum of its calls' fastest (`fastest_calls`): see the
    module docstring for why calls, not passes, and why passes take the row counts in turn.

    Args:
        weights: CPU float32 [out, in] weights in the order a forward pass reads them. Give more
            bytes than the last-level cache holds (a few layers and the LM head), so the passes
            stream them from memory as decoding does; the weights themselves are not changed.
        row_counts: ascending row counts to time, the first 1.
        repeats: timed passes.

    Raises:
        ValueError: no weights, a weight that is not CPU float32 [out, in], or bad row counts.
    """
    if not weights:
        raise ValueError("weights must hold at least one weight")
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.device.type != "cpu" or w.dtype != torch.float32:
            got = (f"{w.dtype} {tuple(w.shape)} on {w.device}" if isinstance(w, torch.Tensor)
                   else type(w).__name__)
            raise ValueError(f"weights must be CPU float32 [out, in] tensors, got weights[{i}]: {got}")
    counts = list(row_counts)
    if not counts or not all(is_int(r) for r in counts) or counts[0] != 1 or counts != sorted(set(counts)):
        raise ValueError(f"row_counts must be strictly ascending ints starting at 1, got {row_counts!r}")
    if not is_int(repeats) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    with torch.inference_mode():
        weights = [w.detach() for w in weights]
        rows_first = [w if w.is_contiguous() else w.contiguous() for w in weights]            # row-major
        inputs_first = [w if w.t().is_contiguous() else w.t().contiguous().t() for w in weights]  # input-major
        calls: dict[Candidate, list[Callable[[torch.Tensor], torch.Tensor]]] = {  # one call per weight
            (False, "linear"): [partial(F.linear, weight=w) for w in rows_first],
            (False, "weight_first"): [partial(weight_first, weight=w) for w in rows_first],
            (True, "linear"): [partial(F.linear, weight=w) for w in inputs_first],
        }
        for name, form in PACKED_FORMS.items():
            if form.available():
                calls[(None, name)] = [partial(form.run, packed=form.pack(w), weight=w) for w in rows_first]
        gen = torch.Generator().manual_seed(0)
        inputs = {rows: [torch.randn(rows, w.shape[1], generator=gen) for w in weights] for rows in counts}
        for candidate in calls.values():  # first calls: allocations, MKL's own setup
            for call, x in zip(candidate, inputs[1], strict=True):
                call(x)
        passes: dict[int, dict[Candidate, list[list[float]]]] = {rows: {key: [] for key in calls} for rows in counts}
        for _ in range(repeats):
            for rows in counts:
                for key, candidate in calls.items():
                    pass_seconds = []
                    for call, x in zip(candidate, inputs[rows], strict=True):
                        start = time.perf_counter()
                        call(x)
                        pass_seconds.append(time.perf_counter() - start)
                    passes[rows][key].append(pass_seconds)
    return choose_matmul_plan({rows: {key: fastest_calls(timed) for key, timed in by_key.items()}
                               for rows, by_key in passes.items()})


def fastest_calls(passes: Sequence[Sequence[float]]) -> float:
    """The seconds of one pass with every call at its fastest: ``passes[p][i]`` timed call ``i``
    in pass ``p`` (every pass makes the same calls); the sum over calls of their minimum over the
    passes. A disturbance that slows one call of a pass (a scheduler tick's wait) then costs
    nothing as long as another pass ran that call undisturbed.

    Raises:
        ValueError: no passes, or passes of different lengths.
    """
    if not passes or len({len(p) for p in passes}) != 1:
        raise ValueError(f"passes must be one or more passes of equally many calls, got {passes!r}")
    return sum(min(call) for call in zip(*passes, strict=True))


def choose_matmul_plan(seconds: Mapping[int, Mapping[Candidate, float]]) -> MatmulPlan:
    """The fastest `MatmulPlan` for measured times: ``seconds[rows][(layout, form)]`` (see
    `Candidate`), for ascending row counts, the first 1.

    The layout is the one whose best candidate is closest to the best of all across the row
    counts (geometric mean of the ratios); the weights leave the row-major layout they are
    loaded in only for a clear gain (`_INPUT_MAJOR_MARGIN`). Each row count then takes its
    fastest form in that layout (the packed copies belong to both); rows above the last count
    run the last count's form.

    Raises:
        ValueError: ``seconds`` without row count 1, with a row count that is not an int, or
            with a row count lacking a candidate of either layout or a positive time.
    """
    counts = list(seconds)
    if not counts or not all(is_int(r) for r in counts) or min(counts) != 1:
        raise ValueError(f"seconds must map int row counts, 1 among them, to times, got row counts {counts!r}")

    def in_layout(times: Mapping[Candidate, float], input_major: bool) -> dict[str, float]:
        return {form: t for (layout, form), t in times.items() if layout in (input_major, None)}

    for rows, times in seconds.items():
        if not all(in_layout(times, layout) for layout in (False, True)) or not all(t > 0 for t in times.values()):
            raise ValueError(f"seconds[{rows}] must time a candidate of each layout, every time > 0, got {times!r}")
        if any(form not in FORMS for _, form in times):  # a rounded form would change the model's outputs
            raise ValueError(f"seconds[{rows}] must time forms of {FORMS} only, got {sorted(f for _, f in times)}")

    def layout_cost(input_major: bool) -> float:
        return sum(math.log(min(in_layout(times, input_major).values()) / min(times.values()))
                   for times in seconds.values())

    input_major = layout_cost(True) < layout_cost(False) - math.log(_INPUT_MAJOR_MARGIN)
    forms: list[tuple[int, str]] = []
    for rows in sorted(seconds):
        times = in_layout(seconds[rows], input_major)
        form = min(times, key=times.get)
        if not forms or forms[-1][1] != form:
            forms.append((rows, form))
    return MatmulPlan(input_major=input_major, forms=tuple(forms))


#: A measurement is stored for later processes only if the rest of the machine used at most this
#: many CPU seconds per second of it: idle daemons stay far below, one busy thread elsewhere is 1.
QUIET_CPU_SHARE = 0.1

_MEASURED: dict[str, MatmulPlan] = {}  # plans of this process, by `_plan_key`


def cpu_seconds_elsewhere() -> float | None:
    """CPU seconds, since boot, that this machine's CPUs spent on anything but this process: other
    processes, the kernel's own work, and time the hypervisor gave to other machines (steal).
    None where ``/proc/stat`` cannot be read (systems other than Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait (guest time is in user)
    ticks = [int(t) for t in fields[1:9]]
    own = os.times()
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK") - own.user - own.system


def plans_file() -> Path:
    """Where `measured_matmul_plan` stores plans: ``matmul_plans.json`` in the package's cache folder
    (`specdec_kernels.pretrained.cache_dir`: ``$SPECDEC_KERNELS_CACHE`` or ``~/.cache/specdec_kernels``).
    Deleting it makes the next process measure again."""
    from .pretrained import cache_dir  # here, not above: pretrained imports the model, which imports this module

    return cache_dir() / "matmul_plans.json"


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    """The CPU model from /proc/cpuinfo ("" where there is none); it cannot change in a process."""
    return _native.cpuinfo_field("model name")


def _plan_key(weights: Sequence[torch.Tensor]) -> str:
    """What a plan holds for: the CPU model and count, the torch build, its threads and packed forms,
    the weights' shapes and the row counts timed."""
    cpu = _cpu_name()
    available = [name for name, form in PACKED_FORMS.items() if form.available()]
    return json.dumps([cpu or platform.processor() or platform.machine(), os.cpu_count(), torch.__version__,
                       torch.get_num_threads(), available, [list(w.shape) for w in weights], list(MEASURED_ROWS)])


def _stored_plans(path: Path) -> dict:
    try:
        plans = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure
        plans = None
    return plans if isinstance(plans, dict) else {}


def _store_plan(path: Path, key: str, plan: MatmulPlan) -> None:
    plans = {**_stored_plans(path), key: {"input_major": plan.input_major, "forms": plan.forms}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(plans, f, indent=1)
        os.replace(f.name, path)  # whole or not at all, whatever another process reads meanwhile
    except OSError:  # a read-only cache folder: the plan serves this process only
        pass


def matmul_sample(groups: Sequence[Sequence[torch.Tensor]], head: torch.Tensor,
                  budget: int = 256 << 20) -> list[torch.Tensor]:
    """Weights to time the matmul forms on (`measured_matmul_plan`): whole ``groups`` (a layer's
    weights, in forward order) until about ``budget`` bytes (more than a CPU's last-level cache,
    so that they stream from memory as in decoding), then the LM ``head`` (its first rows when it
    holds more than half of ``budget``); all of them in a smaller model."""
    row_bytes = head.shape[1] * head.element_size()
    head = head[: max(1, min(head.shape[0], budget // 2 // row_bytes))]
    weights, size = [], head.shape[0] * row_bytes
    for group in groups:
        weights += group
        size += sum(w.numel() * w.element_size() for w in group)
        if size >= budget:
            break
    return [*weights, head]


def measured_matmul_plan(weights: Sequence[torch.Tensor]) -> MatmulPlan:
    """The `MatmulPlan` for weights of these shapes on this machine, under this number of torch
    threads: the one stored in `plans_file` if a process stored one, else `measure_matmul_plan`'s,
    stored there if the rest of the machine used at most `QUIET_CPU_SHARE` of a CPU meanwhile
    (`cpu_seconds_elsewhere`; never where that cannot be told). Once per process: later calls
    return the same plan.

    A plan measured under a load that lasted through the measurement may be slow on the quiet
    machine (see the module docstring): it serves the process that measured it, and is not stored,
    so that a process on the quiet machine measures again.
    """
    key = _plan_key(weights)
    if key not in _MEASURED:
        path, plan = plans_file(), None
        with contextlib.suppress(TypeError, KeyError, ValueError):  # no entry, or not a plan
            entry = _stored_plans(path).get(key)
            plan = MatmulPlan(input_major=entry["input_major"], forms=entry["forms"])
        if plan is not None and plan.rounded:
            plan = None  # a rounded form is never measured into a plan: the stored entry is not one
        if plan is None:
            elsewhere, start = cpu_seconds_elsewhere(), time.perf_counter()
            plan = measure_matmul_plan(weights)
            seconds, after = time.perf_counter() - start, cpu_seconds_elsewhere()
            if elsewhere is not None and after is not None and after - elsewhere <= QUIET_CPU_SHARE * seconds:
                _store_plan(path, key, plan)
        _MEASURED[key] = plan
    return _MEASURED[key]


def _weight_identity(weight: torch.Tensor) -> tuple:
    """What a packed copy of ``weight`` must still match: its storage, in-place change counter
    (inference tensors have none) and layout."""
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), version, weight.dtype, weight.device, weight.shape, weight.stride()


def _store_weight(weight: torch.Tensor, *, input_major: bool) -> None:
    """Store ``weight`` [out, in] input-major (``weight.t()`` contiguous) or row-major, in place of
    its data (a parameter stays the same object, tied weights stay tied; values are unchanged)."""
    source = weight.t() if input_major else weight
    if source.is_contiguous():
        return
    # An inference tensor stays one (it has no version counter), any other never becomes one.
    with torch.inference_mode(weight.is_inference()), torch.no_grad():
        stored = source.clone(memory_format=torch.contiguous_format)
    weight.data = stored.t() if input_major else stored


class Linear(nn.Linear):
    """``nn.Linear`` without bias, computed by `linear` until `pack` gives it a `MatmulPlan`;
    then CPU float32 inputs without autograd run the plan's form for their row count, from the
    weight stored in the plan's layout. For each packed form of the plan it keeps a copy of the
    weight in that library's layout: not a parameter or buffer (``state_dict`` ignores it;
    ``.to()`` and the like drop it), made again from the weight at the first use after the
    weight has changed; copies of the module (``copy.deepcopy``, pickling) make their own.
    `unpack` drops the plan and stores the weight row-major again."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.plan: MatmulPlan | None = None
        # form -> (weight identity, the weight packed, the packed copy). Holding the weight keeps
        # its storage, so a new weight cannot reuse the address and pass for the packed one.
        self._packed: dict[str, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    @property
    def packing(self) -> bool:
        """Whether `pack` has given this layer a plan."""
        return self.plan is not None

    def check_packable(self, plan: MatmulPlan | None = None) -> None:
        """Raise unless `pack` can apply ``plan`` (None: any plan without packed forms) to this
        weight: ValueError for a weight that is not CPU float32, RuntimeError for a packed form
        this torch build (or, for a rounded form, this CPU) lacks."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"packing needs a CPU float32 weight, got {weight.dtype} on {weight.device}")
        for form in plan.packed_forms if plan is not None else ():
            if not _copied_form(form).available():
                raise RuntimeError(f"the {form!r} form is not available on this machine (torch build or CPU)")

    def pack(self, plan: MatmulPlan = MKL_PACKED_PLAN) -> None:
        """Follow ``plan`` from now on (see `Llama.pack_weights`): the weight is stored in its
        layout, and copied into the layout of each packed form the plan runs."""
        if not isinstance(plan, MatmulPlan):
            raise ValueError(f"plan must be a MatmulPlan, got {type(plan).__name__}")
        self.check_packable(plan)
        self.plan = plan
        _store_weight(self.weight, input_major=plan.input_major)
        identity, weight = _weight_identity(self.weight), self.weight.detach()
        self._packed = {form: (identity, weight, _copied_form(form).pack(weight)) for form in plan.packed_forms}

    def unpack(self) -> None:
        """Drop the plan (and any packed copy) and store the weight row-major: every input is then
        computed by `linear`."""
        self.plan, self._packed = None, {}
        _store_weight(self.weight, input_major=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, plan = self.weight, self.plan
        if (plan is None or x.device.type != "cpu" or not x.dtype == weight.dtype == torch.float32
                or x.shape[-1] != weight.shape[1]  # MKL's op does not check it: let F.linear raise
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):  # no backward
            return linear(x, weight)
        form = plan.form(x.numel() // max(x.shape[-1], 1))
        if form == "weight_first":
            return weight_first(x, weight)
        if form == "linear":
            return F.linear(x, weight)
        packed = self._packed.get(form)
        if packed is None or packed[0] != _weight_identity(weight):  # new, replaced or changed
            self.pack(plan)
            packed = self._packed[form]
        return _copied_form(form).run(x, packed[2], weight)

    def _apply(self, fn, recurse=True):
        # ``.to()``, ``.cuda()``, ``.half()``...: the copies would pin the old weight; pack anew at next use.
        self._packed = {}
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        # Packed copies can be neither copied nor pickled (nor moved): copies pack their own.
        return {**super().__getstate__(), "_packed": {}}

    def __setstate__(self, state: dict) -> None:
        if "plan" not in state:  # pickled before plans: `packing` was a flag for MKL_PACKED_PLAN
            state = {**state, "_packed": {}}
            state["plan"] = MKL_PACKED_PLAN if state.pop("packing", False) else None
        super().__setstate__(state)
        if self.plan is not None and not all(_copied_form(f).available() for f in self.plan.packed_forms):
            self.unpack()  # unpickled where torch lacks a packed form of the plan
