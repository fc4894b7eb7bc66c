"""Tests of the test harness itself: traffic meter, compile check, sync counter, poisoning."""

import math
from pathlib import Path

import pytest
import torch

from specdec_kernels.testing import (
    INT_POISON,
    TOLERANCES,
    SyncCounter,
    TrafficMeter,
    assert_close,
    run_compile_check,
)

HARNESS_KERNELS = str(Path(__file__).with_name("kernels_for_harness.py"))


@pytest.mark.parametrize("n, block", [(1, 16), (256, 256), (1000, 256), (4097, 1024)],
                         ids=lambda v: str(v))
def test_traffic_meter_counts_copy_exactly(n, block):
    from kernels_for_harness import copy_kernel

    x = torch.randn(n)
    y = torch.zeros(n)
    with TrafficMeter() as meter:
        copy_kernel[(math.ceil(n / block),)](x, y, n, BLOCK=block)
    torch.testing.assert_close(y, x)
    assert meter.num_launches == 1
    assert meter.launches[0].kernel == "copy_kernel"
    assert meter.bytes_loaded == 4 * n  # masked-off lanes past n cost nothing
    assert meter.bytes_stored == 4 * n
    assert meter.bytes_moved == 8 * n


def test_traffic_meter_separates_launches_and_restores_interpreter():
    from triton.runtime import interpreter

    from kernels_for_harness import copy_kernel

    original = interpreter.InterpreterBuilder.create_masked_load
    x16 = torch.randn(100, dtype=torch.float16)
    with TrafficMeter() as meter:
        copy_kernel[(1,)](x16, torch.empty_like(x16), 100, BLOCK=128)
        copy_kernel[(2,)](torch.randn(200), torch.empty(200), 200, BLOCK=128)
    assert [(x.bytes_loaded, x.bytes_stored) for x in meter.launches] == [(200, 200), (800, 800)]
    assert interpreter.InterpreterBuilder.create_masked_load is original


@pytest.fixture(scope="module")
def harness_compile_reports():
    reports = run_compile_check([HARNESS_KERNELS])
    return {(r.name, r.arch): r for r in reports}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_check_passes_a_good_kernel(harness_compile_reports, arch):
    report = harness_compile_reports["harness_copy", arch]
    assert report.ok, report
    assert report.registers and report.registers > 0


def test_compile_check_uses_alignment_hints(harness_compile_reports):
    # Aligned pointers allow vector loads: fewer registers than the scalar-access version.
    for arch in ("sm_80", "sm_90"):
        aligned = harness_compile_reports["harness_copy_aligned", arch]
        plain = harness_compile_reports["harness_copy", arch]
        assert aligned.ok and aligned.registers <= plain.registers


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_check_passes_compiler_options(harness_compile_reports, arch):
    # A spec's options (here a register cap) reach the compiler, as they reach real launches.
    capped = harness_compile_reports["harness_wide_copy_maxnreg", arch]
    plain = harness_compile_reports["harness_wide_copy", arch]
    assert capped.error is None and plain.error is None
    assert capped.registers <= 32 < plain.registers


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_check_catches_what_only_the_interpreter_accepts(harness_compile_reports, arch):
    from kernels_for_harness import loop_type_change_kernel

    # The interpreter runs it without complaint...
    x, y = torch.ones(300), torch.empty(256)
    loop_type_change_kernel[(1,)](x, y, 300, BLOCK=256)
    assert y[:44].eq(2).all() and y[44:].eq(1).all()
    # ...the GPU compiler does not.
    report = harness_compile_reports["harness_loop_type_change", arch]
    assert not report.ok
    assert "Loop-carried variable" in report.error


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_check_catches_register_spills(harness_compile_reports, arch):
    report = harness_compile_reports["harness_spilling", arch]
    assert report.error is None
    assert not report.ok and (report.stack_bytes or report.local_bytes)


def test_sync_counter_catches_planted_item():
    x = torch.randn(16)

    def sync_free(t):
        return (t.softmax(0) * 2).argmax(0, keepdim=True)

    def with_item(t):
        return sync_free(t) + t.max().item()

    with SyncCounter() as syncs:
        sync_free(x)
    assert syncs.count == 0, syncs.events
    with SyncCounter() as syncs:
        with_item(x)
    assert syncs.count == 1
    assert syncs.events[0].kind == "_local_scalar_dense"
    assert "with_item" in syncs.events[0].where


