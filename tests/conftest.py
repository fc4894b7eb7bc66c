"""Test configuration shared by every test module.

- Triton kernels run under the interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is set
  here, before anything imports triton, and restored when the session ends. This holds on CUDA
  machines too, so the suite checks the same things everywhere.
- ``SPECDEC_CUDA_TESTS=1`` runs instead only the tests marked ``cuda`` (`tests/test_cuda.py`:
  the compiled kernels on CUDA tensors against the reference), with the interpreter off.
- Tests that take a ``backend`` fixture run once per backend.
- ``torch.empty`` is NaN-poisoned in every test (see `specdec_kernels.testing.poison_empty`).
- Every test starts without verify costs carried from an earlier call (`known_costs`): a
  module's shared model does not make one test's adaptive lengths depend on another's.
"""

import os

import pytest

_saved_interpret = os.environ.get("TRITON_INTERPRET")
CUDA_TESTS = os.environ.get("SPECDEC_CUDA_TESTS", "0") == "1"
assert "triton" not in __import__("sys").modules, "triton was imported before TRITON_INTERPRET was set"
os.environ["TRITON_INTERPRET"] = "0" if CUDA_TESTS else "1"  # CUDA tests: the compiled kernels, never interpreted

from specdec_kernels import BACKENDS, triton_available  # noqa: E402
from specdec_kernels._draft_lengths import _KNOWN_COSTS  # noqa: E402
from specdec_kernels.testing import poison_empty  # noqa: E402


def pytest_unconfigure(config):
    if _saved_interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret


def pytest_collection_modifyitems(config, items):
    if CUDA_TESTS:
        skip = pytest.mark.skip(reason="SPECDEC_CUDA_TESTS=1 runs only the tests marked cuda")
    else:
        skip = pytest.mark.skip(reason="compiled kernels on CUDA tensors: run with SPECDEC_CUDA_TESTS=1 on a GPU")
    for item in items:
        if (item.get_closest_marker("cuda") is not None) != CUDA_TESTS:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        backends = [b for b in BACKENDS if b != "triton" or triton_available()]
        metafunc.parametrize("backend", backends)


@pytest.fixture(autouse=True)
def _nan_poisoned_empty():
    with poison_empty():
        yield


@pytest.fixture(autouse=True)
def _no_carried_costs():
    _KNOWN_COSTS.clear()
    yield
