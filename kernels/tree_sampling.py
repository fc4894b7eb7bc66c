"""Triton kernel of `specdec_kernels.tree_rejection_sample`: verification of a token tree, one
program per batch row.

The program walks its row's nodes in index order (topological), as the torch path does, testing
node i when its parent is the current node. Full vocabulary rows are read only where the rule
needs them (without top-k / top-p; a filter's thresholds launch reads every row first):

- **greedy** rows: the target row of each node on the accepted path (root included), once, for
  its argmax;
- **sampled** rows: the target row of a path node once for its normalizer, and only if one of its
  children is tested (a leaf's row is not read for it); the acceptance tests gather ``p(x)``.
  Deterministic children (no draft logits) keep the residual implicit: it is ``p`` with the
  rejected siblings' tokens removed, so a rejection costs a subtraction from the mass and a
  repeated token is rejected by a scan of the earlier siblings' ids. Sampled children read their
  draft row for its normalizer, and a rejection writes ``max(r - q * mass, 0)`` to a float32
  scratch row (two slots, so that a rejection leaving no mass keeps the previous residual, as the
  torch path and the reference do; no test reaches that case). The mass of deterministic
  children is kept by subtraction, where the torch path sums the residual again: they may
  differ by rounding;
- the final token of a sampled row: one pass over the last node's target row (an exponential race
  in log space, ``argmax l / T - log E`` over kept entries, the rejected siblings' tokens
  excluded), or over the scratch residual (``argmax w / E``).

Random numbers and the race follow `specdec_kernels.kernels.sampling`: node i's acceptance uniform
is counter i of the row's stream, the race's exponentials counters ``N + 1 + v``; explicit noise
(``accept`` ``[B, N]``, ``exponential`` ``[B, V]``) replaces them for exact tests. Top-k / top-p
thresholds come from `logit_thresholds_triton` (one launch before this one, when a filter is set).
Inputs are assumed checked (`tree_rejection_sample` validates them on the device first, or its
caller did): out-of-range ids are clamped, as on the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels._backend import on_input_device
from specdec_kernels._types import RejectionNoise

from .registry import KernelSpec, register, torch_dtype_to_triton
from .sampling import (
    _DTYPE_TAG,
    _FLAGS,
    _ROW_SHAPES,
    BV,
    DTYPES,
    NUM_WARPS,
    _accept_uniform,
    _any,
    _contiguous_rows,
    _merge_max,
    _prob_at,
    _race_exponential,
    _row_argmax,
    _row_args,
    _row_divisor,
    _row_inputs,
    _row_normalizer,
    _scaled,
    _temperature_args,
    logit_thresholds_triton,
)

#: Nodes handled per vector step (sibling scans, output stores; any N works).
BN = 16
#: Excluded tokens compared per vector step with a vocabulary tile (a [BV, BX] compare in registers).
BX = 4


@triton.jit
def _earlier_sibling_has(p_par, p_ids, c, i, x, V, BN: tl.constexpr):
    """1 if a node before ``i`` with parent ``c`` has token ``x`` (ids clamped to ``[0, V)``), else 0.
    Children come after their parent: the scan starts at ``c + 1``."""
    dup = i * 0
    for j0 in range(c + 1, i, BN):
        o_j = j0 + tl.arange(0, BN)
        m_j = o_j < i
        b_par = tl.load(p_par + o_j, mask=m_j, other=-2)
        b_ids = tl.minimum(tl.maximum(tl.load(p_ids + o_j, mask=m_j, other=-1), 0), V - 1)
        dup = tl.maximum(dup, _any((b_par == c) & (b_ids == x)))
    return dup


@triton.jit
def _residual_pass(p_row, p_q, src_ptr, dst_ptr, from_scratch, V, D, thr, m_t, s_t, thr_q, m_q, s_q, mass,
                   BV: tl.constexpr):
    """Write ``w = max(r - q * mass, 0)`` to ``dst_ptr`` and return its sum, where ``r`` is the
    scratch row ``src_ptr`` (``from_scratch``) or the target row's softmax, and ``q`` the draft
    row's softmax."""
    V_scr = tl.where(from_scratch != 0, V, 0)
    V_row = V - V_scr
    total = 0.0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        b_r = tl.load(src_ptr + o_v, mask=o_v < V_scr, other=0.0)
        b_l = _scaled(tl.load(p_row + o_v, mask=o_v < V_row, other=float("-inf")), D)
        b_l = tl.where(b_l >= thr, b_l, float("-inf"))
        b_r = tl.where(from_scratch != 0, b_r, tl.exp(b_l - m_t) / s_t)
        b_lq = _scaled(tl.load(p_q + o_v, mask=m_v, other=float("-inf")), D)
        b_lq = tl.where(b_lq >= thr_q, b_lq, float("-inf"))
        b_w = tl.maximum(b_r - tl.exp(b_lq - m_q) / s_q * mass, 0.0)
        tl.store(dst_ptr + o_v, b_w, mask=m_v)
        total += tl.sum(tl.where(m_v, b_w, 0.0), 0)
    return total


