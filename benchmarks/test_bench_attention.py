"""ragged_attention against torch's scaled_dot_product_attention on the same inputs.

SmolLM2-135M attention shapes (Hq = 9, Hkv = 3, D = 64), decode (T = 1) and verification
(T = 5), batch 1 and 8, ragged cache lengths around 512 and 4096 (each row's length drawn from
L - 32 .. L + 31, cache capacity L + 64), caches stored token-major ([B, Lmax, Hkv, D]
contiguous) or head-major ([B, Hkv, Lmax, D], as `KVCache` keeps them, passed as
[B, Lmax, Hkv, D] views). The baseline gets everything prebuilt: the boolean mask
[B, 1, T, Lmax] and [B, H, L, D] views; our time includes building our own mask. Each shape is one
pytest-benchmark group, so the table shows the two side by side; the ratio is ours / SDPA.

    python -m pytest benchmarks/test_bench_attention.py --benchmark-group-by=group

On CUDA the Triton kernel is benchmarked against SDPA in the same way (CUDA-event medians in
``extra_info``).

CPU threads: both sides run with ``SPECDEC_BENCH_THREADS`` torch threads (default 1). On a shared,
oversubscribed machine every OpenMP parallel region waits for a descheduled worker thread, which
measures the scheduler rather than the op, and punishes whichever side launches more parallel ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.timing import bench, cuda_graph_of
from specdec_kernels import RaggedAttentionPlan, ragged_attention

HQ, HKV, D = 9, 3, 64
pytestmark = pytest.mark.usefixtures("pinned_torch_threads")
SHAPES = [pytest.param(B, T, L, id=f"B{B}-T{T}-L{L}") for L in (512, 4096) for B in (1, 8) for T in (1, 5)]


def make_case(B, T, L, device="cpu", dtype=torch.float32, layout="token_major", heads=(HQ, HKV, D)):
    gen = torch.Generator().manual_seed(0)
    Lmax = L + 64
    hq, hkv, d = heads
    q = torch.randn(B, T, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(B, Lmax, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(B, Lmax, hkv, d, generator=gen).to(device, dtype)
    if layout == "head_major":
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    cache_seqlens = torch.randint(L - 32, L + 32, (B,), generator=gen).to(device)
    q_seqlens = torch.full((B,), T, device=device)
    positions = cache_seqlens[:, None] - T + torch.arange(T, device=device)            # [B, T]
    mask = (torch.arange(Lmax, device=device) <= positions[:, :, None])[:, None]        # [B, 1, T, Lmax]
    return q, k, v, cache_seqlens, q_seqlens, mask


def sdpa_baseline(q, k, v, mask):
    """The baseline: one SDPA call with a prebuilt boolean mask and GQA, [B, T, Hq, D] out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2)


# impl is the top decorator, so it varies fastest: the four runs of one group follow each other (the VM's
# load drifts over seconds); 50 rounds each.
@pytest.mark.parametrize("impl", ["ragged_attention", "ragged_attention_planned", "ragged_attention_min_seqlen",
                                  "sdpa"])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("B,T,L", SHAPES)
def test_cpu(benchmark, impl, B, T, L, layout):
    """``ragged_attention`` builds its plan (value checks, masks) inside the timed call;
    ``ragged_attention_planned`` reuses a prebuilt `RaggedAttentionPlan`, as the layers of one
    forward pass do (the model builds one plan per forward and shares it by all its layers);
    ``ragged_attention_min_seqlen`` also tells that plan the shortest row's length, as the
    decoding loops do (read in their one transfer per step), so V's positions below it are
    multiplied in place. All three read the whole cache capacity, as SDPA does."""
    q, k, v, cache_seqlens, q_seqlens, mask = make_case(B, T, L, layout=layout)
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=k.shape[1])
    bounded = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=k.shape[1],
                                  min_seqlen=int(cache_seqlens.min()))
    for p in (plan, bounded):
        p.torch_masks()
        p.value_keep()
    calls = {
        "ragged_attention": lambda: ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch"),
        "ragged_attention_planned": lambda: ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens,
                                                             backend="torch", plan=plan),
        "ragged_attention_min_seqlen": lambda: ragged_attention(q, k, v, bounded.cache_seqlens, bounded.q_seqlens,
                                                                backend="torch", plan=bounded),
        "sdpa": lambda: sdpa_baseline(q, k, v, mask),
    }
    torch.testing.assert_close(calls[impl](), sdpa_baseline(q, k, v, mask), rtol=1e-4, atol=1e-4)
    benchmark.group = f"cpu B{B}-T{T}-L{L} {layout}"
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    bench(benchmark, calls[impl], rounds=50)


