"""Verification of a token tree: the longest path the target accepts, and one token of its own.

A drafter may propose a tree instead of a chain: several candidates for the next token, each
with candidates of its own. ``tree_rejection_sample`` verifies N nodes per row in one call,
given the target's logits at the root (the row's last committed token) and at every node:

- **nodes** ``0 .. n_b - 1`` of row b in topological order: ``parents[b, i] < i`` (-1: a child
  of the root); siblings are tested in index order;
- **sampling** (SpecInfer's multi-candidate verification, Miao et al. 2024; SpecTr, Sun et al.
  2023): at the current node, with residual r (at first the target's distribution there), a
  child with token x drawn from its draft distribution q is accepted iff ``u * q(x) <= r(x)``;
  a rejected child turns r into ``normalize(max(r - q, 0))`` before the next sibling is tested
  (q one-hot at x for deterministic children: no draft logits). An accepted child becomes the
  current node. When no child is accepted, one token is drawn from r: the correction, or the
  bonus token at a leaf. Lossless when each child was drawn from its q independently of its
  siblings (with replacement), or chosen deterministically;
- **greedy** rows follow the first child equal to the target's argmax, then emit the argmax.

The reference walks each row (`specdec_kernels.reference.tree_sampling`); the torch path below
visits the nodes in order for all rows at once, with no host synchronization; the Triton kernel
(`specdec_kernels.kernels.tree_sampling`, the default on CUDA) walks each row in one program and
reads full target rows only along the accepted path and at the node where the walk stops (and
the draft rows of the nodes it tests; with top-k / top-p, a thresholds launch reads every row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._backend import Dispatch, resolve_backend
from ._checks import check_tensor, device_check
from ._logits import process_logits
from ._noise import make_rejection_noise
from ._sampling_checks import _check_noise, check_sampling_params
from ._sampling_torch import _chunk_sums, _pick
from ._types import SAMPLE_CHUNK, RejectionNoise


class TreeRejectionOutput(NamedTuple):
    """Result of `tree_rejection_sample`.

    Attributes:
        token_ids: ``[B, N+1]`` int64: the accepted path's tokens, then the corrected or bonus
            token, then -1.
        num_accepted: ``[B]`` int64: the accepted path's length (its depth); a row emits
            ``num_accepted + 1`` tokens.
        path: ``[B, N]`` int64: the accepted nodes' indices from the root down, then -1 (for
            `KVCache.compact`: the verify input's positions ``path + 1`` after its first token).
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    path: torch.Tensor


