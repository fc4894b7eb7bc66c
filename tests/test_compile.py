"""GPU compile check: every kernel specialization the package launches compiles for sm_80 and
sm_90 (no GPU needed) and spills no registers."""

import pytest
from specdec_kernels.kernels import KERNEL_MODULES

from specdec_kernels.testing import COMPILE_TARGETS, run_compile_check


@pytest.fixture(scope="module")
def reports():
    return run_compile_check()


def test_every_kernel_module_registers_specializations(reports):
    assert KERNEL_MODULES, "no kernel module is registered for the compile check"
    compiled = {r.name.split("[")[0] for r in reports}
    for module in KERNEL_MODULES:
        assert any(name.startswith(module) for name in compiled), f"{module} registered no kernel specs"
    assert len(reports) % len(COMPILE_TARGETS) == 0


def test_all_specializations_compile_without_spills(reports):
    assert reports
    failures = [f"{r.arch} {r.name}: {r.error or f'stack={r.stack_bytes} local={r.local_bytes}'}"
                for r in reports if not r.ok]
    assert not failures, "\n".join(failures)