@pytest.mark.parametrize("planted, kind", [
    (lambda t: bool(t.sum() > 0), "_local_scalar_dense"),
    (lambda t: t.tolist(), "tolist"),
    (lambda t: t.nonzero(), "nonzero"),
    (lambda t: t[t > 0], "boolean-mask indexing"),
    (lambda t: int(t.argmax()), "_local_scalar_dense"),
    (lambda t: t.numpy(), "numpy"),
    (lambda t: torch.unique(t), "_unique2"),
    (lambda t: t.repeat_interleave(torch.tensor([1, 2, 1, 1])), "repeat_interleave without output_size"),
], ids=["bool", "tolist", "nonzero", "mask-index", "int", "numpy", "unique", "repeat_interleave"])
def test_sync_counter_catches_each_kind(planted, kind):
    with SyncCounter() as syncs:
        planted(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    assert [e.kind for e in syncs.events] == [kind]


def test_sync_counter_restores_patches():
    tolist = torch.Tensor.tolist
    with SyncCounter():
        pass
    assert torch.Tensor.tolist is tolist
    assert torch.tensor([1]).tolist() == [1]


def test_empty_is_poisoned():
    assert torch.empty(4).isnan().all()
    assert torch.empty_like(torch.zeros(3, dtype=torch.float16)).isnan().all()
    assert torch.zeros(2).new_empty(5).isnan().all()
    assert (torch.empty(3, dtype=torch.int64) == INT_POISON).all()


def test_tolerance_table_covers_every_dtype_and_fails_on_nan():
    assert set(TOLERANCES) == {torch.float32, torch.float16, torch.bfloat16}
    x = torch.randn(8)
    assert_close(x.half(), x, dtype=torch.float16)
    with pytest.raises(AssertionError):
        assert_close(x, x + 1e-3)
    with pytest.raises(AssertionError):
        assert_close(torch.full((2,), float("nan")), torch.full((2,), float("nan")))


def test_interleaved_speedups_follow_a_drifting_machine(monkeypatch):
    """The generation benchmark's speedups against a baseline run around each method stay true
    while the machine slows down (here each second of clock adds 2% to every run's time); a ratio
    of medians does not (the medians of two methods come from runs far apart)."""
    from types import SimpleNamespace

    import benchmarks.generation as bench

    clock = [0.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def run(setup, batch_size, tokens, cost):
        clock[0] += cost * tokens * (1 + 0.02 * clock[0])

    setup = SimpleNamespace(model=SimpleNamespace(output=SimpleNamespace(weight=torch.zeros(1))))
    methods = {"plain": (run, 1.0), **{f"half {i}": (run, 0.5) for i in range(8)}, "quarter": (run, 0.25)}
    speedups = {}
    median = bench._interleaved_medians(setup, methods, 1, 1, 3, "plain", speedups)
    assert all(abs(speedups[f"half {i}"] / 2 - 1) < 0.03 for i in range(8)), speedups
    assert abs(speedups["quarter"] / 4 - 1) < 0.03, speedups
    assert abs(median["plain"][0] / median["quarter"][0] / 4 - 1) > 0.05  # what the ratio of medians gives


def test_per_prompt_speedups_sum_minima_and_medians_over_groups():
    """The per-prompt benchmark's speedups: plain's summed minima (medians) over a method's, a
    slow spell moving the medians and not the minima; a method with other tokens than plain is
    refused."""
    from types import SimpleNamespace

    import benchmarks.generation as bench

    tokens = torch.arange(4)
    seconds = {None: [1.0, 3.0], "half": [0.5, 1.5]}  # per group
    calls = []

    def run(m, i):
        calls.append((m, i))
        slow = 5.0 if len(calls) in (9, 14) else 1.0  # two runs of "half" on group 0 in a slow spell
        return seconds[m][i] * slow, SimpleNamespace(tokens=tokens)

    speedups = bench._per_prompt_speedups(["half"], 2, run, repeats=3)
    (minima, medians), outputs = speedups["half"]
    assert minima == pytest.approx(4 / (0.5 + 1.5)) and medians == pytest.approx(4 / (2.5 + 1.5))
    assert len(outputs) == 2 and len(calls) == 4 + 3 * 2 * 2
    assert calls[4:8] == [(None, 0), ("half", 0), (None, 1), ("half", 1)]
    assert calls[8:12] == [("half", 0), (None, 0), ("half", 1), (None, 1)]  # every other round reversed

    def other_tokens(m, i):
        return 1.0, SimpleNamespace(tokens=tokens + (m is not None))

    with pytest.raises(AssertionError, match="other tokens than plain generate on prompt group 0"):
        bench._per_prompt_speedups(["half"], 2, other_tokens, repeats=1)
