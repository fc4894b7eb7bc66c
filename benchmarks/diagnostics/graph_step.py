# ruff: noqa: B023, B007, E501  (closures run inside their loop iteration; long report lines)
"""Scratch: how fast one decoding step runs when replayed as a CUDA graph (random SmolLM2 weights)."""

import time

import torch
from smollm2_shape import SMOLLM2_SHAPE

from specdec_kernels.model import Llama, LlamaConfig

cfg = LlamaConfig(**SMOLLM2_SHAPE, rope_theta=100000.0)
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    m = Llama(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(torch.ones_like(p) if n.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    m = m.to("cuda", dtype).eval()
    for B, T in ((1, 1), (8, 1), (8, 5)):
        cache = m.new_cache(B, 256)
        try:
            with torch.inference_mode():
                m(torch.randint(0, 49152, (B, 64), device="cuda"), cache)
                start = cache.lengths.clone()
                tok = torch.randint(0, 49152, (B, T), device="cuda")

                def step():
                    out = m(tok, cache, last_only=True)
                    return out

                eager = step()
                cache.crop(start)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        step()
                        cache.crop(start)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = step()
                cache.crop(start)
                graph.replay()
                torch.cuda.synchronize()
                err = (static_out.float() - eager.float()).abs().max().item()
                ok_len = torch.equal(cache.lengths, start + T)
                times = {}
                for name, fn in (("eager", step), ("graph", graph.replay)):
                    for _ in range(3):
                        cache.crop(start)
                        fn()
                    torch.cuda.synchronize()
                    ts = []
                    for _ in range(20):
                        cache.crop(start)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fn()
                        torch.cuda.synchronize()
                        ts.append(time.perf_counter() - t0)
                    ts.sort()
                    times[name] = ts[10] * 1e3
                print(
                    f"{dtype} B{B} T{T}: eager {times['eager']:.2f} ms, CUDA graph replay {times['graph']:.2f} ms "
                    f"({times['eager'] / times['graph']:.1f}x); max |graph - eager| logits {err:.2e}, lengths advanced {ok_len}",
                    flush=True,
                )
        except Exception as e:
            print(f"{dtype} B{B} T{T}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
