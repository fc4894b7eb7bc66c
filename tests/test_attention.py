"""ragged_attention: every backend against the fp32 reference (and the reference against a dense
per-row oracle), forced split / no-split Triton paths, NaN-poisoned caches, bad input, host syncs,
and bytes moved by the Triton kernels.

Triton runs under the interpreter on CPU, which is slow: its cases keep caches short (<= 300 keys)
except one split case over a 4100-key cache; the largest shapes (caches of 4160 keys, B = 4) run on
the reference and torch backends only.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdec_kernels import RaggedAttentionPlan, ragged_attention
from specdec_kernels.attention import DeviceCheckError
from specdec_kernels.testing import SyncCounter, TrafficMeter, assert_close


def make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype=torch.float32, seed=0, device="cpu"):
    """Random q/k/v with NaN in every cache entry at or beyond each row's length and in padding queries."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, G * Hkv, D, generator=gen).to(dtype)
    k = torch.randn(B, Lmax, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, Lmax, Hkv, D, generator=gen).to(dtype)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int64)
    q_seqlens = None if q_lens is None else torch.tensor(q_lens, dtype=torch.int32)
    for b in range(B):
        k[b, lengths[b]:] = float("nan")
        v[b, lengths[b]:] = float("nan")
        if q_lens is not None:
            q[b, q_lens[b]:] = float("nan")
    return [x.to(device) if x is not None else None for x in (q, k, v, cache_seqlens, q_seqlens)]


def dense_oracle(q, k, v, cache_seqlens, q_seqlens, scale=None, window=None, tree_mask=None):
    """Independent oracle: SDPA in float64 on each row's valid prefix, queries cut to the real ones
    (with ``window``, each query's mask keeps its last ``window`` keys; with ``tree_mask``, every
    key before the row's new tokens, then the new tokens the tree mask gives)."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(cache_seqlens[b])
        n = T if q_seqlens is None else int(q_seqlens[b])
        qb = q[b, :n].double().transpose(0, 1)                                  # [Hq, n, D]
        kb = k[b, :L].double().transpose(0, 1).repeat_interleave(G, dim=0)     # [Hq, L, D]
        vb = v[b, :L].double().transpose(0, 1).repeat_interleave(G, dim=0)
        positions = (L - n + torch.arange(n))[:, None]
        mask = torch.arange(L)[None, :] <= positions
        if window is not None:
            mask &= torch.arange(L)[None, :] > positions - window
        if tree_mask is not None:
            mask = torch.cat([mask[:, : L - n], tree_mask[b, :n, :n]], 1)
        out[b, :n] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def reference_fp32(q, k, v, cache_seqlens, q_seqlens):
    """The reference on fp32 copies of the inputs (the oracle for every dtype)."""
    return ragged_attention(q.float(), k.float(), v.float(), cache_seqlens, q_seqlens, backend="reference")


def _layout(x: torch.Tensor, layout: str, lengths: list[int]) -> torch.Tensor:
    """The same [B, Lmax, Hkv, D] values stored another way (for the shared layouts, the values
    of the longest row, or of the first head, in every row or head)."""
    B, Lmax, Hkv, D = x.shape
    if layout == "head_major":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "slice_of_longer":  # positions 3 .. Lmax + 2 of a longer buffer, NaN around them
        nan = torch.full_like(x[:, :7], float("nan"))
        return torch.cat([nan[:, :3], x, nan], 1)[:, 3:Lmax + 3]
    if layout == "shared_by_rows":  # one row's cache expanded over the batch (stride 0)
        longest = lengths.index(max(lengths))
        return x[longest:longest + 1].expand(B, -1, -1, -1)
    if layout == "shared_by_heads":  # one KV head expanded over the heads (stride 0)
        return x[:, :, :1].expand(-1, -1, Hkv, -1)
    if layout == "strided_head_dim":  # D values two apart
        return torch.stack([x, torch.full_like(x, float("nan"))], -1)[..., 0]
    if layout == "padded_positions":  # one spare element after each position: strides not multiples of D
        padded = torch.full((B, Lmax, Hkv * D + 1), float("nan"), dtype=x.dtype)
        padded[..., :-1] = x.flatten(2)
        return padded[..., :-1].unflatten(-1, (Hkv, D))
    return x


def assert_padding_rows_zero(out: torch.Tensor, T: int, q_lens: list[int] | None) -> None:
    """Query rows past each row's q_seqlens are exactly zero."""
    for b in range(out.shape[0]):
        n = T if q_lens is None else q_lens[b]
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))


