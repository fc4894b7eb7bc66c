# ruff: noqa: B023, B007, E501  (closures run inside their loop iteration; long report lines)
"""Scratch: our generate with and without CUDA graphs, and HF generate (random SmolLM2-shaped weights)."""

import time

import torch
import transformers
from smollm2_shape import SMOLLM2_SHAPE

from specdec_kernels import generate
from specdec_kernels.model import Llama

hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_SHAPE)).eval()
ours = Llama.from_pretrained(hf)
for dtype in (torch.bfloat16, torch.float32):
    m, h = ours.to("cuda", dtype), hf.to("cuda", dtype)
    for B in (1, 8):
        ids = torch.randint(0, 49152, (B, 64), device="cuda")
        runs = {
            "ours, CUDA graphs": lambda: generate(m, ids, max_new_tokens=48, temperature=0),
            "ours, eager": lambda: generate(m, ids, max_new_tokens=48, temperature=0, cuda_graphs=False),
            "HF generate": lambda: h.generate(
                ids, max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0
            ),
        }
        res = {}
        for name, fn in runs.items():
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            res[name] = 48 * B / sorted(ts)[1]
        a = generate(m, ids, max_new_tokens=48, temperature=0).tokens
        b = generate(m, ids, max_new_tokens=48, temperature=0, cuda_graphs=False).tokens
        print(
            f"{dtype} B{B}: "
            + ", ".join(f"{k} {v:.1f} tok/s" for k, v in res.items())
            + f"; graphs/eager {res['ours, CUDA graphs'] / res['ours, eager']:.1f}x, graphs/HF {res['ours, CUDA graphs'] / res['HF generate']:.2f}x"
            + f"; graph tokens == eager tokens in {(a == b).all(1).sum().item()}/{B} rows",
            flush=True,
        )
