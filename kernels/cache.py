"""Triton kernels of the KV cache: appends at each row's own length, and compaction.

Append: one program per (new token t, KV head h, row b) copies one [D] vector of K and of V to
position ``lengths[b] + t``. Tokens ``t >= q_seqlens[b]`` and positions at or beyond ``max_len``
are masked off (nothing loaded, nothing stored), so an overflowing append never corrupts the
cache; the caller reports it with a device-side assert.

Compaction (`KVCache.compact`): one program per (KV head h, row b) moves the row's kept entries
in order, one [D] vector of K and of V at a time; entries already in place are not touched.

No host synchronization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels._backend import TRITON_HEAD_DIMS as HEAD_DIMS
from specdec_kernels._backend import on_input_device

from .registry import KernelSpec, register, torch_dtype_to_triton


@triton.jit(do_not_specialize=["has_q_seqlens", "T", "max_len"])  # launched = registered (see attention)
def _kv_append_kernel(
    k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, lengths_ptr, q_seqlens_ptr, has_q_seqlens, T, max_len,
    stride_kcb, stride_kcl, stride_kch, stride_vcb, stride_vcl, stride_vch,
    stride_knb, stride_knt, stride_knh, stride_vnb, stride_vnt, stride_vnh,
    D: tl.constexpr, BD: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    n = tl.load(q_seqlens_ptr + i_b, mask=has_q_seqlens != 0, other=T).to(tl.int32)
    position = tl.load(lengths_ptr + i_b) + i_t
    o_d = tl.arange(0, BD)
    m = (o_d < D) & (o_d * 0 + i_t < n) & (o_d * 0 + position < max_len)
    k = tl.load(k_new_ptr + i_b * stride_knb + i_t * stride_knt + i_h * stride_knh + o_d, mask=m)
    v = tl.load(v_new_ptr + i_b * stride_vnb + i_t * stride_vnt + i_h * stride_vnh + o_d, mask=m)
    tl.store(k_cache_ptr + i_b * stride_kcb + position * stride_kcl + i_h * stride_kch + o_d, k, mask=m)
    tl.store(v_cache_ptr + i_b * stride_vcb + position * stride_vcl + i_h * stride_vch + o_d, v, mask=m)


def append_config(head_dim: int) -> dict[str, int]:
    """Block size, warps and stages for one [D] vector (shared by launcher and registry)."""
    return dict(BD=max(16, triton.next_power_of_2(head_dim)), num_warps=1, num_stages=1)


@on_input_device
def append_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  lengths: torch.Tensor, q_seqlens: torch.Tensor | None, *, plan: object = None) -> None:
    """Scatter validated ``k_new``/``v_new`` [B, T, Hkv, D] into ``k_cache``/``v_cache``
    [B, max_len, Hkv, D] (any strides with a contiguous head dim: the cache is written in place)
    at positions ``lengths[b] + t`` for ``t < q_seqlens[b]`` (one launch). ``plan``: the append's
    `AppendPlan`, passed to every backend; unused here (the kernel computes the positions)."""
    B, T, Hkv, D = k_new.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"the Triton append supports head_dim in {HEAD_DIMS}, got D={D}; "
                         "use backend='torch'")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the Triton append needs the head dim of k_cache and v_cache to be contiguous")
    k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_new, v_new))
    has_q = q_seqlens is not None
    lengths = lengths.contiguous()  # the kernel indexes [B] inputs as contiguous
    q_seqlens = q_seqlens.to(torch.int64).contiguous() if has_q else lengths
    cfg = append_config(D)
    _kv_append_kernel[(T, Hkv, B)](
        k_cache, v_cache, k_new, v_new, lengths, q_seqlens, int(has_q), T,
        k_cache.shape[1], *k_cache.stride()[:3], *v_cache.stride()[:3], *k_new.stride()[:3], *v_new.stride()[:3],
        D=D, BD=cfg["BD"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


@triton.jit(do_not_specialize=["T"])  # launched = registered (see attention)
def _kv_compact_kernel(
    k_cache_ptr, v_cache_ptr, keep_ptr, num_keep_ptr, start_ptr, T,
    stride_kcb, stride_kcl, stride_kch, stride_vcb, stride_vcl, stride_vch,
    D: tl.constexpr, BD: tl.constexpr,
):
    i_h = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    n = tl.load(num_keep_ptr + i_b)
    start = tl.load(start_ptr + i_b)
    o_d = tl.arange(0, BD)
    p_k = k_cache_ptr + i_b * stride_kcb + i_h * stride_kch + o_d
    p_v = v_cache_ptr + i_b * stride_vcb + i_h * stride_vch + o_d
    # In order: kept indices increase and are >= i, so entry i is written only after every entry
    # that reads position start + i (each thread moves its own channels, in program order).
    for i in range(0, n):
        source = tl.load(keep_ptr + i_b * T + i)
        m = (o_d < D) & (o_d * 0 + source != i)
        k = tl.load(p_k + (start + source) * stride_kcl, mask=m)
        v = tl.load(p_v + (start + source) * stride_vcl, mask=m)
        tl.store(p_k + (start + i) * stride_kcl, k, mask=m)
        tl.store(p_v + (start + i) * stride_vcl, v, mask=m)


@on_input_device
def compact_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, keep: torch.Tensor, num_keep: torch.Tensor,
                   start: torch.Tensor) -> None:
    """`KVCache.compact` of one layer for validated arguments: ``k_cache`` / ``v_cache``
    [B, max_len, Hkv, D] (contiguous head dim), ``keep`` [B, T] int64, ``num_keep`` and
    ``start`` [B] int64 (one launch)."""
    B, _, Hkv, D = k_cache.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"the Triton compaction supports head_dim in {HEAD_DIMS}, got D={D}; use backend='torch'")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the Triton compaction needs the head dim of k_cache and v_cache to be contiguous")
    keep, num_keep, start = keep.contiguous(), num_keep.contiguous(), start.contiguous()
    cfg = append_config(D)
    _kv_compact_kernel[(Hkv, B)](
        k_cache, v_cache, keep, num_keep, start, keep.shape[1], *k_cache.stride()[:3], *v_cache.stride()[:3],
        D=D, BD=cfg["BD"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def compact_layers_triton(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], keep: torch.Tensor,
                          num_keep: torch.Tensor, start: torch.Tensor) -> None:
    """`KVCache.compact` for validated arguments: `compact_triton` on each layer's buffers (one
    launch per layer)."""
    for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
        compact_triton(k_cache, v_cache, keep, num_keep, start)


def _register() -> None:
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ptr = torch_dtype_to_triton(dtype)
        for D in HEAD_DIMS:
            cfg = append_config(D)
            signature = {"k_cache_ptr": ptr, "v_cache_ptr": ptr, "k_new_ptr": ptr, "v_new_ptr": ptr,
                         "lengths_ptr": "*i64", "q_seqlens_ptr": "*i64",
                         **{n: "i32" for n in ("has_q_seqlens", "T", "max_len")},
                         **{f"stride_{t}": "i32" for t in ("kcb", "kcl", "kch", "vcb", "vcl", "vch",
                                                            "knb", "knt", "knh", "vnb", "vnt", "vnh")},
                         "D": "constexpr", "BD": "constexpr"}
            # Pointers 16-byte aligned, strides multiples of D (so of 16), as in real launches.
            aligned = tuple(n for n in signature if n.endswith("_ptr") or n.startswith("stride_"))
            register(KernelSpec(f"cache[append,{short[dtype]},D={D}]", _kv_append_kernel, signature,
                                dict(D=D, BD=cfg["BD"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                aligned=aligned))
            compact = {"k_cache_ptr": ptr, "v_cache_ptr": ptr, "keep_ptr": "*i64", "num_keep_ptr": "*i64",
                       "start_ptr": "*i64", "T": "i32",
                       **{f"stride_{t}": "i32" for t in ("kcb", "kcl", "kch", "vcb", "vcl", "vch")},
                       "D": "constexpr", "BD": "constexpr"}
            aligned = tuple(n for n in compact if n.endswith("_ptr") or n.startswith("stride_"))
            register(KernelSpec(f"cache[compact,{short[dtype]},D={D}]", _kv_compact_kernel, compact,
                                dict(D=D, BD=cfg["BD"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                aligned=aligned))


_register()
