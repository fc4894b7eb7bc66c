"""Reference verification of a token tree: one row at a time, a walk from the root.

Same signature as `specdec_kernels.tree_rejection_sample` (without ``backend``; inputs assumed
checked). Row b walks from the root: at the current node it tests the node's children in index
order. A child with token x drawn from q (its draft distribution) is accepted iff
``u * q(x) <= r(x)``, r the current residual (the target's distribution at the node, normalized;
``q(x) == 0`` rejects); a deterministic child (no draft logits) has q one-hot at x. An accepted
child becomes the current node (its residual: the target's distribution there); a rejected one
turns the residual into ``normalize(max(r - q, 0))`` (kept as it was if nothing is left, which
exact arithmetic never gives) and the next sibling is tested. When no child is accepted the
walk ends with one token drawn from the residual: the correction, or the bonus token at a leaf.
Greedy rows follow the first child equal to the target's argmax and end with that argmax.

This is SpecInfer's multi-candidate verification (Miao et al. 2024; SpecTr, Sun et al. 2023):
lossless when each child was drawn from its q independently of its siblings, or chosen
deterministically. Slow on purpose; imports torch and the shared sampler modules only.
"""

from __future__ import annotations

import torch

from .._types import RejectionNoise
from .sampling import _sample_inverse_cdf, _sample_race, process_logits


def tree_rejection_sample(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, token_ids: torch.Tensor,
                          parents: torch.Tensor, num_nodes: torch.Tensor | None = None, *,
                          temperature: float | torch.Tensor = 1.0, top_k: int | None = None,
                          top_p: float | None = None, greedy: bool | torch.Tensor = False,
                          noise: RejectionNoise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(token_ids [B, N+1], num_accepted [B], path [B, N])`` as the op's
    `TreeRejectionOutput`; ``noise``: ``accept`` [B, N] (node i's uniform), and for the final draw
    ``exponential`` [B, V] (an exponential race, as the Triton kernel draws) or else ``uniform``
    [B, 2] (the two-level inverse CDF)."""
    B, N1, V = target_logits.shape
    N = N1 - 1
    temps = temperature.tolist() if isinstance(temperature, torch.Tensor) else [temperature] * B
    flags = greedy.tolist() if isinstance(greedy, torch.Tensor) else [bool(greedy)] * B
    out_ids = torch.full((B, N + 1), -1, dtype=torch.int64)
    out_path = torch.full((B, N), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        n = N if num_nodes is None else int(num_nodes[b])
        p = process_logits(target_logits[b : b + 1, : n + 1], temps[b], top_k, top_p)[0].cpu()    # [n+1, V]
        q = None if draft_logits is None else process_logits(draft_logits[b : b + 1, :n], temps[b], top_k,
                                                             top_p)[0].cpu()
        is_greedy = flags[b] or temps[b] == 0
        ids, parent = token_ids[b, :n].tolist(), parents[b, :n].tolist()
        u = noise.accept[b].cpu()
        node, path, residual = -1, [], p[0].clone()
        while True:
            moved = False
            for child in (i for i in range(n) if parent[i] == node):
                x = ids[child]
                if is_greedy:
                    accept = x == int(target_logits[b, node + 1].float().argmax())
                else:
                    q_child = torch.zeros(V).index_fill_(0, torch.tensor([x]), 1.0) if q is None else q[child]
                    accept = bool(q_child[x] > 0) and bool(u[child] * q_child[x] <= residual[x])
                if accept:
                    node, moved = child, True
                    path.append(child)
                    residual = p[child + 1].clone()
                    break
                if not is_greedy:
                    left = (residual - q_child).clamp_min(0.0)
                    if left.sum() > 0:
                        residual = left / left.sum()
            if not moved:
                break
        if is_greedy:
            token = int(target_logits[b, node + 1].float().argmax())
        elif noise.exponential is not None:
            token = _sample_race(residual, noise.exponential[b].cpu())
        else:
            token = _sample_inverse_cdf(residual, noise.uniform[b].cpu())
        out_ids[b, : len(path)] = torch.tensor([ids[i] for i in path], dtype=torch.int64)
        out_ids[b, len(path)] = token
        out_path[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
        num_accepted[b] = len(path)
    device = target_logits.device
    return out_ids.to(device), num_accepted.to(device), out_path.to(device)
