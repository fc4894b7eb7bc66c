"""Smoke benchmark of the machinery itself: a plain torch copy, so `pytest benchmarks/` always has
a baseline row recorded with the machine line (later op benchmarks sit beside it)."""

import torch

from benchmarks.timing import bench


def test_torch_copy_baseline(benchmark):
    x = torch.randn(1 << 20)
    y = torch.empty_like(x)
    bench(benchmark, lambda: y.copy_(x))
