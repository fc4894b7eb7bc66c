# ruff: noqa: B023, B007, E501  (closures run inside their loop iteration; long report lines)
"""Scratch: decode / verify attention configs on the GPU (CUDA-graph timings, pure GPU time)."""

import itertools

import specdec_kernels.kernels.attention as A
import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

orig_config, orig_max_splits = A.attention_config, A._max_splits
SHAPES = [
    ("B32 Hq32 Hkv8 D128 L16384 T1 fp16", 32, 1, 32, 8, 128, 16384, torch.float16),
    ("B32 Hq32 Hkv8 D128 L4096 T1 fp16", 32, 1, 32, 8, 128, 4096, torch.float16),
    ("B32 Hq32 Hkv8 D128 L4096 T5 fp16", 32, 5, 32, 8, 128, 4096, torch.float16),
    ("B8 Hq9 Hkv3 D64 L4096 T1 bf16", 8, 1, 9, 3, 64, 4096, torch.bfloat16),
    ("B1 Hq9 Hkv3 D64 L16384 T5 bf16", 1, 5, 9, 3, 64, 16384, torch.bfloat16),
]
for name, B, T, Hq, Hkv, D, L, dtype in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, L + 64, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, L + 64, Hkv, D, device="cuda", dtype=dtype, generator=g)
    cs = torch.randint(L - 32, L + 32, (B,), device="cuda", generator=g)
    qs = torch.full((B,), T, device="cuda")
    pos = cs[:, None] - T + torch.arange(T, device="cuda")
    mask = (torch.arange(L + 64, device="cuda") <= pos[:, :, None])[:, None]
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    min_bytes = (2 * int(cs.sum()) * Hkv + 2 * B * T * Hq) * D * q.element_size()
    sdpa = do_bench_cudagraph(
        lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
    )
    print(f"\n{name}: SDPA {sdpa * 1e3:.1f} us ({min_bytes / sdpa / 1e6:.0f} GB/s)", flush=True)
    base = orig_config(dtype, D, Hq // Hkv * T, A._max_shared_memory(q.device))
    results = []
    for BN, warps, stages, split_mult in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 4)):
        cfg = dict(base, BN=BN, num_warps=warps, num_stages=stages)
        A.attention_config = lambda *a, **kw: cfg
        A._max_splits = lambda *a, m=split_mult: min(A.MAX_SPLITS, orig_max_splits(*a) * m)
        try:
            fn = lambda: A.ragged_attention_triton(q, k, v, cs, qs, D**-0.5)
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            t = do_bench_cudagraph(fn)
            ok = err < 2e-2
        except Exception as e:
            t, ok, err = float("nan"), False, str(e)[:60]
        finally:
            A.attention_config, A._max_splits = orig_config, orig_max_splits
        results.append((t, BN, warps, stages, split_mult, ok, err))
        if BN == base["BN"] and warps == base["num_warps"] and stages == base["num_stages"] and split_mult == 1:
            print(
                f"  current config BN={BN} warps={warps} stages={stages}: {t * 1e3:.1f} us ({min_bytes / t / 1e6:.0f} GB/s) ok={ok}",
                flush=True,
            )
    results.sort(key=lambda r: (not r[5], r[0]))
    for t, BN, warps, stages, sm, ok, err in results[:6]:
        print(
            f"  BN={BN:3d} warps={warps} stages={stages} splits x{sm}: {t * 1e3:7.1f} us ({min_bytes / t / 1e6:5.0f} GB/s) ok={ok}",
            flush=True,
        )
    bad = [r for r in results if not r[5]]
    if bad:
        print("  failed:", [(r[1], r[2], r[3], r[4], r[6]) for r in bad][:4], flush=True)
