"""A preallocated KV cache with per-row lengths, for ragged speculative decoding.

One buffer pair per layer, ``k[layer]`` and ``v[layer]`` of shape [B, max_len, Hkv, D], and one
length per row, ``lengths`` [B] int64 on the cache's device. Positions ``0 .. lengths[b] - 1`` of
row b are valid; everything beyond is scratch that `specdec_kernels.ragged_attention` never reads.

The protocol of one forward pass over T new tokens per row (``q_seqlens[b] <= T`` real ones)::

    for layer in range(num_layers):
        cache.append(layer, k_new, v_new, q_seqlens)          # writes at lengths[b] .. (no move)
        out = ragged_attention(q, cache.k[layer], cache.v[layer],
                               cache.lengths + q_seqlens, q_seqlens)
    cache.advance(q_seqlens)                                   # lengths += q_seqlens
    ...
    cache.crop(lengths_after_acceptance)                       # roll back rejected tokens

Nothing here reads a device value on the host (no synchronization), except `select` given a
boolean mask, whose result size depends on the mask's values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._backend import Dispatch, resolve_backend
from ._checks import check_lengths_tensor, device_check, is_int


def _as_lengths(name: str, value: int | torch.Tensor, batch: int, device: torch.device, most: int) -> torch.Tensor:
    """``value`` as a [batch] int64 tensor on ``device`` (an int, checked to lie in ``0 .. most``
    on the host, is broadcast; a tensor's values are the caller's device check)."""
    if not (is_int(value) or isinstance(value, torch.Tensor)):
        raise ValueError(f"{name} must be an int or a [B] integer tensor, got {type(value).__name__}")
    if is_int(value):
        if not 0 <= value <= most:
            raise ValueError(f"{name} must lie in 0..{most}, got {value}")
        return torch.full((batch,), int(value), dtype=torch.int64, device=device)
    check_lengths_tensor(name, value, batch, device, on=f"the cache's device {device}")
    return value.to(torch.int64)


@dataclass(frozen=True, eq=False)
class AppendPlan:
    """Where one forward pass's appends write (see `KVCache.plan_append`); shapes [B, T]."""

    cache: KVCache                # the cache it was made for ...
    version: int                  # ... and that cache's `version` then (its lengths since)

    num_new: int                  # T
    q_seqlens: torch.Tensor | None  # [B] int64, or None for T
    rows: torch.Tensor            # [B, T] row index of each entry
    positions: torch.Tensor       # [B, T] cache position of each entry
    gather: torch.Tensor | None   # [B, T, Hkv, D] source entry (padding repeats the last real one)
    empty: torch.Tensor | None    # [B, 1, 1, 1] bool: rows with q_seqlens = 0 (write nothing)


def _append_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  lengths: torch.Tensor, q_seqlens: torch.Tensor | None, *, plan: AppendPlan) -> None:
    """`KVCache.append` on the torch backend: one ``index_put_`` per buffer at the plan's positions
    (``lengths`` and ``q_seqlens`` are read through ``plan``, made for them)."""
    k_src, v_src = k_new, v_new
    if plan.gather is not None:
        k_src, v_src = k_new.gather(1, plan.gather), v_new.gather(1, plan.gather)
        k_src = torch.where(plan.empty, k_cache[plan.rows, plan.positions], k_src)
        v_src = torch.where(plan.empty, v_cache[plan.rows, plan.positions], v_src)
    k_cache.index_put_((plan.rows, plan.positions), k_src)
    v_cache.index_put_((plan.rows, plan.positions), v_src)


# The cache has no reference of its own: "reference" runs the torch scatter, which tests check
# against a Python model of the cache.
_APPEND = Dispatch(reference=_append_torch, torch=_append_torch, triton="specdec_kernels.kernels.cache:append_triton")