def count_calls(monkeypatch, owner, name: str) -> list:
    """Record each call of ``owner.<name>`` (which still runs) in the returned list."""
    calls, original = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.fixture
def torch_ops(monkeypatch) -> None:
    """The CPU path on its torch ops at every size (the C kernel for a few queries, tested in
    test_attention_few_queries.py, would otherwise take these tests' small shapes)."""
    import specdec_kernels.attention as attention

    monkeypatch.setattr(attention, "_FEW_QUERIES_MAX_WORK", 0)


def torch_path_on_layout(layout, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    """`make_inputs` with the cache stored in ``layout`` (`_layout`), and the torch path's output:
    ``(q, k, v, cache_seqlens, q_seqlens, out)``."""
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    k, v = _layout(k, layout, lengths), _layout(v, layout, lengths)
    return q, k, v, cache_seqlens, q_seqlens, ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend="torch")


# (B, T, G, Hkv, D, Lmax, cache_seqlens, q_seqlens, dtype)
CASES = [
    pytest.param(1, 1, 1, 1, 64, 16, [1], None, torch.float32, id="B1-T1-G1-D64-L1"),
    pytest.param(4, 1, 3, 2, 64, 200, [1, 200, 77, 130], None, torch.float32, id="B4-T1-G3-D64-ragged"),
    pytest.param(3, 2, 4, 2, 80, 150, [2, 150, 61], [2, 1, 2], torch.float32, id="B3-T2-G4-D80-ragged-q"),
    pytest.param(3, 5, 3, 3, 64, 257, [5, 257, 100], [5, 1, 3], torch.float32, id="B3-T5-G3-D64-ragged-q"),
    pytest.param(2, 9, 8, 1, 128, 120, [9, 120], [9, 4], torch.float32, id="B2-T9-G8-D128-rowblocks"),
    pytest.param(2, 17, 1, 2, 80, 90, [17, 90], [17, 6], torch.float32, id="B2-T17-G1-D80-ragged-q"),
    pytest.param(2, 17, 4, 1, 64, 64, [64, 20], [1, 17], torch.float32, id="B2-T17-G4-D64-Lmax=64"),
    pytest.param(2, 5, 3, 3, 128, 140, [140, 7], [5, 2], torch.float16, id="B2-T5-G3-D128-fp16"),
    pytest.param(2, 5, 4, 2, 80, 140, [33, 140], [3, 5], torch.bfloat16, id="B2-T5-G4-D80-bf16"),
    pytest.param(2, 2, 3, 2, 96, 70, [70, 2], None, torch.float16, id="B2-T2-G3-D96-fp16"),
    pytest.param(2, 17, 8, 1, 128, 60, [60, 17], [17, 9], torch.float16, id="B2-T17-G8-D128-fp16-wide"),
]


