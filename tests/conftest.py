"""Test configuration shared by every test module.

- Without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` is
  set here, before anything imports triton, and restored when the session ends.
- Tests that take a ``backend`` fixture run once per backend; tests that take
  ``device`` run once per available device (CPU, and CUDA when present).
- ``torch.empty`` is NaN-poisoned in every test (see `specdec_kernels.testing.poison_empty`).
"""

import os

import pytest
import torch

_saved_interpret = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    assert "triton" not in __import__("sys").modules, "triton was imported before TRITON_INTERPRET was set"
    os.environ["TRITON_INTERPRET"] = "1"

from specdec_kernels import BACKENDS, triton_available  # noqa: E402
from specdec_kernels.testing import poison_empty  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_unconfigure(config):
    if _saved_interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        backends = [b for b in BACKENDS if b != "triton" or triton_available()]
        metafunc.parametrize("backend", backends)
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


@pytest.fixture(autouse=True)
def _nan_poisoned_empty():
    with poison_empty():
        yield