def _tree_rejection_sample_torch(target_logits: torch.Tensor, draft_logits: torch.Tensor | None,
                                 token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor | None,
                                 *, temperature: torch.Tensor, top_k: int | None, top_p: float | None,
                                 greedy: torch.Tensor, generator: torch.Generator | None = None,
                                 seed: int | torch.Tensor | None = None, noise: RejectionNoise | None = None,
                                 all_greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorized over rows: one pass over the node indices, each testing node i in the rows
    whose current node is its parent. Sync-free. When every row is greedy (``greedy`` all True
    on the host's knowledge: ``all_greedy``), only the argmaxes are computed and no random
    number is drawn."""
    B, N1, V = target_logits.shape
    N, device = N1 - 1, target_logits.device
    n = torch.full((B,), N, dtype=torch.int64, device=device) if num_nodes is None else num_nodes.to(torch.int64)
    argmax = target_logits.argmax(-1)                                                         # [B, N+1]
    if all_greedy:
        return _greedy_walk(argmax, token_ids, parents, n)
    if noise is None:
        noise = make_rejection_noise(B, N, generator=generator, seed=seed, device=device)
    elif noise.uniform is None:
        raise ValueError("noise: the torch backend consumes noise.uniform ([B, 2] float32); it is None")
    p = process_logits(target_logits, temperature, top_k, top_p).float()                     # [B, N+1, V]
    q = None if draft_logits is None else process_logits(draft_logits, temperature, top_k, top_p).float()
    ids = token_ids.to(torch.int64).clamp(0, V - 1)
    node = torch.full((B,), -1, dtype=torch.int64, device=device)
    depth = torch.zeros(B, dtype=torch.int64, device=device)
    path = torch.full((B, max(N, 1)), -1, dtype=torch.int64, device=device)
    residual, mass = p[:, 0].clone(), p[:, 0].sum(-1)   # unnormalized residual and its mass
    for i in range(N):
        x = ids[:, i : i + 1]
        tested = (parents[:, i] == node) & (i < n)
        r_x = residual.gather(1, x).squeeze(1)
        if q is None:
            accept = noise.accept[:, i] * mass <= r_x
        else:
            q_x = q[:, i].gather(1, x).squeeze(1)
            accept = (q_x > 0) & (noise.accept[:, i] * q_x * mass <= r_x)
        accept = torch.where(greedy, ids[:, i] == argmax.gather(1, (node + 1)[:, None]).squeeze(1), accept) & tested
        rejected = tested & ~accept & ~greedy
        if q is None:
            left = residual.scatter(1, x, (r_x[:, None] - mass[:, None]).clamp_min(0.0))
        else:
            left = (residual - q[:, i] * mass[:, None]).clamp_min(0.0)
        left_mass = left.sum(-1)
        update = rejected & (left_mass > 0)
        residual = torch.where(update[:, None], left, residual)
        mass = torch.where(update, left_mass, mass)
        residual = torch.where(accept[:, None], p[:, i + 1], residual)
        mass = torch.where(accept, p[:, i + 1].sum(-1), mass)
        slot = depth.clamp(max=path.shape[1] - 1)[:, None]
        path.scatter_(1, slot, torch.where(accept[:, None], i, path.gather(1, slot)))
        node = torch.where(accept, i, node)
        depth = depth + accept.long()
    token = _draw(residual, noise.uniform)
    token = torch.where(greedy, argmax.gather(1, (node + 1)[:, None]).squeeze(1), token)
    path = path[:, :N]
    return _emitted(ids, path, depth, token), depth, path


def _greedy_walk(argmax: torch.Tensor, token_ids: torch.Tensor, parents: torch.Tensor, n: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row greedy: follow the first child equal to the target's argmax ``argmax``
    [B, N+1] at the current node, then emit the argmax there."""
    B, N = token_ids.shape
    node = torch.full((B,), -1, dtype=torch.int64, device=argmax.device)
    depth = torch.zeros_like(node)
    path = torch.full((B, N + 1), -1, dtype=torch.int64, device=argmax.device)
    for i in range(N):
        accept = (parents[:, i] == node) & (i < n) & (token_ids[:, i] == argmax.gather(1, (node + 1)[:, None])[:, 0])
        path.scatter_(1, depth[:, None], torch.where(accept[:, None], i, path.gather(1, depth[:, None])))
        node, depth = torch.where(accept, i, node), depth + accept.long()
    token = argmax.gather(1, (node + 1)[:, None])[:, 0]
    return _emitted(token_ids, path[:, :N], depth, token), depth, path[:, :N]


def _emitted(token_ids: torch.Tensor, path: torch.Tensor, depth: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``[B, N+1]``: the path's tokens, then ``token``, then -1."""
    B, N = token_ids.shape
    steps = torch.arange(N + 1, device=token_ids.device)
    out = torch.cat([token_ids.gather(1, path.clamp(min=0)), token_ids.new_full((B, 1), -1)], 1)
    out = torch.where(steps < depth[:, None], out, -1)
    return torch.where(steps == depth[:, None], token[:, None], out)


def _draw(w: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One id per row of unnormalized weights ``w`` [B, V] by the two-level inverse CDF of the
    rejection sampler (a chunk of `SAMPLE_CHUNK` entries, then an entry; the same uniforms give
    the reference's token)."""
    B, V = w.shape
    C = SAMPLE_CHUNK
    cdf = _chunk_sums(w).double().cumsum(-1)
    c = _pick(cdf, uniform[:, :1], cdf.shape[1])                                             # [B, 1]
    cols = c * C + torch.arange(C, device=w.device)
    inside = cols < V
    w_c = torch.where(inside, w.gather(1, cols.clamp_max(V - 1)), 0.0)
    i = _pick(w_c.double().cumsum(-1), uniform[:, 1:], C)
    return (c * C + i).squeeze(1).clamp_max(V - 1)


_TREE_REJECTION_SAMPLE = Dispatch(
    reference="specdec_kernels.reference.tree_sampling:tree_rejection_sample",
    torch=_tree_rejection_sample_torch,
    triton="specdec_kernels.kernels.tree_sampling:tree_rejection_sample_triton",
)


def _check_tree(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, token_ids: torch.Tensor,
                parents: torch.Tensor, n: torch.Tensor) -> None:
    """`tree_rejection_sample`'s value checks, on the device (`device_check`)."""
    B, N1, V = target_logits.shape
    N, device = N1 - 1, target_logits.device
    steps = torch.arange(N, device=device)
    real = steps < n[:, None]
    device_check(((n >= 0) & (n <= N)).all() & ((parents >= -1) & (parents < steps) | ~real).all()
                 & ((token_ids >= 0) & (token_ids < V) | ~real).all(),
                 f"tree_rejection_sample: num_nodes must lie in 0..N={N}, parents[b, i] in -1..i-1 and token_ids "
                 f"in 0..V-1={V - 1} for every row's first num_nodes nodes")
    rows_read = torch.arange(N + 1, device=device) <= n[:, None]
    device_check((target_logits.amax(-1).isfinite() | ~rows_read).all(),
                 "target_logits: a row the walk may read has no finite largest value (NaN, +inf or only -inf)")
    if draft_logits is not None:
        device_check((draft_logits.amax(-1).isfinite() | ~real).all(),
                     "draft_logits: a node's row has no finite largest value (NaN, +inf or only -inf)")


def tree_rejection_sample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None = None,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    noise: RejectionNoise | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> TreeRejectionOutput:
    """Verify a tree of N draft tokens per row: the longest path the target accepts, then a
    corrected or bonus token (see the module docstring for the rule; lossless).

    Args:
        target_logits: ``[B, N+1, V]`` float32 / float16 / bfloat16: the target's logits at the
            root (index 0: after the row's last committed token) and after each node i (index
            i + 1).
        draft_logits: ``[B, N, V]`` same dtype: the distribution node i's token was drawn from
            (siblings drawn from one distribution share it); or None: every node was chosen
            deterministically (q one-hot at its token).
        token_ids: ``[B, N]`` int64 in ``[0, V)``: each node's token.
        parents: ``[B, N]`` int64: node i's parent, ``-1 <= parents[b, i] < i`` (-1: the root).
        num_nodes: ``[B]`` integer in ``0 .. N``: real nodes per row (the rest is ignored); None: N.
        temperature, top_k, top_p: as in `rejection_sample_logits` (applied to target and draft
            alike); temperature 0 verifies greedily.
        greedy: bool or ``[B]`` bool: rows verified by argmax.
        generator, seed, noise: the random inputs, as in `rejection_sample` (``noise``: ``accept``
            ``[B, N]``, one uniform per node; the final draw's ``uniform`` ``[B, 2]`` for the
            reference and torch paths, ``exponential`` ``[B, V]`` for the Triton kernel; given
            ``exponential`` the reference races with it as the kernel does, so it then draws
            other final tokens than the torch path from the same noise).
        validate: check on the device (no host sync) that counts, parents and ids are in range
            and that every logits row the walk may read has a finite largest value. False is
            for callers that checked them already (`speculative_generate` does, deferring the
            error to its step's transfer on CUDA): out-of-range ids are then clamped, and rows
            without a distribution give meaningless tokens.
        backend: ``"auto"`` (``"triton"`` on CUDA, else ``"torch"``), ``"reference"``, ``"torch"``,
            ``"triton"``.

    Returns:
        `TreeRejectionOutput`: ``token_ids`` ``[B, N+1]``, ``num_accepted`` ``[B]``, ``path``
        ``[B, N]``.

    Raises:
        ValueError: bad shapes, dtypes or devices (naming the argument); out-of-range ids,
            parents or counts, and logits without a finite largest value in a row the walk may
            read, raise `DeviceCheckError` (a ValueError) on CPU, a device assert on CUDA.

    Example::

        # Two candidates for the next token (nodes 0 and 1), and one continuation of node 0.
        parents = torch.tensor([[-1, -1, 0]])
        out = tree_rejection_sample(target_logits, None, torch.tensor([[5, 9, 2]]), parents, seed=0)
        out.token_ids[0, : out.num_accepted[0] + 1]   # e.g. [5, 2, 7]: nodes 0 and 2, then 7
    """
    check_tensor("target_logits", target_logits, 3)
    B, N1, V = target_logits.shape
    N, device = N1 - 1, target_logits.device
    if target_logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"target_logits must be float32, float16 or bfloat16, got {target_logits.dtype}")
    if draft_logits is not None:
        check_tensor("draft_logits", draft_logits, 3)
        if draft_logits.shape != (B, N, V) or draft_logits.dtype != target_logits.dtype:
            raise ValueError(f"draft_logits must be [B, N, V] = {[B, N, V]} in {target_logits.dtype} like "
                             f"target_logits, got {list(draft_logits.shape)} {draft_logits.dtype}")
    for name, t in (("token_ids", token_ids), ("parents", parents)):
        check_tensor(name, t, 2)
        if t.shape != (B, N) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be [B, N] = {[B, N]} int64, got {list(t.shape)} {t.dtype}")
    for name, t in (("draft_logits", draft_logits), ("token_ids", token_ids), ("parents", parents),
                    ("num_nodes", num_nodes)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} must be on {device} like target_logits, got {t.device}")
    n = torch.full((B,), N, dtype=torch.int64, device=device)
    if num_nodes is not None:
        check_tensor("num_nodes", num_nodes, 1)
        if num_nodes.shape != (B,) or num_nodes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"num_nodes must be a [B] = [{B}] integer tensor, got {list(num_nodes.shape)} "
                             f"{num_nodes.dtype}")
        n = num_nodes.to(torch.int64)
    all_greedy = greedy is True or (not isinstance(temperature, torch.Tensor) and temperature == 0)
    temperature = check_sampling_params(temperature, top_k, top_p, B, device)
    temperature = temperature if isinstance(temperature, torch.Tensor) else torch.full((B,), float(temperature),
                                                                                       device=device)
    if isinstance(greedy, bool):
        greedy = torch.full((B,), greedy, dtype=torch.bool, device=device)
    elif not isinstance(greedy, torch.Tensor) or greedy.shape != (B,) or greedy.dtype != torch.bool:
        raise ValueError(f"greedy must be a bool or a [B] = [{B}] bool tensor, got {greedy!r}")
    greedy = greedy | (temperature == 0)
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be True or False, got {validate!r}")
    if validate:
        _check_tree(target_logits, draft_logits, token_ids, parents, n)
    backend = resolve_backend(backend, device)
    if noise is not None:
        _check_noise(noise, B, N, V, device)
        if backend == "triton" and noise.exponential is None:
            raise ValueError("noise: the triton backend consumes noise.exponential ([B, V] float32); it is None")
        if backend == "reference" and noise.uniform is None and noise.exponential is None:
            raise ValueError("noise: the reference consumes noise.uniform ([B, 2]) or noise.exponential ([B, V]); "
                             "both are None")
    if backend == "reference":
        noise = noise or make_rejection_noise(B, N, generator=generator, seed=seed, device=device)
        return TreeRejectionOutput(*_TREE_REJECTION_SAMPLE["reference"](
            target_logits, draft_logits, token_ids, parents, num_nodes, temperature=temperature, top_k=top_k,
            top_p=top_p, greedy=greedy, noise=noise))
    return TreeRejectionOutput(*_TREE_REJECTION_SAMPLE[backend](
        target_logits, draft_logits, token_ids, parents, num_nodes, temperature=temperature, top_k=top_k,
        top_p=top_p, greedy=greedy, generator=generator, seed=seed, noise=noise, all_greedy=all_greedy))
