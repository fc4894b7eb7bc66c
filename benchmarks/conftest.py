"""Benchmark configuration: machine info in the JSON, and the interpreter off.

Run with ``python -m pytest benchmarks/`` (the default test run only collects
``tests/``). Results carry the machine line (CPU model, cores, torch and triton
versions, GPU) in ``machine_info["specdec"]`` of ``--benchmark-json`` output.
"""

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
