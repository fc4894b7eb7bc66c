"""GPU compile check: every kernel specialization the package launches compiles for sm_80 and
sm_90 (no GPU needed), spills no registers and fits the shared memory of the GPUs it runs on;
and what the launchers launch is exactly what the registry holds (`launch_recorder`)."""

import re

import pytest
import torch
from launch_recorder import LaunchRecorder, assert_all_registered
from specdec_kernels.kernels import KERNEL_MODULES
from specdec_kernels.kernels.registry import registered_specs

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


def _registered(prefix: str) -> set[str]:
    return {spec.name for spec in registered_specs() if spec.name.startswith(prefix)}


def test_attention_launches_are_the_registered_specializations(monkeypatch):
    """Tile sizes, warps, stages and compiler options of every attention launch (1 to 240 packed
    rows, every dtype and head dim, with and without a 99 KB shared-memory limit, with and
    without a tree mask) are registered specs, and every registered spec is launched by one of
    these inputs."""
    from specdec_kernels.kernels import attention as kernels

    recorder = LaunchRecorder(monkeypatch, kernels, "_ragged_attn_fwd_kernel", "_ragged_attn_merge_kernel")
    monkeypatch.setattr(kernels, "interpreter_enabled", lambda: False)  # record the GPU launches
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for D in kernels.HEAD_DIMS:
            for G, T in ((1, 1), (4, 5), (3, 5), (4, 9), (8, 9), (8, 17), (8, 30)):
                # 128 keys: two splits of at least one key block (up to 64 keys) each.
                q, k, v = torch.zeros(1, T, G, D, dtype=dtype), *torch.zeros(2, 1, 128, 1, D, dtype=dtype)
                for max_shared in (None, SHARED_MEMORY_LIMITS[86]):
                    monkeypatch.setattr(kernels, "_max_shared_memory", lambda device, limit=max_shared: limit)
                    for q_seqlens, tree in ((None, None), (torch.tensor([T]), None),
                                            (None, torch.ones(1, T, T, dtype=torch.bool))):
                        for max_splits in (1, 2):  # forward only; forward and merge
                            kernels.ragged_attention_triton(q, k, v, torch.tensor([128]), q_seqlens, 0.1,
                                                            tree_mask=tree, max_splits=max_splits, min_chunk=32)
    assert len(recorder.launches) == 3 * len(kernels.HEAD_DIMS) * 7 * 2 * 3 * 3
    assert assert_all_registered(recorder.launches) == _registered("attention[")


def test_cache_append_launches_are_the_registered_specializations(monkeypatch):
    """Every cache append (each dtype and head dim, with and without counts) and compaction is a
    registered spec."""
    from specdec_kernels.kernels import cache as kernels

    recorder = LaunchRecorder(monkeypatch, kernels, "_kv_append_kernel", "_kv_compact_kernel")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for D in kernels.HEAD_DIMS:
            k_cache, v_cache = torch.zeros(2, 2, 16, 3, D, dtype=dtype)
            for T, q_seqlens in ((1, None), (5, None), (5, torch.tensor([5, 2], dtype=torch.int32))):
                k_new, v_new = torch.zeros(2, 2, T, 3, D, dtype=dtype)
                kernels.append_triton(k_cache, v_cache, k_new, v_new, torch.tensor([3, 0]), q_seqlens)
            kernels.compact_triton(k_cache, v_cache, torch.tensor([[0, 2], [1, 0]]), torch.tensor([2, 1]),
                                   torch.tensor([3, 0]))
    assert len(recorder.launches) == 3 * len(kernels.HEAD_DIMS) * 4
    assert assert_all_registered(recorder.launches) == _registered("cache[")


