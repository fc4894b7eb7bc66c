"""ragged_attention with a tree_mask: every backend against a dense masked oracle over random
trees and arbitrary masks, split and unsplit Triton paths, NaN-poisoned caches, the causal mask
reproducing the chain case bit for bit, bytes moved, host syncs and bad input."""

from __future__ import annotations

import pytest
import torch
from test_attention import dense_oracle, make_inputs

from specdec_kernels import RaggedAttentionPlan, ragged_attention
from specdec_kernels.attention import DeviceCheckError, pack_tree_mask
from specdec_kernels.testing import SyncCounter, TrafficMeter, assert_close


def random_tree_masks(B: int, T: int, seed: int) -> torch.Tensor:
    """[B, T, T] ancestor masks of random trees in topological order (node i's parent is a
    random earlier node, or none for the roots; each node sees itself and its ancestors)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
            if parent >= 0:
                mask[b, i] = mask[b, parent]
            mask[b, i, i] = True
    return mask


def random_masks(B: int, T: int, seed: int) -> torch.Tensor:
    """[B, T, T] arbitrary masks (later tokens too) with a True diagonal."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(B, T, T, generator=gen) < 0.4) | torch.eye(T, dtype=torch.bool)


# (B, T, G, Hkv, D, Lmax, cache_seqlens, q_seqlens, dtype)
TREE_CASES = [
    pytest.param(3, 8, 1, 2, 64, 90, [90, 8, 40], [8, 5, 8], torch.float32, id="B3-T8-G1"),
    pytest.param(2, 16, 3, 2, 64, 130, [130, 30], [16, 11], torch.float32, id="B2-T16-G3"),
    pytest.param(2, 9, 8, 1, 128, 70, [70, 12], None, torch.float32, id="B2-T9-G8-D128"),
    pytest.param(2, 16, 3, 3, 64, 100, [100, 20], [16, 9], torch.float16, id="B2-T16-G3-fp16"),
    pytest.param(2, 40, 1, 1, 80, 120, [120, 41], [40, 33], torch.bfloat16, id="B2-T40-G1-bf16-two-words"),
    # fp32 tiles of 64 rows step 16 keys at a time: blocks that straddle a mask word
    pytest.param(2, 40, 2, 1, 64, 95, [95, 60], [40, 37], torch.float32, id="B2-T40-G2-fp32-two-words"),
]


@pytest.mark.parametrize("masks", ["tree", "arbitrary"])
@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", TREE_CASES)
def test_tree_attention_matches_the_masked_oracle(backend, masks, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    tree = (random_tree_masks if masks == "tree" else random_masks)(B, T, seed=T)
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree, backend=backend)
    assert out.dtype == dtype
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree), dtype)
    for b in range(B):  # padding queries are zero
        n = T if q_lens is None else q_lens[b]
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))


