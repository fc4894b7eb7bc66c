"""tree_rejection_sample: the torch path and the Triton kernel (under the interpreter) equal the
reference walk token for token; greedy takes the longest path of argmaxes; sampling is lossless by
chi-square on adversarial trees (sampled and deterministic siblings, equal and duplicate tokens,
one-hot targets, a second level); the kernel reads full vocabulary rows only along the accepted
path and where the walk stops; bad input raises; no host sync."""

from __future__ import annotations

import zlib

import pytest
import torch
from test_sampling_distribution import P_THRESHOLD, chi_square_pvalue

from specdec_kernels import DeviceCheckError, make_rejection_noise, rejection_sample_logits, tree_rejection_sample
from specdec_kernels._backend import interpreter_enabled, triton_available
from specdec_kernels.testing import SyncCounter, TrafficMeter

INTERPRETED = triton_available() and interpreter_enabled()  # the Triton kernel runs on CPU tensors
needs_interpreter = pytest.mark.skipif(not INTERPRETED,
                                       reason="the Triton kernel runs on CPU tensors under the interpreter")


def random_parents(B: int, N: int, gen: torch.Generator) -> torch.Tensor:
    """[B, N] parents of random trees in topological order."""
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        parents[:, i] = torch.randint(-1, i, (B,), generator=gen)
    return parents


def random_case(B: int, N: int, V: int, drafts: str, seed: int, dtype: torch.dtype = torch.float32):
    """Random trees whose tokens are often the target's argmax (long paths), ragged node counts
    and a quarter of greedy rows: ``(target, draft, ids, parents, num_nodes, greedy)``. With
    ``drafts="duplicates"`` the (deterministic) tokens come from three likely ids, so that
    siblings often repeat a rejected token."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(B, N + 1, V, generator=gen) * 2
    draft = torch.randn(B, N, V, generator=gen) * 2 if drafts == "sampled" else None
    ids = torch.where(torch.rand(B, N, generator=gen) < 0.6, target[:, :N].argmax(-1),
                      torch.randint(0, V, (B, N), generator=gen))
    if drafts == "duplicates":
        target[..., :3] += 8
        ids = torch.randint(0, 3, (B, N), generator=gen)
    parents = random_parents(B, N, gen)
    num_nodes = torch.randint(0, N + 1, (B,), generator=gen)
    greedy = torch.rand(B, generator=gen) < 0.25
    return (target.to(dtype), None if draft is None else draft.to(dtype), ids, parents, num_nodes, greedy)


@pytest.mark.parametrize("drafts", ["sampled", "deterministic", "duplicates"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, 0.9), (0.0, None, None)])
def test_torch_path_equals_the_reference(drafts, temperature, top_k, top_p):
    *args, greedy = random_case(24, 9, 300, drafts, seed=1)  # two vocabulary chunks in the final draw
    target, draft, ids, parents, num_nodes = args
    B = target.shape[0]
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


@needs_interpreter
@pytest.mark.parametrize("drafts", ["sampled", "deterministic", "duplicates"])
@pytest.mark.parametrize("B,V,dtype,temperature,top_k,top_p", [
    (24, 300, torch.float32, 1.0, None, None),
    (6, 300, torch.float32, 0.7, 5, 0.9),
    (12, 2100, torch.float16, 0.8, None, None),  # three vocabulary tiles
    (12, 300, torch.bfloat16, 0.0, None, None),
], ids=["fp32", "fp32-topk-topp", "fp16-three-tiles", "bf16-greedy"])
def test_triton_kernel_equals_the_reference(drafts, B, V, dtype, temperature, top_k, top_p):
    """Given the same uniforms and exponentials, the kernel takes the reference's path and draws
    its token (greedy, sampled and filtered rows; duplicate and equal siblings; ragged counts)."""
    *args, greedy = random_case(B, 9, V, drafts, seed=B + V, dtype=dtype)
    noise = make_rejection_noise(B, 9, V, seed=3)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, noise=noise)
    ref = tree_rejection_sample(*args, **kw, backend="reference")
    out = tree_rejection_sample(*args, **kw, backend="triton")
    assert torch.equal(out.token_ids, ref.token_ids) and torch.equal(out.path, ref.path)
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert (ref.num_accepted > 0).any()


@needs_interpreter
@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_triton_kernel_walks_trees_wider_than_a_block(drafts):
    """40 nodes, more than a block of `BN` = 16: chains accepted deeper than 16, a root with 40
    children, random trees; and trees without nodes."""
    B, N, V = 6, 40, 64
    gen = torch.Generator().manual_seed(2)
    target = torch.randn(B, N + 1, V, generator=gen)
    target[..., 7] += 12  # token 7 is (nearly) always the target's choice
    draft = torch.randn(B, N, V, generator=gen) if drafts == "sampled" else None
    if draft is not None:
        draft[..., 7] += 12
    ids = torch.where(torch.rand(B, N, generator=gen) < 0.8, 7, torch.randint(0, V, (B, N), generator=gen))
    ids[:2] = 7  # the chains' tokens
    chain, star = torch.arange(-1, N - 1), torch.full((N,), -1)
    parents = torch.stack([chain, chain, star, star, *random_parents(2, N, gen)])
    noise = make_rejection_noise(B, N, V, seed=5)
    for args in ((target, draft, ids, parents, None), (target[:, :1], None if draft is None else draft[:, :0],
                                                       ids[:, :0], parents[:, :0], None)):
        ref = tree_rejection_sample(*args, noise=noise if args[2].shape[1] else make_rejection_noise(B, 0, V, seed=5),
                                    backend="reference")
        out = tree_rejection_sample(*args, noise=noise if args[2].shape[1] else make_rejection_noise(B, 0, V, seed=5),
                                    backend="triton")
        assert torch.equal(out.token_ids, ref.token_ids) and torch.equal(out.path, ref.path)
        assert torch.equal(out.num_accepted, ref.num_accepted)
    assert ref.num_accepted.tolist() == [0] * B
    full = tree_rejection_sample(target, draft, ids, parents, noise=noise, backend="triton")
    assert full.num_accepted[:2].max() > 16


@needs_interpreter
@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_triton_chain_draws_what_the_chain_sampler_draws(drafts):
    """A chain tree is a chain: with the same int seed, the kernel's random numbers (node i's
    acceptance uniform, the final race's exponentials) are those of `rejection_sample_logits`."""
    gen = torch.Generator().manual_seed(3)
    B, K, V = 8, 4, 300
    target = torch.randn(B, K + 1, V, generator=gen) * 2
    draft = torch.randn(B, K, V, generator=gen) * 2 if drafts == "sampled" else None
    ids = torch.where(torch.rand(B, K, generator=gen) < 0.7, target[:, :K].argmax(-1),
                      torch.randint(0, V, (B, K), generator=gen))
    chain = torch.arange(-1, K - 1).expand(B, K).contiguous()
    tree = tree_rejection_sample(target, draft, ids, chain, temperature=0.8, seed=11, backend="triton")
    flat = rejection_sample_logits(target, draft, ids, temperature=0.8, seed=11, backend="triton")
    assert torch.equal(tree.token_ids, flat.token_ids) and torch.equal(tree.num_accepted, flat.num_accepted)
    assert (flat.num_accepted > 0).any() and (flat.num_accepted < K).any()


