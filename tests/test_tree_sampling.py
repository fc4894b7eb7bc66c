"""tree_rejection_sample: the torch path equals the reference walk token for token; greedy takes
the longest path of argmaxes; sampling is lossless by chi-square on adversarial trees (sampled
and deterministic siblings, equal and duplicate tokens, one-hot targets, a second level); bad
input raises; no host sync."""

from __future__ import annotations

import pytest
import torch
from test_sampling_distribution import P_THRESHOLD, chi_square_pvalue

from specdec_kernels import DeviceCheckError, tree_rejection_sample
from specdec_kernels.testing import SyncCounter


def random_parents(B: int, N: int, gen: torch.Generator) -> torch.Tensor:
    """[B, N] parents of random trees in topological order."""
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        parents[:, i] = torch.randint(-1, i, (B,), generator=gen)
    return parents


@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, 0.9), (0.0, None, None)])
def test_torch_path_equals_the_reference(drafts, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    B, N, V = 24, 9, 300  # two vocabulary chunks in the final draw
    target = torch.randn(B, N + 1, V, generator=gen) * 2
    draft = torch.randn(B, N, V, generator=gen) * 2 if drafts == "sampled" else None
    # Tokens near the target's argmax, so that paths get long.
    ids = torch.where(torch.rand(B, N, generator=gen) < 0.6, target[:, :N].argmax(-1),
                      torch.randint(0, V, (B, N), generator=gen))
    parents = random_parents(B, N, gen)
    num_nodes = torch.randint(0, N + 1, (B,), generator=gen)
    greedy = torch.rand(B, generator=gen) < 0.25
    args = (target, draft, ids, parents, num_nodes)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, seed=7)
    ref = tree_rejection_sample(*args, **kw, backend="reference")
    out = tree_rejection_sample(*args, **kw, backend="torch")
    assert torch.equal(out.token_ids, ref.token_ids) and torch.equal(out.path, ref.path)
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert (out.num_accepted > 0).any()
    for b in range(B):  # the path follows parents from the root, and its tokens are the nodes'
        j, path = int(out.num_accepted[b]), out.path[b].tolist()
        assert all(p == -1 for p in path[j:]) and out.token_ids[b, j + 1:].eq(-1).all()
        previous = -1
        for node in path[:j]:
            assert int(parents[b, node]) == previous and node < int(num_nodes[b])
            previous = node
        assert out.token_ids[b, :j].tolist() == [int(ids[b, n]) for n in path[:j]]


def test_greedy_takes_the_longest_path_of_argmaxes():
    V = 6
    target = torch.full((1, 6, V), -5.0)
    best = [2, 4, 1, 3, 0, 5]  # the target's argmax at the root and after each node
    for i, x in enumerate(best):
        target[0, i, x] = 5.0
    # root -> 0 (tok 1, wrong), 1 (tok 2, right) ; 1 -> 2 (tok 1: argmax after node 1 is best[2] = 1)
    # 2 -> 3 (tok 0: wrong, argmax after node 2 is best[3] = 3), 4 (tok 3: right)
    ids = torch.tensor([[1, 2, 1, 0, 3]])
    parents = torch.tensor([[-1, -1, 1, 2, 2]])
    out = tree_rejection_sample(target, None, ids, parents, temperature=0.0)
    assert out.path[0].tolist() == [1, 2, 4, -1, -1]
    assert out.token_ids[0].tolist() == [2, 1, 3, best[5], -1, -1]


