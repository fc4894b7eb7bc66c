# ruff: noqa: B023, E501  (closures run inside their loop iteration; long report lines)
"""Scratch: the Triton kernel's bandwidth with a sliding window at long context (CUDA graphs,
kernel only): bytes of the keys some query sees, per second, against full attention."""

import torch
import triton

from specdec_kernels import ragged_attention

for T, window in ((1, 4096), (5, 4096), (1, 1024)):
    B, Hq, Hkv, D, L = 32, 32, 8, 128, 16384
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    lengths = torch.full((B,), L, device="cuda")
    for name, w in (("window", window), ("full", None)):
        fn = lambda: ragged_attention(q, k, v, lengths, sliding_window=w, backend="triton")  # noqa: E731
        ms = triton.testing.do_bench_cudagraph(fn)
        keys = min(L, (w or L) + T - 1)
        bytes_read = B * keys * Hkv * D * 2 * 2 + 2 * q.numel() * 2
        print(f"T={T} {name} W={w}: {ms * 1e3:.1f} us, {bytes_read / (ms * 1e-3) / 1e9:.0f} GB/s over the visible keys",
              flush=True)
