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


def test_launchers_make_their_tensors_cuda_device_current(monkeypatch):
    """Triton launches on the current CUDA device: `on_input_device` (which decorates every
    launcher in kernels/) switches to the tensors' device, seen here through a recording
    torch.cuda.device and a tensor that reports cuda:1."""
    import contextlib

    from specdec_kernels._backend import on_input_device

    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: (entered.append(d), contextlib.nullcontext())[1])

    class OnSecondGpu(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 1)

    @on_input_device
    def launcher(scale, x):
        return "launched"

    assert launcher(0.5, torch.empty(0).as_subclass(OnSecondGpu)) == "launched"
    assert entered == [torch.device("cuda", 1)]
    assert launcher(0.5, torch.empty(0)) == "launched" and len(entered) == 1  # CPU tensors: no switch
