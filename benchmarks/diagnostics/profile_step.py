# ruff: noqa: B023, B007, E501  (closures run inside their loop iteration; long report lines)
"""Scratch: where a decoding step's time goes on the GPU (random SmolLM2-shaped weights)."""

import time
import warnings

import torch
from smollm2_shape import SMOLLM2_SHAPE
from specdec_kernels.kernels.attention import ragged_attention_triton

from specdec_kernels import RaggedAttentionPlan, generate, ragged_attention
from specdec_kernels.model import Llama, LlamaConfig

torch.manual_seed(0)
cfg = LlamaConfig(**SMOLLM2_SHAPE, rope_theta=100000.0)


def make(dtype):
    m = Llama(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(torch.ones_like(p) if n.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    return m.to("cuda", dtype).eval()


def host_and_gpu(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        total.append(t2 - t0)
    host.sort()
    total.sort()
    return host[n // 2] * 1e3, total[n // 2] * 1e3


for dtype in (torch.bfloat16, torch.float32):
    model = make(dtype)
    for B in (1, 8):
        cache = model.new_cache(B, 256)
        ids = torch.randint(0, 49152, (B, 64), device="cuda")
        with torch.no_grad():
            model(ids, cache)
            tok = torch.randint(0, 49152, (B, 1), device="cuda")

            def step():
                model(tok, cache, last_only=True)
                cache.crop(cache.lengths - 1)

            h, t = host_and_gpu(step)
            print(f"{dtype} B{B} decode step: host {h:.2f} ms, host+GPU {t:.2f} ms", flush=True)
            tok5 = torch.randint(0, 49152, (B, 5), device="cuda")

            def verify():
                model(tok5, cache)
                cache.crop(cache.lengths - 5)

            h, t = host_and_gpu(verify)
            print(f"{dtype} B{B} verify-5 step: host {h:.2f} ms, host+GPU {t:.2f} ms", flush=True)
            if B == 1:
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    step()
                torch.cuda.set_sync_debug_mode("default")
                print(f"  syncs in one decode step: {len(w)}", [str(x.message)[:100] for x in w[:3]], flush=True)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        step()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
                launches = sum(
                    e.count
                    for e in prof.key_averages()
                    if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
                )
                print(f"  kernel launches per step: {launches / 2}", flush=True)
        prompt = torch.randint(0, 49152, (B, 64), device="cuda")
        t0 = time.perf_counter()
        out = generate(model, prompt, max_new_tokens=48, temperature=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(model, prompt, max_new_tokens=48, temperature=0)
        torch.cuda.synchronize()
        print(f"{dtype} B{B} our generate 48 tokens: {48 * B / (time.perf_counter() - t0):.1f} tokens/s", flush=True)
    try:
        import transformers

        hcfg = transformers.LlamaConfig(**SMOLLM2_SHAPE)
        hf = transformers.LlamaForCausalLM(hcfg).to("cuda", dtype).eval()
        for B in (1, 8):
            prompt = torch.randint(0, 49152, (B, 64), device="cuda")
            kw = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0)
            hf.generate(prompt, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(prompt, **kw)
            torch.cuda.synchronize()
            print(f"{dtype} B{B} HF generate 48 tokens: {48 * B / (time.perf_counter() - t0):.1f} tokens/s", flush=True)
    except Exception as e:
        print("HF failed", e)

# attention alone, SmolLM2 decode shape
for B, T, L in ((1, 1, 512), (8, 5, 512)):
    q = torch.randn(B, T, 9, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L + 64, 3, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cs = torch.full((B,), L, device="cuda")
    qs = torch.full((B,), T, device="cuda")
    plan = RaggedAttentionPlan(cs, qs, num_queries=T, max_len=L + 64)
    for name, fn in (
        ("unplanned", lambda: ragged_attention(q, k, v, cs, qs)),
        ("planned", lambda: ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, plan=plan)),
        ("launcher only", lambda: ragged_attention_triton(q, k, v, cs, qs, 0.125)),
        ("launcher, 1 split", lambda: ragged_attention_triton(q, k, v, cs, qs, 0.125, max_splits=1)),
        (
            "sdpa",
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
            ),
        ),
    ):
        h, t = host_and_gpu(fn, 50)
        print(f"attention B{B} T{T} L{L} {name}: host {h * 1e3:.0f} us, host+GPU {t * 1e3:.0f} us", flush=True)
