"""Triton kernels: causal GQA attention over a ragged KV cache, split-KV with a log-sum-exp merge.

Layout of the work (flash-decoding, also for T > 1):

- One program per (split s, KV head h x row block, batch row b). The G query heads of KV head h
  and the T queries of row b are packed into one tile of G*T rows (row r = t * G + g), so each
  K/V tile is loaded once per KV head and serves every query that reads it (up to
  `max_tile_rows` packed rows; more take several row blocks).
- The split count of row b is chosen on the device from its actual length (`_num_splits`):
  at most ``max_splits`` (a host-side bound from the batch shape and the GPU size, never from a
  length), and no split shorter than ``min_chunk`` keys. Programs with ``s >= n_split(b)`` exit
  at once, as do all key blocks past the row's length.
- A row that needs one split writes its normalized output directly; a split row writes fp32
  partial outputs and log2-sum-exp values, which `_ragged_attn_merge_kernel` combines. When the
  host bound is one split (short caches or a batch that fills the GPU), the merge is not launched.
- fp32 accumulation, exp2 softmax (scale * log2(e) folded into the scores), output in the input
  dtype. Keys at or beyond a row's length are never loaded (masked loads), so whatever the cache
  holds there cannot reach the output.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from specdec_kernels._backend import TRITON_HEAD_DIMS as HEAD_DIMS
from specdec_kernels._backend import interpreter_enabled, on_input_device
from specdec_kernels._tree_mask import pack_tree_mask

from .registry import KernelSpec, register, torch_dtype_to_triton

#: Upper bound of splits per row (the merge kernel reads one block of this many partials).
MAX_SPLITS = 64
MERGE_WARPS = 4
MERGE_STAGES = 2
_LOG2E = 1.4426950408889634


@triton.jit
def _num_splits(length, max_splits, min_chunk, BN: tl.constexpr):
    """Splits of a row with ``length`` keys and the keys per split (a multiple of BN)."""
    n_split = tl.maximum(tl.minimum(max_splits, tl.cdiv(length, min_chunk)), 1)
    chunk = tl.cdiv(tl.cdiv(length, n_split), BN) * BN
    return tl.cdiv(length, chunk), chunk


# Integer arguments are never specialized (Triton would otherwise compile separate variants for
# values equal to 1, such as T in decoding, or divisible by 16): the launched kernels are exactly
# the registered, compile-checked specializations.
_FWD_INTS = ["has_q_seqlens", "tree_words", "T", "G", "num_row_blocks", "max_splits", "min_chunk", "window"]
_MERGE_INTS = ["has_q_seqlens", "T", "G", "max_splits", "min_chunk", "window"]


@triton.jit
def _first_key(length, n_q, window, BN: tl.constexpr):
    """The first key any query of a row can see, rounded down to a key block: 0 without a window
    (``window`` 0); with one, the window start of the row's first query."""
    return tl.where(window > 0, (tl.maximum(length - n_q - window + 1, 0) // BN) * BN, 0)


@triton.jit(do_not_specialize=_FWD_INTS)
def _ragged_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, o_part_ptr, lse_part_ptr, cache_seqlens_ptr, q_seqlens_ptr, tree_ptr,
    has_q_seqlens, tree_words, T, G, num_row_blocks, max_splits, min_chunk, window, scale_log2e,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh, stride_ob, stride_ot, stride_oh,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
    DOT_F32: tl.constexpr, TREE: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_h = tl.program_id(1) // num_row_blocks
    i_mb = tl.program_id(1) % num_row_blocks
    i_b = tl.program_id(2).to(tl.int64)
    Hkv = tl.num_programs(1) // num_row_blocks

    length = tl.load(cache_seqlens_ptr + i_b).to(tl.int32)
    n_q = tl.load(q_seqlens_ptr + i_b, mask=has_q_seqlens != 0, other=T).to(tl.int32)
    first = _first_key(length, n_q, window, BN)  # keys before it are outside every query's window
    n_split, chunk = _num_splits(length - first, max_splits, min_chunk, BN)
    if i_s >= n_split:
        return
    lo = first + i_s * chunk
    hi = tl.minimum(lo + chunk, length)

    o_m = i_mb * BM + tl.arange(0, BM)          # packed rows r = t * G + g
    o_t = o_m // G
    o_g = o_m % G
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_row = (o_m < G * T) & (o_t < n_q)         # real queries
    new_start = length - n_q                    # the row's first new token
    pos = tl.where(m_row, new_start + o_t, -1)  # causal limit; -1: attends to nothing
    span = tl.where(window > 0, window, 2147483647)  # the most keys a query sees (no window: all)

    o_head = i_h * G + o_g                      # query head of each packed row
    p_q = q_ptr + i_b * stride_qb + o_t[:, None] * stride_qt + o_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)

    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    p_k0 = k_ptr + i_b * stride_kb + i_h * stride_kh
    p_v0 = v_ptr + i_b * stride_vb + i_h * stride_vh
    p_tree = tree_ptr + (i_b * T + o_t) * tree_words  # [BM] each query's packed mask row
    for start in range(lo, hi, BN):
        o_n = start + tl.arange(0, BN)
        m_n = o_n < hi
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(p_k0 + o_n[:, None] * stride_kl + o_d[None, :], mask=m_kv, other=0.0)
        if DOT_F32:  # interpreter only (its bf16 dot is wrong): same rounding, fp32 product
            b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        behind = pos[:, None] - o_n[None, :]  # how far each key lies behind each query
        keep = m_n[None, :] & (behind >= 0) & (behind < span)
        if TREE:
            # New token j = key - new_start is seen iff bit j of the query's packed mask row is
            # set (the keys before the new tokens are seen by every real query, as above). A
            # block's BN keys start anywhere in a word, so they take bits from up to
            # (BN + 31) // 32 + 1 consecutive words of each row, loaded as [BM] vectors. Only the
            # blocks that reach the new tokens take this branch, so the loop over a long row's
            # cached keys does the causal kernel's work (the alternatives measured slower:
            # docs/performance.md, "Tree masks").
            if start + BN > new_start:
                j = o_n - new_start
                jj = tl.maximum(j, 0)
                first_word = tl.maximum(start - new_start, 0) // 32
                bits = tl.zeros_like(b_s.to(tl.int32))
                for w in tl.static_range((BN + 31) // 32 + 1):
                    in_row = m_row & (o_m * 0 + first_word + w < tree_words)
                    word = tl.load(p_tree + first_word + w, mask=in_row, other=0)
                    in_word = (jj // 32 == first_word + w)[None, :]
                    bits |= tl.where(in_word, (word[:, None] >> (jj % 32)[None, :]) & 1, 0)
                keep = m_row[:, None] & m_n[None, :] & ((j < 0)[None, :] | (bits != 0))
        b_s = tl.where(keep, b_s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        alpha = tl.exp2(m_i - m_new)
        b_p = tl.exp2(b_s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_v0 + o_n[:, None] * stride_vl + o_d[None, :], mask=m_kv, other=0.0)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype).to(tl.float32), b_v.to(tl.float32),
                                                input_precision="ieee")
        elif IEEE:
            acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        m_i = m_new

    has_keys = l_i > 0.0
    b_o = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if n_split == 1:
        # Padding rows (t >= n_q) are written as zeros by this, the only program of the row.
        p_o = out_ptr + i_b * stride_ob + o_t[:, None] * stride_ot + o_head[:, None] * stride_oh
        p_o += o_d[None, :]
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=(o_m < G * T)[:, None] & m_d[None, :])
    else:
        GT = G * T
        base = ((i_b * Hkv + i_h) * max_splits + i_s) * GT
        p_part = o_part_ptr + (base + o_m)[:, None] * D + o_d[None, :]
        tl.store(p_part, b_o, mask=m_row[:, None] & m_d[None, :])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_part_ptr + base + o_m, lse, mask=m_row)


