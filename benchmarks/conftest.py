"""Benchmark configuration: machine info in the JSON, and the interpreter off.

Run with ``python -m pytest benchmarks/`` (the default test run only collects
``tests/``). Results carry the machine line (CPU model, cores, torch and triton
versions, GPU) in ``machine_info["specdec"]`` of ``--benchmark-json`` output.
"""

import os

import pytest

from benchmarks.timing import machine_line, machine_summary


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["specdec"] = machine_summary()


def pytest_report_header(config):
    return f"machine: {machine_line()}"


@pytest.fixture(scope="session")
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def pinned_torch_threads():
    """Run with ``SPECDEC_BENCH_THREADS`` torch threads (default 1): on a shared 2-core machine,
    OpenMP regions with 2 threads wait for descheduled workers and time the scheduler, not the op."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("SPECDEC_BENCH_THREADS", "1")))
    yield
    torch.set_num_threads(saved)