NUM_LAYERS = 30  # SmolLM2-135M's


@pytest.mark.parametrize("impl", ["ragged_attention", "ragged_attention_torch_ops", "sdpa"])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("B,T,L", SHAPES)
def test_cpu_forward_pass(benchmark, monkeypatch, impl, B, T, L, layout):
    """The attention of one forward pass: a `RaggedAttentionPlan` built inside the timed call
    (value checks, masks) and shared by ``NUM_LAYERS`` layer calls, as `specdec_kernels.Llama`
    builds one per forward pass, against as many SDPA calls sharing one prebuilt mask, which is
    not timed. The calls are `test_cpu`'s planned ones (no ``min_seqlen``, the whole capacity
    read, ``q_seqlens`` given); every layer reads the same cache on both sides. Medians are per
    pass; divide by ``NUM_LAYERS`` for a layer. ``ragged_attention`` runs the C kernel for a few
    queries where its work bound admits the shape (``extra_info["few_queries_kernel"]``);
    ``ragged_attention_torch_ops`` the torch ops at every shape."""
    import specdec_kernels.attention as attention

    if impl == "ragged_attention_torch_ops":
        monkeypatch.setattr(attention, "_FEW_QUERIES_MAX_WORK", 0)
    q, k, v, cache_seqlens, q_seqlens, mask = make_case(B, T, L, layout=layout)

    # Only the last layer's output is kept (each is released when the next call returns), as a
    # model consumes each one. (Keeping all of them alive makes glibc return our per-call V
    # scratch to the OS and fault it back in on every call, which a model never does:
    # docs/performance.md.)
    def ours():
        plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=k.shape[1])
        for _ in range(NUM_LAYERS):
            out = ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, backend="torch", plan=plan)
        return out

    def baseline():
        for _ in range(NUM_LAYERS):
            out = sdpa_baseline(q, k, v, mask)
        return out

    torch.testing.assert_close(ours(), baseline(), rtol=1e-4, atol=1e-4)
    benchmark.group = f"cpu forward pass ({NUM_LAYERS} layers) B{B}-T{T}-L{L} {layout}"
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    benchmark.extra_info["few_queries_kernel"] = (impl == "ragged_attention" and attention._native.library() is not None
                                                  and B * T * HQ * k.shape[1] <= attention._FEW_QUERIES_MAX_WORK)
    bench(benchmark, baseline if impl == "sdpa" else ours, rounds=10 if L < 4096 else 5)


