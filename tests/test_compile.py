"""GPU compile check: every kernel specialization the package launches compiles for sm_80 and
sm_90 (no GPU needed), spills no registers and fits the shared memory of the GPUs it runs on."""

import re

import pytest
from specdec_kernels.kernels import KERNEL_MODULES

from specdec_kernels.testing import COMPILE_TARGETS, SHARED_MEMORY_LIMITS, run_compile_check


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
    failures = [f"{r.arch} {r.name}: "
                f"{r.error or f'stack={r.stack_bytes} local={r.local_bytes} shared={r.shared_bytes}'}"
                for r in reports if not r.ok]
    assert not failures, "\n".join(failures)


def test_specializations_fit_the_shared_memory_of_the_gpus_that_launch_them(reports):
    """Every specialization fits the 99 KB a program gets on compute capability 8.6 / 8.9, except
    the 256-row attention tiles at head dims 80-128, which the launcher picks only on GPUs with
    `WIDE_HEAD_TILE_SHARED_BYTES` or more (and which must need no more than that)."""
    from specdec_kernels.kernels.attention import WIDE_HEAD_TILE_SHARED_BYTES

    smallest = min(SHARED_MEMORY_LIMITS.values())
    wide = re.compile(r"attention\[fwd,(fp16|bf16),D=(80|96|128),BM=256,")
    for r in reports:
        limit = WIDE_HEAD_TILE_SHARED_BYTES if wide.match(r.name) else smallest
        assert r.shared_bytes is not None and r.shared_bytes <= limit, (r.arch, r.name, r.shared_bytes, limit)
