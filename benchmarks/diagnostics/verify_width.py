"""Scratch: seconds of one SmolLM2 forward over T = 1 .. 8 new tokens at batch 1 on the CPU, after a
chat prompt's prefill (what a batch-1 verification of K = T - 1 drafts costs), with the matmul
forms `Llama.pack_weights` picks; medians of 22 interleaved rounds.

    python -m benchmarks.diagnostics.verify_width
"""

import statistics
import time

import torch

from benchmarks.generation import encode, load_setup

setup = load_setup(True)
model = setup.model
ids, _ = encode(setup, 1)
cache = model.new_cache(1, 400)
with torch.inference_mode():
    model(ids, cache, last_only=True)
    prefix = cache.lengths.clone()
    seconds = {T: [] for T in range(1, 9)}
    for _ in range(25):
        for T in seconds:
            tokens = torch.randint(0, 1000, (1, T))
            start = time.perf_counter()
            model(tokens, cache, max_seqlen=int(prefix) + T)
            seconds[T].append(time.perf_counter() - start)
            cache.crop(prefix)
print(f"matmuls: {model.output.plan.describe()}")
for T, times in seconds.items():
    print(f"T = {T}: {statistics.median(times[3:]) * 1e3:.1f} ms")