def _pair(V: int, gen: torch.Generator, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(torch.randn(V, generator=gen) * 1.5, 0)
    q = torch.softmax(torch.randn(V, generator=gen) * 1.5, 0)
    if kind == "one-hot-target":
        p = torch.zeros(V)
        p[3] = 1.0
    if kind == "q-disjoint":
        p[: V // 2] = 0
        q[V // 2:] = 0
        p, q = p / p.sum(), q / q.sum()
    return p, q


ROWS = 20000


@pytest.mark.parametrize("kind", ["sampled-siblings", "one-hot-target", "q-disjoint", "deterministic-disjoint",
                                  "deterministic-duplicates", "deterministic-all-equal"])
@pytest.mark.parametrize("backend_name", ["torch", "reference"])
def test_first_token_follows_the_target(kind, backend_name):
    """Three children of the root: the emitted first token follows the target's distribution."""
    rows = ROWS if backend_name == "torch" else 2000
    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    V, m = 8, 3
    p, q = _pair(V, gen, kind)
    target = p.log().expand(rows, m + 1, V).contiguous()
    if kind.startswith("deterministic"):
        draft = None
        choices = {"deterministic-disjoint": [1, 4, 6], "deterministic-duplicates": [1, 1, 6],
                   "deterministic-all-equal": [5, 5, 5]}[kind]
        ids = torch.tensor(choices).expand(rows, m).contiguous()
    else:
        draft = q.log().expand(rows, m, V).contiguous()
        ids = torch.multinomial(q, rows * m, replacement=True, generator=gen).view(rows, m)
    parents = torch.full((rows, m), -1, dtype=torch.int64)
    out = tree_rejection_sample(target, draft, ids, parents, seed=11, backend=backend_name)
    first = out.token_ids[:, 0]
    assert chi_square_pvalue(first, p) > P_THRESHOLD


@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_second_level_follows_the_target(drafts):
    """The root's one child is always accepted (the target puts all mass on it); its three
    children are verified against the target at it: the second emitted token follows that."""
    gen = torch.Generator().manual_seed(5)
    V = 8
    p_root = torch.zeros(V)
    p_root[2] = 1.0
    p1, q1 = _pair(V, gen, "sampled-siblings")
    target = torch.stack([p_root, p1, p1, p1, p1]).log().expand(ROWS, 5, V).contiguous()
    parents = torch.tensor([-1, 0, 0, 0]).expand(ROWS, 4).contiguous()
    if drafts == "sampled":
        draft = torch.stack([p_root, q1, q1, q1]).log().expand(ROWS, 4, V).contiguous()
        children = torch.multinomial(q1, ROWS * 3, replacement=True, generator=gen).view(ROWS, 3)
    else:
        draft, children = None, torch.tensor([0, 7, 0]).expand(ROWS, 3)
    ids = torch.cat([torch.full((ROWS, 1), 2), children], 1)
    out = tree_rejection_sample(target, draft, ids, parents, seed=3)
    assert (out.num_accepted >= 1).all() and (out.token_ids[:, 0] == 2).all()
    assert chi_square_pvalue(out.token_ids[:, 1], p1) > P_THRESHOLD


def test_chi_square_catches_verification_without_the_residual_update():
    """The test has power: testing each sibling against the untouched target (no residual
    update) over-emits the drafted tokens, and the chi-square test sees it."""
    gen = torch.Generator().manual_seed(9)
    V = 8
    p, q = _pair(V, gen, "sampled-siblings")
    ids = torch.multinomial(q, ROWS * 3, replacement=True, generator=gen).view(ROWS, 3)
    u = torch.rand(ROWS, 3, generator=gen)
    accepted = u * q[ids] <= p[ids]
    first = torch.where(accepted.any(1), ids.gather(1, accepted.long().argmax(1, keepdim=True)).squeeze(1),
                        torch.multinomial(p, ROWS, replacement=True, generator=gen))
    assert chi_square_pvalue(first, p) < P_THRESHOLD


def test_bad_input_raises():
    target, ids, parents = torch.randn(2, 4, 10), torch.zeros(2, 3, dtype=torch.int64), torch.full((2, 3), -1)
    with pytest.raises(DeviceCheckError, match="parents"):
        tree_rejection_sample(target, None, ids, torch.tensor([[-1, 1, 0], [-1, -1, -1]]))  # node 1 its own parent
    with pytest.raises(DeviceCheckError, match="token_ids"):
        tree_rejection_sample(target, None, ids + 10, parents)
    with pytest.raises(ValueError, match="draft_logits"):
        tree_rejection_sample(target, torch.randn(2, 4, 10), ids, parents)
    with pytest.raises(ValueError, match="parents"):
        tree_rejection_sample(target, None, ids, parents.int())
    nan = target.clone()
    nan[1, 2] = float("nan")
    with pytest.raises(DeviceCheckError, match="target_logits"):
        tree_rejection_sample(nan, None, ids, parents)
    # A row past num_nodes is never read: NaN there is fine.
    tree_rejection_sample(nan, None, ids, parents, torch.tensor([3, 1]))
    # Callers that checked the values themselves skip the checks: ids stay in range.
    out = tree_rejection_sample(nan, None, ids, parents, validate=False, seed=0)
    assert ((out.token_ids >= -1) & (out.token_ids < 10)).all()
    with pytest.raises(TypeError, match="validate"):
        tree_rejection_sample(target, None, ids, parents, validate=1)


def test_no_host_sync():
    target, ids = torch.randn(3, 5, 40), torch.randint(0, 40, (3, 4))
    parents = torch.tensor([[-1, 0, 0, 1]] * 3)
    with SyncCounter() as syncs:
        tree_rejection_sample(target, torch.randn(3, 4, 40), ids, parents, torch.tensor([4, 2, 0]), seed=1)
    assert syncs.count == 0, syncs.events
