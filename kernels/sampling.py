"""Triton kernels for batched speculative verification (one program per batch row, or per row and position).

- `_rejection_sample_kernel`: from probabilities. Acceptance tests gather ``p_i(x_i)`` and
  ``q_i(x_i)`` only; the full vocabulary row is read once, at the row's first rejection j
  (residual ``max(p_j - q_j, 0)``) or at the bonus position. Greedy rows scan ``argmax p_i``
  position by position and stop at the first mismatch.
- `_rejection_sample_logits_kernel`: from logits, softmax fused. Rows are scanned in order; each
  scanned row is read once for its normalizer (online max / sum) and the scan stops at the first
  rejection; then the residual row is read again (or the bonus row, sampled in log space:
  ``argmax l/T - log E``, which needs no normalizer). No probability tensor is written.
- `_logit_thresholds_kernel`: top-k / top-p logit thresholds of every target and draft row (one
  program per row and position), without sorting: a search over the order-preserving int32 keys
  of the float32 scaled logits that tests ``BP = 16`` pivots per pass over the row (at most 18
  passes). Launched before the logits sampler when a filter is set, so a filtered call is two
  launches and writes ``B * (2K+1)`` floats.
- `_first_rejection_kernel`: the first-rejection search on its own.

Sampling is an exponential race ``argmax w / E`` over vocabulary tiles, with ``E = -log u``
drawn in registers from a counter-based RNG (``tl.randint(seed_b, offset)``): no memory traffic
and no host sync. Entries with ``w <= 0`` never win; if no entry has ``w > 0`` the row falls back
to ``p_j`` (tracked in the same pass). Explicit noise (``use_noise``) replaces the RNG for exact
tests; masked-off loads move no bytes, so the flag costs nothing when off.

No token can come from NaN or inf (a logits row: NaN, +inf, or only -inf). The samplers flag, per
batch row, the target and draft values they read that hold such numbers, in a ``[2, B]`` uint8
output taken from what the passes compute anyway (the normalizers, the greedy maxima, a check
per tile of the row they sample from); the launchers assert the flags on the device
(`refuse_rows_without_token`) unless the op validates its inputs instead.

Scaled logits are ``div_rn(l.float(), T)``: IEEE division, bit-identical to torch's ``l.float() / T``
(Triton's ``/`` lowers to the 2-ulp ``div.full.f32`` on NVIDIA), so an entry equal to its threshold
is kept in both kernels and in the reference.

Uniforms: acceptance ``u = (r >> 8 + 1) * 2**-24`` in (0, 1]; race ``u = (r >> 9 + 0.5) * 2**-23``
in (0, 1), so ``E > 0``. Both are exact in float32; nothing is clamped.

Why one module of this length: the four kernels share their ``@triton.jit`` helpers (row inputs,
the RNG, the race merge, the scaled logits), their launch-argument builders and their registry
entries; split apart, each piece would import the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels._backend import on_input_device
from specdec_kernels._checks import ValueChecks
from specdec_kernels._sampling_checks import (
    LOGITS_ARGS,
    PROBS_ARGS,
    refuse_rows_without_token,
    require_values_read_after,
)
from specdec_kernels._types import RejectionNoise, RejectionOutput

from .registry import KernelSpec, register, torch_dtype_to_triton

#: Draft positions handled per vector step (any K works; larger K loops).
BK = 16
#: Vocabulary tile.
BV = 1024
#: Vocabulary tile and pivots per pass of the threshold search (each pass shrinks the key range BP-fold).
BT = 1024
BP = 16
NUM_WARPS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: Per-call runtime flags (never specialized, so one compiled kernel serves every call). Row
#: inputs that are not given as tensors (counts, greedy flags, seeds) come in as scalars, so a call
#: needs no extra launches to materialize them.
_FLAGS = ["has_n", "has_greedy", "greedy_all", "has_row_seed", "seed_hi", "seed_lo"]
#: Shapes and strides of the target / draft rows (never specialized either).
_ROW_SHAPES = ["K", "V", "stride_tb", "stride_tk", "stride_db", "stride_dk"]


@triton.jit
def _row_inputs(
    i_b, K, n_ptr, greedy_ptr, seed_ptr, use_noise, has_n, has_greedy, greedy_all, has_row_seed, seed_hi, seed_lo
):
    """(draft count clamped to [0, K], sampled-row flag, Philox seed) of row ``i_b``. An int seed
    comes in as two int32 halves, so every launch has the registered argument types."""
    n = tl.load(n_ptr + i_b, mask=has_n != 0, other=0).to(tl.int32)
    n = tl.minimum(tl.maximum(tl.where(has_n != 0, n, K), 0), K)
    g = tl.load(greedy_ptr + i_b, mask=has_greedy != 0, other=0)
    sampled = (g == 0) & (greedy_all == 0)
    row_seed = tl.load(seed_ptr + i_b, mask=(has_row_seed != 0) & (use_noise == 0), other=0)
    seed_base = (seed_hi.to(tl.int64) << 32) | (seed_lo.to(tl.int64) & 0xFFFFFFFF)
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
def _scaled(x, DIVISOR):
    """``x.float() / DIVISOR`` rounded as torch rounds it (IEEE division, see the module docstring)."""
    return tl.math.div_rn(x.to(tl.float32), DIVISOR)


@triton.jit
def _row_divisor(i_b, temp_ptr, has_temp_rows, temp_scalar):
    """(temperature, divisor) of row ``i_b``: the divisor is the temperature, or 1 where it is 0."""
    T = tl.load(temp_ptr + i_b, mask=has_temp_rows != 0, other=0.0)
    T = tl.where(has_temp_rows != 0, T, temp_scalar)
    return T, tl.where(T == 0, 1.0, T)


@triton.jit
def _unusable(b_x, LOGITS: tl.constexpr):
    """Entries no token can come from: NaN and +inf, and -inf too unless ``LOGITS`` (a logit of
    -inf is a token filtered out)."""
    bad = (b_x != b_x) | (b_x == float("inf"))
    if not LOGITS:
        bad = bad | (b_x == float("-inf"))
    return bad


@triton.jit
def _any(b_m):
    """1 if any entry of the bool block is true, else 0 (int32, for flags carried through loops)."""
    return tl.max(b_m.to(tl.int32), 0)


@triton.jit
def _row_argmax(row_ptr, V, DIVISOR, thr, BV: tl.constexpr):
    """(first argmax of ``row / DIVISOR`` masked below ``thr``, NaN counting as -inf; 1 if the row
    has no argmax, i.e. holds NaN or its maximum is +inf or -inf, else 0)."""
    best = float("-inf")
    best_idx = 0
    nan = 0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        b_x = _scaled(tl.load(row_ptr + o_v, mask=o_v < V, other=float("-inf")), DIVISOR)
        nan = tl.maximum(nan, _any(b_x != b_x))
        b_x = tl.where((b_x == b_x) & (b_x >= thr), b_x, float("-inf"))
        best, best_idx = _merge_max(best, best_idx, b_x, v0)
    return best_idx, tl.where((best == float("inf")) | (best == float("-inf")), 1, nan)


@triton.jit
def _store_output(ids_ptr, token_ptr, num_acc_ptr, bad_ptr, i_b, K, j, tok, bad, BK: tl.constexpr):
    """Row ``i_b``'s tokens, accepted count and flags (``bad`` bits 1: target, 2: draft; ``bad_ptr``
    ``[2, B]``: the target row, then the draft row)."""
    for k0 in range(0, K + 1, BK):
        o_k = k0 + tl.arange(0, BK)
        b_x = tl.load(ids_ptr + i_b * K + o_k, mask=o_k < j, other=0)
        b_out = tl.where(o_k < j, b_x, tl.where(o_k == j, tok, -1)).to(tl.int64)
        tl.store(token_ptr + i_b * (K + 1) + o_k, b_out, mask=o_k < K + 1)
    tl.store(num_acc_ptr + i_b, j.to(tl.int64))
    tl.store(bad_ptr + i_b, (bad & 1).to(tl.uint8))
    tl.store(bad_ptr + tl.num_programs(0) + i_b, (bad >> 1).to(tl.uint8))


@triton.jit(
    do_not_specialize=[*_ROW_SHAPES, "use_noise", *_FLAGS]
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
    bad_ptr,
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
    seed_hi,
    seed_lo,
    HAS_DRAFT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    n, sampled, seed = _row_inputs(
        i_b, K, n_ptr, greedy_ptr, seed_ptr, use_noise, has_n, has_greedy, greedy_all, has_row_seed, seed_hi,
        seed_lo,
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
        # NaN and -inf fail the test; p(x) = +inf is rejected too, so that every non-finite value
        # tested lies in a row read in full below, whose flags refuse it.
        b_rej = m_k & ~((b_q > 0) & (b_u * b_q <= b_p) & (b_p != float("inf")))
        j = tl.minimum(j, tl.min(tl.where(b_rej, o_k, n), 0))

    # Rows read with NaN or inf, as bits (1: target, 2: draft): one register through every loop.
    bad = n * 0

    # Greedy rows: argmax of each target row until the first mismatch (or the bonus row).
    i = n * 0
    tok_g = n * 0
    searching = ~sampled
    while searching:
        am, no_argmax = _row_argmax(p_t + i * stride_tk, V, 1.0, float("-inf"), BV)
        bad = bad | no_argmax
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
        bad = bad | _any(_unusable(b_p, False))  # masked-off loads are 0: greedy rows add nothing
        if HAS_DRAFT:
            b_q = tl.load(p_d + j * stride_dk + o_v, mask=o_v < V_rej, other=0.0).to(tl.float32)
            bad = bad | (_any(_unusable(b_q, False)) << 1)  # q_j, read at a rejection only
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
    _store_output(ids_ptr, token_ptr, num_acc_ptr, bad_ptr, i_b, K, j, tok, bad, BK)


@triton.jit
def _row_normalizer(row_ptr, V, DIVISOR, thr, BV: tl.constexpr):
    """Online (max, sum of exp(l - max)) of ``row / DIVISOR`` with entries below ``thr`` at -inf.
    NaN is kept, so that NaN or +inf in the row makes the sum NaN (see `_no_distribution`)."""
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        b_l = _scaled(tl.load(row_ptr + o_v, mask=o_v < V, other=float("-inf")), DIVISOR)
        b_l = tl.where(b_l < thr, float("-inf"), b_l)
        m_new = tl.maximum(m, tl.max(b_l, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(b_l - m_safe), 0)
        m = m_new
    return m, s


@triton.jit
def _no_distribution(m, s):
    """1 if a row's `_row_normalizer` ``(m, s)`` leaves no distribution, else 0: ``m == -inf`` (only
    -inf) or ``s`` NaN (NaN or +inf: ``exp(inf - inf)``). Otherwise ``s >= 1``."""
    return tl.where((m == float("-inf")) | (s != s), 1, 0)


@triton.jit
def _prob_at(row_ptr, x, m_x, DIVISOR, thr, m, s):
    """Softmax probability of entry ``x`` given the row's (max, sum); 0 where masked."""
    b_l = _scaled(tl.load(row_ptr + x, mask=m_x, other=float("-inf")), DIVISOR)
    b_l = tl.where(b_l >= thr, b_l, float("-inf"))
    return tl.exp(b_l - tl.where(m == float("-inf"), 0.0, m)) / s