@triton.jit(do_not_specialize=_MERGE_INTS)
def _ragged_attn_merge_kernel(
    out_ptr, o_part_ptr, lse_part_ptr, cache_seqlens_ptr, q_seqlens_ptr, has_q_seqlens,
    T, G, max_splits, min_chunk, window, stride_ob, stride_ot, stride_oh,
    D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
):
    i_r = tl.program_id(0)                      # packed row r = t * G + g
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    Hkv = tl.num_programs(1)
    length = tl.load(cache_seqlens_ptr + i_b).to(tl.int32)
    n_q = tl.load(q_seqlens_ptr + i_b, mask=has_q_seqlens != 0, other=T).to(tl.int32)
    n_split, chunk = _num_splits(length - _first_key(length, n_q, window, BN), max_splits, min_chunk, BN)
    if n_split == 1:                            # the forward program wrote this row already
        return
    o_t = i_r // G
    o_g = i_r % G
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_o = out_ptr + i_b * stride_ob + o_t * stride_ot + (i_h * G + o_g) * stride_oh + o_d
    if o_t >= n_q:                              # padding row
        tl.store(p_o, tl.zeros([BD], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=m_d)
        return
    o_s = tl.arange(0, BS)
    m_s = o_s < n_split
    GT = G * T
    rows = ((i_b * Hkv + i_h) * max_splits + o_s) * GT + i_r
    lse = tl.load(lse_part_ptr + rows, mask=m_s, other=float("-inf"))
    lse_max = tl.max(lse, 0)                    # finite: some split holds the query's own key
    w = tl.exp2(lse - lse_max)
    b_o = tl.load(o_part_ptr + rows[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_out = tl.sum(w[:, None] * b_o, 0) / tl.sum(w, 0)
    tl.store(p_o, b_out.to(out_ptr.dtype.element_ty), mask=m_d)


def _compiler_has_sched4reg() -> bool:
    """Whether this Triton's CUDA compiler takes the ``sched4reg`` option (added in 3.9; ROCm's
    compiler does not)."""
    if torch.version.hip is not None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "sched4reg" in CUDAOptions.__dataclass_fields__


#: Shared memory a 256-row tile at head dims 80-128 takes (compile metadata for sm_80 and sm_90;
#: `tests/test_compile.py` checks it): more than GPUs of compute capability 8.6 and 8.9 give one
#: program (99 KB), so there such heads keep 128-row tiles.
WIDE_HEAD_TILE_SHARED_BYTES = 128 * 1024
_SCHED4REG = _compiler_has_sched4reg()


def max_tile_rows(dtype: torch.dtype, head_dim: int, max_shared: int | None = None) -> int:
    """Most packed rows (G * T) one tile holds, so that K/V are read once per KV head: the largest
    tiles that compile without spills for sm_80 and sm_90 (`attention_config`). fp16 / bf16: 256
    rows at head dim 64; at head dims 80-128 also 256 where the compiler has ``sched4reg`` and
    the GPU gives a program ``max_shared`` >= `WIDE_HEAD_TILE_SHARED_BYTES` bytes (None: no
    limit), else 128. fp32: 128 rows at head dim 64, 64 at the wider heads."""
    if dtype == torch.float32:
        return 128 if head_dim == 64 else 64
    if head_dim == 64:
        return 256
    fits = max_shared is None or max_shared >= WIDE_HEAD_TILE_SHARED_BYTES
    return 256 if _SCHED4REG and fits else 128


def attention_config(dtype: torch.dtype, head_dim: int, rows: int, max_shared: int | None = None,
                     tree: bool = False) -> dict[str, Any]:
    """Block sizes, warps, stages and other compiler options (``options``, launch keywords) for
    ``rows = G * T`` packed query rows (shared by launcher and registry), on a GPU that gives a
    program ``max_shared`` bytes of shared memory (None: no limit, as on the compile check's
    sm_80 and sm_90 targets), for the kernel with a tree mask (``tree``) or without."""
    # One tile of next_pow2(rows) rows (at least 16, the smallest tl.dot), so each K/V tile is
    # loaded once per KV head, up to `max_tile_rows`; more rows take more row blocks, each
    # re-reading K/V. Every size here compiles without spills for sm_80 and sm_90 (the compile
    # check): 32 keys per step and 8 warps, except
    # - fp16 / bf16 tiles of at most 32 rows: 64 keys per step, 4 warps and 3 stages (below);
    # - fp32 tiles of 32 rows or more, whose fp32 products need 16 keys per step to stay in
    #   registers, and the widest tiles (fp32 from 64 rows, fp16 / bf16 at 256), which need 16
    #   warps;
    # - fp16 / bf16 tiles of 256 rows with heads wider than 64, which also need 16 keys per step,
    #   one stage, and LLVM's register-pressure scheduling (``sched4reg``): without it they
    #   spill 8 bytes on sm_80.
    # fp32 tiles are not software-pipelined (2 stages spilled for D = 80 and 96 on sm_80).
    # The tree mask's bits take registers too (in the key blocks that reach the new tokens):
    # without a change below, its kernel spills in fp16 / bf16 tiles of 256 rows at heads wider
    # than 64 (capped at 128 rows) and in fp32 tiles of 128 rows at head dim 64 (capped at 64)
    # and of 64 rows at the wider heads (capped at 32, with 32 keys per step and 16 warps).
    most = max_tile_rows(dtype, head_dim, max_shared)
    if tree and (dtype == torch.float32 or head_dim > 64):
        most = min(most, (64 if head_dim == 64 else 32) if dtype == torch.float32 else 128)
    BM = min(most, max(16, triton.next_power_of_2(rows)))
    fp32_wide = dtype == torch.float32 and BM >= 32
    half_wide_heads = dtype != torch.float32 and BM >= 256 and head_dim > 64
    BD = max(16, triton.next_power_of_2(head_dim))
    BN = 16 if (fp32_wide and not (tree and head_dim > 64)) or half_wide_heads else 32
    num_warps = 16 if (fp32_wide and (BM >= 64 or tree)) or BM >= 256 else 8
    num_stages = 1 if dtype == torch.float32 or half_wide_heads else 2
    if dtype != torch.float32 and BM <= 32:
        # Decoding and short verification tiles stream K/V with little math per byte: more keys
        # per step and more stages in flight keep more loads outstanding, with fewer warps
        # (the GPU measurements are in docs/performance.md).
        BN, num_warps, num_stages = 64, 4, 3
    # The Triton interpreter (3.x) computes bf16 tl.dot wrongly; there, and only there, bf16 tiles
    # are widened to fp32 right before each product (values unchanged). GPU builds never do this.
    dot_f32 = dtype == torch.bfloat16 and interpreter_enabled()
    return dict(BM=BM, BN=BN, BD=BD, IEEE=dtype == torch.float32, DOT_F32=dot_f32, num_warps=num_warps,
                num_stages=num_stages, options={"sched4reg": True} if half_wide_heads else {})


def min_split_keys(dtype: torch.dtype, rows: int, BN: int) -> int:
    """Fewest keys per split: partials (about 8 bytes per row and channel, written and read back)
    stay under ~5 % of the K/V bytes a split reads (2 * element size per key and channel)."""
    element = torch.empty((), dtype=dtype).element_size()
    keys = max(256, 80 * rows // element)
    return triton.cdiv(keys, BN) * BN


@functools.cache
def _max_shared_memory(device: torch.device) -> int | None:
    """Shared memory one program may use on ``device`` (a tensor's: CUDA ones carry their index;
    None off CUDA: the interpreter)."""
    if device.type != "cuda":
        return None
    return triton.runtime.driver.active.utils.get_device_properties(device.index)["max_shared_mem"]


def _max_splits(batch: int, programs_per_row: int, max_len: int, min_chunk: int, device: torch.device) -> int:
    """Host-side bound on splits per row, from shapes only: enough programs for ~2 waves of the GPU."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128
    want = triton.cdiv(2 * sms, batch * programs_per_row)
    return max(1, min(MAX_SPLITS, want, triton.cdiv(max_len, min_chunk)))


@on_input_device
def ragged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, q_seqlens: torch.Tensor | None, scale: float, *,
                            sliding_window: int | None = None, tree_mask: torch.Tensor | None = None,
                            max_splits: int | None = None, min_chunk: int | None = None,
                            plan: object = None) -> torch.Tensor:
    """Launch the kernels for validated inputs (see `specdec_kernels.ragged_attention`).

    Args:
        q: [B, T, Hq, D]; k_cache, v_cache: [B, Lmax, Hkv, D] (same dtype; fp32, fp16 or bf16).
        cache_seqlens, q_seqlens: [B] integer (q_seqlens may be None: T per row).
        scale: softmax scale.
        sliding_window: the most keys a query sees, or None: each row's key loop then starts at
            the key block of its first query's window (the splits cover only what is visible).
        tree_mask: [B, T, T] bool or None, as in `ragged_attention` (not with a window): read
            as bits (`specdec_kernels.attention.pack_tree_mask`), and only by the key blocks that
            reach a row's new tokens.
        plan: the op's `RaggedAttentionPlan`, passed to every backend: its packed tree mask is
            used (packed once for every layer); the kernels mask by the lengths themselves.
        max_splits: override the host-side bound on splits per row (tests force 1 or many).
        min_chunk: override the fewest keys per split (rounded up to the key block).

    Returns:
        [B, T, Hq, D] in ``q.dtype``. One launch when at most one split per row is possible,
        two (forward + merge) otherwise; no host synchronization.
    """
    B, T, Hq, D = q.shape
    Lmax, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    if D not in HEAD_DIMS:
        raise ValueError(f"backend='triton' supports head_dim in {HEAD_DIMS}, got D={D}; use backend='torch'")
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    rows = G * T
    cfg = attention_config(q.dtype, D, rows, _max_shared_memory(q.device), tree=tree_mask is not None)
    BM, BN, BD, num_warps = cfg["BM"], cfg["BN"], cfg["BD"], cfg["num_warps"]
    num_row_blocks = triton.cdiv(rows, BM)
    if min_chunk is None:
        min_chunk = min_split_keys(q.dtype, rows, BN)
    min_chunk = triton.cdiv(max(1, min_chunk), BN) * BN
    window = sliding_window or 0
    span = Lmax if not window else min(Lmax, window + T - 1 + BN)  # the most keys a row's splits cover
    if max_splits is None:
        max_splits = _max_splits(B, Hkv * num_row_blocks, span, min_chunk, q.device)
    max_splits = max(1, min(MAX_SPLITS, max_splits, triton.cdiv(span, min_chunk)))
    cache_seqlens = cache_seqlens.to(torch.int64).contiguous()  # the kernels index [B] inputs as contiguous
    has_q = q_seqlens is not None
    q_lens = q_seqlens.to(torch.int64).contiguous() if has_q else cache_seqlens  # not read when has_q is False
    has_tree = tree_mask is not None
    if has_tree:
        tree = plan.tree_bits() if plan is not None else pack_tree_mask(tree_mask)
    else:  # never read
        tree = torch.empty(1, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if max_splits > 1:
        o_part = torch.empty(B, Hkv, max_splits, rows, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, Hkv, max_splits, rows, dtype=torch.float32, device=q.device)
    else:  # never written (every row has one split); fp32 so the launch matches the registered signature
        o_part = lse_part = torch.empty(1, dtype=torch.float32, device=q.device)
    _ragged_attn_fwd_kernel[(max_splits, Hkv * num_row_blocks, B)](
        q, k_cache, v_cache, out, o_part, lse_part, cache_seqlens, q_lens, tree,
        int(has_q), tree.shape[-1], T, G, num_row_blocks, max_splits, min_chunk, window, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=D, BM=BM, BN=BN, BD=BD, IEEE=cfg["IEEE"], DOT_F32=cfg["DOT_F32"], TREE=has_tree, num_warps=num_warps,
        num_stages=cfg["num_stages"], **cfg["options"],
    )
    if max_splits > 1:
        _ragged_attn_merge_kernel[(rows, Hkv, B)](
            out, o_part, lse_part, cache_seqlens, q_lens, int(has_q), T, G, max_splits, min_chunk, window,
            out.stride(0), out.stride(1), out.stride(2),
            D=D, BD=BD, BN=BN, BS=MAX_SPLITS, num_warps=MERGE_WARPS, num_stages=MERGE_STAGES,
        )
    return out


def _register() -> None:
    strides = ("stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kl", "stride_kh",
               "stride_vb", "stride_vl", "stride_vh", "stride_ob", "stride_ot", "stride_oh")
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    # As Triton's JIT specializes real launches: torch allocations are 16-byte aligned, and every
    # stride is a multiple of D (64, 80, 96 or 128 elements), so of 16.
    pointers = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "o_part_ptr", "lse_part_ptr", "cache_seqlens_ptr",
                "q_seqlens_ptr", "tree_ptr")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ptr = torch_dtype_to_triton(dtype)
        for D, tree in ((D, tree) for D in HEAD_DIMS for tree in (False, True)):
            seen = set()
            for rows in (1, 17, 33, 65, 129):  # one packed-row count per tile size the launcher can pick
                cfg = attention_config(dtype, D, rows, tree=tree)
                if cfg["BM"] in seen:
                    continue
                seen.add(cfg["BM"])
                signature = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "out_ptr": ptr, "o_part_ptr": "*fp32",
                             "lse_part_ptr": "*fp32", "cache_seqlens_ptr": "*i64", "q_seqlens_ptr": "*i64",
                             "tree_ptr": "*i32", **{n: "i32" for n in _FWD_INTS}, "scale_log2e": "fp32",
                             **{n: "i32" for n in strides}, "D": "constexpr", "BM": "constexpr",
                             "BN": "constexpr", "BD": "constexpr", "IEEE": "constexpr", "DOT_F32": "constexpr",
                             "TREE": "constexpr"}
                constexprs = dict(D=D, BM=cfg["BM"], BN=cfg["BN"], BD=cfg["BD"], IEEE=cfg["IEEE"],
                                  DOT_F32=False, TREE=tree)
                register(KernelSpec(
                    f"attention[fwd{',tree' if tree else ''},{short[dtype]},D={D},BM={cfg['BM']},BN={cfg['BN']}]",
                    _ragged_attn_fwd_kernel, signature, constexprs, num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"], options=cfg["options"],
                    aligned=pointers + strides))
                merge_sig = {"out_ptr": ptr, "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
                             "cache_seqlens_ptr": "*i64", "q_seqlens_ptr": "*i64",
                             **{n: "i32" for n in (*_MERGE_INTS, "stride_ob", "stride_ot", "stride_oh")},
                             "D": "constexpr", "BD": "constexpr", "BN": "constexpr", "BS": "constexpr"}
                register(KernelSpec(
                    f"attention[merge,{short[dtype]},D={D},BN={cfg['BN']}]", _ragged_attn_merge_kernel,
                    merge_sig, dict(D=D, BD=cfg["BD"], BN=cfg["BN"], BS=MAX_SPLITS),
                    num_warps=MERGE_WARPS, num_stages=MERGE_STAGES,
                    aligned=("out_ptr", "o_part_ptr", "lse_part_ptr", "cache_seqlens_ptr", "q_seqlens_ptr",
                             "stride_ob", "stride_ot", "stride_oh")))


_register()