def _tested_children(parents: list[int], n: int, path: list[int]) -> list[tuple[int, bool]]:
    """(node, accepted) of every node the walk tests, in order: the children of each path node
    (and the root) up to the accepted one, then all children of the last."""
    tested, node = [], -1
    for nxt in path + [None]:
        for i in range(node + 1, n):
            if parents[i] == node:
                tested.append((i, i == nxt))
                if i == nxt:
                    break
        node = nxt
    return tested


def minimum_tree_bytes(target, draft, parents, num_nodes, greedy, out) -> int:
    """Bytes the tree rule needs per row: parents and the outputs; greedy rows read each path
    node's target row (and the root's) for its argmax. Sampled rows read a path node's target row
    for its normalizer when a child of it is tested, gather the tested tokens' probabilities, read
    each tested child's draft row for its normalizer, and draw the final token in one more pass
    over the last node's row; with draft rows a rejection also reads the residual and the draft
    row again and writes the new residual (float32), which the final draw then reads."""
    B, N1, V = target.shape
    N, es = N1 - 1, target.element_size()
    row = V * es
    total = 0
    for b in range(B):
        n, depth = int(num_nodes[b]), int(out.num_accepted[b])
        path = out.path[b, :depth].tolist()
        total += 8 + 1 + n * 8 + (2 * N + 1) * 8 + 8  # count, greedy flag, parents; outputs
        tested = _tested_children(parents[b].tolist(), n, path)
        if greedy[b]:
            total += (depth + 1) * row + len(tested) * 8
            continue
        normalized = {int(parents[b, i]) for i, _ in tested}
        total += len(normalized) * row + len(tested) * (8 + es) + row
        if draft is not None:
            total += len(tested) * (row + es)
            scratch = False
            for _, accepted in tested:
                if accepted:
                    scratch = False
                    continue
                total += (V * 4 if scratch else row) + row + V * 4
                scratch = True
            total += V * 4 - row if scratch else 0  # the final draw reads the residual instead
    return total