def _compact_torch(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], keep: torch.Tensor,
                   num_keep: torch.Tensor, start: torch.Tensor) -> None:
    """`KVCache.compact` on the torch backend: in each layer's buffers the kept entries gathered,
    then written at their new positions (the positions computed once for every layer). Entries
    past ``num_keep`` repeat the row's last kept one (same position, same value: ``index_put_``
    stays deterministic); a row keeping nothing writes its entry at ``start`` onto itself."""
    B, T = keep.shape
    max_len = k_caches[0].shape[1]
    last = torch.minimum(torch.arange(T, device=keep.device), (num_keep[:, None] - 1).clamp(min=0))  # [B, T]
    source = torch.where(num_keep[:, None] > 0, keep.gather(1, last), 0)
    rows = torch.arange(B, device=keep.device)[:, None].expand(B, T)
    source = (start[:, None] + source).clamp(max=max_len - 1)
    target = (start[:, None] + last).clamp(max=max_len - 1)
    for cache in (*k_caches, *v_caches):
        cache.index_put_((rows, target), cache[rows, source])


_COMPACT = Dispatch(reference=_compact_torch, torch=_compact_torch,
                    triton="specdec_kernels.kernels.cache:compact_layers_triton")


class CacheAllocationError(ValueError, MemoryError):
    """The cache's buffers could not be allocated (a ValueError naming the sizes; also a
    MemoryError, as the refusal it stands for)."""


