"""Input checks of the samplers (`rejection_sample`, `rejection_sample_logits`, `process_logits`).

Host checks (types, shapes, dtypes, devices, sampling parameters) raise at once. Value checks
(``validate=True``) cost little and make one host read in all (`ValueChecks`):

- small inputs (draft ids, counts, explicit noise) are checked before the op runs;
- probabilities are checked where the sampler reads them, from numbers it computes anyway: the
  drafted tokens' ``p_i(x_i)``, ``q_i(x_i)`` (finite, in ``[0, 1]``), the one row it samples
  from, ``p_j`` and at a rejection ``q_j`` (finite, non-negative, summing to 1), and the largest
  entry of each row a greedy row takes the argmax of (`require_values_read`). Reading every row to
  check it would cost more than the sampler itself, which reads one row of V entries per row;
- logits are checked on every row the sampler may read (``j <= n_b``): each needs a finite largest
  value, also divided by its temperature (`require_logit_rows`), which costs one pass.

Without validation, every backend still refuses the values no token can come from where it reads
them (NaN or inf; a logits row of only -inf): each reports, per batch row and argument, flags it
derives from numbers it computes anyway (row maxima, normalizers, sums), and `refuse_rows_without_token`
asserts them on the device. Finite invalid values (negative or unnormalized probabilities, ids and
counts out of range) get index guards instead: the ids stay in ``[0, V)``.

Imports torch only (with the shared types and checks), so the reference and the kernels' launchers
may use it too.
"""

from __future__ import annotations

import math

import torch

from ._checks import ValueChecks, check_generator_and_seed, check_tensor, device_check
from ._types import FLOAT_DTYPES, RejectionNoise, RejectionOutput

_SKIP = "(pass validate=False to skip this check)"
#: The arguments a sampler's rows come from, target first: what `refuse_rows_without_token` names.
PROBS_ARGS = ("target_probs", "draft_probs")
LOGITS_ARGS = ("target_logits", "draft_logits")