@needs_interpreter
@pytest.mark.parametrize("drafts,dtype", [("deterministic", torch.float32), ("deterministic", torch.bfloat16),
                                          ("sampled", torch.float32)], ids=["deterministic-fp32", "deterministic-bf16",
                                                                            "sampled-fp32"])
def test_triton_bytes_within_115_percent_of_minimum(drafts, dtype):
    """The kernel reads full rows only where the rule needs them (`minimum_tree_bytes`): along the
    accepted path and at the node where the walk stops, never the other nodes' rows."""
    B, N, V = 6, 8, 4096
    target, draft, ids, parents, num_nodes, greedy = random_case(B, N, V, drafts, seed=4, dtype=dtype)
    greedy = torch.tensor([False, True, False, False, False, False])
    if draft is None:  # likely tokens, so that sampled rows walk deeper than the root
        ids = torch.randint(0, 3, (B, N), generator=torch.Generator().manual_seed(0))
        target[..., :3] = 10.0  # each about 1/3
    with TrafficMeter() as meter:
        out = tree_rejection_sample(target, draft, ids, parents, num_nodes, greedy=greedy, temperature=0.9,
                                    seed=2, validate=False, backend="triton")
    assert meter.num_launches == 1
    minimum = minimum_tree_bytes(target, draft, parents, num_nodes, greedy, out)
    assert meter.bytes_moved <= 1.15 * minimum, (meter, minimum)
    every_row = target.numel() * target.element_size() + (0 if draft is None else draft.numel() * draft.element_size())
    assert minimum < 0.6 * every_row, (minimum, every_row)  # the test tells reading every row apart
    assert out.num_accepted[~greedy].max() >= 2


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


KINDS = ["sampled-siblings", "one-hot-target", "q-disjoint", "deterministic-disjoint", "deterministic-duplicates",
         "deterministic-all-equal"]


def _first_tokens(kind: str, rows: int, backend_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three children of the root: the emitted first tokens, and the target's distribution."""
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()) % 1000)  # str hashes vary per run
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
    return out.token_ids[:, 0], p


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend_name", ["torch", "reference"])
def test_first_token_follows_the_target(kind, backend_name):
    """The emitted first token follows the target's distribution."""
    first, p = _first_tokens(kind, ROWS if backend_name == "torch" else 2000, backend_name)
    assert chi_square_pvalue(first, p) > P_THRESHOLD


@needs_interpreter
@pytest.mark.parametrize("kind", ["sampled-siblings", "deterministic-disjoint", "deterministic-duplicates"])
def test_triton_first_token_follows_the_target(kind):
    """The kernel with its own random numbers (on fewer rows: the interpreter is slow; its
    equality with the reference given the same noise covers the other kinds)."""
    first, p = _first_tokens(kind, 400, "triton")
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


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_no_host_sync(backend_name):
    if backend_name == "triton" and not INTERPRETED:
        pytest.skip("the Triton kernel runs on CPU tensors under the interpreter")
    target, ids = torch.randn(3, 5, 40), torch.randint(0, 40, (3, 4))
    parents = torch.tensor([[-1, 0, 0, 1]] * 3)
    with SyncCounter() as syncs:
        tree_rejection_sample(target, torch.randn(3, 4, 40), ids, parents, torch.tensor([4, 2, 0]), seed=1,
                              generator=None, top_k=5, backend=backend_name)
    assert syncs.count == 0, syncs.events


def test_explicit_noise_must_fit_the_backend():
    target, ids, parents = torch.randn(2, 4, 10), torch.zeros(2, 3, dtype=torch.int64), torch.full((2, 3), -1)
    with pytest.raises(ValueError, match="noise.accept"):
        tree_rejection_sample(target, None, ids, parents, noise=make_rejection_noise(2, 2))
    with pytest.raises(ValueError, match="noise.uniform"):
        tree_rejection_sample(target, None, ids, parents, backend="torch",
                              noise=make_rejection_noise(2, 3, 10)._replace(uniform=None))
    if INTERPRETED:
        with pytest.raises(ValueError, match="noise.exponential"):
            tree_rejection_sample(target, None, ids, parents, noise=make_rejection_noise(2, 3), backend="triton")
