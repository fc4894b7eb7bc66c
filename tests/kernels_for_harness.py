"""Small Triton kernels that exercise the test harness itself (not part of the package)."""

import triton
import triton.language as tl
from specdec_kernels.kernels.registry import KernelSpec, register


@triton.jit
def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def loop_type_change_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # The interpreter runs this; the compiler rejects it: `acc` is an int before the
    # loop and a float tensor inside it (loop-carried variables must keep their type).
    acc = 0
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        acc = acc + tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(y_ptr + tl.arange(0, BLOCK), acc)


@triton.jit
def spilling_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    # A 16K x fp32 tile held by one warp needs ~512 registers per thread: it spills.
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(y_ptr + offsets, tl.cumsum(x * x, 0) + tl.flip(x, 0))


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}

if __name__ != "__main__":
    register(KernelSpec("harness_copy", copy_kernel, SIGNATURE, {"BLOCK": 256}))
    register(KernelSpec("harness_copy_aligned", copy_kernel, SIGNATURE, {"BLOCK": 256},
                        aligned=("x_ptr", "y_ptr", "n")))
    # 64 elements per thread (one warp): dozens of registers, unless an option caps them.
    register(KernelSpec("harness_wide_copy", copy_kernel, SIGNATURE, {"BLOCK": 2048}, num_warps=1))
    register(KernelSpec("harness_wide_copy_maxnreg", copy_kernel, SIGNATURE, {"BLOCK": 2048}, num_warps=1,
                        options={"maxnreg": 32}))
    register(KernelSpec("harness_loop_type_change", loop_type_change_kernel, SIGNATURE, {"BLOCK": 256}))
    register(KernelSpec("harness_spilling", spilling_kernel,
                        {"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 16384},
                        num_warps=1))