@triton.jit(
    do_not_specialize=[
        *_ROW_SHAPES,
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
    bad_ptr,
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
    seed_hi,
    seed_lo,
    has_thr,
    has_temp_rows,
    temp_scalar,
    HAS_DRAFT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    n, sampled, seed = _row_inputs(
        i_b, K, n_ptr, greedy_ptr, seed_ptr, use_noise, has_n, has_greedy, greedy_all, has_row_seed, seed_hi,
        seed_lo,
    )
    # Temperature 0 means greedy; other rows divide their logits by the temperature.
    T, D = _row_divisor(i_b, temp_ptr, has_temp_rows, temp_scalar)
    sampled = sampled & (T != 0)
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
    # Rows read without a distribution, as bits (1: target, 2: draft): one register through every loop.
    bad = n * 0
    scanning = sampled & (n > 0)
    while scanning:
        thr_t = tl.load(thr_t_ptr + i_b * (K + 1) + i, mask=filtered, other=float("-inf"))
        x = tl.load(ids_ptr + i_b * K + i)
        m_x = (x >= 0) & (x < V)
        m_t, s_t = _row_normalizer(p_t + i * stride_tk, V, D, thr_t, BV)
        bad = bad | _no_distribution(m_t, s_t)
        p_x = _prob_at(p_t + i * stride_tk, x, m_x, D, thr_t, m_t, s_t)
        if HAS_DRAFT:
            thr_d = tl.load(thr_d_ptr + i_b * K + i, mask=filtered, other=float("-inf"))
            m_d, s_d = _row_normalizer(p_d + i * stride_dk, V, D, thr_d, BV)
            bad = bad | (_no_distribution(m_d, s_d) << 1)
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
        am, no_argmax = _row_argmax(p_t + i * stride_tk, V, D, thr_g, BV)
        bad = bad | no_argmax
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
    # Only a sampled row j's normalizers are used (greedy rows never scanned); keep -inf - -inf out.
    m_t = tl.where(is_rej & sampled, m_t, 0.0)
    m_d = tl.where(is_rej & sampled, m_d, 0.0)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V_s
        m_rej = o_v < V_rej
        b_l = _scaled(tl.load(p_t + j * stride_tk + o_v, mask=m_v, other=float("-inf")), D)
        bad = bad | _any(_unusable(b_l, True))  # row j: the bonus row was not scanned
        b_l = tl.where(b_l >= thr_j, b_l, float("-inf"))
        b_e_noise = tl.load(exp_ptr + i_b * V + o_v, mask=o_v < V_noise, other=1.0)
        b_e = tl.where(noisy, b_e_noise, _race_exponential(seed, o_v + K + 1))
        # bonus: argmax l - log E over kept entries
        s_l = tl.where(m_v & (b_l > float("-inf")), b_l - tl.log(b_e), float("-inf"))
        best_l, idx_l = _merge_max(best_l, idx_l, s_l, v0)
        # residual: max(p - q, 0) / E, falling back to p / E
        b_p = tl.exp(b_l - m_t) / s_t
        if HAS_DRAFT:
            b_ld = _scaled(tl.load(p_d + j * stride_dk + o_v, mask=m_rej, other=float("-inf")), D)
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
    # A sampled row j whose race saw no entry above -inf has only -inf (the threshold keeps the maximum).
    bad = tl.where(sampled & (best_l == float("-inf")), bad | 1, bad)
    _store_output(ids_ptr, token_ptr, num_acc_ptr, bad_ptr, i_b, K, j, tok, bad, BK)


@triton.jit
def _from_key(k):
    """Float32 of an int32 key of `_row_keys` (the mapping is an involution on int32)."""
    k = k.to(tl.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _row_keys(p_x, o_v, V, D):
    """Scaled entries ``o_v`` of a row (as `_scaled`) and their order-preserving int32 keys:
    ``a < b`` iff ``key(a) < key(b)``; -0.0 is taken as +0.0 so that equal floats share a key,
    NaN keys lie outside those of -inf / +inf, and ``o_v >= V`` gets INT32_MIN (below every pivot).
    No nested calls: each costs milliseconds per tile under the interpreter."""
    m_v = o_v < V
    b_x = tl.math.div_rn(tl.load(p_x + o_v, mask=m_v, other=0.0).to(tl.float32), D)
    b_i = tl.where(b_x == 0, 0.0, b_x).to(tl.int32, bitcast=True)
    return b_x, tl.where(m_v, b_i ^ ((b_i >> 31) & 0x7FFFFFFF), -2147483647 - 1)


@triton.jit(do_not_specialize=[*_ROW_SHAPES, "has_temp_rows", "temp_scalar", "top_k", "top_p"])
def _logit_thresholds_kernel(
    target_ptr,
    draft_ptr,
    temp_ptr,
    thr_t_ptr,
    thr_d_ptr,
    K,
    V,
    stride_tb,
    stride_tk,
    stride_db,
    stride_dk,
    has_temp_rows,
    temp_scalar,
    top_k,
    top_p,
    BT: tl.constexpr,
    BP: tl.constexpr,
):
    """Threshold of one row ``x = l.float() / D``; grid ``(B, K+1 [+ K])``: program ``(b, i)`` is
    target position i for ``i <= K``, else draft position ``i - K - 1``. ``top_k >= V`` and
    ``top_p >= 1`` turn a filter off. Both searches run over the int32 keys (`_row_keys`) in the row's
    ``[min, max]``; each pass over the row tests ``BP`` pivots at once and shrinks the key range
    ``BP``-fold, so a search takes at most 8 passes (``BP = 16``, 2**32 keys):

    - top-k: the largest key t with ``count(x >= t) >= k``, i.e. the k-th largest value.
    - top-p: the smallest key t >= the top-k threshold with ``M(t) < top_p``, ``M(t)`` the
      top-k-renormalized softmax mass of the entries with key > t. ``M`` sums non-negative terms
      in a fixed order, so it is non-increasing in t and steps only at present values: t is one.
    """
    i_b = tl.program_id(0).to(tl.int64)
    i_r = tl.program_id(1)
    is_t = i_r <= K
    i = tl.where(is_t, i_r, i_r - (K + 1)).to(tl.int64)
    p_x = tl.where(is_t, target_ptr + i_b * stride_tb + i * stride_tk, draft_ptr + i_b * stride_db + i * stride_dk)
    p_o = tl.where(is_t, thr_t_ptr + i_b * (K + 1) + i, thr_d_ptr + i_b * K + i)
    D = _row_divisor(i_b, temp_ptr, has_temp_rows, temp_scalar)[1]
    o_p = tl.arange(0, BP).to(tl.int64)

    # Key range [k_lo, k_hi] of the row; the searches never leave it.
    k_lo = 2147483647
    k_hi = -2147483647 - 1
    for v0 in range(0, V, BT):
        o_v = v0 + tl.arange(0, BT)
        _, b_k = _row_keys(p_x, o_v, V, D)
        k_lo = tl.minimum(k_lo, tl.min(tl.where(o_v < V, b_k, 2147483647), 0))
        k_hi = tl.maximum(k_hi, tl.max(b_k, 0))

    # Top-k: count(x >= lo) >= k holds (k < V at k_lo). Pivots in (lo, hi], the last at hi; the
    # bounds are int64 because hi - lo can exceed the int32 range.
    has_topk = top_k < V
    lo = k_lo.to(tl.int64)
    hi = tl.where(has_topk, k_hi, k_lo).to(tl.int64)
    while lo < hi:
        t_p = lo + ((hi - lo) * (o_p + 1) + BP - 1) // BP
        b_t = t_p.to(tl.int32)
        cnt = tl.zeros([BP], dtype=tl.int32)
        for v0 in range(0, V, BT):
            _, b_k = _row_keys(p_x, v0 + tl.arange(0, BT), V, D)
            cnt += tl.sum((b_k[:, None] >= b_t[None, :]).to(tl.int32), 0)
        ok = cnt >= top_k
        lo = tl.maximum(lo, tl.max(tl.where(ok, t_p, lo), 0))
        hi = tl.minimum(hi, tl.min(tl.where(ok, hi, t_p - 1), 0))
    k_k = lo.to(tl.int32)  # smallest key kept by top-k (k_lo without top-k)

    # Top-p: normalizer of the kept entries (the row maximum is always kept); M(hi) = 0 < top_p.
    # Pivots in [lo, hi). Without top-p the loops run zero times.
    has_topp = top_p < 1.0
    V_p = tl.where(has_topp, V, 0)
    m = _from_key(k_hi)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf: z = 0, M is NaN, t stays at k_hi
    z = 0.0
    for v0 in range(0, V_p, BT):
        b_x, b_k = _row_keys(p_x, v0 + tl.arange(0, BT), V, D)
        z += tl.sum(tl.where(b_k >= k_k, tl.exp(b_x - m_safe), 0.0), 0)
    lo = k_k.to(tl.int64)
    hi = tl.where(has_topp, k_hi, k_k).to(tl.int64)
    while lo < hi:
        t_p = lo + ((hi - lo) * o_p) // BP
        b_t = t_p.to(tl.int32)
        mass = tl.zeros([BP], dtype=tl.float32)
        for v0 in range(0, V, BT):
            b_x, b_k = _row_keys(p_x, v0 + tl.arange(0, BT), V, D)
            b_e = tl.where(b_k >= k_k, tl.exp(b_x - m_safe), 0.0)
            mass += tl.sum(tl.where(b_k[:, None] > b_t[None, :], b_e[:, None], 0.0), 0)
        ok = mass / z < top_p
        hi = tl.minimum(hi, tl.min(tl.where(ok, t_p, hi), 0))
        lo = tl.maximum(lo, tl.max(tl.where(ok, lo, t_p + 1), 0))
    # hi only ever takes pivots that passed: the top-p key (k_k without top-p).
    thr = tl.where(has_topk | has_topp, _from_key(hi), float("-inf"))
    tl.store(p_o, thr)


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
    """Spec name, constexprs and num_warps the launcher uses: the one place block sizes are chosen.
    ``kind`` is ``"probs"``, ``"logits"`` or ``"thresholds"`` (one kernel for target and draft rows:
    ``has_draft`` is ignored)."""
    if kind == "thresholds":
        return f"sampling.logit_thresholds[{_DTYPE_TAG[dtype]},BT={BT},BP={BP}]", dict(BT=BT, BP=BP), NUM_WARPS
    name = f"sampling.{kind}[{_DTYPE_TAG[dtype]},draft={int(has_draft)},BK={BK},BV={BV}]"
    return name, dict(HAS_DRAFT=has_draft, BK=BK, BV=BV), NUM_WARPS


def _signature(kind: str, dtype: torch.dtype) -> dict[str, str]:
    val = torch_dtype_to_triton(dtype)
    rows = {"target_ptr": val, "draft_ptr": val}
    shapes = dict.fromkeys(_ROW_SHAPES, "i32")
    temperature = {"has_temp_rows": "i32", "temp_scalar": "fp32"}
    if kind == "thresholds":
        return {**rows, "temp_ptr": "*fp32", "thr_t_ptr": "*fp32", "thr_d_ptr": "*fp32", **shapes, **temperature,
                "top_k": "i32", "top_p": "fp32", "BT": "constexpr", "BP": "constexpr"}
    common_in = {**rows, "ids_ptr": "*i64", "n_ptr": "*i64", "greedy_ptr": "*u8"}
    ints = {**shapes, "use_noise": "i32", **dict.fromkeys(_FLAGS, "i32")}
    const = {"HAS_DRAFT": "constexpr", "BK": "constexpr", "BV": "constexpr"}
    rand = {"seed_ptr": "*i64", "accept_ptr": "*fp32", "exp_ptr": "*fp32"}
    out = {"token_ptr": "*i64", "num_acc_ptr": "*i64", "bad_ptr": "*u8"}
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
        **temperature,
        **const,
    }


_KERNELS = {"probs": _rejection_sample_kernel, "logits": _rejection_sample_logits_kernel,
            "thresholds": _logit_thresholds_kernel}

for _kind, _kernel in _KERNELS.items():
    for _dtype in DTYPES:
        for _has_draft in (True, False) if _kind != "thresholds" else (False,):  # one thresholds kernel
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
    # The kernels index [B] inputs as contiguous: a strided view (a column of a larger tensor) is copied.
    n_arg = n.to(torch.int64).contiguous() if has_n else i64
    has_greedy = isinstance(greedy, torch.Tensor)
    greedy_arg = greedy.contiguous().view(torch.uint8) if has_greedy else u8
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
    # An int seed as two int32 halves (Triton types a Python int by its value: i32 or i64).
    seed_lo = (seed_base & 0xFFFFFFFF) - ((seed_base & 0x80000000) << 1)
    scalars = [int(use_noise), int(has_n), int(has_greedy), greedy_all, int(has_row_seed), seed_base >> 32, seed_lo]
    return pointers, scalars


def _outputs(B: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ``[B, K+1]``, accepted counts ``[B]`` and the flags ``[2, B]`` of rows read that
    leave no token (target, draft)."""
    return (
        torch.empty(B, K + 1, dtype=torch.int64, device=device),
        torch.empty(B, dtype=torch.int64, device=device),
        torch.empty(2, B, dtype=torch.uint8, device=device),
    )


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@on_input_device
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
    checks: ValueChecks | None = None,
) -> RejectionOutput:
    """Launch `_rejection_sample_kernel` (one launch, grid ``(B,)``; one more small launch when
    seeds are drawn from a generator). Shapes already checked: target ``[B, K+1, V]``, draft
    ``[B, K, V]`` or None, ids ``[B, K]`` integer, n ``[B]`` integer or None, greedy bool or ``[B]``
    bool. With ``checks`` (``validate=True``), the values the kernel read are gathered again and
    added to them, after the launch; without, the kernel's flags refuse NaN or inf among them."""
    B, K1, V = target.shape
    K = K1 - 1
    target = _contiguous_rows(target)
    draft_arg = _contiguous_rows(draft) if draft is not None else target
    (n_arg, greedy_arg, seeds, accept, exp), scalars = _row_args(
        B, target.device, n, greedy, generator, seed, noise
    )
    tokens, num_acc, bad = _outputs(B, K, target.device)
    _, constexprs, num_warps = _config("probs", target.dtype, draft is not None)
    _rejection_sample_kernel[(B,)](
        target,
        draft_arg,
        ids.to(torch.int64).contiguous(),
        n_arg,
        greedy_arg,
        seeds,
        accept,
        exp,
        tokens,
        num_acc,
        bad,
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
    out = RejectionOutput(tokens, num_acc)
    if checks is not None:
        require_values_read_after(checks, target, draft, ids, n, greedy, out)
    else:
        refuse_rows_without_token(bad, PROBS_ARGS)
    return out


def _temperature_args(temperature: float | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int, float]:
    """Kernel arguments of a temperature: ``(temp_ptr, has_temp_rows, temp_scalar)``; a [B] tensor
    goes in as float32 rows, a float as the scalar (with a 1-element placeholder pointer)."""
    if isinstance(temperature, torch.Tensor):
        return temperature.to(torch.float32).contiguous(), 1, 0.0
    return torch.empty(1, dtype=torch.float32, device=device), 0, float(temperature)


@on_input_device
def logit_thresholds_triton(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    temperature: float | torch.Tensor,
    top_k: int | None,
    top_p: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`specdec_kernels.sampling.logit_thresholds` of the temperature-scaled target and draft rows,
    in one launch of `_logit_thresholds_kernel` (grid ``(B, K+1+K)``, or ``(B, K+1)`` without draft).

    Args:
        target: ``[B, K+1, V]`` float32 / float16 / bfloat16 logits.
        draft: ``[B, K, V]`` same dtype, or None.
        temperature: float, or ``[B]`` float tensor; rows divide by it (by 1 where it is 0), as
            ``logits.float() / T`` in torch.
        top_k, top_p: as in `specdec_kernels.process_logits`; None turns a filter off.

    Returns:
        ``(thr_t, thr_d)``: ``[B, K+1]`` and ``[B, K]`` float32 (None without draft); entries
        ``>= threshold`` are kept, -inf where no filter applies. Top-k thresholds equal torch's bit
        for bit. Top-p sums the mass in another order than torch's sort + cumsum: a row whose
        cumulative mass lands within rounding of ``top_p`` may keep one distinct value more or
        less than `logit_thresholds` (the kernel's mass is monotone in the threshold, so the
        result is still a valid top-p threshold for its own sums).
    """
    B, K1, V = target.shape
    K = K1 - 1
    device = target.device
    target = _contiguous_rows(target)
    # Without draft rows (None, or K == 0) the draft arguments alias the target ones: never read.
    has_draft_rows = draft is not None and K > 0
    draft_arg = _contiguous_rows(draft) if has_draft_rows else target
    temp_arg, has_temp_rows, temp_scalar = _temperature_args(temperature, device)
    thr_t = torch.empty(B, K1, dtype=torch.float32, device=device)
    thr_d = torch.empty(B, K, dtype=torch.float32, device=device) if draft is not None else None
    rows = K1 + (K if has_draft_rows else 0)
    _, constexprs, num_warps = _config("thresholds", target.dtype, False)
    _logit_thresholds_kernel[(B, rows)](
        target,
        draft_arg,
        temp_arg,
        thr_t,
        thr_d if has_draft_rows else thr_t,
        K,
        V,
        target.stride(0),
        target.stride(1),
        draft_arg.stride(0),
        draft_arg.stride(1),
        has_temp_rows,
        temp_scalar,
        V if top_k is None else min(top_k, V),  # within int32, and >= V means off
        1.0 if top_p is None else float(top_p),
        num_warps=num_warps,
        **constexprs,
    )
    return thr_t, thr_d


@on_input_device
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
    checks: ValueChecks | None = None,
) -> RejectionOutput:
    """Launch `_rejection_sample_logits_kernel` (grid ``(B,)``), preceded by `_logit_thresholds_kernel`
    when a filter is set (``top_k < V`` or ``top_p < 1``): two launches at most, plus the seed draw
    when seeds come from a generator.

    Rows with temperature 0 are greedy (decided in the kernel). Filters write one float32 threshold
    per row and position (`logit_thresholds_triton`); no ``[B, K+1, V]`` tensor is allocated.
    Without ``checks`` (the op's validation of every row it may read), the kernel's flags refuse
    rows read that leave no token.
    """
    B, K1, V = target.shape
    K = K1 - 1
    device = target.device
    target = _contiguous_rows(target)
    draft_arg = _contiguous_rows(draft) if draft is not None else target
    temp_arg, has_temp_rows, temp_scalar = _temperature_args(temperature, device)
    f32 = torch.empty(1, dtype=torch.float32, device=device)
    thr_t = thr_d = f32
    has_thr = 0
    # Filters that keep every entry (top_k >= V, top_p == 1) cost no launch.
    if (top_k is not None and top_k < V) or (top_p is not None and top_p < 1.0):
        thr_t, thr_d = logit_thresholds_triton(target, draft, temperature, top_k, top_p)
        thr_d = f32 if thr_d is None or K == 0 else thr_d
        has_thr = 1
    (n_arg, greedy_arg, seeds, accept, exp), scalars = _row_args(B, device, n, greedy, generator, seed, noise)
    tokens, num_acc, bad = _outputs(B, K, device)
    _, constexprs, num_warps = _config("logits", target.dtype, draft is not None)
    _rejection_sample_logits_kernel[(B,)](
        target,
        draft_arg,
        ids.to(torch.int64).contiguous(),
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
        bad,
        K,
        V,
        target.stride(0),
        target.stride(1),
        draft_arg.stride(0),
        draft_arg.stride(1),
        *scalars,
        has_thr,
        has_temp_rows,
        temp_scalar,
        num_warps=num_warps,
        **constexprs,
    )
    if checks is None:
        refuse_rows_without_token(bad, LOGITS_ARGS)
    return RejectionOutput(tokens, num_acc)


@on_input_device
def first_rejection_index_triton(accepted: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Launch `_first_rejection_kernel`: ``[B, K]`` bool, ``[B]`` int64 -> ``[B]`` int64."""
    B, K = accepted.shape
    out = torch.empty(B, dtype=torch.int64, device=accepted.device)
    _first_rejection_kernel[(B,)](accepted.contiguous().view(torch.uint8), n.to(torch.int64).contiguous(), out, K,
                                  BK=BK, num_warps=1)
    return out