def test_sampling_launches_are_the_registered_specializations(monkeypatch):
    """Every sampler launch (probabilities, logits with and without filters, thresholds, first
    rejection), with and without a draft, ragged counts, per-row greedy flags, temperatures,
    every kind of seed and explicit noise, is a registered spec, and every registered spec is
    launched."""
    from specdec_kernels.kernels import sampling as kernels

    from specdec_kernels import make_rejection_noise

    recorder = LaunchRecorder(monkeypatch, kernels, "_rejection_sample_kernel", "_rejection_sample_logits_kernel",
                              "_logit_thresholds_kernel", "_first_rejection_kernel")
    # The kernels are recorded, not run: their flags of rows without a token are never written.
    monkeypatch.setattr(kernels, "refuse_rows_without_token", lambda bad, names: None)
    B, K, V = 2, 3, 50
    ids = torch.zeros(B, K, dtype=torch.int64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        target = torch.zeros(B, K + 1, V, dtype=dtype)
        for draft in (None, torch.zeros(B, K, V, dtype=dtype)):
            for n, greedy, seed in ((None, False, 7), (torch.tensor([3, 1], dtype=torch.int32), True, -3),
                                    (torch.tensor([0, 3]), torch.tensor([True, False]), 2**62 + 5),
                                    (None, False, torch.tensor([1, 2])), (None, False, None)):
                kernels.rejection_sample_triton(target, draft, ids, n, greedy, seed=seed)
                for temperature, top_k, top_p in ((0.7, None, None), (torch.tensor([0.0, 1.5]), 5, 0.9)):
                    kernels.rejection_sample_logits_triton(target, draft, ids, n, greedy, temperature, top_k, top_p,
                                                           seed=seed)
            noise = make_rejection_noise(B, K, V, seed=0)  # explicit noise in place of the RNG
            kernels.rejection_sample_triton(target, draft, ids, None, False, noise=noise)
            kernels.rejection_sample_logits_triton(target, draft, ids, None, False, 0.7, 5, 0.9, noise=noise)
    kernels.first_rejection_index_triton(torch.zeros(B, K, dtype=torch.bool), torch.tensor([3, 1]))
    assert assert_all_registered(recorder.launches) == _registered("sampling.")


def test_tree_sampling_launches_are_the_registered_specializations(monkeypatch):
    """Every tree sampler launch (with and without draft logits, filtered or not, greedy rows,
    ragged counts, every kind of seed and explicit noise) is a registered spec, and every
    registered spec is launched."""
    from specdec_kernels.kernels import sampling, tree_sampling

    from specdec_kernels import make_rejection_noise

    recorder = LaunchRecorder(monkeypatch, tree_sampling, "_tree_rejection_sample_kernel")
    LaunchRecorder(monkeypatch, sampling, "_logit_thresholds_kernel")  # run by the filtered calls, not recorded
    B, N, V = 2, 3, 50
    ids, parents = torch.zeros(B, N, dtype=torch.int64), torch.tensor([[-1, 0, 0], [-1, -1, 1]])
    settings = [  # counts, seed, top_k, every row greedy
        (None, 7, None, False), (torch.tensor([3, 1], dtype=torch.int32), -3, 5, False),
        (torch.tensor([0, 3]), torch.tensor([1, 2]), None, False), (None, None, 5, False), (None, None, None, True)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        target = torch.zeros(B, N + 1, V, dtype=dtype)
        for draft in (None, torch.zeros(B, N, V, dtype=dtype)):
            for n, seed, top_k, all_greedy in settings:
                tree_sampling.tree_rejection_sample_triton(
                    target, draft, ids, parents, n, temperature=torch.tensor([0.0, 0.7]), top_k=top_k, top_p=None,
                    greedy=torch.tensor([True, False]), seed=seed, all_greedy=all_greedy)
            tree_sampling.tree_rejection_sample_triton(
                target, draft, ids, parents, None, temperature=torch.tensor([1.0, 1.0]), top_k=None, top_p=0.9,
                greedy=torch.tensor([False, False]), noise=make_rejection_noise(B, N, V, seed=0))
    assert assert_all_registered(recorder.launches) == _registered("tree_sampling.")