# On a GPU, SmolLM2's shapes are launch-bound; a Llama-3-8B-like layer (Hq = 32, Hkv = 8, D = 128)
# with a batch of 32 moves enough bytes (about 0.5 GB per call at 4096 keys) to measure bandwidth.
CUDA_SHAPES = ([pytest.param(B, T, L, (HQ, HKV, D), id=f"B{B}-T{T}-L{L}") for L in (512, 4096) for B in (1, 8)
                for T in (1, 5)]
               + [pytest.param(32, T, L, (32, 8, 128), id=f"B32-T{T}-L{L}-llama8b") for L in (4096, 16384)
                  for T in (1, 5)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
@pytest.mark.parametrize("B,T,L,heads", CUDA_SHAPES)
@pytest.mark.parametrize("impl", ["ragged_attention", "sdpa"])
def test_cuda(benchmark, impl, B, T, L, heads, dtype):
    """CUDA-event medians in ``extra_info``, with the bandwidth they imply: the fewest bytes a call
    must move (each row's valid keys and values read once, q read and the output written once)."""
    q, k, v, cache_seqlens, q_seqlens, mask = make_case(B, T, L, "cuda", dtype, heads=heads)
    ours = lambda: ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="triton")
    torch.testing.assert_close(ours(), sdpa_baseline(q, k, v, mask), rtol=2e-3, atol=2e-3)
    benchmark.group = f"cuda B{B}-T{T}-L{L}-Hq{heads[0]}-Hkv{heads[1]}-D{heads[2]}"
    baseline = lambda: sdpa_baseline(q, k, v, mask)
    bench(benchmark, ours if impl == "ragged_attention" else baseline, cuda=True)
    hq, hkv, d = heads
    min_bytes = (2 * int(cache_seqlens.sum()) * hkv + 2 * B * T * hq) * d * k.element_size()
    benchmark.extra_info["min_bytes"] = min_bytes
    benchmark.extra_info["GB_per_s"] = min_bytes / benchmark.extra_info["cuda_event_median_ms"] / 1e6


def binary_tree_mask(B: int, T: int, device="cpu") -> torch.Tensor:
    """[B, T, T] ancestor mask of a binary token tree (node i's parent is (i - 1) // 2)."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        if i:
            mask[i] = mask[(i - 1) // 2]
        mask[i, i] = True
    return mask.expand(B, T, T).contiguous().to(device)


TREE_SHAPES = [pytest.param(B, T, 512, id=f"B{B}-T{T}-L512") for B in (1, 8) for T in (8, 16)]


@pytest.mark.parametrize("impl", ["tree", "causal"])
@pytest.mark.parametrize("B,T,L", TREE_SHAPES)
def test_cpu_tree_forward_pass(benchmark, impl, B, T, L):
    """A tree's verification against a chain's at the same shapes: one forward pass's attention
    (`test_cpu_forward_pass`: a plan built in the timed call, shared by ``NUM_LAYERS`` calls),
    with a binary tree's ``tree_mask`` or causal. The issue's bound: tree <= 1.1x causal."""
    q, k, v, cache_seqlens, q_seqlens, _ = make_case(B, T, L, layout="head_major")
    tree = binary_tree_mask(B, T) if impl == "tree" else None

    def forward_pass():
        plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=k.shape[1], tree_mask=tree)
        for _ in range(NUM_LAYERS):
            out = ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, tree_mask=plan.tree_mask,
                                   backend="torch", plan=plan)
        return out

    forward_pass()
    benchmark.group = f"cpu tree vs causal forward pass ({NUM_LAYERS} layers) B{B}-T{T}-L{L}"
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    bench(benchmark, forward_pass, rounds=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["tree", "causal"])
@pytest.mark.parametrize("B,T,L", [pytest.param(B, T, L, id=f"B{B}-T{T}-L{L}") for B in (1, 8) for T in (8, 16)
                                   for L in (512, 4096)])
def test_cuda_tree(benchmark, impl, B, T, L):
    """The Triton kernel with a binary tree's ``tree_mask`` against causal, same shapes, fp16, timed as
    CUDA graph replays (per call: the ``cuda_event_median_us_per_call`` extra info)."""
    q, k, v, cache_seqlens, q_seqlens, _ = make_case(B, T, L, "cuda", torch.float16)
    tree = binary_tree_mask(B, T, "cuda") if impl == "tree" else None
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=k.shape[1], tree_mask=tree)
    call = lambda: ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, tree_mask=plan.tree_mask,
                                    backend="triton", plan=plan)
    calls = 20
    replay = cuda_graph_of(call, calls)  # the kernels' time: eagerly, the host's launch work dominates
    benchmark.group = f"cuda tree vs causal B{B}-T{T}-L{L} ({calls} calls in one CUDA graph)"
    bench(benchmark, replay, cuda=True)
    benchmark.extra_info["cuda_event_median_us_per_call"] = benchmark.extra_info["cuda_event_median_ms"] * 1e3 / calls
