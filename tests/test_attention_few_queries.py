"""The CPU path's C kernel for a few queries (``attention.c``): against the dense oracle and the
torch ops it stands in for, over ragged rows, GQA, windows, trees and NaN-poisoned caches; a
query's output independent of the other queries in the call; rows with out-of-range lengths
never read; and when the torch ops run instead."""

from __future__ import annotations

import pytest
import torch
from test_attention import CASES, dense_oracle, make_inputs
from test_tree_attention import TREE_CASES, random_masks, random_tree_masks

import specdec_kernels.attention as attention
from specdec_kernels import _native, ragged_attention
from specdec_kernels.testing import assert_close

pytestmark = pytest.mark.skipif(_native.library() is None, reason=f"no native library: {_native.unavailable_reason()}")

FP32_CASES = [case for case in CASES + TREE_CASES if case.values[-1] == torch.float32]


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Each call of the C kernel appends to the list."""
    calls: list[int] = []
    original = attention._few_queries
    monkeypatch.setattr(attention, "_few_queries", lambda *a: calls.append(1) or original(*a))
    return calls


def torch_ops(monkeypatch, *args, **kwargs) -> torch.Tensor:
    """`ragged_attention` on the CPU path's torch ops (the kernel's work bound set to 0)."""
    with monkeypatch.context() as patch:
        patch.setattr(attention, "_FEW_QUERIES_MAX_WORK", 0)
        return ragged_attention(*args, backend="torch", **kwargs)


@pytest.mark.parametrize("masks", ["causal", "window", "tree", "arbitrary"])
@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", FP32_CASES)
def test_kernel_matches_the_oracle_and_the_torch_ops(monkeypatch, kernel_calls, masks, B, T, G, Hkv, D, Lmax,
                                                     lengths, q_lens, dtype):
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    extra = {"window": dict(sliding_window=7), "tree": dict(tree_mask=random_tree_masks(B, T, seed=T)),
             "arbitrary": dict(tree_mask=random_masks(B, T, seed=T))}.get(masks, {})
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch", **extra)
    assert kernel_calls == [1]
    oracle = dense_oracle(q, k, v, cache_seqlens, q_seqlens, window=extra.get("sliding_window"),
                          tree_mask=extra.get("tree_mask"))
    assert_close(out, oracle, dtype)
    torch.testing.assert_close(out, torch_ops(monkeypatch, q, k, v, cache_seqlens, q_seqlens, **extra),
                               rtol=2e-5, atol=2e-6)
    for b in range(B):  # padding queries are zero (their q is NaN), and no NaN beyond a length leaks
        n = T if q_lens is None else q_lens[b]
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))
    assert not out.isnan().any()


@pytest.mark.parametrize("layout", ["head_major", "shared_by_rows", "slice_of_longer"])
def test_kernel_reads_caches_in_place_in_any_layout(kernel_calls, layout):
    """Head-major storage (as `KVCache` keeps it), a cache expanded over rows (stride 0) and a
    view of a longer buffer give the oracle's output."""
    B, T, G, Hkv, D, L = 3, 4, 3, 2, 64, 50
    lengths = [50, 17, 4] if layout != "shared_by_rows" else [50, 50, 50]
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, L, lengths, [4, 2, 3])
    if layout == "head_major":
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    elif layout == "shared_by_rows":
        k, v = (x[:1].expand(B, -1, -1, -1) for x in (k, v))
    else:
        k, v = (torch.cat([x, torch.full_like(x, float("nan"))], 1)[:, :L] for x in (k, v))
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch")
    assert kernel_calls == [1]
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens))


def test_a_query_gets_the_same_output_bit_for_bit_whatever_the_other_queries():
    """Query t of a verification step (T = 5) equals, to the bit, the same query computed as the
    last of a step with t + 1 queries: so a model's verification logits equal its decoding
    step's wherever its matmuls are row-independent too."""
    B, T, G, Hkv, D = 2, 5, 3, 3, 64
    lengths = [60, 23]
    q, k, v, cache_seqlens, _ = make_inputs(B, T, G, Hkv, D, 64, lengths, None)
    out = ragged_attention(q, k, v, cache_seqlens, backend="torch")
    for t in range(T):
        alone = ragged_attention(q[:, t:t + 1], k, v, cache_seqlens - (T - 1 - t), backend="torch")
        assert torch.equal(out[:, t:t + 1], alone), t


def test_a_row_with_out_of_range_lengths_gets_nan_and_no_read():
    """The plan's checks refuse such lengths before any call; should one be deferred, the kernel
    still reads nothing outside the caches: the row's outputs are NaN, the other rows exact."""
    B, T, Hq, Hkv, D, Lmax = 3, 2, 3, 1, 64, 8
    q = torch.randn(B, T, Hq, D)
    k, v = torch.randn(B, Lmax, Hkv, D), torch.randn(B, Lmax, Hkv, D)
    out = torch.empty_like(q)
    scratch = torch.empty(torch.get_num_threads() * (Lmax + 16))
    cache_seqlens = torch.tensor([1 << 40, 5, 1])  # past the cache; fine; shorter than its queries
    sb, sl, sh, _ = k.stride()
    _native.library().ragged_attention_few_queries(
        q.data_ptr(), B, T, Hq, D, k.data_ptr(), v.data_ptr(), sb, sl, sh, Hkv, Lmax, cache_seqlens.data_ptr(),
        0, 0, 0, D ** -0.5, out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
    assert out[0].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[1], ragged_attention(q[1:2], k[1:2], v[1:2], cache_seqlens[1:2], backend="torch")[0])


def test_the_torch_ops_run_where_the_kernel_does_not(monkeypatch, kernel_calls):
    """Half precision, a head dim with a stride, caches of different layouts, work past the bound
    and a machine without the library all take the torch ops, with the oracle's output."""
    q, k, v, cache_seqlens, q_seqlens = make_inputs(2, 3, 3, 1, 64, 40, [40, 9], [3, 2])
    oracle = dense_oracle(q, k, v, cache_seqlens, q_seqlens)
    k_strided, v_strided = (torch.empty(2, 40, 1, 128)[..., ::2].copy_(x) for x in (k, v))  # head dim 2 apart
    cases = {"fp16": (q.half(), k.half(), v.half()), "strided head dim": (q, k_strided, v_strided),
             "two layouts": (q, k, torch.empty(2, 80, 1, 64)[:, :40].copy_(v))}  # v in a longer buffer
    for name, (qc, kc, vc) in cases.items():
        out = ragged_attention(qc, kc, vc, cache_seqlens, q_seqlens, backend="torch")
        assert not kernel_calls, name
        assert_close(out, oracle.to(qc.dtype) if qc.dtype != torch.float32 else oracle, qc.dtype)
    work = 2 * 3 * 3 * 40  # B x T x Hq x Lmax
    monkeypatch.setattr(attention, "_FEW_QUERIES_MAX_WORK", work - 1)
    assert_close(ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch"), oracle)
    assert not kernel_calls
    monkeypatch.setattr(attention, "_FEW_QUERIES_MAX_WORK", work)
    assert_close(ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch"), oracle)
    assert kernel_calls == [1]
    monkeypatch.setattr(_native, "library", lambda: None)
    assert_close(ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch"), oracle)
    assert kernel_calls == [1]
