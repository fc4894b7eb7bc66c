"""Speculative decoding with token trees: a drafter returning ``DraftProposal.parents`` is
verified as a tree in one target forward (tree-masked attention, positions by depth), the
accepted path kept with `KVCache.compact`; greedy output equals plain greedy decoding whatever
the tree; a target that cannot take a tree is refused by name."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels import DraftProposal, PromptLookupDraft, generate, speculative_generate
from specdec_kernels.testing import OracleDraft

from tiny_models import V, ragged_prompts, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


class OracleTree(OracleDraft):
    """The known continuation as a tree: every right token has a wrong elder sibling (its token
    plus one), so the accepted path is the right nodes: nodes 1, 3, 5, ... of a proposal."""

    def propose(self, num_tokens: int, sample):
        right = super().propose((num_tokens + 1) // 2, sample).token_ids          # [B, ceil(k / 2)]
        B = right.shape[0]
        ids = torch.stack([(right + 1) % V, right], -1).flatten(1)[:, :num_tokens]
        node = torch.arange(num_tokens)
        parents = torch.where(node < 2, -1, (node // 2) * 2 - 1).expand(B, -1).contiguous()
        return DraftProposal(ids, None, None, parents)


class RandomTree:
    """Random tokens under random parents (a hostile tree)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def prefill(self, input_ids, q_seqlens, max_len):
        self.B = input_ids.shape[0]

    def propose(self, num_tokens, sample):
        ids = torch.randint(0, V, (self.B, num_tokens), generator=self.gen)
        parents = torch.stack([torch.randint(-1, max(i, 0), (self.B,), generator=self.gen) if i else
                               torch.full((self.B,), -1) for i in range(num_tokens)], 1)
        return DraftProposal(ids, torch.randint(0, num_tokens + 1, (self.B,), generator=self.gen), None, parents)

    def commit(self, token_ids, num_tokens):
        pass

    def select(self, rows):
        self.B = rows.shape[0]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_oracle_tree_keeps_its_right_branch(target, adaptive):
    ids, mask = ragged_prompts(B=4)
    plain = generate(target, ids, mask, max_new_tokens=21, temperature=0)
    truth = generate(target, ids, mask, max_new_tokens=21 + 8, temperature=0).tokens
    spec = speculative_generate(target, OracleTree(truth), ids, mask, num_draft_tokens=6, max_new_tokens=21,
                                temperature=0, adaptive=adaptive)
    assert torch.equal(spec.tokens, plain.tokens)
    if not adaptive:  # the 3 right nodes of 6 accepted at every step with the whole tree, then
        # the target's own token: 20 tokens after the prefill's in 5 steps
        assert (spec.stats.draft_lengths[:, 6] == 5).all() and (spec.stats.num_accepted == 15).all()


@pytest.mark.parametrize("max_new_tokens", [17, 18, 19, 20])
def test_a_tree_near_the_token_budget_keeps_its_nodes_and_stops_its_path(target, max_new_tokens):
    """Near the end of the budget the tree is not cut to as many nodes as drafts could be kept
    (that keeps the wrong first sibling and shallow paths): it is verified whole, and its
    accepted path stops at the budget. Each step gains its 3 right nodes and the target's token
    or what the budget has left, so the n = 16-19 tokens after the prefill's take ceil(n / 4)
    steps (at n = 17 the last is a plain one: one token is left, no draft can be kept)."""
    ids, mask = ragged_prompts(B=4)
    plain = generate(target, ids, mask, max_new_tokens=max_new_tokens, temperature=0)
    truth = generate(target, ids, mask, max_new_tokens=max_new_tokens + 8, temperature=0).tokens
    spec = speculative_generate(target, OracleTree(truth), ids, mask, num_draft_tokens=6,
                                max_new_tokens=max_new_tokens, temperature=0, adaptive=False)
    assert torch.equal(spec.tokens, plain.tokens)
    steps, trees = -(-(max_new_tokens - 1) // 4), -(-(max_new_tokens - 2) // 4)
    assert (spec.stats.num_steps == steps).all() and (spec.stats.draft_lengths[:, 6] == trees).all()
    assert (spec.stats.num_accepted == max_new_tokens - 1 - steps).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_tree_cannot_change_greedy_output(target, seed):
    ids, mask = ragged_prompts(B=5, seed=seed)
    plain = generate(target, ids, mask, max_new_tokens=16, temperature=0)
    spec = speculative_generate(target, RandomTree(seed), ids, mask, num_draft_tokens=5, max_new_tokens=16,
                                temperature=0, adaptive=False)
    assert torch.equal(spec.tokens, plain.tokens)


def test_sampling_with_a_tree_is_seeded_and_in_range(target):
    ids, mask = ragged_prompts(B=3)
    truth = generate(target, ids, mask, max_new_tokens=20, temperature=0).tokens
    runs = [speculative_generate(target, OracleTree(truth), ids, mask, num_draft_tokens=4, max_new_tokens=12,
                                 temperature=0.8, seed=5, adaptive=False).tokens for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert ((runs[0] >= 0) & (runs[0] < V)).all()


def test_a_target_without_tree_mask_is_refused(target):
    class ChainOnly(type(target)):
        def forward(self, input_ids, cache, q_seqlens=None, *, last_only=False):
            return super().forward(input_ids, cache, q_seqlens, last_only=last_only)

    chain_only = ChainOnly.__new__(ChainOnly)
    chain_only.__dict__ = target.__dict__
    ids, mask = ragged_prompts(B=2)
    truth = generate(target, ids, mask, max_new_tokens=12, temperature=0).tokens
    with pytest.raises(TypeError, match="tree_mask"):
        speculative_generate(chain_only, OracleTree(truth), ids, mask, num_draft_tokens=4, max_new_tokens=8,
                             temperature=0, adaptive=False)


def test_prompt_lookup_is_a_chain_by_default():
    context = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 0, 0]])
    proposal = PromptLookupDraft()
    proposal.prefill(context, torch.tensor([7]), 16)
    assert proposal.propose(3, None).parents is None