class KVCache:
    """Per-layer K/V buffers plus one length per row; appends, crops and row selection in place.

    Args:
        num_layers: number of layers (one k/v buffer pair each).
        batch_size: rows B.
        max_len: positions per row.
        num_kv_heads: Hkv.
        head_dim: D.
        dtype: buffer dtype (float32, float16 or bfloat16).
        device: buffer device.

    Attributes:
        k, v: lists of ``num_layers`` tensors [B, max_len, Hkv, D] (zero-initialized): views of
            head-major buffers [B, Hkv, max_len, D], so not contiguous; writes through them
            land in the cache.
        lengths: [B] int64 on ``device``: valid positions per row.
        version: host-side counter, bumped by `advance`, `crop` and `select`, the only ways to
            change the lengths (an `AppendPlan` is valid for the version it was made at).
        num_layers, batch_size, max_len, num_kv_heads, head_dim, dtype, device.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("max_len", max_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        self.num_layers, self.batch_size, self.max_len = num_layers, batch_size, max_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # The device the buffers land on: "cuda" becomes "cuda:<current>", which inputs are compared with.
        self.dtype, self.device = dtype, torch.empty(0, device=device).device
        # Head-major storage [B, Hkv, max_len, D]: each (row, head) block of keys and values is
        # contiguous, so attention streams it instead of striding over the other heads.
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        try:
            self._k_heads = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self._v_heads = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        except (RuntimeError, MemoryError, OverflowError) as e:  # out of memory, or a size past torch's count
            gib = 2 * num_layers * math.prod(shape) * torch.empty(0, dtype=dtype).element_size() / 2**30
            raise CacheAllocationError(f"a KV cache of {batch_size} rows x max_len={max_len} positions needs "
                                       f"{gib:.3g} GiB on {self.device}, which could not be allocated; lower "
                                       f"batch_size or max_len ({type(e).__name__}: {e})") from e
        self._expose()
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        self.version = 0  # bumped whenever lengths or rows change: an append plan is valid for one version

    def _expose(self) -> None:
        """``k`` / ``v``: [B, max_len, Hkv, D] views of the head-major buffers."""
        self.k = [t.transpose(1, 2) for t in self._k_heads]
        self.v = [t.transpose(1, 2) for t in self._v_heads]

    def __repr__(self) -> str:
        return (f"KVCache(num_layers={self.num_layers}, batch_size={self.batch_size}, "
                f"max_len={self.max_len}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, "
                f"device={self.device})")

    def plan_append(self, num_new: int, q_seqlens: int | torch.Tensor | None = None) -> AppendPlan:
        """Where the next `append` calls (one per layer of a forward pass) write: checked once.

        The plan is valid until the lengths or rows change (`advance`, `crop`, `select`); `append`
        refuses it afterwards.

        Args:
            num_new: T, new tokens per row in ``k_new`` / ``v_new``.
            q_seqlens: [B] integer in ``0 .. T`` (or an int), default T: real new tokens per row.

        Raises:
            ValueError: bad arguments; writing past ``max_len`` raises `DeviceCheckError` (a
                ValueError) on CPU and is a device-side assert on CUDA.
        """
        if not isinstance(num_new, int) or isinstance(num_new, bool) or num_new < 1:
            raise ValueError(f"num_new must be a positive int, got {num_new!r}")
        T, B = num_new, self.batch_size
        if T > self.max_len:
            raise ValueError(f"num_new={T} new tokens per row is more than max_len={self.max_len}")
        qs = None if q_seqlens is None else _as_lengths("q_seqlens", q_seqlens, B, self.device, most=T)
        new_end = self.lengths + (T if qs is None else qs)
        in_range = (new_end <= self.max_len).all()
        if qs is not None:
            in_range = in_range & ((qs >= 0) & (qs <= T)).all()
        device_check(in_range, f"KVCache.append: writing past max_len={self.max_len} "
                               f"(lengths + q_seqlens must be <= max_len and 0 <= q_seqlens <= T={T})")
        steps = torch.arange(T, device=self.device)
        rows = torch.arange(B, device=self.device)[:, None].expand(B, T)
        if qs is None:
            positions = (self.lengths[:, None] + steps).clamp(max=self.max_len - 1)
            return AppendPlan(self, self.version, T, None, rows, positions, None, None)
        # Padding entries t >= q_seqlens[b] rewrite the row's last real entry with the same value
        # (duplicate indices with identical values keep index_put_ deterministic); a row with
        # q_seqlens = 0 writes its entries back onto themselves.
        source = torch.minimum(steps, (qs[:, None] - 1).clamp(min=0))               # [B, T]
        positions = (self.lengths[:, None] + source).clamp(max=self.max_len - 1)
        gather = source[:, :, None, None].expand(B, T, self.num_kv_heads, self.head_dim)
        return AppendPlan(self, self.version, T, qs, rows, positions, gather, (qs == 0)[:, None, None, None])

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor,
               q_seqlens: int | torch.Tensor | None = None, *, plan: AppendPlan | None = None,
               backend: str = "auto") -> None:
        """Write row b's first ``q_seqlens[b]`` new keys/values at positions ``lengths[b] ..``.

        Does not move `lengths` (every layer of one forward pass appends at the same offsets;
        call `advance` once afterwards). Entries ``t >= q_seqlens[b]`` of ``k_new``/``v_new``
        are ignored.

        Args:
            layer: layer index in ``0 .. num_layers - 1``.
            k_new, v_new: [B, T, Hkv, D] in the cache's dtype, on its device.
            q_seqlens: [B] integer in ``0 .. T`` (or an int), default T.
            plan: from `plan_append` (made once for all layers of a forward pass, with the
                same lengths); then ``q_seqlens`` must be None (the plan holds it).
            backend: ``"auto"`` (a Triton scatter on CUDA for head dims 64, 80, 96 and 128, an
                ``index_put_`` elsewhere),
                ``"torch"``, ``"triton"``; ``"reference"`` means ``"torch"`` here.

        Raises:
            ValueError: bad layer, shape, dtype or device. Writing past ``max_len`` raises
                `DeviceCheckError` (a ValueError) on CPU and is a device-side assert on CUDA;
                the Triton scatter also masks such writes, so the cache is never corrupted.
        """
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in 0..{self.num_layers - 1}, got {layer!r}")
        B, Hkv, D = self.batch_size, self.num_kv_heads, self.head_dim
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B or t.shape[2:] != (Hkv, D):
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape [B={B}, T, Hkv={Hkv}, D={D}], got {shape}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} must have the cache's dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on the cache's device {self.device}, got {t.device}")
        if k_new.shape != v_new.shape:
            raise ValueError(f"v_new must have k_new's shape {list(k_new.shape)}, got {list(v_new.shape)}")
        if plan is None:
            if k_new.shape[1] > self.max_len:
                raise ValueError(f"k_new has T={k_new.shape[1]} new tokens, more than max_len={self.max_len}")
            plan = self.plan_append(k_new.shape[1], q_seqlens)
        elif not isinstance(plan, AppendPlan):
            raise ValueError(f"plan must be an AppendPlan from plan_append or None, got {type(plan).__name__}")
        elif q_seqlens is not None:
            raise ValueError("pass q_seqlens to plan_append, not to append, when a plan is given")
        elif plan.cache is not self or plan.version != self.version:
            raise ValueError("plan was made for another cache, or before its lengths or rows changed "
                             "(advance, crop, select): make a new one with plan_append")
        elif plan.num_new != k_new.shape[1]:
            raise ValueError(f"plan was made for T={plan.num_new}; k_new has shape {list(k_new.shape)}")
        backend = resolve_backend(backend, self.device, head_dim=D)
        _APPEND[backend](self.k[layer], self.v[layer], k_new, v_new, self.lengths, plan.q_seqlens, plan=plan)

    def advance(self, q_seqlens: int | torch.Tensor) -> None:
        """``lengths += q_seqlens`` (an int or a [B] integer tensor); no data is touched.

        Moving past ``max_len`` raises `DeviceCheckError` on CPU (a device assert on CUDA).
        """
        step = _as_lengths("q_seqlens", q_seqlens, self.batch_size, self.device, most=self.max_len)
        new = self.lengths + step
        # step <= max_len first, so that a huge step cannot wrap `new` around into range.
        device_check(((step >= 0) & (step <= self.max_len) & (new <= self.max_len)).all(),
                     f"KVCache.advance: lengths would leave 0..max_len={self.max_len} (or q_seqlens < 0)")
        self.lengths.copy_(new)
        self.version += 1

    def crop(self, new_lengths: int | torch.Tensor) -> None:
        """Set ``lengths = new_lengths`` (roll back rejected tokens); no data is touched.

        ``new_lengths`` ([B] integer tensor or int) must lie in ``0 .. lengths`` row by row;
        otherwise `DeviceCheckError` on CPU (a device assert on CUDA) and nothing changes.
        """
        new = _as_lengths("new_lengths", new_lengths, self.batch_size, self.device, most=self.max_len)
        device_check(((new >= 0) & (new <= self.lengths)).all(),
                     "KVCache.crop: new_lengths must lie in 0..lengths for every row "
                     "(crop cannot grow a row)")
        self.lengths.copy_(new)
        self.version += 1

    def compact(self, keep: torch.Tensor, num_keep: torch.Tensor, *, start: torch.Tensor | None = None,
                backend: str = "auto") -> None:
        """Keep some of each row's last appended entries, moved together: the accepted path of a
        verified token tree, or lookahead decoding's accepted n-gram.

        Row b's appended entries begin at ``start[b]`` (default ``lengths[b] - T``: every row
        appended all T). Its entries ``start[b] + keep[b, i]`` for ``i < num_keep[b]`` move, in
        order, to positions ``start[b] + i`` in every layer, and ``lengths[b]`` becomes
        ``start[b] + num_keep[b]``. The Triton kernel copies no entry already in place (a kept
        prefix); the torch path rewrites each row's T entries.

        Args:
            keep: [B, T] int64: indices into each row's appended entries, strictly increasing
                over its first ``num_keep[b]`` (a path from a tree's root, nodes in topological
                order); the rest is ignored.
            num_keep: [B] integer in ``0 .. T``.
            start: [B] integer: each row's length before the append (the forward's
                ``cache.lengths`` before it ran), or None for ``lengths - T``.
            backend: ``"auto"`` (a Triton kernel on CUDA for head dims 64, 80, 96 and 128, one
                launch per layer; torch elsewhere), ``"torch"``, ``"triton"``; ``"reference"``
                means ``"torch"``.

        Raises:
            ValueError: bad shapes, dtypes or devices; out-of-range or unordered indices raise
                `DeviceCheckError` (a ValueError) on CPU and are device-side asserts on CUDA
                (checked before anything moves; no host synchronization).

        Example::

            start = cache.lengths.clone()
            model(tree_tokens, cache, tree_mask=tree)    # appends T entries per row
            cache.compact(path, path_length, start=start)  # keep the accepted path only
        """
        B = self.batch_size
        if not isinstance(keep, torch.Tensor) or keep.dim() != 2 or keep.shape[0] != B or keep.shape[1] < 1:
            raise ValueError(f"keep must be a [B={B}, T] int64 tensor, got "
                             f"{list(keep.shape) if isinstance(keep, torch.Tensor) else type(keep).__name__}")
        if keep.dtype != torch.int64 or keep.device != self.device:
            raise ValueError(f"keep must be int64 on the cache's device {self.device}, got {keep.dtype} on "
                             f"{keep.device}")
        T = keep.shape[1]
        if T > self.max_len:
            raise ValueError(f"keep has T={T} entries per row, more than max_len={self.max_len}")
        check_lengths_tensor("num_keep", num_keep, B, self.device, on=f"the cache's device {self.device}")
        if start is None:
            start = self.lengths - T
        else:
            check_lengths_tensor("start", start, B, self.device, on=f"the cache's device {self.device}")
        start, num_keep = start.to(torch.int64), num_keep.to(torch.int64)
        steps = torch.arange(T, device=self.device)
        real = steps < num_keep[:, None]
        ordered = (keep[:, 1:] > keep[:, :-1]) | ~real[:, 1:]
        in_range = (keep >= 0) & (keep < self.lengths[:, None] - start[:, None])
        device_check(((num_keep >= 0) & (num_keep <= T) & (start >= 0) & (start <= self.lengths)).all()
                     & (in_range | ~real).all() & ordered.all(),
                     f"KVCache.compact: num_keep must lie in 0..T={T}, start in 0..lengths, and each row's "
                     "first num_keep indices of keep must increase strictly within its appended entries "
                     "(start .. lengths - 1)")
        keep = torch.where(real, keep, steps)  # ignored entries stay where they are
        backend = resolve_backend(backend, self.device, head_dim=self.head_dim)
        _COMPACT[backend](self.k, self.v, keep, num_keep, start)
        self.lengths.copy_(start + num_keep)
        self.version += 1

    def select(self, rows: torch.Tensor) -> KVCache:
        """Keep only the rows ``rows`` (to drop finished sequences), IN PLACE; returns ``self``.

        Args:
            rows: [B'] int64 or int32 index tensor (any order, repeats allowed), or a [B] bool mask.
                An index tensor is sync-free; a bool mask is turned into indices with
                ``nonzero`` (one host synchronization: the new batch size depends on it).

        Every layer's buffers and `lengths` are replaced by new tensors (gathered rows);
        `batch_size` becomes B'. References to the old tensors keep the old rows.
        """
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1:
            raise ValueError(f"rows must be a 1-D index or bool tensor, got "
                             f"{list(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        if rows.device != self.device:
            raise ValueError(f"rows must be on the cache's device {self.device}, got {rows.device}")
        if rows.dtype == torch.bool:
            if rows.shape[0] != self.batch_size:
                raise ValueError(f"a bool mask rows must have shape [B] = [{self.batch_size}], "
                                 f"got {list(rows.shape)}")
            rows = rows.nonzero().squeeze(1)
        elif rows.dtype not in (torch.int64, torch.int32):  # uint8 is not taken for a mask either
            raise ValueError(f"rows must be an int64 / int32 index tensor or a bool mask, got dtype {rows.dtype}")
        else:
            device_check(((rows >= 0) & (rows < self.batch_size)).all(),
                         f"KVCache.select: rows must index 0..{self.batch_size - 1}")
        rows = rows.to(torch.int64)
        self._k_heads = [t.index_select(0, rows) for t in self._k_heads]
        self._v_heads = [t.index_select(0, rows) for t in self._v_heads]
        self._expose()
        self.lengths = self.lengths.index_select(0, rows)
        self.version += 1
        self.batch_size = int(rows.shape[0])
        return self