def check_sampler_inputs(target: torch.Tensor, draft: torch.Tensor | None, draft_token_ids: torch.Tensor,
                         num_draft_tokens: torch.Tensor | None, greedy: bool | torch.Tensor,
                         generator: torch.Generator | None, seed: int | torch.Tensor | None,
                         noise: RejectionNoise | None, names: tuple[str, str], validate: bool | None,
                         ) -> tuple[ValueChecks | None, int, int, int]:
    """Checks shared by both samplers, for ``target`` already checked to be a 3-D tensor: shapes,
    dtypes and devices on the host, always; when ``validate`` (None: True for CPU tensors) the
    values of ids, counts and explicit noise, added to the returned `ValueChecks` (decided later,
    with the values the op reads).

    Returns:
        ``(ValueChecks, or None when not validating, B, K, V)``.
    """
    tname, dname = names
    if validate is None:
        validate = target.device.type == "cpu"
    B, K1, V = target.shape
    if K1 < 1:
        raise ValueError(f"{tname} must have K+1 >= 1 positions, got shape {tuple(target.shape)}")
    if V < 1:
        raise ValueError(f"{tname} must have a non-empty vocabulary, got shape {tuple(target.shape)}")
    K = K1 - 1
    if target.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{tname} must be float32, float16 or bfloat16, got {target.dtype}")
    device = target.device
    if draft is not None:
        check_tensor(dname, draft, 3)
        if tuple(draft.shape) != (B, K, V):
            raise ValueError(
                f"{dname} must have shape [B, K, V] = {(B, K, V)} to match {tname} "
                f"{tuple(target.shape)}, got {tuple(draft.shape)}"
            )
        if draft.dtype != target.dtype:
            raise TypeError(f"{dname} must have the dtype of {tname} ({target.dtype}), got {draft.dtype}")
        if draft.device != device:
            raise ValueError(f"{dname} is on {draft.device} but {tname} is on {device}")
    check_tensor("draft_token_ids", draft_token_ids, 2)
    if tuple(draft_token_ids.shape) != (B, K):
        raise ValueError(
            f"draft_token_ids must have shape [B, K] = {(B, K)} to match {tname} "
            f"{tuple(target.shape)}, got {tuple(draft_token_ids.shape)}"
        )
    if draft_token_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"draft_token_ids must be int64 or int32, got {draft_token_ids.dtype}")
    if draft_token_ids.device != device:
        raise ValueError(f"draft_token_ids is on {draft_token_ids.device} but {tname} is on {device}")
    if num_draft_tokens is not None:
        check_counts(num_draft_tokens, B, device, tname)
    if isinstance(greedy, torch.Tensor):
        check_tensor("greedy", greedy, 1)
        if greedy.shape[0] != B or greedy.dtype != torch.bool:
            raise ValueError(
                f"greedy must be a bool or a [B] = [{B}] bool tensor, got "
                f"{greedy.dtype} {tuple(greedy.shape)}"
            )
        if greedy.device != device:
            raise ValueError(f"greedy is on {greedy.device} but {tname} is on {device}")
    elif not isinstance(greedy, bool):
        raise TypeError(f"greedy must be a bool or a [B] bool tensor, got {type(greedy).__name__}")
    check_generator_and_seed(generator, seed, B, device, on=tname)
    if noise is not None:
        _check_noise(noise, B, K, V, device)
    if not validate:
        return None, B, K, V
    checks = ValueChecks()
    if noise is not None:
        ranges = {"accept": ("(0, 1]", lambda t: (t > 0) & (t <= 1)),
                  "uniform": ("[0, 1)", lambda t: (t >= 0) & (t < 1)),
                  "exponential": ("(0, inf)", lambda t: (t > 0) & t.isfinite())}
        for field, (interval, inside) in ranges.items():
            t = getattr(noise, field)
            if t is not None:
                checks.require(inside(t), f"noise.{field} must lie in {interval} {_SKIP}")
    if num_draft_tokens is not None:
        checks.require(num_draft_tokens.clamp(0, K) == num_draft_tokens,
                       f"num_draft_tokens must lie in [0, K] = [0, {K}]")
    checks.require(draft_token_ids.clamp(0, V - 1) == draft_token_ids, f"draft_token_ids must lie in [0, V) = [0, {V})")
    return checks, B, K, V


def check_counts(num_draft_tokens: torch.Tensor, B: int, device: torch.device, on: str) -> None:
    """``num_draft_tokens`` is a [B] integer tensor on ``device`` (where ``on`` lives)."""
    check_tensor("num_draft_tokens", num_draft_tokens, 1)
    if num_draft_tokens.shape[0] != B:
        raise ValueError(f"num_draft_tokens must have shape [B] = [{B}], got {tuple(num_draft_tokens.shape)}")
    if num_draft_tokens.dtype.is_floating_point or num_draft_tokens.dtype == torch.bool:
        raise TypeError(f"num_draft_tokens must be an integer tensor, got {num_draft_tokens.dtype}")
    if num_draft_tokens.device != device:
        raise ValueError(f"num_draft_tokens is on {num_draft_tokens.device} but {on} is on {device}")


