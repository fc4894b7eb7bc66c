"""KVCache: append at ragged lengths (torch index_put and Triton scatter), advance / crop / select
round trips keep every accepted entry, overflow is an error that corrupts nothing, no host syncs,
bytes moved by the append kernel, and an end-to-end decode + verify loop through ragged_attention."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels import KVCache, ragged_attention
from specdec_kernels.attention import DeviceCheckError
from specdec_kernels.testing import SyncCounter, TrafficMeter, assert_close

# The cache has no separate reference: "reference" runs the torch scatter, checked against a Python model.
APPEND_BACKENDS = ["torch", "triton"]


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class RowModel:
    """Plain Python model of a cache: per layer and row, the list of accepted [Hkv, D] entries."""

    def __init__(self, num_layers, batch):
        self.k = [[[] for _ in range(batch)] for _ in range(num_layers)]
        self.v = [[[] for _ in range(batch)] for _ in range(num_layers)]

    def append(self, layer, k_new, v_new, q_lens):
        for b, n in enumerate(q_lens):
            self.k[layer][b].extend(k_new[b, :n].unbind(0))
            self.v[layer][b].extend(v_new[b, :n].unbind(0))

    def crop(self, new_lengths):
        for layer_k, layer_v in zip(self.k, self.v, strict=True):
            for b, n in enumerate(new_lengths):
                del layer_k[b][n:], layer_v[b][n:]

    def check(self, cache):
        assert cache.lengths.tolist() == [len(r) for r in self.k[0]]
        for layer in range(cache.num_layers):
            for b in range(cache.batch_size):
                n = len(self.k[layer][b])
                if n:
                    assert torch.equal(cache.k[layer][b, :n], torch.stack(self.k[layer][b]))
                    assert torch.equal(cache.v[layer][b, :n], torch.stack(self.v[layer][b]))


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("append_backend", APPEND_BACKENDS)
def test_append_writes_only_real_tokens_at_each_length(append_backend, dtype):
    cache = KVCache(2, 3, 12, 2, 64, dtype=dtype)
    cache.lengths.copy_(torch.tensor([0, 4, 7]))
    before_k, before_v = cache.k[1].clone(), cache.v[1].clone()
    k_new, v_new = _rand(3, 5, 2, 64, seed=1, dtype=dtype), _rand(3, 5, 2, 64, seed=2, dtype=dtype)
    q_lens = torch.tensor([5, 2, 0])
    cache.append(1, k_new, v_new, q_lens, backend=append_backend)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for b, (start, n) in enumerate(zip([0, 4, 7], [5, 2, 0], strict=True)):
        expected_k[b, start:start + n] = k_new[b, :n]
        expected_v[b, start:start + n] = v_new[b, :n]
    assert torch.equal(cache.k[1], expected_k) and torch.equal(cache.v[1], expected_v)
    assert cache.lengths.tolist() == [0, 4, 7]  # append never moves lengths
    assert torch.equal(cache.k[0], torch.zeros_like(cache.k[0]))  # other layers untouched


@pytest.mark.parametrize("append_backend", APPEND_BACKENDS)
def test_append_reads_strided_q_seqlens_by_value(append_backend):
    """q_seqlens given as a strided [B] view (a column of a larger tensor) writes what it says."""
    strided, contiguous = KVCache(1, 3, 12, 2, 64), KVCache(1, 3, 12, 2, 64)
    for cache in (strided, contiguous):
        cache.lengths.copy_(torch.tensor([0, 4, 7]))
    k_new, v_new = _rand(3, 5, 2, 64, seed=1), _rand(3, 5, 2, 64, seed=2)
    strided.append(0, k_new, v_new, torch.tensor([[5, 1], [2, 1], [3, 1]])[:, 0], backend=append_backend)
    contiguous.append(0, k_new, v_new, torch.tensor([5, 2, 3]), backend=append_backend)
    assert torch.equal(strided.k[0], contiguous.k[0]) and torch.equal(strided.v[0], contiguous.v[0])


@pytest.mark.parametrize("append_backend", APPEND_BACKENDS)
def test_speculative_round_trips_keep_accepted_entries(append_backend):
    """Prefill, then steps of append(K+1) / advance / crop(accepted) / select, against a Python model."""
    gen = torch.Generator().manual_seed(3)
    L, B, K = 2, 4, 3
    cache, model = KVCache(L, B, 40, 1, 64), RowModel(L, B)
    prompt = torch.tensor([3, 1, 5, 2])
    for step in range(4):
        T = K + 1 if step else 5
        q_lens = prompt if step == 0 else torch.full((B,), T)
        for layer in range(L):
            k_new, v_new = torch.randn(B, T, 1, 64, generator=gen), torch.randn(B, T, 1, 64, generator=gen)
            cache.append(layer, k_new, v_new, q_lens, backend=append_backend)
            model.append(layer, k_new, v_new, q_lens.tolist())
        cache.advance(q_lens)
        model.check(cache)
        if step:
            accepted = torch.randint(0, K + 1, (B,), generator=gen)  # rejected tail rolled back
            new_lengths = cache.lengths - (K - accepted)
            cache.crop(new_lengths)
            model.crop(new_lengths.tolist())
            model.check(cache)
    rows = torch.tensor([2, 0, 3])  # drop row 1, reorder
    cache.select(rows)
    model.k = [[layer[i] for i in rows.tolist()] for layer in model.k]
    model.v = [[layer[i] for i in rows.tolist()] for layer in model.v]
    assert cache.batch_size == 3 and cache.k[0].shape[0] == 3
    model.check(cache)
    cache.select(torch.tensor([True, False, True]))  # bool mask
    model.k = [[layer[0], layer[2]] for layer in model.k]
    model.v = [[layer[0], layer[2]] for layer in model.v]
    model.check(cache)


@pytest.mark.parametrize("append_backend", APPEND_BACKENDS)
def test_append_past_max_len_raises_and_corrupts_nothing(append_backend):
    cache = KVCache(1, 2, 8, 1, 64)
    cache.lengths.copy_(torch.tensor([6, 2]))
    k_new = _rand(2, 3, 1, 64)
    with pytest.raises(DeviceCheckError, match="max_len"):
        cache.append(0, k_new, k_new, backend=append_backend)
    with pytest.raises(RuntimeError, match="max_len"):  # also a RuntimeError, like torch._assert_async
        cache.append(0, k_new, k_new, torch.tensor([3, 1]), backend=append_backend)
    assert torch.equal(cache.k[0], torch.zeros_like(cache.k[0]))
    cache.append(0, k_new, k_new, torch.tensor([2, 3]), backend=append_backend)  # exactly fills row 0
    assert torch.equal(cache.k[0][0, 6:], k_new[0, :2])
    with pytest.raises(ValueError, match="max_len"):
        cache.advance(torch.tensor([3, 0]))


def test_triton_append_kernel_masks_overflow():
    """Even without the assert, the scatter kernel drops writes past max_len (no wrap, no corruption)."""
    pytest.importorskip("triton")
    from specdec_kernels.kernels.cache import append_triton

    k_cache, v_cache = torch.zeros(2, 8, 1, 64), torch.zeros(2, 8, 1, 64)
    k_new = _rand(2, 3, 1, 64)
    append_triton(k_cache, v_cache, k_new, k_new, torch.tensor([6, 0]), None)
    assert torch.equal(k_cache[0, 6:], k_new[0, :2]) and torch.equal(k_cache[0, :6], torch.zeros(6, 1, 64))
    assert torch.equal(k_cache[1, :3], k_new[1]) and torch.equal(k_cache[1, 3:], torch.zeros(5, 1, 64))


def test_crop_and_advance():
    cache = KVCache(1, 3, 10, 1, 64)
    lengths = cache.lengths
    cache.advance(4)
    cache.advance(torch.tensor([1, 0, 2]))
    assert cache.lengths.tolist() == [5, 4, 6] and cache.lengths is lengths  # updated in place
    cache.crop(torch.tensor([5, 1, 0]))
    assert cache.lengths.tolist() == [5, 1, 0]
    with pytest.raises(DeviceCheckError, match="new_lengths"):
        cache.crop(torch.tensor([6, 1, 0]))  # crop cannot grow a row
    with pytest.raises(ValueError, match="new_lengths"):
        cache.crop(torch.tensor([-1, 1, 0]))
    assert cache.lengths.tolist() == [5, 1, 0]
    cache.crop(0)
    assert cache.lengths.tolist() == [0, 0, 0]


def test_huge_or_negative_int_lengths_are_refused_on_the_host():
    """Int steps and lengths are range-checked before any arithmetic (2**63 - 1 used to wrap
    lengths around to negative values); a huge tensor step is caught on the device."""
    import numpy as np

    cache = KVCache(1, 2, 8, 1, 64)
    cache.advance(np.int64(2))
    for call in (lambda: cache.advance(2**63 - 1), lambda: cache.advance(2**64), lambda: cache.crop(-1),
                 lambda: cache.plan_append(2, 3)):
        with pytest.raises(ValueError, match=r"must lie in 0\.\.\d"):
            call()
    with pytest.raises(DeviceCheckError, match="advance"):
        cache.advance(torch.tensor([2**63 - 1, 0]))
    assert cache.lengths.tolist() == [2, 2]


@pytest.mark.parametrize("append_backend", APPEND_BACKENDS)
def test_no_host_sync(append_backend):
    cache = KVCache(2, 3, 16, 1, 64)
    k_new = _rand(3, 4, 1, 64)
    q_lens = torch.tensor([4, 1, 2])
    cache.append(0, k_new, k_new, q_lens, backend=append_backend)  # compile outside the counter
    with SyncCounter() as syncs:
        cache.append(1, k_new, k_new, q_lens, backend=append_backend)
        cache.append(1, k_new, k_new, backend=append_backend)
        cache.advance(q_lens)
        cache.crop(cache.lengths - 1)
        cache.select(torch.tensor([2, 0]))
    assert syncs.count == 0, syncs.events


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_triton_append_bytes_moved(dtype):
    """The scatter reads and writes each real new entry once: 4 x (sum q_seqlens) x Hkv x D elements."""
    pytest.importorskip("triton")
    cache = KVCache(1, 4, 32, 3, 64, dtype=dtype)
    k_new = _rand(4, 5, 3, 64, dtype=dtype)
    q_lens = torch.tensor([5, 1, 3, 2])
    with TrafficMeter() as meter:
        cache.append(0, k_new, k_new, q_lens, backend="triton")
    minimum = 4 * int(q_lens.sum()) * 3 * 64 * k_new.element_size()
    assert meter.num_launches == 1
    assert minimum <= meter.bytes_moved <= 1.15 * minimum, (meter, minimum)


@pytest.mark.parametrize("case", ["layer", "layer-bool", "shape", "dtype", "device", "q_seqlens", "T"])
def test_bad_arguments(case):
    cache = KVCache(2, 2, 8, 1, 64)
    k_new = torch.zeros(2, 3, 1, 64)
    args, expected = dict(layer=0, k_new=k_new, v_new=k_new, q_seqlens=None), case
    if case == "layer":
        args["layer"] = 2
    elif case == "layer-bool":
        args["layer"], expected = True, "layer"
    elif case == "shape":
        args["k_new"], expected = torch.zeros(2, 3, 2, 64), "k_new"
    elif case == "dtype":
        args["v_new"], expected = k_new.half(), "v_new"
    elif case == "device":
        args["k_new"], expected = torch.empty(k_new.shape, device="meta"), "k_new"
    elif case == "q_seqlens":
        args["q_seqlens"] = torch.tensor([1.0, 2.0])
    else:
        args["k_new"] = args["v_new"] = torch.zeros(2, 9, 1, 64)
        expected = "max_len"
    with pytest.raises(ValueError, match=expected):
        cache.append(**args)
    with pytest.raises(ValueError, match="rows"):
        cache.select(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="rows"):  # uint8 is neither an index dtype nor taken for a mask
        cache.select(torch.tensor([1, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="max_len"):
        KVCache(1, 1, 0, 1, 64)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_decode_and_verify_through_cache_match_full_recompute(path):
    """Prefill 7 tokens, decode 2 steps (T=1), verify once (T=4, ragged q_seqlens), crop:
    each attention output equals the reference over the row's whole accepted history."""
    gen = torch.Generator().manual_seed(7)
    B, Hkv, G, D = 2, 1, 3, 64
    cache, model = KVCache(1, B, 24, Hkv, D), RowModel(1, B)
    for T, q_lens in [(7, torch.tensor([7, 4])), (1, None), (1, None), (4, torch.tensor([4, 2]))]:
        q = torch.randn(B, T, G * Hkv, D, generator=gen)
        k_new, v_new = torch.randn(B, T, Hkv, D, generator=gen), torch.randn(B, T, Hkv, D, generator=gen)
        n = q_lens if q_lens is not None else torch.full((B,), T)
        cache.append(0, k_new, v_new, q_lens, backend=path)
        model.append(0, k_new, v_new, n.tolist())
        out = ragged_attention(q, cache.k[0], cache.v[0], cache.lengths + n, q_lens, backend=path)
        for b in range(B):
            keys, values = torch.stack(model.k[0][b])[None], torch.stack(model.v[0][b])[None]
            rows = int(n[b])
            expected = ragged_attention(q[b:b + 1, :rows], keys, values, torch.tensor([keys.shape[1]]),
                                        backend="reference")
            assert_close(out[b, :rows], expected[0], torch.float32)
        cache.advance(n)
    cache.crop(cache.lengths - torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [11, 8]


@pytest.mark.parametrize("append_backend", APPEND_BACKENDS)
def test_append_plan_shared_by_layers(append_backend):
    planned, direct = KVCache(3, 3, 12, 2, 64), KVCache(3, 3, 12, 2, 64)
    for cache in (planned, direct):
        cache.lengths.copy_(torch.tensor([0, 4, 12]))
    q_lens = torch.tensor([5, 2, 0])
    plan = planned.plan_append(5, q_lens)
    for layer in range(3):
        k_new, v_new = _rand(3, 5, 2, 64, seed=layer), _rand(3, 5, 2, 64, seed=10 + layer)
        planned.append(layer, k_new, v_new, plan=plan, backend=append_backend)
        direct.append(layer, k_new, v_new, q_lens, backend=append_backend)
    for layer in range(3):
        assert torch.equal(planned.k[layer], direct.k[layer]) and torch.equal(planned.v[layer], direct.v[layer])


def test_append_plan_errors():
    cache = KVCache(2, 2, 8, 1, 4)
    cache.lengths.copy_(torch.tensor([6, 0]))
    with pytest.raises(ValueError, match="writing past max_len=8"):
        cache.plan_append(3)
    with pytest.raises(ValueError, match="num_new must be a positive int"):
        cache.plan_append(0)
    with pytest.raises(ValueError, match="q_seqlens must be an integer tensor"):
        cache.plan_append(2, torch.tensor([1.0, 2.0]))
    plan = cache.plan_append(2, torch.tensor([2, 1]))
    k_new = torch.zeros(2, 2, 1, 4)
    with pytest.raises(ValueError, match="plan must be an AppendPlan"):
        cache.append(0, k_new, k_new, plan="positions")
    with pytest.raises(ValueError, match="pass q_seqlens to plan_append"):
        cache.append(0, k_new, k_new, torch.tensor([2, 1]), plan=plan)
    with pytest.raises(ValueError, match="plan was made for T=2"):
        cache.append(0, k_new[:, :1], k_new[:, :1], plan=plan)
    with pytest.raises(ValueError, match="num_new=9 new tokens per row is more than max_len=8"):
        cache.plan_append(9)
    other = KVCache(2, 2, 8, 1, 4)
    other.lengths.copy_(cache.lengths)
    with pytest.raises(ValueError, match="another cache"):
        other.append(0, k_new, k_new, plan=plan)
    for change in (lambda: cache.advance(0), lambda: cache.crop(cache.lengths.clone()),
                   lambda: cache.select(torch.arange(2))):
        plan = cache.plan_append(2, torch.tensor([2, 1]))
        change()  # even a change that moves nothing retires the plan
        with pytest.raises(ValueError, match="before its lengths or rows changed"):
            cache.append(0, k_new, k_new, plan=plan)


def test_a_cache_too_large_to_allocate_names_its_size():
    """The allocator's refusal becomes an error naming the sizes (a ValueError, and a MemoryError)."""
    from specdec_kernels.cache import CacheAllocationError

    with pytest.raises(CacheAllocationError, match=r"3 rows x max_len=1000000000000 positions needs .* GiB"):
        KVCache(2, 3, 10**12, 2, 16)
    assert issubclass(CacheAllocationError, ValueError) and issubclass(CacheAllocationError, MemoryError)
