"""KVCache.compact: the kept entries of each row's last append move, in order, behind its
previous length (every layer, torch and Triton), against a plain Python model; prefixes stay in
place and are not copied; bad indices raise before anything moves; no host sync."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels import KVCache
from specdec_kernels.attention import DeviceCheckError
from specdec_kernels.testing import SyncCounter, TrafficMeter

BACKENDS = ["torch", "triton"]


def _needs(backend: str) -> str:
    """``backend``, after skipping the test where Triton is missing."""
    if backend == "triton":
        pytest.importorskip("triton")
    return backend


def filled_cache(B=3, L=2, max_len=24, Hkv=2, D=64, dtype=torch.float32, lengths=(5, 0, 9), T=6, q_lens=None):
    """A cache whose rows hold ``lengths`` entries, then an append of T (or ``q_lens``) random
    entries; returns the cache and the lengths before the append."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(L, B, max_len, Hkv, D, dtype=dtype)
    for layer in range(L):
        cache.k[layer].copy_(torch.randn(B, max_len, Hkv, D, generator=gen).to(dtype))
        cache.v[layer].copy_(torch.randn(B, max_len, Hkv, D, generator=gen).to(dtype))
    cache.advance(torch.tensor(lengths))
    start = cache.lengths.clone()
    cache.advance(T if q_lens is None else torch.tensor(q_lens))
    return cache, start


def expected_rows(cache, start, keep, num_keep):
    """The Python model: each row's entries before ``start``, then its kept ones, per layer."""
    rows = []
    for layer in range(cache.num_layers):
        for b in range(cache.batch_size):
            s, n = int(start[b]), int(num_keep[b])
            picks = list(range(s)) + [s + int(i) for i in keep[b, :n]]
            rows.append((cache.k[layer][b, picks].clone(), cache.v[layer][b, picks].clone()))
    return rows


@pytest.mark.parametrize("compact_backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compact_keeps_exactly_the_kept_entries(compact_backend, dtype):
    backend = _needs(compact_backend)
    cache, start = filled_cache(dtype=dtype)
    keep = torch.tensor([[0, 2, 5, 0, 0, 0], [1, 3, 4, 5, 0, 0], [0, 1, 2, 3, 0, 0]])
    num_keep = torch.tensor([3, 4, 2])  # moved, moved from index 1 on, a prefix (stays in place)
    want = expected_rows(cache, start, keep, num_keep)
    untouched = [cache.k[0][2, int(start[2]) + 2:].clone()]  # row 2's entries past its kept prefix
    cache.compact(keep, num_keep, backend=backend)
    assert cache.lengths.tolist() == (start + num_keep).tolist()
    i = 0
    for layer in range(cache.num_layers):
        for b in range(cache.batch_size):
            n = int(cache.lengths[b])
            assert torch.equal(cache.k[layer][b, :n], want[i][0]) and torch.equal(cache.v[layer][b, :n], want[i][1])
            i += 1
    assert torch.equal(cache.k[0][2, int(start[2]) + 2:], untouched[0])


@pytest.mark.parametrize("compact_backend", BACKENDS)
def test_compact_after_ragged_appends_with_start(compact_backend):
    """Rows appended fewer than T entries: their start is given; keeping nothing drops the append."""
    backend = _needs(compact_backend)
    cache, start = filled_cache(T=5, q_lens=[5, 2, 3])
    keep = torch.tensor([[4, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    num_keep = torch.tensor([1, 1, 0])
    want = expected_rows(cache, start, keep, num_keep)
    cache.compact(keep, num_keep, start=start, backend=backend)
    assert cache.lengths.tolist() == [6, 1, 9]
    for b in range(3):
        n = int(cache.lengths[b])
        assert torch.equal(cache.k[0][b, :n], want[b][0]) and torch.equal(cache.v[1][b, :n], want[3 + b][1])


def test_compact_at_the_end_of_the_cache():
    """A row whose kept entries reach max_len: the torch path's padding entries never overwrite them."""
    cache, start = filled_cache(lengths=(18, 0, 3), T=6, max_len=24)
    keep = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    num_keep = torch.tensor([6, 1, 1])
    want = expected_rows(cache, start, keep, num_keep)
    cache.compact(keep, num_keep, backend="torch")
    for b in range(3):
        n = int(cache.lengths[b])
        assert torch.equal(cache.k[0][b, :n], want[b][0])


def test_triton_compact_copies_only_what_moves():
    """A kept prefix moves no bytes; each moved entry is read and written once (K and V)."""
    pytest.importorskip("triton")
    cache, start = filled_cache(L=1)
    prefix = torch.tensor([[0, 1, 2, 0, 0, 0]] * 3)
    with TrafficMeter() as meter:
        cache.compact(prefix, torch.tensor([3, 3, 3]), backend="triton")
    index_bytes = 3 * 2 * (2 + 3) * 8  # per row and head: num_keep, start and the three kept indices
    assert meter.bytes_moved <= index_bytes, meter
    cache, start = filled_cache(L=1)
    with TrafficMeter() as meter:
        cache.compact(torch.tensor([[1, 3, 5, 0, 0, 0]] * 3), torch.tensor([3, 3, 3]), backend="triton")
    entries = 3 * 3 * 2 * 2  # rows x moved entries x heads x (K, V)
    assert meter.bytes_moved - index_bytes <= entries * 64 * 4 * 2  # read once, written once


@pytest.mark.parametrize("compact_backend", BACKENDS)
def test_compact_refuses_bad_indices_and_moves_nothing(compact_backend):
    backend = _needs(compact_backend)
    cache, _ = filled_cache()
    before = [t.clone() for t in cache.k], cache.lengths.clone()
    bad = [
        (torch.tensor([[2, 1, 0, 0, 0, 0]] * 3), torch.tensor([2, 2, 2])),  # not increasing
        (torch.tensor([[0, 6, 0, 0, 0, 0]] * 3), torch.tensor([2, 2, 2])),  # past the append
        (torch.tensor([[0, 1, 0, 0, 0, 0]] * 3), torch.tensor([7, 2, 2])),  # num_keep > T
        (torch.tensor([[-1, 1, 0, 0, 0, 0]] * 3), torch.tensor([2, 2, 2])),
    ]
    for keep, num_keep in bad:
        with pytest.raises(DeviceCheckError, match="compact"):
            cache.compact(keep, num_keep, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(before[0], cache.k, strict=True))
    assert torch.equal(before[1], cache.lengths)
    with pytest.raises(ValueError, match="keep must be"):
        cache.compact(torch.zeros(3, 6, dtype=torch.int32), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="keep must be"):
        cache.compact(torch.zeros(2, 6, dtype=torch.int64), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="num_keep"):
        cache.compact(torch.zeros(3, 6, dtype=torch.int64), torch.tensor([1, 1]))


@pytest.mark.parametrize("compact_backend", BACKENDS)
def test_compact_has_no_host_sync(compact_backend):
    backend = _needs(compact_backend)
    keep, num_keep = torch.tensor([[0, 2, 5, 0, 0, 0]] * 3), torch.tensor([3, 1, 2])
    cache, _ = filled_cache()
    cache.compact(keep, num_keep, backend=backend)  # compile outside the counter
    cache, _ = filled_cache()
    with SyncCounter() as syncs:
        cache.compact(keep, num_keep, backend=backend)
    assert syncs.count == 0, syncs.events
