"""Causal attention over a ragged KV cache: decode (T = 1) and speculative verification (T = K + 1).

``ragged_attention(q, k_cache, v_cache, cache_seqlens, q_seqlens)`` attends T new queries per row
to that row's own cache prefix. The convention is FlashAttention's ``flash_attn_with_kvcache``:
``cache_seqlens`` counts the valid keys of a row *including* its new tokens (they were appended
before the call), and the queries sit at the end of that prefix, causal among themselves
(bottom-right aligned). A row may have fewer real queries than T (``q_seqlens``); its padding
rows come out as zeros.

Backends (see `specdec_kernels._backend`):

- ``"reference"``: `specdec_kernels.reference.attention`, row by row in fp32;
- ``"torch"``: vectorized and sync-free (no host read of a length): the G query heads of a KV
  head and the T queries of a row are packed into one matrix, so each KV head's cache is
  multiplied once, in place. Integer masks built on device cover causality and the ragged
  lengths: ANDed into the scores' bits and followed by a -inf bias, they also remove the NaN
  scores of keys beyond a length. What lies beyond a length in V is never multiplied (a NaN
  there would survive a zero weight): V is zeroed there bitwise in chunks of batch rows (sized
  from the shapes alone) before one GEMM per chunk. A plan given a host lower bound on the
  lengths (``min_seqlen``, as the decoding loops pass it) multiplies the positions below it in
  place (when they hold 1 MiB of V or more) and zeroes only the rest; when the bound covers the
  whole cache view (one row with an exact bound), nothing is copied, and with T = 1 nothing is
  masked. Padding rows are zeroed at the end. Half-precision inputs are computed in fp32.
  In float32 at a few queries (up to `_FEW_QUERIES_MAX_WORK` rows x queries x heads x cache
  positions, a decoding, verification or tree step over a cache of modest length) it runs
  ``attention.c`` instead, where the package's C sources build (`specdec_kernels._native`):
  one call for what the ops above do in a dozen, reading only keys below each length;
- ``"triton"``: `specdec_kernels.kernels.attention`, split-KV (flash-decoding) with a
  log-sum-exp merge; the split count is chosen per row on the device.

Everything that depends only on the lengths (their value checks, the torch path's masks) lives
in a `RaggedAttentionPlan`, made once and shared by calls with the same lengths, such as the
layers of one forward pass. Value checks (``cache_seqlens`` within ``q_seqlens .. Lmax``,
``q_seqlens`` within ``1 .. T``) are made without a host synchronization through
``torch._assert_async``: on CPU tensors a bad value raises `DeviceCheckError` (a ``ValueError``)
at once; on CUDA it is a device-side assert, reported at the next synchronization.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _native
from ._backend import Dispatch, as_float32, resolve_backend
from ._checks import DeviceCheckError, check_lengths_tensor, device_check, is_int
from ._tree_mask import pack_tree_mask
from ._types import FLOAT_DTYPES


def _check_ragged_attention_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None
                                   ) -> tuple[int, int, int, int, int, int]:
    """Host-side checks of `ragged_attention`'s arguments (ValueError naming the argument, with
    expected and actual values); return ``(B, T, Hq, D, Lmax, Hkv)``."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "[B, T, Hq, D]" if name == "q" else "[B, Lmax, Hkv, D]"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {list(t.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    B, T, Hq, D = q.shape
    if min(B, T, Hq, D) < 1:
        raise ValueError(f"q must have B, T, Hq, D >= 1, got shape {list(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, "
                         f"got {list(v_cache.shape)}")
    Bk, Lmax, Hkv, Dk = k_cache.shape
    if Bk != B:
        raise ValueError(f"k_cache must have batch size {B} like q, got shape {list(k_cache.shape)}")
    if Dk != D:
        raise ValueError(f"k_cache must have head_dim {D} like q, got shape {list(k_cache.shape)}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"q's heads Hq={Hq} must be a multiple of k_cache's heads Hkv={Hkv}")
    if Lmax < T:
        raise ValueError(f"k_cache must hold at least T={T} positions, got Lmax={Lmax}")
    on = f"{q.device} like q"  # formatted once: this runs on every call
    check_lengths_tensor("cache_seqlens", cache_seqlens, B, q.device, on=on)
    if q_seqlens is not None:
        check_lengths_tensor("q_seqlens", q_seqlens, B, q.device, on=on)
    return B, T, Hq, D, Lmax, Hkv


def _check_ragged_attention_lengths(cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None,
                                    T: int, Lmax: int, min_seqlen: int | None = None) -> None:
    """Device-side (sync-free) check of the length values; see `device_check`. ``min_seqlen``:
    a host lower bound on ``cache_seqlens`` to check too (`RaggedAttentionPlan`)."""
    low = "q_seqlens" if q_seqlens is not None else f"T={T}"
    if min_seqlen is not None:
        low = f"max({low}, min_seqlen={min_seqlen})"
    cache_message = (f"cache_seqlens must lie in {low}..Lmax={Lmax} for every row (it counts the new "
                     f"tokens, already in the cache)")
    q_message = f"q_seqlens must lie in 1..T={T} for every row"
    if q_seqlens is None:
        low_bound = T if min_seqlen is None else max(T, min_seqlen)
        device_check(((cache_seqlens >= low_bound) & (cache_seqlens <= Lmax)).all(), cache_message)
        return
    q_ok = (q_seqlens >= 1) & (q_seqlens <= T)
    cache_ok = (cache_seqlens >= q_seqlens) & (cache_seqlens <= Lmax)
    if min_seqlen is not None:
        cache_ok &= cache_seqlens >= min_seqlen
    try:  # one check on the hot path; on CPU a failure is then attributed to its argument
        device_check((q_ok & cache_ok).all(), f"{q_message}; {cache_message}")
    except DeviceCheckError:
        device_check(q_ok.all(), q_message)
        device_check(cache_ok.all(), cache_message)
        raise


class TorchMasks(NamedTuple):
    """What the CPU path's scores need beyond the lengths (`RaggedAttentionPlan.torch_masks`).

    - ``score_keep`` [B, 1, T, 1, Lmax] int32: all ones (-1) on the keys query t of row b sees,
      0 elsewhere; ANDed into the scores' bits, it turns every hidden score (NaN included: keys
      beyond a row's length may hold anything) into +0.0;
    - ``score_bias`` [B, 1, T, 1, Lmax] float32: 0 on visible keys, -inf on hidden ones, added next
      (an AND and an add are cheaper on CPU than a broadcast ``masked_fill_``);
    - ``padding`` [B, 1, T, 1, 1] bool: query rows past q_seqlens (None without q_seqlens or with
      T = 1).
    """

    score_keep: torch.Tensor
    score_bias: torch.Tensor
    padding: torch.Tensor | None


_NEG_INF_BITS = -(1 << 23)  # 0xFF800000: float32 -inf as an int32


class RaggedAttentionPlan:
    """The part of `ragged_attention` that depends only on the lengths, made once and shared.

    Every layer of one forward pass attends with the same ``cache_seqlens`` and ``q_seqlens``;
    a plan checks their values once (on the device, no host sync) and builds the CPU path's masks
    once, instead of once per layer (FlashInfer's plan / run split). The plan keeps private copies
    of the lengths; calls pass them back as ``plan.cache_seqlens`` / ``plan.q_seqlens``::

        plan = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, max_len=Lmax)
        for layer in range(num_layers):
            out = ragged_attention(q, k_cache[layer], v_cache[layer], plan.cache_seqlens,
                                   plan.q_seqlens, plan=plan)

    Args:
        cache_seqlens: [B] integer tensor, as in `ragged_attention`.
        q_seqlens: [B] integer tensor or None, as in `ragged_attention`.
        num_queries: T, the query length of the calls.
        max_len: Lmax, the cache length of the calls.
        min_seqlen: an int <= every row's ``cache_seqlens``, when the caller knows one on the host
            (checked on the device with the lengths). The CPU path multiplies V's first
            ``min_seqlen`` positions in place (when they hold 1 MiB of V or more,
            `_IN_PLACE_MIN_BYTES`) and zeroes only the rest beyond each length; when it
            equals ``max_len`` (no row has keys beyond its length: a batch of one row whose cache
            view ends at its length, as the decoding loops pass it), nothing is copied, and with
            T = 1 no mask is applied at all.

    Raises:
        ValueError: bad shapes or dtypes (host), or out-of-range values (`DeviceCheckError` on
            CPU, a device assert on CUDA), as `ragged_attention` would.
    """

    def __init__(self, cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None = None, *,
                 num_queries: int, max_len: int, min_seqlen: int | None = None,
                 sliding_window: int | None = None, tree_mask: torch.Tensor | None = None) -> None:
        if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
            raise ValueError(f"cache_seqlens must be a [B] integer tensor, got "
                             f"{getattr(cache_seqlens, 'shape', type(cache_seqlens).__name__)}")
        for name, value in (("num_queries", num_queries), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_len < num_queries:
            raise ValueError(f"max_len={max_len} must be >= num_queries={num_queries}")
        if min_seqlen is not None and (not is_int(min_seqlen) or not 1 <= min_seqlen <= max_len):
            raise ValueError(f"min_seqlen must be None or an int in 1..max_len={max_len}, got {min_seqlen!r}")
        B, device = cache_seqlens.shape[0], cache_seqlens.device
        check_lengths_tensor("cache_seqlens", cache_seqlens, B, device, on=str(device))
        if q_seqlens is not None:
            check_lengths_tensor("q_seqlens", q_seqlens, B, device, on=f"{device} like cache_seqlens")
        _check_sliding_window(sliding_window)
        _check_tree_mask(tree_mask, B, num_queries, device, _hiding_window(sliding_window, max_len))
        # Private copies: the masks are built from these values once, so they must not change.
        self._setup(cache_seqlens.clone(), None if q_seqlens is None else q_seqlens.clone(), num_queries, max_len,
                    None if min_seqlen is None else int(min_seqlen), sliding_window,
                    None if tree_mask is None else tree_mask.clone())

    @classmethod
    def _for_one_call(cls, cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None, num_queries: int,
                      max_len: int, sliding_window: int | None, tree_mask: torch.Tensor | None
                      ) -> RaggedAttentionPlan:
        """The plan `ragged_attention` makes for itself when given none, from arguments it has
        already checked: used by that call only, so it needs no private copies."""
        plan = cls.__new__(cls)
        plan._setup(cache_seqlens, q_seqlens, num_queries, max_len, None, sliding_window, tree_mask)
        return plan

    def _setup(self, cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None, num_queries: int,
               max_len: int, min_seqlen: int | None, sliding_window: int | None,
               tree_mask: torch.Tensor | None) -> None:
        B = cache_seqlens.shape[0]
        _check_ragged_attention_lengths(cache_seqlens, q_seqlens, num_queries, max_len, min_seqlen)
        if tree_mask is not None:  # every real query sees itself, so none attends to nothing
            diagonal = tree_mask.diagonal(dim1=1, dim2=2)                               # [B, T]
            if q_seqlens is not None:
                diagonal = diagonal | (torch.arange(num_queries, device=diagonal.device) >= q_seqlens.view(B, 1))
            device_check(diagonal.all(), "tree_mask must be True on the diagonal (each new token sees itself) "
                                         "for every row's first q_seqlens queries")
        self.cache_seqlens, self.q_seqlens, self.tree_mask = cache_seqlens, q_seqlens, tree_mask
        self._tree_bits: torch.Tensor | None = None
        self._kernel_inputs: tuple | None = None
        self.batch_size, self.num_queries, self.max_len = B, num_queries, max_len
        self.min_seqlen = min_seqlen or 0  # positions below it hold keys in every row
        self.sliding_window = _hiding_window(sliding_window, max_len)
        self._masks: TorchMasks | None = None
        self._value_keep: torch.Tensor | None = None

    @property
    def full(self) -> bool:
        """Whether every row's keys reach the end of the cache view (``min_seqlen == max_len``)
        and each query sees all of them up to its own (no sliding window or tree hides any)."""
        return self.min_seqlen == self.max_len and self.sliding_window is None and self.tree_mask is None

    def check_call(self, cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None, T: int, Lmax: int,
                   sliding_window: int | None = None, tree_mask: torch.Tensor | None = None) -> None:
        """Raise ValueError unless a call's lengths, tree mask, shapes and window are the ones
        this plan was made for."""
        if cache_seqlens is not self.cache_seqlens or q_seqlens is not self.q_seqlens:
            raise ValueError("plan was made for other cache_seqlens / q_seqlens tensors: pass "
                             "plan.cache_seqlens and plan.q_seqlens")
        if tree_mask is not self.tree_mask:
            raise ValueError("plan was made for another tree_mask: pass plan.tree_mask (None for a plan made "
                             "without one)")
        if (T, Lmax) != (self.num_queries, self.max_len):
            raise ValueError(f"plan was made for T={self.num_queries}, Lmax={self.max_len}; "
                             f"got q with T={T} and a cache with Lmax={Lmax}")
        if _hiding_window(sliding_window, Lmax) != self.sliding_window:
            raise ValueError(f"plan was made for sliding_window={self.sliding_window}; the call has "
                             f"sliding_window={sliding_window}")

    def torch_masks(self) -> TorchMasks:
        """The CPU path's score masks (`TorchMasks`), built on the first call."""
        if self._masks is None:
            B, T, Lmax, device = self.batch_size, self.num_queries, self.max_len, self.cache_seqlens.device
            n = T if self.q_seqlens is None else self.q_seqlens.view(B, 1)
            steps = torch.arange(T, device=device)
            # Query t of row b sees keys 0 .. last[b, t]. Padding rows (t >= n) reach past the
            # row's length (possibly NaN there); they are zeroed at the end.
            last = self.cache_seqlens.view(B, 1) - n + steps                           # [B, T]
            keys = torch.arange(Lmax, device=device)
            visible = keys <= last.view(B, 1, T, 1, 1)
            if self.sliding_window is not None:  # and only the window's last keys
                visible &= keys > (last - self.sliding_window).view(B, 1, T, 1, 1)
            if self.tree_mask is not None:  # the keys before the new tokens, then the tree's
                visible = self._tree_visible(n, keys).view(B, 1, T, 1, Lmax)
            score_keep = visible.to(torch.int32).neg_().view(B, 1, T, 1, Lmax)
            score_bias = torch.bitwise_not(score_keep).bitwise_and_(_NEG_INF_BITS).view(torch.float32)
            # With T = 1 every row has its one query (q_seqlens lies in 1..T): nothing to zero.
            padding = None if self.q_seqlens is None or T == 1 else (steps >= n).view(B, 1, T, 1, 1)
            self._masks = TorchMasks(score_keep, score_bias, padding)
        return self._masks

    def _tree_visible(self, n: torch.Tensor | int, keys: torch.Tensor) -> torch.Tensor:
        """[B, T, Lmax] bool: query t of row b sees key l if l lies before the row's n new tokens
        (first at ``start = cache_seqlens - n``), or if it is new token j = l - start, a valid
        key, and ``tree_mask[b, t, j]``."""
        B, T, Lmax = self.batch_size, self.num_queries, self.max_len
        start = self.cache_seqlens.view(B, 1) - n                                      # [B, 1]
        j = keys - start                                                                # [B, Lmax]
        in_tree = self.tree_mask.gather(2, j.clamp(0, T - 1).view(B, 1, Lmax).expand(B, T, Lmax))
        new_key = (j >= 0) & (keys < self.cache_seqlens.view(B, 1))
        return torch.where(new_key.view(B, 1, Lmax), in_tree, (j < 0).view(B, 1, Lmax))

    def tree_bits(self) -> torch.Tensor:
        """The tree mask packed as the Triton kernel reads it (`pack_tree_mask`), packed on the
        first call; the plan must have a tree mask."""
        if self._tree_bits is None:
            self._tree_bits = pack_tree_mask(self.tree_mask)
        return self._tree_bits

    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``cache_seqlens``, ``q_seqlens`` (int64) and the tree mask (bool, one byte each) as
        ``attention.c`` reads them: contiguous, made on the first call and shared by the layers."""
        if self._kernel_inputs is None:
            self._kernel_inputs = tuple(None if x is None else x.contiguous() for x in (
                self.cache_seqlens.to(torch.int64), None if self.q_seqlens is None else self.q_seqlens.to(torch.int64),
                self.tree_mask))
        return self._kernel_inputs

    def value_keep(self) -> torch.Tensor:
        """[B, 1, Lmax, 1] int32: all ones (-1) on each row's valid keys, 0 beyond (the CPU path's
        mask for zeroing V by a bitwise AND), built on the first call. When the score masks were
        built first, without a window, and T = 1 or ``q_seqlens`` is None, it is a view of their ``score_keep``
        (not contiguous for T > 1); neither is ever written to."""
        if self._value_keep is None:
            B, Lmax = self.batch_size, self.max_len
            reusable = self.num_queries == 1 or self.q_seqlens is None
            if self._masks is not None and reusable and self.sliding_window is None and self.tree_mask is None:
                # Each row's last query sees exactly its valid keys: its score mask is this mask
                # (not with a window, which hides the first keys from the last query only, nor
                # with a tree, which may hide new tokens from it).
                self._value_keep = self._masks.score_keep[:, :, -1].view(B, 1, Lmax, 1)
            else:
                valid = torch.arange(Lmax, device=self.cache_seqlens.device) < self.cache_seqlens.view(B, 1)
                self._value_keep = valid.to(torch.int32).neg_().view(B, 1, Lmax, 1)
        return self._value_keep


def _times_cache(a: torch.Tensor, cache: torch.Tensor, *, transposed: bool, alpha: float = 1.0) -> torch.Tensor:
    """``alpha * a @ C`` per KV head for ``a`` [B, Hkv, M, K] float32 and C a head's [Lmax, D]
    slice of ``cache`` [B, Lmax, Hkv, D] float32 (its transpose when ``transposed``: ``Q K^T``),
    reading the cache in place: one batched GEMM when rows and heads merge into one batch
    dimension (one row, or head-major storage as `KVCache` keeps it), else one per head (merging
    would copy the cache; torch's CPU bmm over a batch that does not merge falls back to a
    per-row loop). ``alpha`` is the GEMM's own factor (``baddbmm`` with ``beta=0`` ignores its
    input: an uninitialized 0-d tensor, or the output), so no scaled copy of ``a`` is made.
    Returns [B, Hkv, M, Lmax or D], contiguous."""
    B, H, M, _ = a.shape
    _, Lmax, _, D = cache.shape
    N = Lmax if transposed else D
    s_b, s_l, s_h, s_d = cache.stride()
    if B == 1 or s_b == H * s_h:
        heads = cache.as_strided((B * H, Lmax, D), (s_h, s_l, s_d))
        a, heads = a.reshape(B * H, M, -1), heads.transpose(1, 2) if transposed else heads
        if alpha == 1.0:  # bmm has less overhead than baddbmm on small CPU products
            return torch.bmm(a, heads).view(B, H, M, N)
        return torch.baddbmm(a.new_empty(()), a, heads, beta=0, alpha=alpha).view(B, H, M, N)
    out = a.new_empty(B, H, M, N)
    for h in range(H):
        head = cache[:, :, h]
        torch.baddbmm(out[:, h], a[:, h], head.transpose(1, 2) if transposed else head, beta=0, alpha=alpha,
                      out=out[:, h])
    return out


# On CPU, V is read in chunks of batch rows of about this size per torch thread, each zeroed
# beyond its lengths into a scratch buffer and multiplied at once, so the fp32 copy is read back
# from the core's cache rather than from memory: a fraction of a core's L2, leaving room for the
# probabilities and the output (see docs/performance.md for the sizes compared). fp16 / bf16
# caches are first widened to fp32 whole. The chunks change which rows share a bmm, so results
# may differ in the last bits between thread counts.
_V_CHUNK_BYTES = 1 << 19


# The positions every row holds (a plan's min_seqlen) are multiplied in place only when they hold
# at least this many bytes of fp32 V: with fewer, the second GEMM costs more than the copy it saves
# (measurements in docs/performance.md).
_IN_PLACE_MIN_BYTES = 1 << 20


def _probs_times_values(probs: torch.Tensor, v_cache: torch.Tensor, plan: RaggedAttentionPlan) -> torch.Tensor:
    """``probs @ V`` per KV head for ``probs`` [B, Hkv, M, Lmax] (exactly 0 on each row's keys
    beyond its length, except in padding query rows, which are zeroed afterwards) and ``v_cache``
    [B, Lmax, Hkv, D]. What lies beyond a row's length is never multiplied: a NaN there would
    survive its zero weight. The positions below the plan's ``min_seqlen`` (valid in every row)
    are multiplied in place when they are many (`_IN_PLACE_MIN_BYTES`); from there on, V's
    entries beyond each length are zeroed by a bitwise AND (exact for every valid value, and
    much cheaper on CPU than torch.where) into a head-major scratch buffer, chunk by chunk, and
    multiplied by one GEMM per chunk. Returns [B, Hkv, M, D] float32.

    ``F.embedding_bag`` (weighted sums of V's rows, read in place) is not used for this: with
    MKL, it slowed down every small-N GEMM that followed it in the same process (all of a model's
    matmuls) until a larger GEMM ran; see docs/performance.md.
    """
    B, Lmax, Hkv, D = v_cache.shape
    M = probs.shape[2]
    v = as_float32(v_cache)
    shared = plan.min_seqlen  # positions every row holds
    if shared == Lmax:  # no row has anything beyond its length: V is multiplied as it lies
        return _times_cache(probs, v, transposed=False)
    if B * shared * Hkv * D * 4 < _IN_PLACE_MIN_BYTES:
        shared = 0
    out, keep = None, plan.value_keep()                                         # [B, 1, Lmax, 1]
    if shared:  # the shared positions in place; the tail from here on
        out = _times_cache(probs[..., :shared], v[:, :shared], transposed=False)
        probs, v, keep = probs[..., shared:], v[:, shared:], keep[:, :, shared:]
    tail = Lmax - shared
    v_bits = v.view(torch.int32).transpose(1, 2)                                # [B, Hkv, tail, D]
    chunk = B
    if v_cache.is_cpu:
        chunk = min(B, max(1, _V_CHUNK_BYTES * torch.get_num_threads() // (Hkv * tail * D * 4)))
    if chunk == B:  # one chunk: no slicing
        kept = torch.bitwise_and(v_bits, keep, out=v_bits.new_empty(B, Hkv, tail, D)).view(torch.float32)
        p, kept = probs.reshape(B * Hkv, M, tail), kept.view(B * Hkv, tail, D)
        if out is None:
            return torch.bmm(p, kept).view(B, Hkv, M, D)
        out.view(B * Hkv, M, D).baddbmm_(p, kept)  # added to the in-place product of the shared positions
        return out
    out = probs.new_empty(B, Hkv, M, D) if out is None else out
    scratch = v_bits.new_empty(chunk, Hkv, tail, D)
    for start in range(0, B, chunk):
        n = min(chunk, B - start)
        kept = torch.bitwise_and(v_bits[start:start + n], keep[start:start + n], out=scratch[:n])
        p = probs[start:start + n].reshape(n * Hkv, M, tail)
        rows = out[start:start + n].view(n * Hkv, M, D)
        if shared:  # added to the in-place product of the shared positions
            rows.baddbmm_(p, kept.view(torch.float32).view(n * Hkv, tail, D))
        else:
            torch.bmm(p, kept.view(torch.float32).view(n * Hkv, tail, D), out=rows)
    return out


def _ragged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None, *, scale: float,
                            sliding_window: int | None, tree_mask: torch.Tensor | None,
                            plan: RaggedAttentionPlan) -> torch.Tensor:
    """Vectorized, sync-free CPU path (works on any device). Arguments as in `ragged_attention`;
    the lengths, the window and the tree mask are read through ``plan`` (made for them)."""
    B, T, Hq, D = q.shape
    Lmax, Hkv = k_cache.shape[1], k_cache.shape[2]
    if (B * T * Hq * Lmax <= _FEW_QUERIES_MAX_WORK and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.device.type == "cpu" and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1):
        library = _native.library()
        if library is not None:
            return _few_queries(library, q, k_cache, v_cache, scale, plan)
    G = Hq // Hkv
    # With every row full (`RaggedAttentionPlan` min_seqlen) and one query, it sees every key.
    masks = None if plan.full and T == 1 else plan.torch_masks()
    # Packed rows r = t * G + g of (row b, KV head h): its G query heads times the row's T queries.
    if T == 1:
        q_packed = as_float32(q).reshape(B, Hkv, G, D)
    else:
        q_packed = as_float32(q).view(B, T, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, T * G, D)
    scores = _times_cache(q_packed, as_float32(k_cache), transposed=True, alpha=scale).view(B, Hkv, T, G, Lmax)
    if masks is not None:
        # Hidden keys get -inf (their bits ANDed to +0.0, then the bias added): also the NaN
        # scores of NaN keys beyond a row's length.
        scores.view(torch.int32).bitwise_and_(masks.score_keep)
        scores.add_(masks.score_bias)
    probs = scores.softmax(-1)
    out = _probs_times_values(probs.view(B, Hkv, T * G, Lmax), v_cache, plan)   # [B, Hkv, T * G, D]
    if T == 1:
        out = out.view(B, 1, Hq, D)
    else:
        out = out.view(B, Hkv, T, G, D)
        if masks.padding is not None:  # T > 1: the masks were built
            out.masked_fill_(masks.padding, 0.0)
        out = out.transpose(1, 2).reshape(B, T, Hq, D)
    return out if q.dtype == torch.float32 else out.to(q.dtype)  # a no-op .to still costs a dispatch


# Up to this many rows x queries x heads x cache positions the CPU path runs attention.c, which
# computes each query alone; past it the torch ops' batched GEMMs, which read each key once for
# the queries and heads that share it, are faster at most shapes with several queries per row
# (docs/performance.md, "The C kernel for a few queries").
_FEW_QUERIES_MAX_WORK = 1 << 17


def _few_queries(library, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 plan: RaggedAttentionPlan) -> torch.Tensor:
    """`_ragged_attention_torch` through ``attention.c`` (float32 CPU tensors, the caches with
    equal strides and contiguous head dims; the plan has checked the lengths, and the kernel reads
    no cache for a row whose lengths are out of range, should a check be deferred)."""
    B, T, Hq, D = q.shape
    Lmax, Hkv = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    scratch = q.new_empty(threads * (Lmax + 16))
    cache_seqlens, q_seqlens, tree = plan.kernel_inputs()
    sb, sl, sh, _ = k_cache.stride()
    library.ragged_attention_few_queries(
        q.data_ptr(), B, T, Hq, D, k_cache.data_ptr(), v_cache.data_ptr(), sb, sl, sh, Hkv, Lmax,
        cache_seqlens.data_ptr(), 0 if q_seqlens is None else q_seqlens.data_ptr(), plan.sliding_window or 0,
        0 if tree is None else tree.data_ptr(), scale, out.data_ptr(), scratch.data_ptr(), threads)
    return out


_RAGGED_ATTENTION = Dispatch(
    reference="specdec_kernels.reference.attention:ragged_attention",
    torch=_ragged_attention_torch,
    triton="specdec_kernels.kernels.attention:ragged_attention_triton",
)


def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None = None, *,
                     scale: float | None = None, sliding_window: int | None = None,
                     tree_mask: torch.Tensor | None = None, backend: str = "auto",
                     plan: RaggedAttentionPlan | None = None) -> torch.Tensor:
    """Causal GQA attention of T new queries per row over a ragged KV cache.

    Query i of row b sits at position ``cache_seqlens[b] - q_seqlens[b] + i`` and attends to keys
    ``0 .. position`` of row b (causal, bottom-right aligned), or with ``sliding_window`` W to the
    last W of them, ``position - W + 1 .. position`` (Mistral's and Gemma's local layers). Keys at
    or beyond ``cache_seqlens[b]`` are never used, whatever they hold (NaN included).

    With a ``tree_mask`` the new tokens need not form a chain: query i sees every key before the
    row's new tokens and new token j iff ``tree_mask[b, i, j]`` (a token tree's ancestors, or
    any other pattern: SpecInfer / Medusa / EAGLE trees, lookahead decoding's branches).

    Args:
        q: [B, T, Hq, D] float32 / float16 / bfloat16: T new query tokens per row (padded when a
            row has fewer).
        k_cache, v_cache: [B, Lmax, Hkv, D], same dtype and device as ``q``, Hq = G * Hkv for
            any G >= 1 (query head j reads KV head j // G).
        cache_seqlens: [B] integer: valid keys in row b, INCLUDING its new tokens (already
            appended), in ``q_seqlens[b] .. Lmax``.
        q_seqlens: [B] integer in ``1 .. T``: real queries per row; None means T for every row.
        scale: softmax scale, default ``1 / sqrt(D)``.
        sliding_window: W >= 1, the most keys a query sees (itself included), or None for all.
        tree_mask: [B, T, T] bool on ``q``'s device, or None (causal among the new tokens):
            which of its row's new tokens each query sees (their keys are the last
            ``q_seqlens[b]`` of the row's prefix, in order; columns ``j >= q_seqlens[b]`` are
            ignored). Must be True on the diagonal of every real query (checked on the device).
            Not with a ``sliding_window`` that hides keys (a tree token's distance to the keys
            before it is its depth, which the mask does not give).
        backend: ``"auto"`` (Triton on CUDA for head dims 64, 80, 96 and 128, torch elsewhere),
            ``"reference"``, ``"torch"`` or ``"triton"``.
        plan: a `RaggedAttentionPlan` for these ``cache_seqlens`` / ``q_seqlens`` (the same
            tensors) and this window, shared by calls with the same lengths; None makes one for
            this call.

    Returns:
        [B, T, Hq, D] in ``q.dtype`` (accumulated in float32); rows ``i >= q_seqlens[b]`` are zero.

    Raises:
        ValueError: a shape, head count, dtype or device mismatch, naming the argument; on CPU
            also out-of-range lengths or a tree mask's missing diagonal (`DeviceCheckError`); on
            CUDA those are device asserts.

    Example::

        # Row 0 verifies a tree: token 0, then two children of it (1 and 2), each seeing only
        # its own ancestors among the new tokens.
        tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
        out = ragged_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=tree)  # q: [1, 3, Hq, D]
    """
    _, T, _, D, Lmax, _ = _check_ragged_attention_shapes(q, k_cache, v_cache, cache_seqlens, q_seqlens)
    backend = resolve_backend(backend, q.device, head_dim=D)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")
    _check_sliding_window(sliding_window)
    if plan is not None:
        if not isinstance(plan, RaggedAttentionPlan):
            raise ValueError(f"plan must be a RaggedAttentionPlan or None, got {type(plan).__name__}")
        plan.check_call(cache_seqlens, q_seqlens, T, Lmax, sliding_window, tree_mask)
    if plan is None:  # checks the lengths' values, whatever the backend
        _check_tree_mask(tree_mask, q.shape[0], T, q.device, _hiding_window(sliding_window, Lmax))
        plan = RaggedAttentionPlan._for_one_call(cache_seqlens, q_seqlens, T, Lmax, sliding_window, tree_mask)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return _RAGGED_ATTENTION[backend](q, k_cache, v_cache, cache_seqlens, q_seqlens, scale=scale,
                                      sliding_window=plan.sliding_window, tree_mask=tree_mask, plan=plan)


def _hiding_window(sliding_window: int | None, max_len: int) -> int | None:
    """The window, or None where it hides nothing (at least as long as the cache view)."""
    return sliding_window if sliding_window is not None and sliding_window < max_len else None


def _check_sliding_window(sliding_window) -> None:
    if sliding_window is not None and (not is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def _check_tree_mask(tree_mask, batch: int, num_queries: int, device: torch.device, window: int | None) -> None:
    """Host-side checks of a ``tree_mask`` argument (its diagonal is checked on the device)."""
    if tree_mask is None:
        return
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool:
        got = tree_mask.dtype if isinstance(tree_mask, torch.Tensor) else type(tree_mask).__name__
        raise ValueError(f"tree_mask must be a bool tensor [B, T, T] or None, got {got}")
    if tuple(tree_mask.shape) != (batch, num_queries, num_queries):
        raise ValueError(f"tree_mask must have shape [B, T, T] = {[batch, num_queries, num_queries]}, got "
                         f"{list(tree_mask.shape)}")
    if tree_mask.device != device:
        raise ValueError(f"tree_mask must be on {device} like q, got {tree_mask.device}")
    if window is not None:
        raise ValueError(f"tree_mask cannot be combined with sliding_window={window}, which hides keys of "
                         "this cache view: a tree token's distance to the keys before it is its depth, "
                         "which the mask does not give")