@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", CASES)
def test_matches_reference(backend, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    if backend == "reference":  # the oracle itself is checked against a dense per-row SDPA
        expected = dense_oracle(q, k, v, cache_seqlens, q_seqlens)
    else:
        expected = reference_fp32(q, k, v, cache_seqlens, q_seqlens)
    assert_close(out, expected, dtype)
    assert_padding_rows_zero(out, T, q_lens)


@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", CASES[:5] + CASES[7:8])
def test_head_major_cache_layout(backend, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    """Caches stored [B, Hkv, Lmax, D] (as `KVCache` keeps them) and passed as [B, Lmax, Hkv, D]
    views take the CPU path's merged-batch bmm; NaN beyond each row's length still never leaks."""
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    k_hm, v_hm = (_layout(x, "head_major", lengths) for x in (k, v))
    out = ragged_attention(q, k_hm, v_hm, cache_seqlens, q_seqlens, backend=backend)
    assert_close(out, reference_fp32(q, k, v, cache_seqlens, q_seqlens), dtype)
    assert not out.isnan().any()


# (B, T, G, Hkv, D, Lmax, cache_seqlens, q_seqlens, dtype): three or four rows, so chunks of one
# or two rows always split the batch (with a shorter last chunk when B = 3).
CHUNK_CASES = [
    pytest.param(4, 1, 3, 2, 64, 200, [1, 200, 77, 130], None, torch.float32, id="B4-T1-G3-ragged"),
    pytest.param(3, 5, 3, 3, 64, 257, [5, 257, 100], [5, 1, 3], torch.float32, id="B3-T5-G3-ragged-q"),
    pytest.param(3, 9, 8, 1, 128, 120, [9, 120, 50], None, torch.float32, id="B3-T9-G8-D128"),
    pytest.param(3, 5, 3, 3, 128, 140, [140, 7, 60], [5, 2, 4], torch.float16, id="B3-T5-fp16"),
    pytest.param(3, 5, 4, 2, 80, 140, [33, 140, 5], [3, 5, 1], torch.bfloat16, id="B3-T5-D80-bf16"),
]


@pytest.mark.parametrize("layout", ["token_major", "head_major", "slice_of_longer"])
@pytest.mark.parametrize("rows_per_chunk", [1, 2])
@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", CHUNK_CASES)
def test_torch_path_in_chunks_of_rows(monkeypatch, torch_ops, rows_per_chunk, layout, B, T, G, Hkv, D, Lmax,
                                      lengths, q_lens, dtype):
    """The CPU path multiplies V in chunks of batch rows once a cache is large; forced here on
    small caches (one or two rows per chunk): same outputs, padding rows exactly zero, and the
    NaN beyond each row's length (zeroed chunk by chunk in a reused buffer) never leaks."""
    import specdec_kernels.attention as attention

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(attention, "_V_CHUNK_BYTES", rows_per_chunk * Hkv * Lmax * D * 4)
    zeroings = count_calls(monkeypatch, torch, "bitwise_and")
    q, k, v, cache_seqlens, q_seqlens, out = torch_path_on_layout(layout, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    assert len(zeroings) == math.ceil(B / rows_per_chunk)  # the chunked branch ran, chunk by chunk
    assert_close(out, reference_fp32(q, k, v, cache_seqlens, q_seqlens), dtype)
    assert not out.isnan().any()
    assert_padding_rows_zero(out, T, q_lens)


# (B, T, G, Hkv, D, Lmax, cache_seqlens, q_seqlens, dtype)
LAYOUT_CASES = [
    pytest.param(4, 1, 3, 2, 64, 200, [1, 200, 77, 130], None, torch.float32, id="B4-T1-G3-ragged"),
    pytest.param(3, 2, 3, 3, 64, 257, [2, 257, 100], [2, 1, 2], torch.float32, id="B3-T2-G3-ragged-q"),
    pytest.param(2, 6, 1, 2, 80, 90, [6, 90], [6, 3], torch.bfloat16, id="B2-T6-G1-D80-bf16"),
    pytest.param(2, 1, 4, 2, 128, 70, [70, 1], None, torch.float16, id="B2-T1-G4-D128-fp16"),
]


@pytest.mark.parametrize("layout", ["token_major", "head_major", "slice_of_longer", "shared_by_rows",
                                    "shared_by_heads", "strided_head_dim", "padded_positions"])
@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", LAYOUT_CASES)
def test_torch_path_on_cache_layouts(torch_ops, layout, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    """The CPU path reads caches stored in any layout: at an offset in a longer buffer, expanded
    over rows or heads (stride 0), with head_dim values apart or strides that are not multiples
    of D; equal to the reference, the NaN beyond the lengths never read."""
    q, k, v, cache_seqlens, q_seqlens, out = torch_path_on_layout(layout, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    assert_close(out, reference_fp32(q, k, v, cache_seqlens, q_seqlens), dtype)
    assert not out.isnan().any()
    assert_padding_rows_zero(out, T, q_lens)


@pytest.mark.parametrize("layout", ["token_major", "head_major", "shared_by_rows"])
@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", LAYOUT_CASES)
def test_torch_path_multiplies_the_shared_positions_in_place(monkeypatch, torch_ops, layout, B, T, G, Hkv, D, Lmax,
                                                              lengths, q_lens, dtype):
    """A plan given ``min_seqlen`` (a bound below every row's length) multiplies V's positions
    below it in place (forced here on small caches) and zeroes only the rest: the same outputs
    as without the bound, for every bound from 1 to the shortest row, in one chunk and in chunks
    of one row."""
    import specdec_kernels.attention as attention

    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    k, v = _layout(k, layout, lengths), _layout(v, layout, lengths)
    expected = reference_fp32(q, k, v, cache_seqlens, q_seqlens)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    in_place = count_calls(monkeypatch, attention, "_times_cache")
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=Lmax, min_seqlen=min(lengths))
    ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, backend="torch", plan=plan)
    assert len(in_place) == 1  # Q K^T only: these few positions are under `_IN_PLACE_MIN_BYTES`
    monkeypatch.setattr(attention, "_IN_PLACE_MIN_BYTES", 0)
    for rows_per_chunk in (B, 1):
        monkeypatch.setattr(attention, "_V_CHUNK_BYTES", rows_per_chunk * Hkv * Lmax * D * 4)
        for bound in sorted({1, min(lengths) // 2 or 1, min(lengths)}):
            plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=Lmax, min_seqlen=bound)
            in_place.clear()
            out = ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, backend="torch", plan=plan)
            assert len(in_place) == 2  # Q K^T, and P V over the shared positions
            assert_close(out, expected, dtype, msg=f"min_seqlen={bound}, {rows_per_chunk} rows per chunk")
            assert not out.isnan().any()
            assert_padding_rows_zero(out, T, q_lens)


def test_torch_path_ignores_default_dtype():
    """The plan's tensors have fixed dtypes: a float64 default dtype changes nothing."""
    q, k, v, cache_seqlens, _ = make_inputs(2, 1, 3, 1, 64, 10, [5, 10], None)
    expected = ragged_attention(q, k, v, cache_seqlens, backend="torch")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = ragged_attention(q, k, v, cache_seqlens, backend="torch")
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == torch.float32 and torch.equal(out, expected)


@pytest.mark.parametrize("split", ["nosplit", "split"])
@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", CASES[1:6] + CASES[7:9])
def test_triton_forced_paths(split, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    """Both Triton paths on the same inputs: one program per row (no merge) and many splits."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels.attention import ragged_attention_triton

    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    kwargs = dict(max_splits=1) if split == "nosplit" else dict(max_splits=16, min_chunk=16)
    with TrafficMeter() as meter:
        out = ragged_attention_triton(q, k, v, cache_seqlens, q_seqlens, 1 / math.sqrt(D), **kwargs)
    assert meter.num_launches == (1 if split == "nosplit" else 2)
    expected = reference_fp32(q, k, v, cache_seqlens, q_seqlens)
    assert_close(out, expected, dtype)


def test_strided_lengths_are_read_by_value(backend):
    """cache_seqlens / q_seqlens given as strided [B] views (columns of a larger tensor)."""
    q, k, v, cache_seqlens, q_seqlens = make_inputs(3, 4, 3, 1, 64, 40, [40, 9, 4], [4, 2, 1])
    column = lambda t: torch.stack((t, t.flip(0)), 1)[:, 0]
    out = ragged_attention(q, k, v, column(cache_seqlens), column(q_seqlens), backend=backend)
    assert_close(out, reference_fp32(q, k, v, cache_seqlens, q_seqlens), torch.float32)


def test_custom_scale(backend):
    q, k, v, cache_seqlens, q_seqlens = make_inputs(2, 3, 2, 2, 64, 40, [40, 9], [3, 2])
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, scale=0.3, backend=backend)
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, scale=0.3), torch.float32)


@pytest.mark.parametrize("backend_name", ["reference", "torch"])
def test_cache_longer_than_4096(backend_name):
    """SmolLM2 verification shape over caches past 4096 keys (reference and torch backends)."""
    q, k, v, cache_seqlens, q_seqlens = make_inputs(4, 5, 3, 3, 64, 4160, [4160, 4097, 5, 2049], [5, 3, 5, 1])
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend=backend_name)
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens), torch.float32)


def test_triton_cache_longer_than_4096_split():
    """The one long Triton case: 4100 keys, split on device into several chunks, merged."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels.attention import ragged_attention_triton

    q, k, v, cache_seqlens, q_seqlens = make_inputs(1, 5, 3, 1, 64, 4100, [4100], [4])
    with TrafficMeter() as meter:
        out = ragged_attention_triton(q, k, v, cache_seqlens, q_seqlens, 0.125, max_splits=8)
    assert meter.num_launches == 2
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens), torch.float32)


def test_auto_on_cpu_is_torch_path():
    q, k, v, cache_seqlens, _ = make_inputs(2, 1, 3, 1, 64, 30, [30, 4], None)
    with SyncCounter():
        auto = ragged_attention(q, k, v, cache_seqlens)
    torch_path = ragged_attention(q, k, v, cache_seqlens, backend="torch")
    torch.testing.assert_close(auto, torch_path, rtol=0, atol=0)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("T", [5, 2], ids=["T5", "T2"])
def test_no_host_sync(backend_name, T):
    if backend_name == "triton":
        pytest.importorskip("triton")
    q, k, v, cache_seqlens, q_seqlens = make_inputs(3, T, 3, 2, 64, 100, [100, 5, 60], [T, 1, 2])
    ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend=backend_name)  # compile outside the counter
    with SyncCounter() as syncs:
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend=backend_name)
    assert syncs.count == 0, syncs.events


