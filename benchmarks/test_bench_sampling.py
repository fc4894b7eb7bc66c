"""Rejection sampling benchmarks: reference vs vectorized torch path vs an HF-style per-row loop
(CPU), and Triton vs torch path vs reference when CUDA is present.

Run: ``python -m pytest benchmarks/test_bench_sampling.py --benchmark-group-by=group``
Goals: at B=16, K=4, V=49152 fp32 the op called with its default arguments (``validate=True`` on
CPU) is >= 10x faster than the per-row baseline called 16 times, and costs <= 1.3x the op with
``validate=False`` (`test_default_arguments_cpu` times the three interleaved, in one run, and
prints the medians and ratios); at B=1 the torch path is no slower than the baseline; time at
B=64 <= 5x time at B=16.

CPU threads: every CPU row runs with ``SPECDEC_BENCH_THREADS`` torch threads (default 1), as in
``test_bench_attention.py``: on a shared, oversubscribed VM, OpenMP regions with 2 threads wait for
descheduled workers and the timings measure the scheduler.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch

from benchmarks.timing import bench
from specdec_kernels import rejection_sample, rejection_sample_logits

V = 49152
K = 4
pytestmark = pytest.mark.usefixtures("pinned_torch_threads")


def hf_speculative_sampling(candidate_input_ids: torch.Tensor, q: torch.Tensor, p: torch.Tensor):
    """One row, after transformers' ``_speculative_sampling`` (generation/utils.py) minus the
    softmax (probabilities are given) and the EOS special case.

    Shapes as in transformers: ``candidate_input_ids`` ``[1, K]`` (the new candidates),
    ``q`` ``[1, K, V]``, ``p`` ``[1, K+1, V]``. Returns (valid_tokens ``[1, n+1]``, n_matches).
    """
    candidate_length = q.shape[1]
    new_candidate_input_ids = candidate_input_ids[:, -candidate_length:]
    q_i = q[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)
    p_i = p[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)
    probability_ratio = p_i / q_i
    r_i = torch.rand_like(probability_ratio)
    is_accepted = r_i <= probability_ratio
    n_matches = ((~is_accepted).cumsum(dim=-1) < 1).sum()  # this is `n` in algorithm 1
    gamma = candidate_length
    p_n_plus_1 = p[:, n_matches, :]
    if n_matches < gamma:  # host sync, as in transformers
        q_n_plus_1 = q[:, n_matches, :]
        p_prime = torch.clamp((p_n_plus_1 - q_n_plus_1), min=0)
        p_prime.div_(p_prime.sum())
    else:
        p_prime = p_n_plus_1
    t = torch.multinomial(p_prime, num_samples=1).squeeze(1)[None, :]
    if n_matches > 0:
        valid_tokens = torch.cat((new_candidate_input_ids[:, :n_matches], t), dim=-1)
    else:
        valid_tokens = t
    return valid_tokens, n_matches


def hf_per_row(p: torch.Tensor, q: torch.Tensor, ids: torch.Tensor) -> list:
    """The batch as users run it today: the per-row baseline called once per row."""
    return [hf_speculative_sampling(ids[b : b + 1], q[b : b + 1], p[b : b + 1]) for b in range(p.shape[0])]


def make_inputs(B: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Target and draft close enough that ~half the drafts are accepted; drafts drawn from q."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(B, K + 1, V, generator=g) * 4
    p = torch.softmax(base + 0.5 * torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(base[:, :K] + 0.5 * torch.randn(B, K, V, generator=g), -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    return p.to(device, dtype), q.to(device, dtype), ids.to(device)


CPU_ROWS = [
    pytest.param(16, "torch", id="B16-torch"),
    pytest.param(16, "hf_per_row", id="B16-hf_per_row"),
    pytest.param(16, "reference", id="B16-reference"),
    pytest.param(1, "torch", id="B1-torch"),
    pytest.param(1, "hf_per_row", id="B1-hf_per_row"),
    pytest.param(64, "torch", id="B64-torch"),
    pytest.param(64, "hf_per_row", id="B64-hf_per_row"),
]


@pytest.mark.parametrize("B,impl", CPU_ROWS)
def test_rejection_sample_cpu(benchmark, B, impl):
    p, q, ids = make_inputs(B)
    benchmark.group = f"rejection_sample CPU B={B} K={K} V={V} fp32"
    benchmark.extra_info.update(B=B, K=K, V=V, impl=impl, threads=torch.get_num_threads())
    if impl == "hf_per_row":
        fn = lambda: hf_per_row(p, q, ids)
    else:
        gen = torch.Generator().manual_seed(1)
        fn = lambda: rejection_sample(p, q, ids, generator=gen, validate=False, backend=impl)
    bench(benchmark, fn, rounds=10 if impl == "reference" else 30)


def interleaved_medians(benchmark, group: str, calls: dict[str, Callable[[], object]], rounds: int,
                        repeats: int = 5) -> dict[str, float]:
    """Median seconds of each call over ``rounds`` rounds, interleaved: every round runs each call
    once untimed, then ``repeats`` times timed, the calls in a rotated order from round to round,
    so that a change of the machine's load hits every call alike and no call is always timed right
    after the same other one (the per-row loop leaves the allocator and caches in another state).
    pytest-benchmark times whole rounds; the medians go to ``extra_info`` and are printed."""
    benchmark.group = f"{group} CPU B=16 K={K} V={V} fp32: default arguments, interleaved"
    benchmark.extra_info.update(B=16, K=K, V=V, threads=torch.get_num_threads(), rounds=rounds, repeats=repeats)
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    counter = iter(range(10**9))

    def one_round() -> None:
        shift = next(counter) % len(names)
        for name in names[shift:] + names[:shift]:
            calls[name]()  # untimed: the call after another one
            for _ in range(repeats):
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)

    benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=1)
    medians = {name: statistics.median(t) for name, t in times.items()}
    benchmark.extra_info.update({f"{name}_median_ms": m * 1e3 for name, m in medians.items()})
    print(f"\n{benchmark.group}: " + ", ".join(f"{name} {m * 1e3:.3f} ms" for name, m in medians.items()))
    return medians


def test_default_arguments_cpu(benchmark):
    """B=16: `rejection_sample` with its default arguments (on CPU: ``validate=True``), with
    ``validate=False``, and the HF-style per-row loop, interleaved round by round."""
    p, q, ids = make_inputs(16)
    gen = torch.Generator().manual_seed(1)
    medians = interleaved_medians(benchmark, "rejection_sample", {
        "default": lambda: rejection_sample(p, q, ids, generator=gen),
        "validate_false": lambda: rejection_sample(p, q, ids, generator=gen, validate=False),
        "hf_per_row": lambda: hf_per_row(p, q, ids),
    }, rounds=20)
    ratios = {"hf_per_row / default": medians["hf_per_row"] / medians["default"],
              "default / validate_false": medians["default"] / medians["validate_false"]}
    benchmark.extra_info.update(ratios)
    print(", ".join(f"{name} = {r:.2f}x" for name, r in ratios.items()) + " (goals: >= 10x, <= 1.3x)")


def test_logits_default_arguments_cpu(benchmark):
    """B=16, from logits at temperature 1: `rejection_sample_logits` with its default arguments
    (``validate=True`` on CPU) and with ``validate=False``, interleaved."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(16, K + 1, V, generator=g) * 4
    target = base + 0.5 * torch.randn(16, K + 1, V, generator=g)
    draft = base[:, :K] + 0.5 * torch.randn(16, K, V, generator=g)
    ids = torch.multinomial(torch.softmax(draft, -1).reshape(-1, V), 1, generator=g).reshape(16, K)
    gen = torch.Generator().manual_seed(1)
    medians = interleaved_medians(benchmark, "rejection_sample_logits", {
        "default": lambda: rejection_sample_logits(target, draft, ids, generator=gen),
        "validate_false": lambda: rejection_sample_logits(target, draft, ids, generator=gen, validate=False),
    }, rounds=10)
    ratio = medians["default"] / medians["validate_false"]
    benchmark.extra_info["default / validate_false"] = ratio
    print(f"default / validate_false = {ratio:.2f}x (goal: <= 1.3x)")