@pytest.mark.parametrize("split", ["nosplit", "split"])
@pytest.mark.parametrize("G", [1, 3, 8])
def test_triton_tree_attention_split_and_unsplit(split, G):
    """Splits of 32 keys: the new tokens (and the mask) fall in the last split, or across two."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels.attention import ragged_attention_triton

    T = 12
    q, k, v, cache_seqlens, q_seqlens = make_inputs(3, T, G, 1, 64, 150, [150, 40, 12], [12, 7, 12])
    tree = random_tree_masks(3, T, seed=G)
    splits = dict(max_splits=1) if split == "nosplit" else dict(max_splits=8, min_chunk=32)
    with TrafficMeter() as meter:
        out = ragged_attention_triton(q, k, v, cache_seqlens, q_seqlens, 64 ** -0.5, tree_mask=tree, **splits)
    assert meter.num_launches == (1 if split == "nosplit" else 2)
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree))


def test_causal_tree_mask_reproduces_the_chain_bit_for_bit():
    """A tree_mask equal to the causal mask gives exactly the output without one (CPU path)."""
    B, T = 3, 6
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, 3, 2, 64, 80, [80, 9, 33], [6, 3, 5])
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).contiguous()
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=causal, backend="torch")
    assert torch.equal(out, ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch"))


@pytest.mark.parametrize("split", ["nosplit", "split"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_triton_tree_attention_bytes_moved(split, dtype):
    """K/V read once per KV head, the mask bits only where a key block reaches the new tokens:
    <= 1.15 x the minimum (valid K/V, real queries, the output, the packed mask)."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels.attention import ragged_attention_triton

    B, T, G = 4, 16, 3
    lengths = [1500, 700, 16, 1200] if split == "split" else [300, 41, 16, 257]
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, 3, 64, max(lengths), lengths, [16, 9, 16, 5], dtype)
    tree = random_tree_masks(B, T, seed=1)
    bits = pack_tree_mask(tree)
    with TrafficMeter() as meter:
        out = ragged_attention_triton(q, k, v, cache_seqlens, q_seqlens, 64 ** -0.5, tree_mask=tree,
                                      max_splits=1 if split == "nosplit" else 8)
    el = q.element_size()
    minimum = (int(cache_seqlens.sum()) * 3 * 64 * 2 * el + int(q_seqlens.sum()) * G * 3 * 64 * el
               + q.numel() * el + bits.numel() * 4)
    assert meter.bytes_moved <= 1.15 * minimum, (meter, minimum)
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree), dtype)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_tree_attention_has_no_host_sync(backend_name):
    if backend_name == "triton":
        pytest.importorskip("triton")
    q, k, v, cache_seqlens, q_seqlens = make_inputs(3, 5, 3, 2, 64, 100, [100, 5, 60], [5, 1, 2])
    tree = random_tree_masks(3, 5, seed=0)
    ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree, backend=backend_name)  # compile first
    with SyncCounter() as syncs:
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree, backend=backend_name)
    assert syncs.count == 0, syncs.events


def test_plan_with_a_tree_is_shared_by_layers(backend):
    B, T = 2, 7
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, 2, 2, 64, 50, [50, 10], [7, 4])
    tree = random_tree_masks(B, T, seed=3)
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=50, tree_mask=tree)
    for layer in range(2):
        scaled = q * (layer + 1)
        out = ragged_attention(scaled, k, v, plan.cache_seqlens, plan.q_seqlens, tree_mask=plan.tree_mask,
                               plan=plan, backend=backend)
        assert_close(out, dense_oracle(scaled, k, v, cache_seqlens, q_seqlens, tree_mask=tree))
    with pytest.raises(ValueError, match="tree_mask"):  # the plan's mask, not another one
        ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, tree_mask=tree, plan=plan, backend=backend)
    with pytest.raises(ValueError, match="tree_mask"):
        ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, plan=plan, backend=backend)


def test_pack_tree_mask_round_trips():
    mask = random_masks(2, 70, seed=5)  # three words per query, bit 31 set in some
    bits = pack_tree_mask(mask)
    assert bits.shape == (2, 70, 3) and bits.dtype == torch.int32
    unpacked = ((bits.to(torch.int64)[..., None] >> torch.arange(32)) & 1).flatten(2)[..., :70].bool()
    assert torch.equal(unpacked, mask)


def test_tree_mask_bad_input_raises():
    q, k, v, cache_seqlens, q_seqlens = make_inputs(2, 4, 2, 1, 64, 20, [20, 6], [4, 2])
    tree = random_tree_masks(2, 4, seed=0)
    with pytest.raises(ValueError, match="tree_mask must be a bool"):
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree.int())
    with pytest.raises(ValueError, match=r"tree_mask must have shape \[B, T, T\]"):
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree[:, :3])
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree, sliding_window=8)
    no_self = tree.clone()
    no_self[1, 1, 1] = False  # a real query (row 1 has two) that does not see itself
    with pytest.raises(DeviceCheckError, match="diagonal"):
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=no_self)
    padding = tree.clone()
    padding[1, 3, 3] = False  # a padding query: allowed
    ragged_attention(q, k, v, cache_seqlens, q_seqlens, tree_mask=padding)