def _minimum_bytes(q, k, cache_seqlens, q_seqlens) -> int:
    """Valid K/V read once per KV head, real queries read once, the whole output written once."""
    B, T, Hq, D = q.shape
    Hkv, el = k.shape[2], q.element_size()
    real_q = B * T if q_seqlens is None else int(q_seqlens.sum())
    return int(cache_seqlens.sum()) * Hkv * D * 2 * el + real_q * Hq * D * el + q.numel() * el


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("split", ["nosplit", "split"])
def test_triton_bytes_moved(split, dtype):
    """SmolLM2 verify shape (G=3, T=5, D=64): <= 1.15 x the analytic minimum in both paths."""
    lengths = [1500, 700, 9, 1200] if split == "split" else [300, 41, 5, 257]
    _check_bytes_moved(4, 5, 3, 3, lengths, [5, 2, 5, 1], dtype, max_splits=1 if split == "nosplit" else 8)


@pytest.mark.parametrize("split", ["nosplit", "split"])
@pytest.mark.parametrize("dtype,T,D", [(torch.float16, 16, 64), (torch.bfloat16, 11, 64), (torch.float32, 8, 64),
                                       (torch.float16, 17, 64), (torch.bfloat16, 30, 64), (torch.float32, 16, 64),
                                       (torch.float16, 17, 128), (torch.bfloat16, 17, 80), (torch.float32, 8, 128)],
                         ids=["fp16-128rows", "bf16-88rows", "fp32-64rows", "fp16-136rows", "bf16-240rows",
                              "fp32-128rows", "fp16-136rows-D128", "bf16-136rows-D80", "fp32-64rows-D128"])
def test_triton_bytes_moved_wide_tiles(split, dtype, T, D):
    """G = 8 query heads per KV head with up to 30 verify queries: G * T up to 256 packed rows in
    fp16 / bf16 at every head dim (128 in fp32 at head dim 64, 64 at the wider heads) still share
    one tile, so K/V are read once per KV head in both paths."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels.attention import attention_config, max_tile_rows, min_split_keys

    if max_tile_rows(dtype, D) < 8 * T:
        pytest.skip("256-row tiles at head dims 80-128 need Triton's sched4reg option (Triton >= 3.9)")
    long = 2 * min_split_keys(dtype, 8 * T, attention_config(dtype, D, 8 * T)["BN"]) + 64  # splits in 3
    _check_bytes_moved(2, T, 8, 1, [long, 40], [T, T - 3], dtype, max_splits=1 if split == "nosplit" else 4, D=D)


def test_wide_head_tiles_only_where_the_gpu_has_the_shared_memory():
    """256-row tiles at head dims 80-128 take 128 KB of shared memory: GPUs of compute capability
    8.6 / 8.9 (99 KB per program) get 128-row tiles; head dim 64 needs less and keeps 256."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels import attention as kernels

    from specdec_kernels.testing import SHARED_MEMORY_LIMITS

    for dtype in (torch.float16, torch.bfloat16):
        assert kernels.attention_config(dtype, 64, 136, SHARED_MEMORY_LIMITS[86])["BM"] == 256
        for D in (80, 96, 128):
            assert kernels.attention_config(dtype, D, 136, SHARED_MEMORY_LIMITS[86])["BM"] == 128
            wide = 256 if kernels._SCHED4REG else 128
            for cc in (80, 90):
                assert kernels.attention_config(dtype, D, 136, SHARED_MEMORY_LIMITS[cc])["BM"] == wide
            assert kernels.attention_config(dtype, D, 136)["BM"] == wide  # the registry's (no limit)


def _check_bytes_moved(B, T, G, Hkv, lengths, q_lens, dtype, max_splits, D=64):
    pytest.importorskip("triton")
    from specdec_kernels.kernels.attention import attention_config, min_split_keys, ragged_attention_triton

    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, max(lengths), lengths, q_lens, dtype)
    with TrafficMeter() as meter:
        out = ragged_attention_triton(q, k, v, cache_seqlens, q_seqlens, D ** -0.5, max_splits=max_splits)
    split = max_splits > 1
    if split:  # the longest rows really split: more than one chunk of the default size
        assert max(lengths) > 2 * min_split_keys(dtype, G * T, attention_config(dtype, D, G * T)["BN"])
    assert meter.num_launches == (2 if split else 1)
    minimum = _minimum_bytes(q, k, cache_seqlens, q_seqlens)
    assert meter.bytes_moved <= 1.15 * minimum, (meter, minimum)
    assert meter.bytes_moved >= minimum  # the meter sees every valid K/V element
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens), dtype)


def test_triton_short_caches_launch_no_merge():
    """When no row can need two splits (short cache), only the forward kernel is launched."""
    pytest.importorskip("triton")
    q, k, v, cache_seqlens, _ = make_inputs(2, 1, 3, 3, 64, 200, [200, 3], None)
    with TrafficMeter() as meter:
        ragged_attention(q, k, v, cache_seqlens, backend="triton")
    assert meter.num_launches == 1


def _bad(name):
    """Valid inputs as a dict, with one argument replaced by ``name``'s bad variant."""
    q, k, v, cache_seqlens, q_seqlens = make_inputs(2, 3, 2, 2, 64, 20, [20, 5], [3, 2])
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=cache_seqlens, q_seqlens=q_seqlens)
    bad = {
        "q-3d": ("q", q[0]),
        "k-batch": ("k_cache", k[:1]),
        "k-headdim": ("k_cache", k[..., :32]),
        "v-shape": ("v_cache", v[:, :10]),
        "heads-not-multiple": ("q", torch.randn(2, 3, 3, 64)),
        "k-dtype": ("k_cache", k.half()),
        "q-int": ("q", q.long()),
        "k-device": ("k_cache", torch.empty(k.shape, device="meta")),
        "seqlens-shape": ("cache_seqlens", cache_seqlens[:1]),
        "seqlens-float": ("cache_seqlens", cache_seqlens.float()),
        "seqlens-above-Lmax": ("cache_seqlens", torch.tensor([21, 5])),
        "seqlens-below-qlens": ("cache_seqlens", torch.tensor([20, 1])),
        "qlens-zero": ("q_seqlens", torch.tensor([0, 2])),
        "qlens-above-T": ("q_seqlens", torch.tensor([4, 2])),
        "qlens-shape": ("q_seqlens", torch.tensor([3])),
        "no-heads": ("q", q[:, :, :0]),
        "scale-nan": ("scale", float("nan")),
        "scale-negative": ("scale", -1.0),
        "scale-bool": ("scale", True),
    }[name]
    args[bad[0]] = bad[1]
    return bad[0], args


BAD = ["q-3d", "k-batch", "k-headdim", "v-shape", "heads-not-multiple", "k-dtype", "q-int", "k-device",
       "seqlens-shape", "seqlens-float", "seqlens-above-Lmax", "seqlens-below-qlens", "qlens-zero",
       "qlens-above-T", "qlens-shape", "no-heads", "scale-nan", "scale-negative", "scale-bool"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_value_error_naming_argument(backend, case):
    argument, args = _bad(case)
    expected = {"heads-not-multiple": "Hkv", "no-heads": "Hq"}.get(case, argument)
    with pytest.raises(ValueError, match=expected):
        ragged_attention(**args, backend=backend)


def test_value_check_error_is_also_runtime_error():
    _, args = _bad("seqlens-above-Lmax")
    with pytest.raises(RuntimeError, match="cache_seqlens"):
        ragged_attention(**args, backend="torch")
    assert issubclass(DeviceCheckError, ValueError)


@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", [CASES[1], CASES[3], CASES[7]])
def test_plan_shared_by_layers_equals_one_call_each(backend, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=Lmax)
    for layer in range(3):  # "layers": other q/k/v, the same lengths and plan
        q_l, k_l, v_l = (x.roll(layer, dims=-1) for x in (q, k, v))
        out = ragged_attention(q_l, k_l, v_l, plan.cache_seqlens, plan.q_seqlens, backend=backend, plan=plan)
        assert torch.equal(out, ragged_attention(q_l, k_l, v_l, cache_seqlens, q_seqlens, backend=backend))


def test_plan_shared_by_caches_of_other_layouts_and_heads():
    """One plan serves caches of other layouts, head counts and head dims (its CPU row indices
    are kept per layout): each call equals the reference, with NaN beyond every length."""
    lengths, q_lens = [1, 40, 23], [1, 2, 2]
    cache_seqlens, q_seqlens = torch.tensor(lengths), torch.tensor(q_lens)
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=2, max_len=40)
    for G, Hkv, D, layout in [(3, 2, 64, "head_major"), (3, 2, 64, "token_major"), (1, 3, 80, "head_major"),
                              (2, 1, 64, "shared_by_rows"), (3, 2, 64, "head_major")]:
        q, k, v, _, _ = make_inputs(3, 2, G, Hkv, D, 40, lengths, q_lens)
        k, v = _layout(k, layout, lengths), _layout(v, layout, lengths)
        out = ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, backend="torch", plan=plan)
        assert_close(out, reference_fp32(q, k, v, cache_seqlens, q_seqlens), torch.float32)
        assert not out.isnan().any()


