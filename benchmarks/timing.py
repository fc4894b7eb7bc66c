"""Timing helpers shared by the benchmarks: machine description and correct CUDA timing."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary() -> dict[str, object]:
    """CPU model, cores, torch / triton versions and GPU name (if any)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }


def machine_line() -> str:
    """One line for tables: ``CPU (N cores), torch X, triton Y, GPU``."""
    m = machine_summary()
    return (f"{m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch threads), torch {m['torch']}, "
            f"triton {m['triton']}, GPU: {m['gpu'] or 'none'}")


def cuda_time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` on the GPU, timed with CUDA events (``triton.testing.do_bench``).

    Host-side timers would measure only the launch; events measure the work.
    """
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench(benchmark, fn: Callable[[], object], *, cuda: bool = False, rounds: int = 20):
    """Run ``fn`` under pytest-benchmark. For CUDA work, each round synchronizes so the
    timer sees the kernel, not just its launch; the CUDA-event median is stored in ``extra_info``."""
    if cuda:
        import torch

        def run():
            out = fn()
            torch.cuda.synchronize()
            return out

        benchmark.extra_info["cuda_event_median_ms"] = cuda_time_ms(fn)
        return benchmark.pedantic(run, rounds=rounds, warmup_rounds=3)
    return benchmark.pedantic(fn, rounds=rounds, warmup_rounds=2)


def cuda_graph_of(fn: Callable[[], object], calls: int = 20) -> Callable[[], None]:
    """``calls`` runs of ``fn`` captured as one CUDA graph; returns its replay. Timing the replay
    (divided by ``calls``) measures the kernels without the host's per-call launch work, which
    for one small attention call is most of its eager time."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay
