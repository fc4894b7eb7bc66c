"""Triton kernels for batched speculative verification (one program per batch row).

- `_rejection_sample_kernel`: from probabilities. Acceptance tests gather ``p_i(x_i)`` and
  ``q_i(x_i)`` only; the full vocabulary row is read once, at the row's first rejection j
  (residual ``max(p_j - q_j, 0)``) or at the bonus position. Greedy rows scan ``argmax p_i``
  position by position and stop at the first mismatch.
- `_rejection_sample_logits_kernel`: from logits, softmax fused. Rows are scanned in order; each
  scanned row is read once for its normalizer (online max / sum) and the scan stops at the first
  rejection; then the residual row is read again (or the bonus row, sampled in log space:
  ``argmax l/T - log E``, which needs no normalizer). No probability tensor is written.
- `_first_rejection_kernel`: the first-rejection search on its own.

Sampling is an exponential race ``argmax w / E`` over vocabulary tiles, with ``E = -log u``
drawn in registers from a counter-based RNG (``tl.randint(seed_b, offset)``): no memory traffic
and no host sync. Entries with ``w <= 0`` never win; if no entry has ``w > 0`` the row falls back
to ``p_j`` (tracked in the same pass). Explicit noise (``use_noise``) replaces the RNG for exact
tests; masked-off loads move no bytes, so the flag costs nothing when off.

Uniforms: acceptance ``u = (r >> 8 + 1) * 2**-24`` in (0, 1]; race ``u = (r >> 9 + 0.5) * 2**-23``
in (0, 1), so ``E > 0``. Both are exact in float32; nothing is clamped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.sampling import RejectionNoise, RejectionOutput, _temperature_rows, logit_thresholds

from .registry import KernelSpec, register, torch_dtype_to_triton

#: Draft positions handled per vector step (any K works; larger K loops).
BK = 16
#: Vocabulary tile.
BV = 1024
NUM_WARPS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: Per-call runtime flags (never specialized, so one compiled kernel serves every call). Row
#: inputs that are not given as tensors (counts, greedy flags, seeds) come in as scalars, so a call
#: needs no extra launches to materialize them.
_FLAGS = ["has_n", "has_greedy", "greedy_all", "has_row_seed", "seed_base"]


@triton.jit
def _row_inputs(
    i_b, K, n_ptr, greedy_ptr, seed_ptr, use_noise, has_n, has_greedy, greedy_all, has_row_seed, seed_base
):
    """(draft count clamped to [0, K], sampled-row flag, Philox seed) of row ``i_b``."""
    n = tl.load(n_ptr + i_b, mask=has_n != 0, other=0).to(tl.int32)
    n = tl.minimum(tl.maximum(tl.where(has_n != 0, n, K), 0), K)
    g = tl.load(greedy_ptr + i_b, mask=has_greedy != 0, other=0)
    sampled = (g == 0) & (greedy_all == 0)
    row_seed = tl.load(seed_ptr + i_b, mask=(has_row_seed != 0) & (use_noise == 0), other=0)
    seed = tl.where(has_row_seed != 0, row_seed, seed_base + i_b)
    return n, sampled, seed


@triton.jit
def _accept_uniform(seed, offsets):
    r = tl.randint(seed, offsets)
    return ((r >> 8).to(tl.float32) + 1.0) * 5.9604644775390625e-08


@triton.jit
def _race_exponential(seed, offsets):
    r = tl.randint(seed, offsets)
    return -tl.log(((r >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07)


@triton.jit
def _merge_max(best, best_idx, scores, v0):
    """Running (max, first argmax) over tiles: a later tile wins only if strictly larger."""
    t_max, t_idx = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
    upd = t_max > best
    return tl.where(upd, t_max, best), tl.where(upd, v0 + t_idx, best_idx)


@triton.jit
def _row_argmax(row_ptr, V, DIVISOR, thr, BV: tl.constexpr):
    """First argmax of ``row / DIVISOR`` masked below ``thr`` (NaN counts as -inf)."""
    best = float("-inf")
    best_idx = 0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        b_x = tl.load(row_ptr + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32) / DIVISOR
        b_x = tl.where((b_x == b_x) & (b_x >= thr), b_x, float("-inf"))
        best, best_idx = _merge_max(best, best_idx, b_x, v0)
    return best_idx


@triton.jit
def _store_output(ids_ptr, token_ptr, num_acc_ptr, i_b, K, j, tok, BK: tl.constexpr):
    for k0 in range(0, K + 1, BK):
        o_k = k0 + tl.arange(0, BK)
        b_x = tl.load(ids_ptr + i_b * K + o_k, mask=o_k < j, other=0)
        b_out = tl.where(o_k < j, b_x, tl.where(o_k == j, tok, -1)).to(tl.int64)
        tl.store(token_ptr + i_b * (K + 1) + o_k, b_out, mask=o_k < K + 1)
    tl.store(num_acc_ptr + i_b, j.to(tl.int64))


@triton.jit(
    do_not_specialize=["K", "V", "stride_tb", "stride_tk", "stride_db", "stride_dk", "use_noise", *_FLAGS]
)
def _rejection_sample_kernel(
    target_ptr,
    draft_ptr,
    ids_ptr,
    n_ptr,
    greedy_ptr,
    seed_ptr,
    accept_ptr,
    exp_ptr,
    token_ptr,
    num_acc_ptr,
    K,
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
    seed_base,
    HAS_DRAFT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    n, sampled, seed = _row_inputs(
        i_b, K, n_ptr, greedy_ptr, seed_ptr, use_noise, has_n, has_greedy, greedy_all, has_row_seed, seed_base
    )
    noisy = use_noise != 0
    p_t = target_ptr + i_b * stride_tb
    p_d = draft_ptr + i_b * stride_db

    # Sampled rows: first position with u * q(x) > p(x) or q(x) == 0 (gathers only).
    # Scalar conditions are folded into loop bounds (n_s, V_s, ...) rather than and-ed with block
    # masks: cheaper, and the interpreter mis-types block & scalar booleans.
    n_s = tl.where(sampled, n, 0)
    n_noise = tl.where(noisy, n_s, 0)
    j = n
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < n_s
        b_x = tl.load(ids_ptr + i_b * K + o_k, mask=m_k, other=0)
        m_x = m_k & (b_x >= 0) & (b_x < V)
        b_p = tl.load(p_t + o_k * stride_tk + b_x, mask=m_x, other=0.0).to(tl.float32)
        if HAS_DRAFT:
            b_q = tl.load(p_d + o_k * stride_dk + b_x, mask=m_x, other=0.0).to(tl.float32)
        else:
            b_q = tl.where(m_x, 1.0, 0.0)
        b_u_noise = tl.load(accept_ptr + i_b * K + o_k, mask=o_k < n_noise, other=1.0)
        b_u = tl.where(noisy, b_u_noise, _accept_uniform(seed, o_k))
        b_rej = m_k & ~((b_q > 0) & (b_u * b_q <= b_p))
        j = tl.minimum(j, tl.min(tl.where(b_rej, o_k, n), 0))

    # Greedy rows: argmax of each target row until the first mismatch (or the bonus row).
    i = n * 0
    tok_g = n * 0
    searching = ~sampled
    while searching:
        am = _row_argmax(p_t + i * stride_tk, V, 1.0, float("-inf"), BV)
        x_i = tl.load(ids_ptr + i_b * K + i, mask=i < n, other=-1)
        mismatch = (am != x_i) | (i >= n)
        tok_g = tl.where(mismatch, am, tok_g)
        searching = ~mismatch
        i = tl.where(mismatch, i, i + 1)
    j = tl.where(sampled, j, i)

    # Residual (j < n) or bonus (j == n) row: one pass, exponential race with p_j as fallback.
    is_rej = j < n
    x_j = tl.load(ids_ptr + i_b * K + j, mask=is_rej & sampled, other=-1)  # -1 unless a rejection
    V_s = tl.where(sampled, V, 0)
    V_rej = tl.where(is_rej, V_s, 0)
    V_noise = tl.where(noisy, V_s, 0)
    best_w = -3.0
    idx_w = 0
    best_p = -3.0
    idx_p = 0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V_s
        b_p = tl.load(p_t + j * stride_tk + o_v, mask=m_v, other=0.0).to(tl.float32)
        if HAS_DRAFT:
            b_q = tl.load(p_d + j * stride_dk + o_v, mask=o_v < V_rej, other=0.0).to(tl.float32)
            b_w = tl.where(is_rej, tl.maximum(b_p - b_q, 0.0), b_p)
        else:
            b_w = tl.where(o_v == x_j, tl.maximum(b_p - 1.0, 0.0), b_p)
        b_e_noise = tl.load(exp_ptr + i_b * V + o_v, mask=o_v < V_noise, other=1.0)
        b_e = tl.where(noisy, b_e_noise, _race_exponential(seed, o_v + K + 1))
        s_w = tl.where(m_v, tl.where(b_w > 0, b_w / b_e, -1.0), -3.0)
        s_p = tl.where(m_v, tl.where(b_p > 0, b_p / b_e, -1.0), -3.0)
        best_w, idx_w = _merge_max(best_w, idx_w, s_w, v0)
        best_p, idx_p = _merge_max(best_p, idx_p, s_p, v0)
    tok_s = tl.where(best_w >= 0, idx_w, idx_p)
    tok = tl.where(sampled, tok_s, tok_g)
    _store_output(ids_ptr, token_ptr, num_acc_ptr, i_b, K, j, tok, BK)


@triton.jit
def _row_normalizer(row_ptr, V, DIVISOR, thr, BV: tl.constexpr):
    """Online (max, sum of exp(l - max)) of ``row / DIVISOR`` with entries below ``thr`` at -inf."""
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        b_l = tl.load(row_ptr + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32) / DIVISOR
        b_l = tl.where(b_l >= thr, b_l, float("-inf"))
        m_new = tl.maximum(m, tl.max(b_l, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(b_l - m_safe), 0)
        m = m_new
    return m, s


@triton.jit
def _prob_at(row_ptr, x, m_x, DIVISOR, thr, m, s):
    """Softmax probability of entry ``x`` given the row's (max, sum); 0 where masked."""
    b_l = tl.load(row_ptr + x, mask=m_x, other=float("-inf")).to(tl.float32) / DIVISOR
    b_l = tl.where(b_l >= thr, b_l, float("-inf"))
    return tl.exp(b_l - tl.where(m == float("-inf"), 0.0, m)) / s


@triton.jit(
    do_not_specialize=[
        "K",
        "V",
        "stride_tb",
        "stride_tk",
        "stride_db",
        "stride_dk",
        "use_noise",
        *_FLAGS,
        "has_thr",
        "has_temp_rows",
        "temp_scalar",
    ]
)
def _rejection_sample_logits_kernel(
    target_ptr,
    draft_ptr,
    ids_ptr,
    n_ptr,
    greedy_ptr,
    temp_ptr,
    thr_t_ptr,
    thr_d_ptr,
    seed_ptr,
    accept_ptr,
    exp_ptr,
    token_ptr,
    num_acc_ptr,
    K,
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
    seed_base,
    has_thr,
    has_temp_rows,
    temp_scalar,
    HAS_DRAFT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    n, sampled, seed = _row_inputs(
        i_b, K, n_ptr, greedy_ptr, seed_ptr, use_noise, has_n, has_greedy, greedy_all, has_row_seed, seed_base
    )
    # Temperature 0 means greedy; other rows divide their logits by the temperature.
    T = tl.load(temp_ptr + i_b, mask=has_temp_rows != 0, other=0.0)
    T = tl.where(has_temp_rows != 0, T, temp_scalar)
    sampled = sampled & (T != 0)
    D = tl.where(T == 0, 1.0, T)
    noisy = use_noise != 0
    filtered = has_thr != 0
    p_t = target_ptr + i_b * stride_tb
    p_d = draft_ptr + i_b * stride_db

    # Sampled rows: scan positions in order, one normalizer pass per row, stop at a rejection.
    i = n * 0
    j = n
    m_t = float("-inf")
    s_t = 1.0
    m_d = float("-inf")
    s_d = 1.0
    scanning = sampled & (n > 0)
    while scanning:
        thr_t = tl.load(thr_t_ptr + i_b * (K + 1) + i, mask=filtered, other=float("-inf"))
        x = tl.load(ids_ptr + i_b * K + i)
        m_x = (x >= 0) & (x < V)
        m_t, s_t = _row_normalizer(p_t + i * stride_tk, V, D, thr_t, BV)
        p_x = _prob_at(p_t + i * stride_tk, x, m_x, D, thr_t, m_t, s_t)
        if HAS_DRAFT:
            thr_d = tl.load(thr_d_ptr + i_b * K + i, mask=filtered, other=float("-inf"))
            m_d, s_d = _row_normalizer(p_d + i * stride_dk, V, D, thr_d, BV)
            q_x = _prob_at(p_d + i * stride_dk, x, m_x, D, thr_d, m_d, s_d)
        else:
            q_x = tl.where(m_x, 1.0, 0.0)
        u_noise = tl.load(accept_ptr + i_b * K + i, mask=noisy, other=1.0)
        u = tl.where(noisy, u_noise, _accept_uniform(seed, i))
        accepted = m_x & (q_x > 0) & (u * q_x <= p_x)
        j = tl.where(accepted, j, i)
        i = i + 1
        scanning = accepted & (i < n)

    # Greedy rows: argmax of each (scaled, filtered) target row until the first mismatch.
    i = n * 0
    tok_g = n * 0
    searching = ~sampled
    while searching:
        thr_g = tl.load(thr_t_ptr + i_b * (K + 1) + i, mask=filtered, other=float("-inf"))
        am = _row_argmax(p_t + i * stride_tk, V, D, thr_g, BV)
        x_i = tl.load(ids_ptr + i_b * K + i, mask=i < n, other=-1)
        mismatch = (am != x_i) | (i >= n)
        tok_g = tl.where(mismatch, am, tok_g)
        searching = ~mismatch
        i = tl.where(mismatch, i, i + 1)
    j = tl.where(sampled, j, i)

    # Residual row j < n (normalizers known from the scan) or bonus row j == n (log-space race).
    is_rej = j < n
    x_j = tl.load(ids_ptr + i_b * K + j, mask=is_rej & sampled, other=-1)
    thr_j = tl.load(thr_t_ptr + i_b * (K + 1) + j, mask=filtered & sampled, other=float("-inf"))
    thr_dj = tl.load(
        thr_d_ptr + i_b * K + j, mask=filtered & sampled & is_rej & (HAS_DRAFT != 0), other=float("-inf")
    )
    V_s = tl.where(sampled, V, 0)
    V_rej = tl.where(is_rej, V_s, 0)
    V_noise = tl.where(noisy, V_s, 0)
    best_w = -3.0
    idx_w = 0
    best_p = -3.0
    idx_p = 0
    best_l = float("-inf")
    idx_l = 0
    m_t = tl.where(is_rej, m_t, 0.0)  # only row j's normalizers are used; keep -inf - -inf out
    m_d = tl.where(is_rej, m_d, 0.0)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V_s
        m_rej = o_v < V_rej
        b_l = tl.load(p_t + j * stride_tk + o_v, mask=m_v, other=float("-inf")).to(tl.float32) / D
        b_l = tl.where(b_l >= thr_j, b_l, float("-inf"))
        b_e_noise = tl.load(exp_ptr + i_b * V + o_v, mask=o_v < V_noise, other=1.0)
        b_e = tl.where(noisy, b_e_noise, _race_exponential(seed, o_v + K + 1))
        # bonus: argmax l - log E over kept entries
        s_l = tl.where(m_v & (b_l > float("-inf")), b_l - tl.log(b_e), float("-inf"))
        best_l, idx_l = _merge_max(best_l, idx_l, s_l, v0)
        # residual: max(p - q, 0) / E, falling back to p / E
        b_p = tl.exp(b_l - m_t) / s_t
        if HAS_DRAFT:
            b_ld = tl.load(p_d + j * stride_dk + o_v, mask=m_rej, other=float("-inf")).to(tl.float32) / D
            b_ld = tl.where(b_ld >= thr_dj, b_ld, float("-inf"))
            b_w = tl.maximum(b_p - tl.exp(b_ld - m_d) / s_d, 0.0)
        else:
            b_w = tl.where(o_v == x_j, tl.maximum(b_p - 1.0, 0.0), b_p)
        s_w = tl.where(m_rej, tl.where(b_w > 0, b_w / b_e, -1.0), -3.0)
        s_p = tl.where(m_rej, tl.where(b_p > 0, b_p / b_e, -1.0), -3.0)
        best_w, idx_w = _merge_max(best_w, idx_w, s_w, v0)
        best_p, idx_p = _merge_max(best_p, idx_p, s_p, v0)
    tok_s = tl.where(is_rej, tl.where(best_w >= 0, idx_w, idx_p), idx_l)
    tok = tl.where(sampled, tok_s, tok_g)
    _store_output(ids_ptr, token_ptr, num_acc_ptr, i_b, K, j, tok, BK)


@triton.jit(do_not_specialize=["K"])
def _first_rejection_kernel(accepted_ptr, n_ptr, out_ptr, K, BK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + i_b).to(tl.int32)
    j = n
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < n
        b_a = tl.load(accepted_ptr + i_b * K + o_k, mask=m_k, other=1)
        j = tl.minimum(j, tl.min(tl.where(m_k & (b_a == 0), o_k, n), 0))
    tl.store(out_ptr + i_b, j.to(tl.int64))


# --------------------------------------------------------------------------- specializations

_DTYPE_TAG = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _config(kind: str, dtype: torch.dtype, has_draft: bool) -> tuple[str, dict[str, object], int]:
    """Spec name, constexprs and num_warps the launcher uses: the one place block sizes are chosen."""
    name = f"sampling.{kind}[{_DTYPE_TAG[dtype]},draft={int(has_draft)},BK={BK},BV={BV}]"
    return name, dict(HAS_DRAFT=has_draft, BK=BK, BV=BV), NUM_WARPS


def _signature(kind: str, dtype: torch.dtype) -> dict[str, str]:
    val = torch_dtype_to_triton(dtype)
    common_in = {"target_ptr": val, "draft_ptr": val, "ids_ptr": "*i64", "n_ptr": "*i64", "greedy_ptr": "*u8"}
    ints = {
        "K": "i32",
        "V": "i32",
        "stride_tb": "i32",
        "stride_tk": "i32",
        "stride_db": "i32",
        "stride_dk": "i32",
        "use_noise": "i32",
        "has_n": "i32",
        "has_greedy": "i32",
        "greedy_all": "i32",
        "has_row_seed": "i32",
        "seed_base": "i64",
    }
    const = {"HAS_DRAFT": "constexpr", "BK": "constexpr", "BV": "constexpr"}
    rand = {"seed_ptr": "*i64", "accept_ptr": "*fp32", "exp_ptr": "*fp32"}
    out = {"token_ptr": "*i64", "num_acc_ptr": "*i64"}
    if kind == "probs":
        return {**common_in, **rand, **out, **ints, **const}
    return {
        **common_in,
        "temp_ptr": "*fp32",
        "thr_t_ptr": "*fp32",
        "thr_d_ptr": "*fp32",
        **rand,
        **out,
        **ints,
        "has_thr": "i32",
        "has_temp_rows": "i32",
        "temp_scalar": "fp32",
        **const,
    }


_KERNELS = {"probs": _rejection_sample_kernel, "logits": _rejection_sample_logits_kernel}

for _kind, _kernel in _KERNELS.items():
    for _dtype in DTYPES:
        for _has_draft in (True, False):
            _name, _constexprs, _warps = _config(_kind, _dtype, _has_draft)
            _sig = _signature(_kind, _dtype)
            # Every pointer is a torch allocation (16-byte aligned), as the JIT specializes real launches.
            _aligned = tuple(k for k, v in _sig.items() if v.startswith("*"))
            register(KernelSpec(_name, _kernel, _sig, _constexprs, num_warps=_warps, aligned=_aligned))
register(
    KernelSpec(
        f"sampling.first_rejection[BK={BK}]",
        _first_rejection_kernel,
        {"accepted_ptr": "*u8", "n_ptr": "*i64", "out_ptr": "*i64", "K": "i32", "BK": "constexpr"},
        {"BK": BK},
        num_warps=1,
        aligned=("accepted_ptr", "n_ptr", "out_ptr"),
    )
)


# --------------------------------------------------------------------------- launchers


def _row_args(
    B: int,
    device: torch.device,
    n: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    generator: torch.Generator | None,
    seed: int | torch.Tensor | None,
    noise: RejectionNoise | None,
) -> tuple[list, list]:
    """Pointer and scalar arguments for the row inputs; nothing is materialized that was not given,
    except the per-row seeds drawn from ``generator`` (one small launch, no host sync)."""
    f32 = torch.empty(1, dtype=torch.float32, device=device)
    i64 = torch.empty(1, dtype=torch.int64, device=device)
    u8 = torch.empty(1, dtype=torch.uint8, device=device)
    has_n = n is not None
    n_arg = n.to(torch.int64) if has_n else i64
    has_greedy = isinstance(greedy, torch.Tensor)
    greedy_arg = greedy.view(torch.uint8) if has_greedy else u8
    greedy_all = int(greedy) if not has_greedy else 0
    accept = exp = f32
    use_noise = noise is not None
    seeds, has_row_seed, seed_base = i64, False, 0
    if use_noise:
        if noise.exponential is None:
            raise ValueError("the triton backend consumes noise.exponential ([B, V] float32); it is None")
        accept, exp = noise.accept.contiguous(), noise.exponential.contiguous()
    elif isinstance(seed, torch.Tensor):
        seeds, has_row_seed = seed.to(torch.int64).contiguous(), True
    elif seed is not None:
        seed_base = int(seed)
    else:
        seeds, has_row_seed = torch.randint(0, 2**62, (B,), device=device, generator=generator), True
    pointers = [n_arg, greedy_arg, seeds, accept, exp]
    scalars = [int(use_noise), int(has_n), int(has_greedy), greedy_all, int(has_row_seed), seed_base]
    return pointers, scalars


def _outputs(B: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(B, K + 1, dtype=torch.int64, device=device),
        torch.empty(B, dtype=torch.int64, device=device),
    )


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rejection_sample_triton(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    ids: torch.Tensor,
    n: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    noise: RejectionNoise | None = None,
) -> RejectionOutput:
    """Launch `_rejection_sample_kernel` (one launch, grid ``(B,)``; one more small launch when
    seeds are drawn from a generator). Inputs already validated: target ``[B, K+1, V]``, draft
    ``[B, K, V]`` or None, ids ``[B, K]`` int64, n ``[B]`` integer or None, greedy bool or ``[B]`` bool."""
    B, K1, V = target.shape
    K = K1 - 1
    target = _contiguous_rows(target)
    draft_arg = _contiguous_rows(draft) if draft is not None else target
    (n_arg, greedy_arg, seeds, accept, exp), scalars = _row_args(
        B, target.device, n, greedy, generator, seed, noise
    )
    tokens, num_acc = _outputs(B, K, target.device)
    _, constexprs, num_warps = _config("probs", target.dtype, draft is not None)
    _rejection_sample_kernel[(B,)](
        target,
        draft_arg,
        ids.contiguous(),
        n_arg,
        greedy_arg,
        seeds,
        accept,
        exp,
        tokens,
        num_acc,
        K,
        V,
        target.stride(0),
        target.stride(1),
        draft_arg.stride(0),
        draft_arg.stride(1),
        *scalars,
        num_warps=num_warps,
        **constexprs,
    )
    return RejectionOutput(tokens, num_acc)


def rejection_sample_logits_triton(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    ids: torch.Tensor,
    n: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | None,
    top_p: float | None,
    *,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    noise: RejectionNoise | None = None,
) -> RejectionOutput:
    """Launch `_rejection_sample_logits_kernel` (one launch, grid ``(B,)``; plus the seed draw from
    a generator, and torch ops for the thresholds when top-k / top-p are set).

    Rows with temperature 0 are greedy (decided in the kernel). With top-k / top-p, the per-row,
    per-position logit thresholds are computed with torch first (`logit_thresholds`).
    """
    B, K1, V = target.shape
    K = K1 - 1
    device = target.device
    target = _contiguous_rows(target)
    draft_arg = _contiguous_rows(draft) if draft is not None else target
    f32 = torch.empty(1, dtype=torch.float32, device=device)
    has_temp_rows = isinstance(temperature, torch.Tensor)
    temp_arg = temperature.to(torch.float32).contiguous() if has_temp_rows else f32
    temp_scalar = 0.0 if has_temp_rows else float(temperature)
    thr_t = thr_d = f32
    has_thr = 0
    if top_k is not None or top_p is not None:
        divisor, _ = _temperature_rows(temperature, B, device)
        thr_t = logit_thresholds(target.float() / divisor[:, None, None], top_k, top_p).contiguous()
        if draft is not None:
            thr_d = logit_thresholds(draft.float() / divisor[:, None, None], top_k, top_p).contiguous()
        has_thr = 1
    (n_arg, greedy_arg, seeds, accept, exp), scalars = _row_args(B, device, n, greedy, generator, seed, noise)
    tokens, num_acc = _outputs(B, K, device)
    _, constexprs, num_warps = _config("logits", target.dtype, draft is not None)
    _rejection_sample_logits_kernel[(B,)](
        target,
        draft_arg,
        ids.contiguous(),
        n_arg,
        greedy_arg,
        temp_arg,
        thr_t,
        thr_d,
        seeds,
        accept,
        exp,
        tokens,
        num_acc,
        K,
        V,
        target.stride(0),
        target.stride(1),
        draft_arg.stride(0),
        draft_arg.stride(1),
        *scalars,
        has_thr,
        int(has_temp_rows),
        temp_scalar,
        num_warps=num_warps,
        **constexprs,
    )
    return RejectionOutput(tokens, num_acc)


def first_rejection_index_triton(accepted: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Launch `_first_rejection_kernel`: ``[B, K]`` bool, ``[B]`` int64 -> ``[B]`` int64."""
    B, K = accepted.shape
    out = torch.empty(B, dtype=torch.int64, device=accepted.device)
    _first_rejection_kernel[(B,)](accepted.contiguous().view(torch.uint8), n, out, K, BK=BK, num_warps=1)
    return out