@pytest.mark.parametrize("T,q_lens", [(1, [1, 1, 1]), (1, None), (4, None), (4, [4, 1, 3])],
                         ids=["T1-q_seqlens", "T1", "T4", "T4-ragged-q"])
@pytest.mark.parametrize("masks_first", [True, False])
def test_plan_value_mask_equals_valid_keys(T, q_lens, masks_first):
    """The CPU path's V mask is -1 exactly on each row's valid keys, whether it is built on its
    own or shared with the last query's score mask (T = 1, or q_seqlens None); sharing leaves
    the score mask as it was."""
    cache_seqlens = torch.tensor([4, 37, 9])
    q_seqlens = None if q_lens is None else torch.tensor(q_lens)
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=40)
    score_keep = plan.torch_masks().score_keep.clone() if masks_first else None
    keep = plan.value_keep()
    if masks_first:
        assert torch.equal(plan.torch_masks().score_keep, score_keep)
    expected = -(torch.arange(40) < cache_seqlens[:, None]).to(torch.int32)
    assert keep.shape == (3, 1, 40, 1) and keep.dtype == torch.int32
    assert torch.equal(keep.reshape(3, 40), expected)
    shared = masks_first and (T == 1 or q_lens is None)
    assert (keep.untyped_storage().data_ptr() == plan.torch_masks().score_keep.untyped_storage().data_ptr()) == shared


def test_plan_checks_lengths_once_and_rejects_another_call():
    q, k, v, cache_seqlens, q_seqlens = make_inputs(3, 5, 3, 3, 64, 257, [5, 257, 100], [5, 1, 3])
    with pytest.raises(ValueError, match="q_seqlens must lie in 1..T=4"):
        RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=4, max_len=257)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=5, max_len=200)
    with pytest.raises(ValueError, match="num_queries"):
        RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=0, max_len=257)
    with pytest.raises(ValueError, match="cache_seqlens must be an integer"):
        RaggedAttentionPlan(cache_seqlens.float(), q_seqlens, num_queries=5, max_len=257)
    with pytest.raises(ValueError, match="q_seqlens must have shape"):
        RaggedAttentionPlan(cache_seqlens, q_seqlens[:2], num_queries=5, max_len=257)
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=5, max_len=257)
    with pytest.raises(ValueError, match="plan must be a RaggedAttentionPlan"):
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, plan={"cache_seqlens": cache_seqlens})
    expected = ragged_attention(q, k, v, cache_seqlens, q_seqlens)
    cache_seqlens -= 1  # the plan keeps its own copy of the lengths it checked
    assert torch.equal(ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, plan=plan), expected)
    with pytest.raises(ValueError, match="plan was made for other"):
        ragged_attention(q, k, v, cache_seqlens, q_seqlens, plan=plan)
    with pytest.raises(ValueError, match="plan was made for other"):
        ragged_attention(q, k, v, plan.cache_seqlens, None, plan=plan)
    with pytest.raises(ValueError, match="plan was made for T=5, Lmax=257"):
        ragged_attention(q[:, :4], k, v, plan.cache_seqlens, plan.q_seqlens, plan=plan)
    with pytest.raises(ValueError, match="plan was made for T=5, Lmax=257"):
        ragged_attention(q, k[:, :256], v[:, :256], plan.cache_seqlens, plan.q_seqlens, plan=plan)


# (B, T, G, Hkv, D, Lmax, q_seqlens, dtype): every row's cache_seqlens is Lmax.
FULL_CASES = [
    pytest.param(1, 1, 3, 3, 64, 81, None, torch.float32, id="B1-T1-decode"),
    pytest.param(1, 5, 3, 3, 64, 97, None, torch.float32, id="B1-T5-verify"),
    pytest.param(3, 5, 3, 2, 80, 40, [5, 2, 4], torch.bfloat16, id="B3-T5-ragged-q-bf16"),
    pytest.param(2, 1, 4, 2, 128, 33, None, torch.float16, id="B2-T1-G4-D128-fp16"),
]