def _check_noise(noise: RejectionNoise, B: int, K: int, V: int, device: torch.device) -> None:
    if not isinstance(noise, RejectionNoise):
        raise TypeError(f"noise must be a RejectionNoise, got {type(noise).__name__}")
    check_tensor("noise.accept", noise.accept, 2)
    if tuple(noise.accept.shape) != (B, K) or noise.accept.dtype != torch.float32:
        raise ValueError(
            f"noise.accept must be float32 [B, K] = {(B, K)}, got {noise.accept.dtype} {tuple(noise.accept.shape)}"
        )
    for field, shape in (("uniform", (B, 2)), ("exponential", (B, V))):
        t = getattr(noise, field)
        if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32):
            raise ValueError(f"noise.{field} must be float32 {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    for t in noise:
        if t is not None and t.device != device:
            raise ValueError(f"noise tensors must be on {device}, got {t.device}")


#: Temperatures below float32's smallest normal number are greedy, in every backend, the loops and
#: the CLI: float32, in which every backend divides, rounds them to 0 or overflows dividing by
#: them, and sampling tends to the argmax as the temperature falls to 0.
GREEDY_BELOW = torch.finfo(torch.float32).tiny


def effective_temperature(temperature: float | torch.Tensor) -> float | torch.Tensor:
    """``temperature`` with every value below `GREEDY_BELOW` set to 0 (greedy); a float stays a
    float, a tensor a tensor of its dtype (sync-free)."""
    if isinstance(temperature, torch.Tensor):
        return temperature.masked_fill(temperature < GREEDY_BELOW, 0.0)
    return 0.0 if temperature < GREEDY_BELOW else float(temperature)


def check_sampling_params(
    temperature: float | torch.Tensor,
    top_k: int | None,
    top_p: float | None,
    batch: int,
    device: torch.device,
) -> float | torch.Tensor:
    """Check temperature (a float, or a [B] floating tensor checked on the device), top-k and
    top-p; return `effective_temperature`, the temperature every backend then uses."""
    if isinstance(temperature, torch.Tensor):
        if temperature.ndim != 1 or temperature.shape[0] != batch:
            raise ValueError(
                f"temperature must be a float or a [B] = [{batch}] tensor, got shape {tuple(temperature.shape)}"
            )
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature must be a floating tensor, got {temperature.dtype}")
        if temperature.device != device:
            raise ValueError(f"temperature is on {temperature.device} but the logits are on {device}")
        device_check((torch.isfinite(temperature) & (temperature >= 0)).all(),
                     "temperature must be finite and >= 0 in every row")
    elif isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        try:
            finite = math.isfinite(temperature)
        except OverflowError:  # an int past the float range
            finite = False
        if not finite or temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    else:
        raise TypeError(f"temperature must be a float or a [B] tensor, got {type(temperature).__name__}")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None:
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool):
            raise TypeError(f"top_p must be a float or None, got {type(top_p).__name__}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    return effective_temperature(temperature)


# --------------------------------------------------------------------------- values the sampler reads


def sum_tolerance(dtype: torch.dtype, V: int) -> float:
    """How far from 1 a row of V probabilities may sum: max(1e-3, 4 eps) plus, for fp16, the
    absolute error of subnormal entries (2**-25 each)."""
    info = torch.finfo(dtype)
    return max(1e-3, 4 * info.eps) + V * info.smallest_normal * info.eps / 2


def require_values_read(
    checks: ValueChecks,
    dtype: torch.dtype,
    V: int,
    n: torch.Tensor,
    j: torch.Tensor,
    greedy: bool | torch.Tensor,
    *,
    ragged: bool,
    p_x: torch.Tensor | None = None,
    q_x: torch.Tensor | None = None,
    p_row: tuple[torch.Tensor, torch.Tensor] | None = None,
    q_row: tuple[torch.Tensor, torch.Tensor] | None = None,
    maxima: torch.Tensor | None = None,
) -> None:
    """Add to ``checks`` the probabilities one `rejection_sample` call read (no host read here).

    Every check is a handful of operations on ``[B, K]`` tensors; masks are built only where the
    host does not know already that every row reads every position.

    Args:
        dtype, V: the probabilities' dtype and vocabulary size (for the row-sum tolerance).
        n: ``[B]`` int64 draft counts in ``[0, K]``; j: ``[B]`` int64 accepted counts (the output).
        greedy: the op's argument: a bool, or ``[B]`` bool rows verified by argmax.
        ragged: whether counts were given (else ``n_b = K`` in every row).
        p_x, q_x: ``[B, K]`` the drafted tokens' target and draft probabilities (None: not read,
            e.g. every row greedy, or no draft probabilities); checked at positions ``i < n_b`` of
            sampled rows: finite, in ``[0, 1]``.
        p_row: ``(min, sum)`` ``[B]`` of ``p_j``, the row each sampled row drew its token from;
            q_row: the same of ``q_j``, read by rows that rejected draft j: finite, non-negative,
            summing to 1 within `sum_tolerance`.
        maxima: ``[B, K+1]`` largest entry of each target row; checked at positions ``i <= j`` of
            greedy rows (the argmaxes they read): finite, in ``(0, 1]``.
    """
    tolerance = sum_tolerance(dtype, V)
    most = 1.0 + tolerance
    # None for a bool: every row samples (False), or every row is greedy (True: only maxima are given).
    greedy_rows = greedy if isinstance(greedy, torch.Tensor) else None
    if p_x is not None:
        unread = torch.arange(p_x.shape[1], device=n.device) >= n[:, None] if ragged else None
        if greedy_rows is not None:
            unread = greedy_rows[:, None] if unread is None else unread | greedy_rows[:, None]
        x = p_x if q_x is None else torch.stack((p_x, q_x))  # one check for both
        ok = x.clamp(0.0, most) == x  # NaN fails too
        checks.require(ok if unread is None else ok | unread, _entries_message(p_x, q_x, unread, most))
    for name, row in (("target_probs", p_row), ("draft_probs", q_row)):
        if row is not None:
            low, total = row
            ok = (low >= 0) & (total.clamp(1.0 - tolerance, most) == total)
            unread_row = greedy_rows
            if name == "draft_probs":  # q_j is read at a rejection only
                unread_row = j >= n if unread_row is None else unread_row | (j >= n)
            if unread_row is not None:
                ok |= unread_row
            checks.require(ok, _row_message(name, low, total, unread_row, tolerance))
    if maxima is not None:
        read = torch.arange(maxima.shape[1], device=j.device) <= j[:, None]
        if greedy_rows is not None:
            read &= greedy_rows[:, None]
        checks.require((maxima.clamp(0.0, most) == maxima) & (maxima > 0) | ~read, _maxima_message(maxima, read))


def _entries_message(p_x: torch.Tensor, q_x: torch.Tensor | None, unread: torch.Tensor | None, most: float):
    def message() -> str:
        for name, x in (("target_probs", p_x), ("draft_probs", q_x)):
            x_read = x if x is None or unread is None else x[~unread]
            if x_read is None or not x_read.numel():
                continue
            if not bool(x_read.isfinite().all()):
                return f"{name} contains NaN or inf"
            if bool((x_read < 0).any()):
                return f"{name} contains negative probabilities {_SKIP}"
            if bool((x_read > most).any()):
                return f"{name} contains a probability above 1 ({float(x_read.max()):.6g}) {_SKIP}"
        return f"target_probs or draft_probs is out of range {_SKIP}"  # not reached: one of the above fails

    return message


def _row_message(name: str, low: torch.Tensor, total: torch.Tensor, unread: torch.Tensor | None,
                 tolerance: float):
    def message() -> str:
        lows, totals = (low, total) if unread is None else (low[~unread], total[~unread])
        if not bool(lows.isfinite().all() & totals.isfinite().all()):
            return f"{name} contains NaN or inf"
        if bool((lows < 0).any()):
            return f"{name} contains negative probabilities {_SKIP}"
        worst = float((totals - 1).abs().max())
        return f"{name} rows must sum to 1 (within {tolerance:.3g}); one is off by {worst:.3g} {_SKIP}"

    return message


def _maxima_message(maxima: torch.Tensor, read: torch.Tensor):
    def message() -> str:
        m = maxima[read]
        if not bool(m.isfinite().all()):
            return "target_probs contains NaN or inf"
        if bool((m <= 0).any()):
            return f"target_probs has a row without a positive probability {_SKIP}"
        return f"target_probs contains a probability above 1 ({float(m.max()):.6g}) {_SKIP}"

    return message


def require_values_read_after(
    checks: ValueChecks,
    target: torch.Tensor,
    draft: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    out: RejectionOutput,
) -> None:
    """`require_values_read` for a backend that does not report what it read (the reference, the
    Triton kernel): the same values, gathered again from the inputs and the output."""
    B, K1, V = target.shape
    K = K1 - 1
    device = target.device
    n = torch.full((B,), K, device=device) if num_draft_tokens is None else num_draft_tokens.clamp(0, K)
    j = out.num_accepted
    ragged = num_draft_tokens is not None
    maxima = target.amax(-1) if greedy is not False else None
    if greedy is True:
        require_values_read(checks, target.dtype, V, n, j, greedy, ragged=ragged, maxima=maxima)
        return
    rows = torch.arange(B, device=device)
    ids = draft_token_ids.to(torch.int64).clamp(0, V - 1)[..., None]
    p_j = target[rows, j]
    q_x = q_row = None
    if draft is not None:
        q_x = draft.gather(-1, ids).squeeze(-1).float()
        if K > 0:
            q_j = draft[rows, j.clamp_max(K - 1)]
            q_row = (q_j.amin(-1), q_j.sum(-1, dtype=torch.float32))
    require_values_read(checks, target.dtype, V, n, j, greedy, ragged=ragged,
                        p_x=target[:, :K].gather(-1, ids).squeeze(-1).float(), q_x=q_x,
                        p_row=(p_j.amin(-1), p_j.sum(-1, dtype=torch.float32)), q_row=q_row, maxima=maxima)


def require_logit_rows(
    checks: ValueChecks,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    num_draft_tokens: torch.Tensor | None,
    temperature: float | torch.Tensor,
) -> None:
    """Add to ``checks``: every logits row the sampler may read (target ``j <= n_b``, draft
    ``j < n_b``) has a finite largest value, also divided by its temperature (NaN, +inf, an all
    -inf row or an overflowing logits / temperature leave no distribution; -inf entries are fine)."""
    B, K1, _ = target_logits.shape
    device = target_logits.device
    divisor = (torch.where(temperature > 0, temperature, 1.0)[:, None] if isinstance(temperature, torch.Tensor)
               else float(temperature) or 1.0)
    counts = torch.full((B, 1), K1 - 1, device=device) if num_draft_tokens is None else num_draft_tokens.view(B, 1)
    positions = torch.arange(K1, device=device)
    for name, t, read in (("target_logits", target_logits, positions <= counts),
                          ("draft_logits", draft_logits, positions[:-1] < counts)):
        if t is not None and t.numel():
            # max commutes with widening to float32, so the widening is done on [B, K] maxima only.
            checks.require((t.amax(-1).float() / divisor).isfinite() | ~read,
                           f"{name} has a row with NaN, +inf or only -inf (or so small a temperature that "
                           "logits / temperature overflows)")


def refuse_rows_without_token(bad: torch.Tensor, names: tuple[str, str]) -> None:
    """Raise `DeviceCheckError` (`device_check`: no host sync; on CUDA a device-side assert) where a
    sampler read a value no token can come from; what the samplers do without validation.

    Args:
        bad: ``[2, B]`` bool or uint8: row 0 flags the batch rows whose target values read were
            bad, row 1 those whose draft values were. For logits: a row read with NaN or +inf, or
            only -inf, also after the temperature; for probabilities: a value read that is NaN or
            inf (a greedy row: its largest entry).
        names: `PROBS_ARGS` or `LOGITS_ARGS`, the arguments the two rows of ``bad`` stand for.
    """

    def message() -> str:
        what = ("NaN, +inf or only -inf (or overflow when divided by the temperature)" if names == LOGITS_ARGS
                else "NaN or inf")
        failed = [(name, flags.nonzero().flatten().tolist()) for name, flags in zip(names, bad.cpu(), strict=True)]
        return "; ".join(f"{name}: batch row(s) {rows} hold {what} at a position the sampler read"
                         for name, rows in failed if rows) + ": no token can be sampled"

    device_check(bad.any().logical_not(), message)  # any() of uint8 is uint8: ~ would not negate it