@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("impl", ["triton", "torch", "hf_per_row", "reference"])
def test_rejection_sample_cuda(benchmark, cuda_available, B, impl):
    if not cuda_available:
        pytest.skip("needs CUDA")
    p, q, ids = make_inputs(B, "cuda")
    benchmark.group = f"rejection_sample CUDA B={B} K={K} V={V} fp32"
    benchmark.extra_info.update(B=B, K=K, V=V, impl=impl)
    if impl == "hf_per_row":
        fn = lambda: hf_per_row(p, q, ids)
    else:
        gen = torch.Generator("cuda").manual_seed(1)
        fn = lambda: rejection_sample(p, q, ids, generator=gen, validate=False, backend=impl)
    bench(benchmark, fn, cuda=True, rounds=5 if impl == "reference" else 20)


@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rejection_sample_logits_cuda(benchmark, cuda_available, B, impl):
    """From logits, temperature 0.8 and top-p 0.9 on both models: the Triton path fuses the
    softmax into the sampler; the torch path materializes both probability tensors first."""
    if not cuda_available:
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(B, K + 1, V, generator=g) * 4
    target = (base + 0.5 * torch.randn(B, K + 1, V, generator=g)).cuda()
    draft = (base[:, :K] + 0.5 * torch.randn(B, K, V, generator=g)).cuda()
    ids = torch.multinomial(torch.softmax(draft / 0.8, -1).reshape(-1, V), 1).reshape(B, K)
    benchmark.group = f"rejection_sample_logits CUDA B={B} K={K} V={V} fp32, T=0.8, top-p 0.9"
    benchmark.extra_info.update(B=B, K=K, V=V, impl=impl)
    gen = torch.Generator("cuda").manual_seed(1)
    bench(benchmark, lambda: rejection_sample_logits(target, draft, ids, temperature=0.8, top_p=0.9,
                                                     generator=gen, backend=impl), cuda=True)