@pytest.mark.parametrize("layout", ["token_major", "head_major", "shared_by_rows", "padded_positions"])
@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,q_lens,dtype", FULL_CASES)
def test_torch_path_with_every_row_full(monkeypatch, torch_ops, layout, B, T, G, Hkv, D, Lmax, q_lens, dtype):
    """A plan told ``min_seqlen == max_len`` (no row has keys beyond its length, as one row
    decoding with an exact ``max_seqlen``) multiplies V in place, and with T = 1 applies no mask:
    equal to the reference and to the same plan without the hint."""
    lengths = [Lmax] * B
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    k, v = _layout(k, layout, lengths), _layout(v, layout, lengths)
    hinted = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=Lmax, min_seqlen=Lmax)
    plain = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=Lmax)
    assert hinted.full and not plain.full
    zeroings = count_calls(monkeypatch, torch, "bitwise_and")
    masks = count_calls(monkeypatch, RaggedAttentionPlan, "torch_masks")
    out = ragged_attention(q, k, v, hinted.cache_seqlens, hinted.q_seqlens, backend="torch", plan=hinted)
    assert not zeroings and len(masks) == (0 if T == 1 else 1)  # V read in place
    assert_close(out, reference_fp32(q, k, v, cache_seqlens, q_seqlens), dtype)
    assert_padding_rows_zero(out, T, q_lens)
    expected = ragged_attention(q, k, v, plain.cache_seqlens, plain.q_seqlens, backend="torch", plan=plain)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_min_seqlen_is_checked():
    cache_seqlens, q_seqlens = torch.tensor([9, 12]), torch.tensor([2, 3])
    for bad in (0, 13, 2.0, True):
        with pytest.raises(ValueError, match="min_seqlen must be None or an int in 1..max_len=12"):
            RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=3, max_len=12, min_seqlen=bad)
    for q_lens in (q_seqlens, None):  # a row shorter than the bound: a device-side check, on CPU at once
        with pytest.raises(DeviceCheckError, match="min_seqlen=10"):
            RaggedAttentionPlan(cache_seqlens, q_lens, num_queries=3, max_len=12, min_seqlen=10)
    assert not RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=3, max_len=12, min_seqlen=9).full


# ---- sliding-window attention ----


@pytest.mark.parametrize("window", [1, 3, 16, 47, 200], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T,q_lens", [(1, None), (5, [5, 1, 3]), (7, None)], ids=["decode", "verify", "prefill"])
def test_sliding_window_matches_the_oracle(backend, window, T, q_lens):
    """Windows shorter than a verification's queries (1, 3), inside the cache (16, 47) and longer
    than it (200: no key hidden), ragged rows, NaN beyond every length: every backend equals
    attention over exactly each query's last ``window`` keys."""
    q, k, v, cache_seqlens, q_seqlens = make_inputs(3, T, 2, 2, 64, 48, [48, 20, 7], q_lens)
    out = ragged_attention(q, k, v, cache_seqlens, q_seqlens, sliding_window=window, backend=backend)
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, window=window))
    if window >= 48:  # a window as long as the cache hides nothing
        assert_close(out, ragged_attention(q, k, v, cache_seqlens, q_seqlens, backend=backend))


@pytest.mark.parametrize("split", ["nosplit", "split"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_triton_sliding_window_reads_only_the_window(split, dtype):
    """Long rows with a 200-key window: the kernel reads within 1.15 x the keys some query of the
    row can see (plus the queries and the output), not the whole row, in both paths."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels.attention import ragged_attention_triton

    window, lengths, q_lens = 200, [1500, 700, 90, 1200], [5, 2, 5, 1]
    q, k, v, cache_seqlens, q_seqlens = make_inputs(4, 5, 3, 3, 64, max(lengths), lengths, q_lens, dtype)
    with TrafficMeter() as meter:
        out = ragged_attention_triton(q, k, v, cache_seqlens, q_seqlens, 64 ** -0.5, sliding_window=window,
                                      max_splits=1 if split == "nosplit" else 8)
    visible = torch.minimum(cache_seqlens, q_seqlens + window - 1)  # keys the row's queries see together
    el = q.element_size()
    minimum = int(visible.sum()) * 3 * 64 * 2 * el + int(q_seqlens.sum()) * 9 * 64 * el + q.numel() * el
    assert meter.bytes_moved <= 1.15 * minimum, (meter, minimum)
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, window=window), dtype)


def test_a_plan_is_made_for_one_window():
    q, k, v, cache_seqlens, q_seqlens = make_inputs(2, 3, 2, 2, 64, 32, [32, 9], [3, 2])
    plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=3, max_len=32, sliding_window=8)
    out = ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, sliding_window=8, plan=plan)
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, window=8))
    with pytest.raises(ValueError, match="plan was made for sliding_window=8"):
        ragged_attention(q, k, v, plan.cache_seqlens, plan.q_seqlens, plan=plan)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            ragged_attention(q, k, v, cache_seqlens, q_seqlens, sliding_window=bad)