@triton.jit(do_not_specialize=["N", "V", "stride_tb", "stride_tk", "stride_db", "stride_dk", "use_noise", *_FLAGS,
                               "has_thr", "has_temp_rows", "temp_scalar"])
def _tree_rejection_sample_kernel(
    target_ptr,
    draft_ptr,
    ids_ptr,
    parents_ptr,
    n_ptr,
    greedy_ptr,
    temp_ptr,
    thr_t_ptr,
    thr_d_ptr,
    seed_ptr,
    accept_ptr,
    exp_ptr,
    res_ptr,
    token_ptr,
    num_acc_ptr,
    path_ptr,
    N,
    V,
    stride_tb,
    stride_tk,
    stride_db,
    stride_dk,
    use_noise,
    has_n,
    has_greedy,
    greedy_all,
    has_row_seed,
    seed_hi,
    seed_lo,
    has_thr,
    has_temp_rows,
    temp_scalar,
    HAS_DRAFT: tl.constexpr,
    BN: tl.constexpr,
    BX: tl.constexpr,
    BV: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    n, sampled, seed = _row_inputs(
        i_b, N, n_ptr, greedy_ptr, seed_ptr, use_noise, has_n, has_greedy, greedy_all, has_row_seed, seed_hi,
        seed_lo,
    )
    T, D = _row_divisor(i_b, temp_ptr, has_temp_rows, temp_scalar)
    sampled = sampled & (T != 0)
    noisy = use_noise != 0
    filtered = has_thr != 0
    p_t = target_ptr + i_b * stride_tb
    p_d = draft_ptr + i_b * stride_db
    p_ids = ids_ptr + i_b * N
    p_par = parents_ptr + i_b * N
    p_res = res_ptr + i_b * 2 * V
    p_thr = thr_t_ptr + i_b * (N + 1)

    # The walk's state: current node c (-1: the root), accepted depth, and for sampled rows the
    # current node's normalizer (read when its first child is tested) and residual mass; sampled
    # children keep the residual in scratch slot `slot` once `in_scratch`.
    c = n * 0 - 1
    depth = n * 0
    am, _ = _row_argmax(p_t, tl.where(sampled, 0, V), 1.0, float("-inf"), BV)  # greedy rows only
    has_norm = n * 0
    thr_c = float("-inf")
    m_t = float("-inf")
    s_t = 1.0
    mass = 1.0
    in_scratch = n * 0
    slot = n * 0
    for i in range(0, N):
        node = n * 0 + i
        parent = tl.load(p_par + node, mask=node < n, other=-2)
        if parent == c:
            x = tl.minimum(tl.maximum(tl.load(p_ids + node), 0), V - 1)
            p_c = p_t + (c + 1).to(tl.int64) * stride_tk   # the current node's target row
            p_q = p_d + node.to(tl.int64) * stride_dk      # this node's draft row
            accept = x == am
            if sampled:
                if has_norm == 0:
                    thr_c = tl.load(p_thr + c + 1, mask=filtered, other=float("-inf"))
                    m_t, s_t = _row_normalizer(p_c, V, D, thr_c, BV)
                    has_norm = n * 0 + 1
                p_x = _prob_at(p_c, x, x >= 0, D, thr_c, m_t, s_t)
                u_noise = tl.load(accept_ptr + i_b * N + node, mask=noisy, other=1.0)
                u = tl.where(noisy, u_noise, _accept_uniform(seed, node))
                if HAS_DRAFT:
                    thr_q = tl.load(thr_d_ptr + i_b * N + node, mask=filtered, other=float("-inf"))
                    m_q, s_q = _row_normalizer(p_q, V, D, thr_q, BV)
                    q_x = _prob_at(p_q, x, x >= 0, D, thr_q, m_q, s_q)
                    r_x = tl.load(p_res + slot * V + x, mask=in_scratch != 0, other=0.0)
                    r_x = tl.where(in_scratch != 0, r_x, p_x)
                    accept = (q_x > 0) & (u * q_x * mass <= r_x)
                    rejected = ~accept
                    if rejected:
                        dst = tl.where(in_scratch != 0, 1 - slot, 0)
                        left = _residual_pass(p_c, p_q, p_res + slot * V, p_res + dst * V, in_scratch, V, D, thr_c,
                                              m_t, s_t, thr_q, m_q, s_q, mass, BV)
                        tl.debug_barrier()  # the scratch row is read by other threads next
                        moved = left > 0  # else keep the previous residual (exact arithmetic never gets here)
                        slot = tl.where(moved, dst, slot)
                        in_scratch = tl.where(moved, 1, in_scratch)
                        mass = tl.where(moved, left, mass)
                else:
                    # The residual is p without the rejected siblings' tokens: a repeated token has none left.
                    r_x = tl.where(_earlier_sibling_has(p_par, p_ids, c, node, x, V, BN) != 0, 0.0, p_x)
                    accept = u * mass <= r_x
                    left = mass - r_x
                    mass = tl.where(~accept & (left > 0), left, mass)
            if accept:
                tl.store(path_ptr + i_b * N + depth, node.to(tl.int64))
                tl.store(token_ptr + i_b * (N + 1) + depth, x.to(tl.int64))
                depth += 1
                c = node
                p_next = p_t + (node + 1).to(tl.int64) * stride_tk
                am, _ = _row_argmax(p_next, tl.where(sampled, 0, V), 1.0, float("-inf"), BV)
                has_norm = n * 0
                mass = 1.0
                in_scratch = n * 0

    # Final token of a sampled row: a race over the scratch residual, or in log space over the
    # current node's kept entries without its (all rejected) children's tokens; the latter without
    # exclusion is the fallback when nothing else is left.
    thr_c = tl.load(p_thr + c + 1, mask=filtered & sampled, other=float("-inf"))
    p_last = p_t + (c + 1).to(tl.int64) * stride_tk
    V_s = tl.where(sampled, V, 0)
    V_scr = tl.where(in_scratch != 0, V_s, 0)
    V_row = V_s - V_scr
    V_noise = tl.where(noisy, V_s, 0)
    n_ex = tl.where((V_row == 0) | (has_norm == 0), 0, n)  # a sampled row's last node had tested children
    best_w = -1.0
    idx_w = 0
    best_l = float("-inf")
    idx_l = 0
    best_x = float("-inf")
    idx_x = 0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        b_e_noise = tl.load(exp_ptr + i_b * V + o_v, mask=o_v < V_noise, other=1.0)
        b_e = tl.where(noisy, b_e_noise, _race_exponential(seed, o_v + N + 1))
        b_w = tl.load(p_res + slot * V + o_v, mask=o_v < V_scr, other=0.0)
        s_w = tl.where(b_w > 0, b_w / b_e, -1.0)
        best_w, idx_w = _merge_max(best_w, idx_w, s_w, v0)
        b_l = _scaled(tl.load(p_last + o_v, mask=o_v < V_row, other=float("-inf")), D)
        s_l = tl.where((o_v < V_row) & (b_l >= thr_c) & (b_l > float("-inf")), b_l - tl.log(b_e), float("-inf"))
        best_l, idx_l = _merge_max(best_l, idx_l, s_l, v0)
        if not HAS_DRAFT:
            excluded = o_v < 0
            for j0 in range(c + 1, n_ex, BX):
                o_j = j0 + tl.arange(0, BX)
                m_j = o_j < n_ex
                b_par = tl.load(p_par + o_j, mask=m_j, other=-2)
                b_ids = tl.minimum(tl.maximum(tl.load(p_ids + o_j, mask=m_j, other=-1), 0), V - 1)
                b_ex = tl.where(b_par == c, b_ids, -1).to(tl.int32)
                excluded = excluded | (tl.max((o_v[:, None] == b_ex[None, :]).to(tl.int32), 1) > 0)
            best_x, idx_x = _merge_max(best_x, idx_x, tl.where(excluded, float("-inf"), s_l), v0)
    tok_race = tl.where(best_x > float("-inf"), idx_x, idx_l)
    # A scratch residual has mass > 0, so some w > 0 wins its race.
    tok = tl.where(sampled, tl.where(in_scratch != 0, idx_w, tok_race), am)

    for k0 in range(0, N + 1, BN):
        o_k = k0 + tl.arange(0, BN)
        b_tok = tl.where(o_k == depth, tok, -1).to(tl.int64)
        tl.store(token_ptr + i_b * (N + 1) + o_k, b_tok, mask=(o_k >= depth) & (o_k < N + 1))
        tl.store(path_ptr + i_b * N + o_k, tl.full([BN], -1, tl.int64), mask=(o_k >= depth) & (o_k < N))
    tl.store(num_acc_ptr + i_b, depth.to(tl.int64))



# --------------------------------------------------------------------------- specializations


def _config(dtype: torch.dtype, has_draft: bool) -> tuple[str, dict[str, object], int]:
    """Spec name, constexprs and num_warps the launcher uses."""
    return (f"tree_sampling.logits[{_DTYPE_TAG[dtype]},draft={int(has_draft)},BN={BN},BX={BX},BV={BV}]",
            dict(HAS_DRAFT=has_draft, BN=BN, BX=BX, BV=BV), NUM_WARPS)


def _signature(dtype: torch.dtype) -> dict[str, str]:
    val = torch_dtype_to_triton(dtype)
    pointers = {"target_ptr": val, "draft_ptr": val, "ids_ptr": "*i64", "parents_ptr": "*i64", "n_ptr": "*i64",
                "greedy_ptr": "*u8", "temp_ptr": "*fp32", "thr_t_ptr": "*fp32", "thr_d_ptr": "*fp32",
                "seed_ptr": "*i64", "accept_ptr": "*fp32", "exp_ptr": "*fp32", "res_ptr": "*fp32",
                "token_ptr": "*i64", "num_acc_ptr": "*i64", "path_ptr": "*i64"}
    ints = {"N": "i32", **dict.fromkeys(_ROW_SHAPES[1:], "i32"), "use_noise": "i32", **dict.fromkeys(_FLAGS, "i32"),
            "has_thr": "i32", "has_temp_rows": "i32", "temp_scalar": "fp32"}
    return {**pointers, **ints, "HAS_DRAFT": "constexpr", "BN": "constexpr", "BX": "constexpr", "BV": "constexpr"}


for _dtype in DTYPES:
    for _has_draft in (True, False):
        _name, _constexprs, _warps = _config(_dtype, _has_draft)
        _sig = _signature(_dtype)
        register(KernelSpec(_name, _tree_rejection_sample_kernel, _sig, _constexprs, num_warps=_warps,
                            aligned=tuple(k for k, v in _sig.items() if v.startswith("*"))))


# --------------------------------------------------------------------------- launcher


@on_input_device
def tree_rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None,
    *,
    temperature: torch.Tensor,
    top_k: int | None,
    top_p: float | None,
    greedy: torch.Tensor,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    noise: RejectionNoise | None = None,
    all_greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch `_tree_rejection_sample_kernel` (grid ``(B,)``), preceded by `logit_thresholds_triton`
    when a filter is set; returns ``(token_ids [B, N+1], num_accepted [B], path [B, N])``.

    Inputs as `specdec_kernels.tree_rejection_sample` takes them after its checks (``temperature``
    and ``greedy`` ``[B]`` tensors). Explicit ``noise`` must carry ``exponential`` ``[B, V]``; without
    it, uniforms and exponentials come from a counter-based RNG in registers (seeds from ``seed``,
    or drawn from ``generator``: one small launch). Sampled children use a ``[B, 2, V]`` float32
    scratch residual, allocated on every call with draft logits (``8 B V`` bytes: 311 MB at
    B = 256, V = 152k).
    """
    B, N1, V = target_logits.shape
    N, device = N1 - 1, target_logits.device
    target = _contiguous_rows(target_logits)
    has_draft = draft_logits is not None and N > 0
    draft = _contiguous_rows(draft_logits) if has_draft else target
    temp_arg, has_temp_rows, temp_scalar = _temperature_args(temperature, device)
    f32 = torch.empty(1, dtype=torch.float32, device=device)
    thr_t = thr_d = f32
    has_thr = 0
    if not all_greedy and ((top_k is not None and top_k < V) or (top_p is not None and top_p < 1.0)):
        thr_t, thr_d = logit_thresholds_triton(target, draft if has_draft else None, temperature, top_k, top_p)
        thr_d = thr_d if has_draft else f32
        has_thr = 1
    (n_arg, greedy_arg, seeds, accept, exp), scalars = _row_args(
        B, device, num_nodes, True if all_greedy else greedy, generator, 0 if all_greedy else seed,
        None if all_greedy else noise)  # every row greedy: no random number is drawn
    scratch = torch.empty(B, 2, V, dtype=torch.float32, device=device) if has_draft else f32
    out_ids = torch.empty(B, N + 1, dtype=torch.int64, device=device)
    num_acc = torch.empty(B, dtype=torch.int64, device=device)
    path = torch.empty(B, N, dtype=torch.int64, device=device)
    _, constexprs, num_warps = _config(target.dtype, has_draft)
    _tree_rejection_sample_kernel[(B,)](
        target, draft, token_ids.contiguous(), parents.contiguous(), n_arg, greedy_arg, temp_arg, thr_t, thr_d,
        seeds, accept, exp, scratch, out_ids, num_acc, path,
        N, V, target.stride(0), target.stride(1), draft.stride(0), draft.stride(1),
        *scalars, has_thr, has_temp_rows, temp_scalar,
        num_warps=num_warps, **constexprs,
    )
    return out_ids, num_acc, path