def test_prompt_lookup_tree_merges_the_continuations_of_earlier_occurrences():
    #                      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    context = torch.tensor([[5, 6, 1, 2, 5, 6, 1, 3, 5, 6, 7, 8, 5, 6, 0, 0]])
    # [5, 6] occurred at 8, 4 and 0: continuations 7 8 5 6 / 1 3 5 6 .. / 1 2 5 6 .. (sharing the 1)
    ids, num, logits, parents = PromptLookupDraft(max_ngram=2, branches=3).lookup_tree(context, torch.tensor([14]), 6)
    assert logits is None and num.tolist() == [6]
    # by depth * (branch + 1): 7 and 1 (roots), 8, then 5 (after 8) and 3 (after 1), then 6
    assert ids.tolist() == [[7, 1, 8, 5, 3, 6]]
    assert parents.tolist() == [[-1, -1, 0, 2, 1, 3]]
    none, zero, _, _ = PromptLookupDraft(branches=2).lookup_tree(torch.tensor([[1, 2, 3, 4]]), torch.tensor([4]), 3)
    assert zero.tolist() == [0]


@pytest.mark.parametrize("branches", [2, 4])
def test_prompt_lookup_trees_keep_greedy_output(target, branches):
    ids, mask = ragged_prompts(B=4, seed=1)
    ids = torch.cat([ids, ids[:, -6:], ids[:, -6:]], 1)  # repeats for the lookup to find
    mask = torch.cat([mask, torch.ones(4, 12, dtype=mask.dtype)], 1)
    plain = generate(target, ids, mask, max_new_tokens=24, temperature=0)
    spec = speculative_generate(target, PromptLookupDraft(branches=branches), ids, mask, num_draft_tokens=7,
                                max_new_tokens=24, temperature=0, adaptive=False)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.stats.num_accepted.sum() > 0


class GreedyTree:
    """Four nodes two deep from the target's own greedy continuation g1, g2 of each row: a wrong
    first child (g1 + 1), then g1 with a wrong child (g2 + 1) and g2: sampled rows often accept
    the path two deep."""

    def __init__(self, model) -> None:
        self.model = model

    def prefill(self, input_ids, q_seqlens, max_len):
        self.text, self.lengths = input_ids, q_seqlens.clone()

    def propose(self, num_tokens, sample):
        width = int(self.lengths.max())
        mask = (torch.arange(width) < self.lengths[:, None]).long()
        g = generate(self.model, self.text[:, :width], mask, max_new_tokens=2, temperature=0).tokens
        V = self.model.vocab_size
        ids = torch.stack([(g[:, 0] + 1) % V, g[:, 0], (g[:, 1] + 1) % V, g[:, 1]], 1)[:, :num_tokens]
        parents = torch.tensor([-1, -1, 1, 1])[:num_tokens].expand(len(g), -1).contiguous()
        return DraftProposal(ids, None, None, parents)

    def commit(self, token_ids, num_tokens):
        columns = self.lengths[:, None] + torch.arange(token_ids.shape[1])
        self.text = torch.cat([self.text, self.text.new_zeros(len(self.text), token_ids.shape[1])], 1)
        real = torch.arange(token_ids.shape[1]) < num_tokens[:, None]
        rows = torch.arange(len(self.text))[:, None].expand_as(columns)
        self.text[rows[real], columns[real]] = token_ids[real]
        self.lengths += num_tokens

    def select(self, rows):
        self.text, self.lengths = self.text[rows], self.lengths[rows]


def test_sampling_with_a_tree_stopped_at_the_budget_is_lossless():
    """Five tokens, trees of 4 nodes two deep: rows that gained two tokens at the first step
    verify a whole tree with room for one draft, so a path accepted two deep stops after one,
    and the second accepted node is the row's last token. The tokens keep the target's exact
    distribution (chi-square over the first two and the last two)."""
    from test_generation import P_THRESHOLD, chi_square_pvalue, exact_joint

    V = 16
    model = tiny_llama(seed=1, scale=4.0, layers=2, hidden=32, heads=4, kv_heads=1, vocab_size=V)
    prompt = torch.tensor([3, 1, 4])
    joint = exact_joint(model, prompt, 5)
    ids = prompt.expand(8000, -1).contiguous()
    out = speculative_generate(model, GreedyTree(model), ids, num_draft_tokens=4, max_new_tokens=5, seed=3,
                               adaptive=False, temperature=1.0)
    t, st = out.tokens, out.stats
    for pair, exact in ((t[:, :2], joint.sum((2, 3, 4))), (t[:, 3:], joint.sum((0, 1, 2)))):
        assert chi_square_pvalue(torch.bincount(pair[:, 0] * V + pair[:, 1], minlength=V * V).reshape(V, V), exact) \
            > P_THRESHOLD
    # The first tree is asked for 3 nodes (before the loop has seen a tree, the budget cuts it);
    # rows that accepted its right node then verify a whole tree and keep one draft of it.
    stopped = (st.num_steps == 2) & (st.num_proposed == 3 + 4) & (st.num_accepted == 1 + 1)
    assert (st.num_generated == 5).all() and stopped.float().mean() > 0.05
