"""Backend resolution shared by every op."""

import pytest
import torch

from specdec_kernels import resolve_backend
from specdec_kernels._backend import auto_backend


def test_auto_picks_torch_on_cpu():
    assert auto_backend("cpu") == "torch"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
def test_explicit_backends_resolve(name):
    assert resolve_backend(name, "cpu") == name  # the suite runs triton under the interpreter on CPU


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("cuda-graphs", "cpu")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")


def test_auto_on_cuda_uses_torch_for_head_dims_the_kernels_lack():
    """The attention and cache kernels are compiled for head dims 64, 80, 96 and 128; "auto" runs
    a model with other heads (e.g. 16 or 256) on the torch path instead of failing in the launcher."""
    pytest.importorskip("triton")
    assert auto_backend("cuda") == "triton"
    assert [auto_backend("cuda", head_dim=d) for d in (16, 64, 80, 256)] == ["torch", "triton", "triton", "torch"]
    assert resolve_backend("auto", "cuda", head_dim=32) == "torch"
    assert auto_backend("cpu", head_dim=64) == "torch"
