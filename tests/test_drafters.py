"""The Drafter protocol: user drafters, proposals checked, per-row draft lengths, adaptive
speculation, streaming."""

from types import SimpleNamespace

import pytest
import torch

from specdec_kernels import (
    DeviceCheckError,
    Drafter,
    DraftProposal,
    EarlyExitDraft,
    LookupFirstDraft,
    ModelDraft,
    PromptLookupDraft,
    _draft_lengths,
    generate,
    speculative_generate,
)
from specdec_kernels._draft_lengths import UNANSWERED_STEPS, DraftLengths
from specdec_kernels.testing import OracleDraft as Oracle

from tiny_models import V, greedy_divergence_allowed, ragged_prompts, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, scale=3.0, layers=3)


class Hostile:
    """Random tokens and random lengths within bounds, with or without (random) draft logits."""

    def __init__(self, seed: int, with_logits: bool) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.with_logits = with_logits

    def prefill(self, input_ids, q_seqlens, max_len):
        self.B = input_ids.shape[0]

    def propose(self, num_tokens, sample):
        ids = torch.randint(0, V, (self.B, num_tokens), generator=self.generator)
        num = torch.randint(0, num_tokens + 1, (self.B,), generator=self.generator)
        logits = torch.randn(self.B, num_tokens, V, generator=self.generator) if self.with_logits else None
        return DraftProposal(ids, num, logits)

    def commit(self, token_ids, num_tokens):
        assert (num_tokens >= 1).all() and token_ids.shape[0] == self.B

    def select(self, rows):
        self.B = len(rows)


def docstring_drafter():
    """The example drafter of `specdec_kernels.drafts`' docstring, run as written there."""
    import textwrap

    import specdec_kernels.drafts as drafts

    doc = drafts.__doc__
    code = textwrap.dedent(doc[doc.index("    class RepeatLastToken:"): doc.index("Every method runs")])
    namespace = {"DraftProposal": DraftProposal}
    exec(code, namespace)
    return namespace["RepeatLastToken"]


RepeatLastToken = docstring_drafter()


def assert_greedy_equal(target, ids, mask, plain, spec, allowances=1):
    differing = 0
    for row in range(ids.shape[0]):
        differ = (plain.tokens[row] != spec.tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(target, ids, mask, plain.tokens, row, int(differ[0])), row
            differing += 1
    assert differing <= allowances


def test_the_docstring_example_drafter_runs(target):
    import specdec_kernels.drafts as drafts

    assert "class RepeatLastToken:" in drafts.__doc__
    assert isinstance(RepeatLastToken(), Drafter)
    ids, mask = ragged_prompts(B=3, left=False)
    plain = generate(target, ids, mask, max_new_tokens=10, temperature=0)
    spec = speculative_generate(target, RepeatLastToken(), ids, mask, max_new_tokens=10, temperature=0)
    assert_greedy_equal(target, ids, mask, plain, spec)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_oracle_drafts_are_always_accepted(target, adaptive):
    ids, mask = ragged_prompts(B=4)
    plain = generate(target, ids, mask, max_new_tokens=21, temperature=0)
    beyond = generate(target, ids, mask, max_new_tokens=21 + 4, temperature=0)  # drafts past the budget are right too
    spec = speculative_generate(target, Oracle(beyond.tokens), ids, mask, num_draft_tokens=4, max_new_tokens=21,
                                temperature=0, adaptive=adaptive)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.stats.acceptance_rate == 1.0
    if not adaptive:  # 20 tokens after the prefill's, 5 per step
        assert spec.stats.num_steps.tolist() == [4] * 4
        assert spec.stats.tokens_per_target_forward == 5.0


@pytest.mark.parametrize("with_logits", [False, True])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_a_hostile_drafter_cannot_change_greedy_output(target, with_logits, adaptive):
    ids, mask = ragged_prompts(B=5, seed=3)
    plain = generate(target, ids, mask, max_new_tokens=16, temperature=0)
    spec = speculative_generate(target, Hostile(0, with_logits), ids, mask, num_draft_tokens=3, max_new_tokens=16,
                                temperature=0, adaptive=adaptive)
    assert_greedy_equal(target, ids, mask, plain, spec)


def test_rows_finish_at_different_steps(target):
    ids, mask = ragged_prompts(B=6, seed=5)
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0)
    eos = int(plain.tokens[2, 3])  # ends row 2 (and maybe others) early
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=eos)
    assert len(set(plain.stats.num_generated.tolist())) > 1
    for draft in (PromptLookupDraft(), target.truncated(1), Oracle(plain.tokens)):
        for adaptive in (False, True):
            spec = speculative_generate(target, draft, ids, mask, max_new_tokens=20, temperature=0,
                                        eos_token_id=eos, adaptive=adaptive)
            assert_greedy_equal(target, ids, mask, plain, spec)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_an_early_exit_draft_proposes_what_the_truncated_model_does_in_the_targets_cache(target, adaptive):
    """EarlyExitDraft drafts with the target's first layer in the target's own cache: greedy
    tokens equal `generate`'s with rows finishing at different steps, and with fixed lengths its
    proposals are accepted exactly as those of the same layers in a cache of their own
    (`ModelDraft(target.truncated(1))`): the shared cache holds what the draft would compute,
    and the draft leaves the target's cache intact."""
    ids, mask = ragged_prompts(B=6, seed=5)
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0)
    eos = int(plain.tokens[2, 3])
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=eos)
    assert len(set(plain.stats.num_generated.tolist())) > 1
    runs = {name: speculative_generate(target, draft, ids, mask, num_draft_tokens=3, max_new_tokens=20,
                                       temperature=0, eos_token_id=eos, adaptive=adaptive)
            for name, draft in (("early exit", EarlyExitDraft(target, 1)), ("model", ModelDraft(target.truncated(1))))}
    assert_greedy_equal(target, ids, mask, plain, runs["early exit"])
    assert runs["early exit"].stats.time_draft_prefill_s < runs["model"].stats.time_draft_prefill_s
    if not adaptive:
        for count in ("num_proposed", "num_accepted"):
            assert torch.equal(getattr(runs["early exit"].stats, count), getattr(runs["model"].stats, count)), count
        assert runs["early exit"].stats.num_accepted.sum() > 0


def test_an_early_exit_draft_needs_the_cache_of_its_own_target(target):
    """Made from a model without layers to truncate, or given another model's cache: clear errors."""
    with pytest.raises(TypeError, match="truncated"):
        EarlyExitDraft(torch.nn.Linear(4, 4), 1)
    with pytest.raises(ValueError, match="num_layers"):
        EarlyExitDraft(target, 9)
    other = tiny_llama(seed=0, scale=3.0, layers=2)
    ids, mask = ragged_prompts(B=2, seed=1)
    with pytest.raises(ValueError, match="EarlyExitDraft drafts in the KV cache of the target it was made from"):
        speculative_generate(other, EarlyExitDraft(target, 1), ids, mask, max_new_tokens=4)


class Nothing:
    """A drafter with nothing to propose (prompt lookup on text that never repeats)."""

    def prefill(self, input_ids, q_seqlens, max_len):
        self.B = input_ids.shape[0]

    def propose(self, num_tokens, sample):
        none = torch.zeros(self.B, dtype=torch.int64)
        return DraftProposal(torch.zeros(self.B, num_tokens, dtype=torch.int64), none)

    def commit(self, token_ids, num_tokens):
        pass

    def select(self, rows):
        self.B = len(rows)


def test_a_drafter_that_never_proposes_is_asked_rarely(target, monkeypatch):
    """Where proposals are not cheap enough to make every step: after the first asks the loop
    decodes plainly and asks again only now and then."""
    monkeypatch.setattr(_draft_lengths, "SHADOW_SHARE", 0.0)
    ids, mask = ragged_prompts(B=2, seed=1)
    out = speculative_generate(target, Nothing(), ids, mask, max_new_tokens=60, temperature=0)
    assert out.stats.draft_calls <= UNANSWERED_STEPS + 4, out.stats.draft_lengths
    assert torch.equal(out.tokens, generate(target, ids, mask, max_new_tokens=60, temperature=0).tokens)


def test_a_cheap_drafter_is_asked_every_step_and_verified_only_where_it_offers(target, monkeypatch):
    """Where proposals are cheap (every one here): a drafter of deterministic chains is asked
    for K every step, and a step whose rows were offered nothing verifies no draft."""
    monkeypatch.setattr(_draft_lengths, "SHADOW_SHARE", float("inf"))
    ids, mask = ragged_prompts(B=2, seed=1)
    out = speculative_generate(target, Nothing(), ids, mask, max_new_tokens=60, temperature=0)
    assert out.stats.draft_calls >= out.stats.target_forwards - 3  # not: a start-up step, the budget's last
    assert out.stats.num_proposed.sum() == 0 and out.stats.tokens_per_target_forward == 1.0
    assert torch.equal(out.tokens, generate(target, ids, mask, max_new_tokens=60, temperature=0).tokens)


@pytest.mark.parametrize("drafter", ["oracle", "lookup", "hostile"])
def test_scored_proposals_keep_greedy_output_and_stream(target, monkeypatch, drafter):
    """Cheap deterministic drafters, scored against the text and asked every step (whatever
    this machine times): greedy tokens, streamed tokens and, for the oracle, full acceptance."""
    monkeypatch.setattr(_draft_lengths, "SHADOW_SHARE", float("inf"))
    ids, mask = ragged_prompts(B=4, seed=4)
    plain = generate(target, ids, mask, max_new_tokens=40, temperature=0)
    draft = {"oracle": lambda: Oracle(generate(target, ids, mask, max_new_tokens=44, temperature=0).tokens),
             "lookup": PromptLookupDraft, "hostile": lambda: Hostile(1, with_logits=False)}[drafter]()
    streamer = Recording()
    spec = speculative_generate(target, draft, ids, mask, num_draft_tokens=4, max_new_tokens=40, temperature=0,
                                streamer=streamer)
    assert_greedy_equal(target, ids, mask, plain, spec)
    for row in range(4):
        assert torch.cat([c[row] for c in streamer.chunks]).tolist() == spec.row_tokens(row)
    if drafter == "oracle":
        assert spec.stats.acceptance_rate == 1.0
        assert spec.stats.num_proposed.sum() > 0  # lengths follow this machine's timings: not asserted


def test_deterministic_proposals_are_scored_against_the_text():
    """Each proposal is compared with the tokens its row commits next, over as many steps as it
    takes, as verification would accept it: the first draft, then draft j once j - 1 matched."""
    policy = DraftLengths(4, 100, 2, adaptive=True)
    assert policy.plan([0, 1], {}) == 1 and policy.scores(True)
    policy.observe([0, 1], [0, 0], 0.0, 0.0, [[3], [3]], [[5, 6, 7, 8], [9]])
    policy.observe([0, 1], [0, 0], 0.0, 0.0, [[5, -1], [4, -1]], [[6, 7], []])  # row 0 matches 1, row 1 misses
    assert policy.first_drafts == [1, 1] and policy.first_accepted == [1, 0]
    policy.observe([0, 1], [0, 0], 0.0, 0.0, [[6, 7, 2], [1]], [[], []])
    # proposal [5, 6, 7, 8]: drafts 2 and 3 matched, 4 missed; proposal [6, 7]: matched to its end.
    assert policy.first_drafts == [2, 1] and policy.first_accepted == [2, 0]
    assert policy.reached[2:5] == [2, 1, 1] and policy.passed[2:5] == [2, 1, 0]
    assert policy.pending == [[], []]
    # By state at proposal: [5, 6, 7, 8] and [9] were made before any comparison (state 0),
    # [6, 7] after row 0's hit (state 1).
    assert policy.state_first == [2, 1] and policy.state_accepted == [1, 1]
    assert policy.state == [1, 0]


def scored_steps(policy: DraftLengths, steps: int, copying, verify_s) -> list[tuple[int, int]]:
    """Drive ``policy`` as the loop does a cheap deterministic drafter of one row (shadowing: K
    asked every step, scored against the text): where ``copying(step)`` its proposal is the
    text's continuation, else wrong; ``verify_s(tokens)`` the verification's seconds (the step
    takes 2 ms more, a proposal 0.3 ms). Returns each step's (length chosen, row state)."""
    text, pos, committed, accepted, chosen = list(range(10_000)), 1, [0], 0, []
    for step in range(steps):
        width = policy.plan([0], {})
        proposal = text[pos: pos + width] if copying(step) else [-5] * width
        policy.scores(True)
        policy.shadowing = True  # every cost below is synthetic: no clock to price the proposal
        policy._compare([0], [committed], [proposal])
        if policy.verified is not None:
            verified, tokens = policy.verified
            policy.verified = None
            policy._measured([0], [verified[0][1]], [verified[0][2]], [accepted], tokens, verify_s(tokens), width,
                             0.0003, verify_s(tokens) + 0.002, [verified[0][3]])
        k = policy.choose([0], [len(proposal)], [0])[0]
        chosen.append((k, policy.state[0]))
        policy.verifying([0], {0: k}, 1 + k)
        accepted = k if copying(step) else 0
        committed = text[pos: pos + accepted + 1]
        pos += accepted + 1
    return chosen


def test_a_scored_drafter_drafts_long_in_runs_of_hits_and_short_after_misses():
    """Cheap deterministic proposals of 4 (shadowing): hits come in spans (a row copying), so
    after a hit the policy verifies the whole offer, after a miss (nearly) nothing."""
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    copying = lambda step: (step // 10) % 2 == 0  # spans of 10 steps copying, 10 steps not
    lengths_by_state = {0: [], 1: []}
    for step, (k, state) in enumerate(scored_steps(policy, 400, copying, lambda n: 0.030 + 0.006 * n)):
        if step > 50:
            lengths_by_state[state].append(k)
    assert sum(lengths_by_state[1]) / len(lengths_by_state[1]) > 3.0
    assert sum(lengths_by_state[0]) / len(lengths_by_state[0]) < 0.5


def test_adaptive_and_fixed_give_the_same_greedy_tokens(target):
    ids, mask = ragged_prompts(B=6, seed=8)
    for draft in (PromptLookupDraft(), target.truncated(2), tiny_llama(seed=7, scale=3.0, layers=1)):
        fixed = speculative_generate(target, draft, ids, mask, num_draft_tokens=4, max_new_tokens=24,
                                     temperature=0, adaptive=False)
        adaptive = speculative_generate(target, draft, ids, mask, num_draft_tokens=4, max_new_tokens=24,
                                        temperature=0, adaptive=True)
        assert_greedy_equal(target, ids, mask, fixed, adaptive)


class Scripted(Oracle):
    """The oracle's tokens, cut to a scripted count per row and step (0 included)."""

    def __init__(self, continuation, script):
        super().__init__(continuation)
        self.script, self.step = script, 0

    def propose(self, num_tokens, sample):
        proposal = super().propose(num_tokens, sample)
        num = torch.tensor(self.script[self.step % len(self.script)])[self.rows].clamp(max=num_tokens)
        self.step += 1
        return DraftProposal(proposal.token_ids, num)


def test_per_row_draft_lengths_including_zero_in_one_step(target):
    ids, mask = ragged_prompts(B=4, seed=2)
    plain = generate(target, ids, mask, max_new_tokens=18, temperature=0)
    script = [[0, 3, 1, 2], [2, 0, 3, 0], [0, 0, 0, 0]]
    spec = speculative_generate(target, Scripted(plain.tokens, script), ids, mask, num_draft_tokens=3,
                                max_new_tokens=18, temperature=0, adaptive=False)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.stats.acceptance_rate == 1.0
    assert (spec.stats.num_proposed < 3 * spec.stats.num_steps).all()


def planned(policy: DraftLengths, rows: list[int], generated: dict[int, int]) -> list[int]:
    """The lengths ``policy`` plans for ``rows`` (what it asks a drafter for)."""
    policy.plan(rows, generated)
    return [policy.planned[r] for r in rows]


def test_the_policy_cuts_each_row_to_its_own_length():
    """Rows whose drafts fail get 0 while rows whose drafts are accepted keep drafting, in the
    same step; with nothing measured yet every row drafts one token."""
    policy = DraftLengths(4, 20, 3, adaptive=True)
    assert planned(policy, [0, 1, 2], {}) == [1, 1, 1]
    for _ in range(20):
        policy._measured([0, 1, 2], [4, 4, 4], [4, 4, 4], [4, 0, 4], verify_tokens=15, verify_s=0.012,
                         draft_tokens=4, draft_s=0.001, step_s=0.014)
        policy._measured([0, 1, 2], [1, 1, 1], [1, 1, 1], [1, 0, 1], verify_tokens=6, verify_s=0.0105,
                         draft_tokens=1, draft_s=0.0003, step_s=0.011)
    lengths = planned(policy, [0, 1, 2], {2: 16})
    assert lengths[0] == 4 and lengths[1] == 0 and lengths[2] == 2  # row 2: only 2 fit its budget
    assert policy.width == 4
    # What is verified: the plan, cut to what the drafter offered and to what the row's budget
    # keeps now (row 2 gained 2 more tokens since the plan's count: 1 draft is left of its 2).
    assert policy.choose([0, 1, 2], [3, 4, 2], [0, 0, 18]) == [3, 0, 1]
    assert policy.planned[2] == 1  # asked, as far as the budget goes: no shortfall of the drafter's
    policy.verifying([0, 1, 2], {0: 3, 1: 0, 2: 1}, 7)
    assert policy.counts[0][3] == policy.counts[1][0] == policy.counts[2][1] == 1


def test_a_tree_near_the_budget_keeps_its_nodes_and_is_scored_on_what_it_can_keep():
    """The same plan and budgets with tree proposals: rows keep their lengths while one draft can
    be kept (row 2: the budget keeps 1 of its 2), and row 2's verification is scored as 1
    draft asked and verified (its deeper nodes could never be accepted: no miss, no shortfall)."""
    policy = DraftLengths(4, 20, 3, adaptive=False)
    policy.trees = True
    assert planned(policy, [0, 1, 2], {2: 16}) == [4, 4, 4]
    assert planned(policy, [0, 1, 2], {2: 18}) == [4, 4, 0]  # no draft can be kept
    policy.plan([0, 1, 2], {2: 16})
    assert policy.choose([0, 1, 2], [4, 4, 4], [0, 0, 18]) == [4, 4, 4]
    policy.verifying([0, 1, 2], {0: 4, 1: 4, 2: 4}, 15)
    assert policy.counts[2][4] == 1  # counted as verified: the whole tree
    assert [(row, asked, drafted) for row, asked, drafted, _ in policy.verified[0]] == [(0, 4, 4), (1, 4, 4),
                                                                                      (2, 1, 1)]


def test_the_policy_decodes_plainly_when_drafting_cannot_pay():
    policy = DraftLengths(4, 20, 2, adaptive=True)
    for _ in range(10):  # drafts never accepted, verification as costly per token as decoding
        policy._measured([0, 1], [2, 2], [2, 2], [0, 0], verify_tokens=6, verify_s=0.030, draft_tokens=2,
                         draft_s=0.02, step_s=0.05)
        policy._measured([0, 1], [0, 0], [0, 0], [0, 0], verify_tokens=2, verify_s=0.010, draft_tokens=0,
                         draft_s=0.0, step_s=0.011)
    assert planned(policy, [0, 1], {}) == [0, 0]


def test_steps_that_record_a_cuda_graph_are_not_costs(monkeypatch):
    """A step whose verification or proposal ran a new shape eagerly or recorded its CUDA graph
    (many times a replay) teaches acceptance but not costs: a good draft comes into use after such steps, also when
    they are the first probes."""
    from specdec_kernels.cuda_graphs import GraphedForward

    def run(recorded_at: set[int]) -> list[int]:
        policy = DraftLengths(4, 10**6, 1, adaptive=True)
        for step in range(12):
            width = policy.plan([0], {})
            lengths = policy.choose([0], [width], [0])
            policy.verifying([0], {0: lengths[0]}, 1 + lengths[0])
            if step in recorded_at:
                monkeypatch.setattr(GraphedForward, "slow_calls", GraphedForward.slow_calls + 1)
            slow = 100.0 if step in recorded_at else 1.0
            policy.observe([0], lengths, slow * (0.030 + 0.0005 * (1 + lengths[0])), slow * 0.001 * lengths[0])
        return planned(policy, [0], {})

    for recorded_at in (set(), {0}, {0, 1}, {1, 2}, {3, 4}):
        assert run(recorded_at) == [4], recorded_at


def simulate(policy, rows, steps, accept, verify_s, draft_s):
    """Run ``policy`` against a synthetic machine: ``accept(row, k)`` drafts accepted of k,
    ``verify_s(tokens)`` and ``draft_s(width)`` seconds. Returns the lengths chosen per step."""
    chosen = []
    for _ in range(steps):
        lengths = planned(policy, rows, {})
        chosen.append(lengths)
        accepted = [accept(r, k) for r, k in zip(rows, lengths, strict=True)]
        tokens, width = len(rows) + sum(lengths), max(lengths)
        policy._measured(rows, lengths, lengths, accepted, tokens, verify_s(tokens), width, draft_s(width),
                         verify_s(tokens) + draft_s(width) + 0.001)
    return chosen


def test_a_useless_draft_is_probed_rarely():
    """Drafts never accepted, costing a fifth of a step per token: after its first probes the
    policy decodes plainly, and the probes it comes back for cost under 2% of the time."""
    policy = DraftLengths(4, 10**6, 2, adaptive=True)
    chosen = simulate(policy, [0, 1], 400, accept=lambda r, k: 0, verify_s=lambda n: 0.030 + 0.001 * n,
                      draft_s=lambda w: 0.006 * w)
    drafting = [lengths for lengths in chosen[3:] if max(lengths) > 0]
    extra = sum(0.006 * max(lengths) + 0.001 * sum(lengths) for lengths in drafting)
    assert extra < 0.02 * 0.033 * len(chosen), len(drafting)


def in_loop_order(policy, rows, steps, accept, verify_s, draft_s):
    """Run ``policy`` as `speculative_generate` calls it: each step's proposal is planned before
    the previous verification's outcome is observed. ``accept(row, k)``, ``verify_s(tokens)``
    and ``draft_s(width)`` as in `simulate` (``verify_s`` also gets the step's index). Returns
    the lengths verified per step."""
    chosen, outcome = [], None
    width = policy.plan(rows, {})
    for _ in range(steps):
        if outcome is not None:
            policy.observe(rows, *outcome, draft_s(width))
        lengths = policy.choose(rows, [width] * len(rows), [0] * len(rows))
        tokens = len(rows) + sum(lengths)
        policy.verifying(rows, dict(zip(rows, lengths, strict=True)), tokens)
        chosen.append(lengths)
        outcome = [accept(r, k) for r, k in zip(rows, lengths, strict=True)], verify_s(tokens, len(chosen) - 1)
        width = policy.plan(rows, {})
    return chosen


def test_a_useless_draft_is_probed_one_step_at_a_time():
    """The loop plans a step before the last one's outcome arrives: a probe still being verified
    counts as a miss, so a failed probe is not followed by another on the same evidence."""
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    chosen = in_loop_order(policy, [0], 400, accept=lambda r, k: 0, verify_s=lambda n, step: 0.030 + 0.001 * n,
                           draft_s=lambda w: 0.006 * w)
    drafting = [i for i, lengths in enumerate(chosen) if lengths[0] > 0]
    assert drafting[:2] == [0, 1]  # the start: one probe before the costs are known, one timed
    assert all(b - a > 1 for a, b in zip(drafting[1:], drafting[2:], strict=False)), drafting
    extra = sum(0.006 * k + 0.001 * k for k, in chosen[2:])
    assert extra < 0.02 * 0.031 * len(chosen), drafting


def test_a_slow_first_step_stands_in_only_until_the_second():
    """The first step may pay one-time costs (here 50 times a step's): its times serve until the
    second step's replace them, and a good draft is drafted in full soon after the start (a
    drafting step and a plain one timed)."""
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    chosen = in_loop_order(policy, [0], 14, accept=lambda r, k: k,
                           verify_s=lambda n, step: (50 if step == 0 else 1) * (0.030 + 0.0005 * n),
                           draft_s=lambda w: 0.0003 * w)
    lengths = [k for k, in chosen]
    assert lengths[:2] == [1, 1] and 0 in lengths[2:5] and lengths[-4:] == [4] * 4, lengths


def test_whole_lengths_are_priced_by_the_seconds_measured_per_count():
    """A forward whose cost jumps at its second draft and then stays flat (as at batch 1 on a
    CPU): drafting the whole offer beats stopping short, which a line through the counts would
    choose (it charges each draft the average slope)."""
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    seconds = {1: 0.030, 2: 0.031, 3: 0.037, 4: 0.037, 5: 0.037}
    for _ in range(60):
        for n, v in seconds.items():
            policy.verify.add(n, v)
            total, weight = policy.verify_at.get(n, (0.0, 0.0))
            policy.verify_at[n] = (total + v, weight + 1)
    policy.overhead, policy.draft_seconds, policy.draft_tokens = 0.0005, 0.0, 1.0
    policy.first_drafts[0], policy.first_accepted[0] = 1000.0, 500.0  # a = 1/2
    policy.reached[2:5] = [500.0, 250.0, 125.0]
    policy.passed[2:5] = [250.0, 125.0, 62.0]  # c_j = 1/2
    assert policy._best([0]) == [4]


def test_a_count_seen_once_is_drawn_toward_the_line():
    """One sample of a token count does not outweigh the line fitted to every step."""
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    for _ in range(20):
        for n in (1, 5):
            policy.verify.add(n, 0.030 + 0.001 * n)
            total, weight = policy.verify_at.get(n, (0.0, 0.0))
            policy.verify_at[n] = (total + 0.030 + 0.001 * n, weight + 1)
    policy.verify.add(3, 0.060)
    policy.verify_at[3] = (0.060, 1.0)
    assert 0.033 < policy._verify_seconds(3) < 0.045


def test_a_good_draft_is_used_at_full_length():
    """Drafts accepted 90% of the time, verification nearly free per token: K every step."""
    policy = DraftLengths(4, 10**6, 2, adaptive=True)
    draws = iter(torch.rand(10_000, generator=torch.Generator().manual_seed(0)).tolist())

    def accept(row, k):
        n = 0
        while n < k and next(draws) < 0.9:
            n += 1
        return n

    chosen = simulate(policy, [0, 1], 200, accept, verify_s=lambda n: 0.030 + 0.0005 * n,
                      draft_s=lambda w: 0.001 * w)
    assert sum(lengths == [4, 4] for lengths in chosen[10:]) >= 0.9 * len(chosen[10:])


def test_sampling_with_adaptive_lengths_keeps_the_target_distribution(target):
    """Chi-square of the second and third generated tokens over many seeds: adaptive speculation
    with a model draft (its first two steps draft: each call starts without carried costs)
    samples what plain generation samples."""
    from scipy.stats import chi2_contingency

    ids = torch.tensor([[5, 17, 33]])
    n = 400
    draft = tiny_llama(seed=7, scale=3.0, layers=1)
    counts_plain, counts_spec = torch.zeros(V), torch.zeros(V)
    proposed = 0
    for seed in range(n):
        counts_plain.index_put_((generate(target, ids, max_new_tokens=4, seed=seed).tokens[0, 1:3],),
                                torch.ones(2), accumulate=True)
        _draft_lengths._KNOWN_COSTS.clear()
        spec = speculative_generate(target, draft, ids, max_new_tokens=4, seed=10_000 + seed, num_draft_tokens=2)
        counts_spec.index_put_((spec.tokens[0, 1:3],), torch.ones(2), accumulate=True)
        proposed += int(spec.stats.num_proposed.sum())
    assert proposed >= n
    keep = (counts_plain + counts_spec) >= 10  # the chi-square approximation needs counts
    assert int(keep.sum()) >= 5
    assert chi2_contingency(torch.stack([counts_plain[keep], counts_spec[keep]]).numpy()).pvalue > 1e-3


class GreedyTarget:
    """A deterministic chain drafter of one row: the target's own greedy continuation of the
    committed text (right often when sampling, as a good draft is)."""

    def __init__(self, model) -> None:
        self.model = model

    def prefill(self, input_ids, q_seqlens, max_len):
        self.text = input_ids[:, : int(q_seqlens[0])]

    def propose(self, num_tokens, sample):
        return DraftProposal(generate(self.model, self.text, max_new_tokens=num_tokens, temperature=0).tokens)

    def commit(self, token_ids, num_tokens):
        self.text = torch.cat([self.text, token_ids[:, : int(num_tokens[0])]], 1)

    def select(self, rows):
        self.text = self.text[rows]


def test_sampling_with_lengths_chosen_after_the_offer_keeps_the_target_distribution(target, monkeypatch):
    """Chi-square of generated tokens 6 to 9 over many seeds: a cheap deterministic drafter,
    asked every step, its rows' lengths chosen after its proposal is seen (once the costs are
    measured: by token 5 in the first call, sooner in the later ones, which start from the verify
    costs of those before), samples what plain generation samples."""
    from scipy.stats import chi2_contingency

    monkeypatch.setattr(_draft_lengths, "SHADOW_SHARE", float("inf"))
    ids = torch.tensor([[5, 17, 33]])
    n = 300
    counts_plain, counts_spec = torch.zeros(V), torch.zeros(V)
    late_drafts = 0
    for seed in range(n):
        counts_plain.index_put_((generate(target, ids, max_new_tokens=10, seed=seed).tokens[0, 6:10],),
                                torch.ones(4), accumulate=True)
        spec = speculative_generate(target, GreedyTarget(target), ids, max_new_tokens=10, seed=10_000 + seed,
                                    num_draft_tokens=3)
        counts_spec.index_put_((spec.tokens[0, 6:10],), torch.ones(4), accumulate=True)
        late_drafts += int(spec.stats.draft_lengths[0, 2:].sum())
    assert late_drafts >= n // 4  # lengths of 2 or 3: chosen after the offer
    keep = (counts_plain + counts_spec) >= 10
    assert int(keep.sum()) >= 5
    assert chi2_contingency(torch.stack([counts_plain[keep], counts_spec[keep]]).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("bad, message", [
    (lambda B, k: DraftProposal(torch.full((B, k), V)), r"token ids outside \[0, 97\)"),
    (lambda B, k: DraftProposal(torch.full((B, k), -1)), r"token ids outside \[0, 97\)"),
    (lambda B, k: DraftProposal(torch.zeros(B, k, dtype=torch.int64), torch.full((B,), k + 1)),
     r"num_tokens outside 0\.\."),
    (lambda B, k: DraftProposal(torch.zeros(B, k + 1, dtype=torch.int64)), r"1 <= k <= "),
    (lambda B, k: DraftProposal(torch.zeros(B + 1, k, dtype=torch.int64)), r"token_ids"),
    (lambda B, k: DraftProposal(torch.zeros(B, k, dtype=torch.int32)), r"token_ids torch.int32"),
    (lambda B, k: DraftProposal(torch.zeros(B, k, dtype=torch.int64), torch.zeros(B, dtype=torch.int32)),
     r"num_tokens torch.int32"),
    (lambda B, k: DraftProposal(torch.zeros(B, k, dtype=torch.int64), None, torch.zeros(B, k, V + 1)),
     r"logits torch.float32 \[\d+, \d+, 98\]"),
    (lambda B, k: (torch.zeros(B, k, dtype=torch.int64), None), r"must return a DraftProposal"),
])
def test_a_bad_proposal_is_a_clear_error_naming_the_drafter(target, bad, message):
    class Bad(RepeatLastToken):
        def propose(self, num_tokens, sample):
            return bad(self.last.shape[0], num_tokens)

    ids, mask = ragged_prompts(B=3)
    with pytest.raises((ValueError, TypeError, DeviceCheckError), match=message) as error:
        speculative_generate(target, Bad(), ids, mask, max_new_tokens=6, temperature=0, adaptive=False)
    assert "drafter Bad" in str(error.value)


def test_model_drafts_sample_what_the_loop_samples(target):
    """ModelDraft samples through the ``sample`` function it is given and returns the logits it
    sampled from."""
    ids, mask = ragged_prompts(B=2)
    draft = ModelDraft(target.truncated(1))
    draft.prefill(ids[:, :5], torch.tensor([5, 5]), 32)
    draft.commit(torch.tensor([[3], [4]]), torch.tensor([1, 1]))
    seen = []
    proposal = draft.propose(3, lambda logits: seen.append(logits.clone()) or logits.argmax(-1))
    assert proposal.token_ids.shape == (2, 3) and proposal.num_tokens is None
    assert torch.equal(proposal.logits, torch.stack(seen, 1))
    assert torch.equal(proposal.token_ids, proposal.logits.argmax(-1))


class FixedWithLogits:
    """Proposes ``token`` every time, with fixed random draft logits; counts its proposals."""

    def __init__(self, token: int = 7) -> None:
        self.token, self.calls, self.committed = token, 0, 0

    def prefill(self, input_ids, q_seqlens, max_len):
        self.B = input_ids.shape[0]

    def propose(self, num_tokens, sample):
        self.calls += 1
        logits = torch.randn(self.B, num_tokens, V, generator=torch.Generator().manual_seed(0))
        return DraftProposal(torch.full((self.B, num_tokens), self.token), None, logits)

    def commit(self, token_ids, num_tokens):
        self.committed += 1

    def select(self, rows):
        self.B = len(rows)


def test_lookup_first_takes_the_lookup_where_it_matches_and_the_draft_elsewhere():
    draft = FixedWithLogits()
    drafter = LookupFirstDraft(draft, draft_tokens=2)
    # Row 0's last bigram (1, 2) occurred before, followed by 3, 1, 2; row 1's never did.
    drafter.prefill(torch.tensor([[1, 2, 3, 1, 2], [5, 6, 7, 8, 9]]), torch.tensor([5, 5]), 16)
    proposal = drafter.propose(3, lambda logits: logits.argmax(-1))
    assert draft.calls == 1
    assert proposal.token_ids.tolist() == [[3, 1, 2], [7, 7, 0]] and proposal.num_tokens.tolist() == [3, 2]
    one_hot = torch.full((3, V), float("-inf")).scatter_(1, torch.tensor([[3], [1], [2]]), 0.0)
    assert torch.equal(proposal.logits[0], one_hot)
    assert torch.equal(proposal.logits[1, :2], draft.propose(2, None).logits[1]) and proposal.parents is None
    # Once every row matches, the draft is not asked (on the CPU), but follows every commit.
    drafter.commit(torch.tensor([[3, 0], [5, 6]]), torch.tensor([1, 2]))
    draft.calls = 0
    proposal = drafter.propose(3, lambda logits: logits.argmax(-1))
    assert draft.calls == 0 and draft.committed == 1
    assert proposal.token_ids.tolist() == [[1, 2, 3], [7, 8, 9]] and proposal.num_tokens.tolist() == [3, 3]
    ids = torch.tensor([[1, 2, 3], [7, 8, 9]])[..., None]  # shaped as the draft's: one-hot logits
    assert torch.equal(proposal.logits, torch.full((2, 3, V), float("-inf")).scatter_(2, ids, 0.0))


def test_lookup_first_gives_chain_rows_as_one_branch_trees_beside_a_tree():
    draft = PromptLookupDraft(branches=2)  # proposes trees, here for the row the first lookup misses
    drafter = LookupFirstDraft(draft, PromptLookupDraft(min_ngram=3))
    drafter.prefill(torch.tensor([[1, 2, 3, 1, 2, 3], [4, 5, 6, 4, 5, 7]]), torch.tensor([6, 6]), 16)
    proposal = drafter.propose(3, None)
    tree = draft.propose(3, None)
    assert proposal.token_ids[0].tolist() == [1, 2, 3] and proposal.parents[0].tolist() == [-1, 0, 1]
    assert torch.equal(proposal.token_ids[1], tree.token_ids[1]) and torch.equal(proposal.parents[1], tree.parents[1])
    drafter.commit(torch.tensor([[1, 0, 0], [4, 5, 6]]), torch.tensor([1, 3]))  # both rows match: a tree still
    proposal = drafter.propose(3, None)
    assert proposal.token_ids.tolist() == [[2, 3, 1], [4, 5, 7]] and proposal.parents.tolist() == [[-1, 0, 1]] * 2


@pytest.mark.parametrize("draft", ["early-exit", "hostile", "lookup-tree"])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("draft_tokens", [None, 2])
def test_greedy_output_with_lookup_first_equals_generate(target, draft, adaptive, draft_tokens):
    ids, mask = ragged_prompts(B=5, P=8, seed=4)
    ids[:3, -4:] = ids[:3, -8:-4].clone()  # some rows repeat themselves, so the lookup matches there
    mask[:3] = 1
    plain = generate(target, ids, mask, max_new_tokens=24, temperature=0)
    inner = {"early-exit": lambda: EarlyExitDraft(target, 1), "hostile": lambda: Hostile(3, True),
             "lookup-tree": lambda: PromptLookupDraft(branches=2)}[draft]()
    drafter = LookupFirstDraft(inner, draft_tokens=draft_tokens)
    spec = speculative_generate(target, drafter, ids, mask, num_draft_tokens=4, max_new_tokens=24, temperature=0,
                                adaptive=adaptive)
    assert_greedy_equal(target, ids, mask, plain, spec)
    assert (spec.stats.num_generated == plain.stats.num_generated).all()


def test_a_model_draft_catches_up_after_many_wide_commits_without_a_proposal():
    """Twelve commits of one real token padded to six, without a proposal, then a proposal: it
    equals a fresh draft's given the same text, though the padding alone is three times the
    cache's capacity."""
    model = tiny_llama(seed=7, scale=3.0, layers=1)
    P, steps, max_len = 6, 12, 24
    text = torch.randint(0, V, (1, P + steps), generator=torch.Generator().manual_seed(5))
    draft = ModelDraft(model)
    draft.prefill(text[:, :P], torch.tensor([P]), max_len)
    for n in range(P, P + steps):
        draft.commit(torch.cat([text[:, n:n + 1], torch.zeros(1, 5, dtype=torch.int64)], 1), torch.tensor([1]),
                     committed_bound=n + 1)  # as the loop gives it
    proposal = draft.propose(3, lambda logits: logits.argmax(-1))
    fresh = ModelDraft(model)
    fresh.prefill(text[:, :-1], torch.tensor([P + steps - 1]), max_len)
    fresh.commit(text[:, -1:], torch.tensor([1]))
    alone = fresh.propose(3, lambda logits: logits.argmax(-1))
    assert torch.equal(proposal.token_ids, alone.token_ids)
    torch.testing.assert_close(proposal.logits, alone.logits, rtol=1e-4, atol=1e-4)


def test_sampling_with_lookup_first_is_lossless():
    """Chi-square of the first three sampled tokens against the target's exact distribution:
    rows whose first token makes the prompt's bigram (1, 62) recur (about 1 in 10) take the lookup's tokens with
    one-hot logits, the others a layer draft's sampled tokens and logits, in the same steps."""
    from test_generation import P_THRESHOLD, chi_square_pvalue, exact_first_tokens_distribution

    small = dict(layers=2, hidden=32, heads=4, kv_heads=1, vocab_size=64)
    target = tiny_llama(seed=1, scale=4.0, **small)
    prompt = torch.tensor([3, 1, 62, 1])
    joint, marginal3 = exact_first_tokens_distribution(target, prompt)
    ids = prompt.expand(6000, -1).contiguous()
    drafter = LookupFirstDraft(EarlyExitDraft(target, 1))
    out = speculative_generate(target, drafter, ids, num_draft_tokens=2, max_new_tokens=3, seed=7, adaptive=False,
                               temperature=1.0)
    t = out.tokens
    assert (t[:, 0] == 62).float().mean() > 0.05  # rows that the lookup serves
    assert chi_square_pvalue(torch.bincount(t[:, 0] * 64 + t[:, 1], minlength=64 * 64).reshape(64, 64), joint) \
        > P_THRESHOLD
    assert chi_square_pvalue(torch.bincount(t[:, 2], minlength=64), marginal3) > P_THRESHOLD


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((object(),), {}, TypeError, "draft must be a Drafter"),
    ((RepeatLastToken(), RepeatLastToken()), {}, TypeError, "lookup must be a PromptLookupDraft"),
    ((RepeatLastToken(),), dict(draft_tokens=0), ValueError, "draft_tokens must be None or an int >= 1"),
    ((ModelDraft(tiny_llama(layers=1)),), {}, TypeError, "ModelDraft keeps its own drafts in its cache"),
])
def test_lookup_first_refuses_bad_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        LookupFirstDraft(*args, **kwargs)


class Recording:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.chunks, self.ended = [], 0

    def put(self, token_ids) -> None:
        assert not self.ended
        self.chunks.append(token_ids)

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("loop", ["generate", "lookup", "model", "fixed-model"])
@pytest.mark.parametrize("B", [1, 4])
def test_streamed_tokens_are_the_returned_tokens(target, loop, B):
    ids, mask = ragged_prompts(B=B, seed=6)
    streamer = Recording()
    kwargs = dict(max_new_tokens=14, temperature=0, streamer=streamer, eos_token_id=5)
    if loop == "generate":
        out = generate(target, ids, mask, **kwargs)
    else:
        draft = PromptLookupDraft() if loop == "lookup" else target.truncated(1)
        out = speculative_generate(target, draft, ids, mask, adaptive=loop != "fixed-model", **kwargs)
    assert streamer.ended == 1
    if B == 1:
        assert all(c.dim() == 2 and c.shape[0] == 1 and c.shape[1] >= 1 for c in streamer.chunks)
        assert torch.cat([c[0] for c in streamer.chunks]).tolist() == out.row_tokens(0)
    else:
        assert all(isinstance(c, list) and len(c) == B for c in streamer.chunks)
        for row in range(B):
            assert torch.cat([c[row] for c in streamer.chunks]).tolist() == out.row_tokens(row)


def test_transformers_text_streamer_works_unchanged(target, capsys):
    transformers = pytest.importorskip("transformers")

    class Tokenizer:  # what TextStreamer asks of a tokenizer
        def decode(self, ids, **kwargs):
            return "".join(f"<{i}>" for i in ids)

    ids = torch.tensor([[5, 17, 33, 2]])
    out = generate(target, ids, max_new_tokens=8, temperature=0,
                   streamer=transformers.TextStreamer(Tokenizer()))
    printed = capsys.readouterr().out
    assert printed.strip() == "".join(f"<{i}>" for i in out.row_tokens(0))


def test_streamer_must_have_put_and_end(target):
    with pytest.raises(TypeError, match="streamer must have put"):
        generate(target, torch.tensor([[1, 2]]), max_new_tokens=2, streamer=print)


class HiddenReader(RepeatLastToken):
    """A drafter asking for the target's hidden states, which it records."""

    needs_target_hidden = True

    def prefill(self, input_ids, q_seqlens, max_len, hidden_states=None):
        super().prefill(input_ids, q_seqlens, max_len)
        self.prompt_states, self.seen = hidden_states, []

    def commit(self, token_ids, num_tokens, hidden_states=None):
        super().commit(token_ids, num_tokens)
        self.seen.append((token_ids, num_tokens, hidden_states))


@pytest.mark.parametrize("prompt", [[5, 17, 33, 2, 5, 17], [9, 9, 9, 9]])
def test_a_drafter_asking_for_hidden_states_gets_those_that_produced_each_token(target, prompt):
    ids = torch.tensor([prompt])
    drafter = HiddenReader()
    out = speculative_generate(target, drafter, ids, max_new_tokens=12, temperature=0, num_draft_tokens=3,
                               adaptive=False)
    sequence = torch.cat([ids[0], out.tokens[0]])[None]
    with torch.no_grad():
        _, every = target(sequence, target.new_cache(1, sequence.shape[1]), return_hidden=True)
    assert drafter.prompt_states.shape == (1, len(prompt), target.config.hidden_size)
    torch.testing.assert_close(drafter.prompt_states[0], every[0, :len(prompt)], atol=1e-4, rtol=1e-4)
    position = len(prompt) - 1  # the position whose hidden state produced the next committed token
    for token_ids, num, states in drafter.seen:
        n = int(num[0])
        assert states.shape == (1, token_ids.shape[1], target.config.hidden_size)
        torch.testing.assert_close(states[0, :n], every[0, position: position + n], atol=1e-4, rtol=1e-4)
        position += n
    assert position >= len(prompt) - 1 + 12


def test_hidden_states_need_a_target_that_returns_them(target):
    class NoHidden(torch.nn.Module):
        vocab_size = V

        def __init__(self):
            super().__init__()
            self.inner = target

        def new_cache(self, batch_size, max_len):
            return target.new_cache(batch_size, max_len)

        def forward(self, input_ids, cache, q_seqlens=None):
            return self.inner(input_ids, cache, q_seqlens)

    with pytest.raises(TypeError, match="takes no return_hidden keyword"):
        speculative_generate(NoHidden(), HiddenReader(), torch.tensor([[1, 2, 3]]), max_new_tokens=4)


# ---- draft vocabularies padded differently from the target's ----


def _sliced_copy(target, vocab_size: int, seed: int = 9):
    """A one-layer draft with ``vocab_size`` rows: the target's first layer and the target's
    embedding and head rows where both have them (random beyond)."""
    c = target.config
    draft = tiny_llama(seed=seed, layers=1, vocab_size=vocab_size, hidden=c.hidden_size, heads=c.num_attention_heads,
                       kv_heads=c.num_key_value_heads)
    state = {k: v for k, v in target.state_dict().items() if k in draft.state_dict()}
    rows = min(vocab_size, target.vocab_size)
    with torch.no_grad():
        for name, tensor in draft.state_dict().items():
            source = state[name]
            if tensor.shape == source.shape:
                tensor.copy_(source)
            else:
                tensor[:rows].copy_(source[:rows])
    return draft


@pytest.mark.parametrize("target_vocab, draft_vocab", [(128, 97), (97, 128)],
                         ids=["target-padded", "draft-padded"])
def test_a_draft_padded_differently_keeps_greedy_tokens(target_vocab, draft_vocab):
    """Vocabularies differing by padding only: ids the draft lacks get draft probability 0, the
    draft's own padded rows are cut; greedy output is the target's, and the draft is used."""
    target = tiny_llama(seed=0, scale=3.0, vocab_size=target_vocab)
    draft = _sliced_copy(target, draft_vocab)
    input_ids, mask = ragged_prompts(seed=2)
    plain = generate(target, input_ids, mask, max_new_tokens=16, temperature=0)
    spec = speculative_generate(target, draft, input_ids, mask, num_draft_tokens=3, max_new_tokens=16,
                                temperature=0, adaptive=False)
    for row in range(input_ids.shape[0]):
        differ = (plain.tokens[row] != spec.tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(target, input_ids, mask, plain.tokens, row, int(differ[0]))
    assert spec.stats.num_accepted.sum() > 0


def test_sampling_with_a_draft_lacking_the_targets_tail_is_lossless():
    """A target of 64 ids, a draft of 12 (padding to 64 rows): the draft never proposes ids 12..63,
    which the target samples all the same, with its exact distribution (chi-square)."""
    from test_generation import P_THRESHOLD, chi_square_pvalue, exact_first_tokens_distribution

    small = dict(layers=2, hidden=32, heads=4, kv_heads=1)
    target = tiny_llama(seed=1, scale=4.0, vocab_size=64, **small)
    draft = _sliced_copy(target, 12)
    prompt = torch.tensor([3, 1, 4])
    joint, marginal3 = exact_first_tokens_distribution(target, prompt)
    ids = prompt.expand(6000, -1).contiguous()
    out = speculative_generate(target, draft, ids, num_draft_tokens=2, max_new_tokens=3, seed=5, adaptive=False,
                               temperature=1.0)
    t = out.tokens
    assert chi_square_pvalue(torch.bincount(t[:, 0] * 64 + t[:, 1], minlength=64 * 64).reshape(64, 64), joint) \
        > P_THRESHOLD
    assert chi_square_pvalue(torch.bincount(t[:, 2], minlength=64), marginal3) > P_THRESHOLD
    assert (t >= 12).any() and out.stats.num_accepted.sum() > 0


@pytest.mark.parametrize("draft_vocab", [50, 105, 1280])
def test_vocabularies_differing_by_more_than_padding_are_refused(draft_vocab):
    """97 against 50 or 105 (the larger not a multiple of 64); 128 against 1280 (a multiple of 64,
    but over 1024 rows longer)."""
    target = tiny_llama(vocab_size=97 if draft_vocab != 1280 else 128)
    ids, _ = ragged_prompts(B=2)
    with pytest.raises(ValueError, match="draft must share the target's vocabulary"):
        speculative_generate(target, tiny_llama(vocab_size=draft_vocab, layers=1), ids, max_new_tokens=4)


# What a call leaves for the next on its target (`known_costs`).
CARRIED_KEYS = {"verify", "verify_at", "overhead", "stale", "deterministic", "pooled", "step", "drafting"}


def test_verify_costs_carry_to_the_next_call_at_the_same_batch_size():
    """A second call on the same target and batch size starts from the verify costs the first
    measured, and the drafting costs the first call's drafter measured stand in for its new
    drafter's: it drafts in full from its first step, where a first call drafts one token while it
    times the drafter, then waits for a second token count to be timed. Its own first step (here 50 times slower: one-
    time costs) is not timed."""
    known = {}
    accept, verify_s = (lambda r, k: k), (lambda n, step: 0.030 + 0.0005 * n)
    first = [k for k, in in_loop_order(DraftLengths(4, 10**6, 1, True, known), [0], 12, accept, verify_s,
                                       draft_s=lambda w: 0.0003 * w)]
    assert first[:3] == [1, 1, 0] and set(known) == CARRIED_KEYS, first
    slow_start = lambda n, step: (50 if step == 0 else 1) * verify_s(n, step)
    policy = DraftLengths(4, 10**6, 1, True, known)
    second = [k for k, in in_loop_order(policy, [0], 12, accept, slow_start, draft_s=lambda w: 0.0003 * w)]
    assert set(second) == {4}, second
    assert all(seconds / weight < 0.04 for seconds, weight in policy.verify_at.values()), policy.verify_at


def _clocked(monkeypatch):
    """A clock that advances only by what the simulated phases spend, and ``spend(seconds)``."""
    clock = [0.0]
    monkeypatch.setattr(_draft_lengths, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def spend(seconds):
        clock[0] += seconds
        return seconds
    return spend


def test_drafting_costs_carry_with_the_drafter_so_the_first_step_chooses(monkeypatch):
    """With the verify costs and the drafter's drafting costs both carried, a call chooses from
    its first step: a cheap, good draft is drafted at length at once, and a useless one costing
    40% of a step per token is not probed at all (the carried prior acceptance prices it out),
    where the first call probed it twice (one probe before the costs are known, one timed)."""
    spend = _clocked(monkeypatch)  # the steps take what their verification and drafting take, nothing else
    verify_s = lambda n, step: spend(0.030 + 0.001 * n)
    for per_token, accept in ((0.0003, lambda r, k: k), (0.012, lambda r, k: 0)):
        draft_s = lambda w, per_token=per_token: spend(per_token * w)
        known, drafting = {}, {}
        first = [k for k, in in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting), [0], 12, accept,
                                           verify_s, draft_s)]
        assert first[:2] == [1, 1], first  # nothing carried yet: two one-token steps
        seconds, tokens, _, _ = drafting["drafting"]
        assert seconds / tokens == pytest.approx(per_token)
        second = [k for k, in in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting), [0], 40, accept,
                                            verify_s, draft_s)]
        if accept(0, 4):  # more than one token from the first step (as the prior rates allow), then all
            assert second[0] > 1 and set(second[2:]) == {4}, second
        else:
            assert sum(second) == 0, second


def test_carried_costs_give_way_to_a_lasting_change(monkeypatch):
    """A target now five times slower than when its costs were carried (a longer context,
    another load): its steps are not dropped as outliers of the stale costs, and the costs kept
    for the next call follow."""
    spend = _clocked(monkeypatch)

    def timed(factor):
        return lambda n, step: spend(factor * (0.030 + 0.0005 * n))

    known = {}
    in_loop_order(DraftLengths(4, 10**6, 1, True, known), [0], 12, lambda r, k: k, timed(1), lambda w: 0.0)
    in_loop_order(DraftLengths(4, 10**6, 1, True, known), [0], 30, lambda r, k: k, timed(5), lambda w: 0.0)
    seconds, weight = known["verify_at"][5]  # the last drafts: 4 per step
    assert seconds / weight > 0.1, known["verify_at"]


def test_costs_timed_under_load_do_not_lock_a_good_draft_out(monkeypatch):
    """A first call timed drafting at 20 ms a token (the machine loaded) over some 40 steps of a
    draft that was accepted then; carried to the next calls, where acceptance starts from the
    prior, those costs price drafting out, so no step would draft again to re-measure them. After
    `PROBE_AFTER` plain steps (counted across calls) one step is forced to draft; its 0.3 ms a
    token replaces the carried cost, and the good draft is drafted in full from then on."""
    spend = _clocked(monkeypatch)
    verify_s = lambda n, step: spend(0.030 + 0.001 * n)
    known, drafting = {}, {}
    first = in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting), [0], 40, lambda r, k: k, verify_s,
                          lambda w: spend(0.020 * w))
    assert sum(k > 0 for k, in first) > 30, first
    seconds, tokens, _, proposals = drafting["drafting"]
    assert seconds / tokens == pytest.approx(0.020) and proposals > 10
    drafting["pooled"] = [0.0, 0.0]  # the pooled acceptance forgotten: the prior back at 1/2, priced out
    calls = [[k for k, in in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting), [0], 48, lambda r, k: k,
                                        verify_s, lambda w: spend(0.0003 * w))] for _ in range(3)]
    lengths = [k for call in calls for k in call]
    forced = next(i for i, k in enumerate(lengths) if k)
    # (Each call's first verification stands in for nothing and its last is never observed: untimed.)
    assert _draft_lengths.PROBE_AFTER <= forced <= _draft_lengths.PROBE_AFTER + 6 and lengths[forced] == 1, calls
    assert set(lengths[forced + 12:48 * 2]) == {4} and set(calls[2][2:]) == {4}, calls
    seconds, tokens, _, _ = drafting["drafting"]
    assert seconds / tokens < 0.001


@pytest.mark.parametrize("same_drafter", [True, False], ids=["same-drafter", "new-drafter"])
def test_a_draft_found_useless_is_not_probed_again_at_each_calls_start(monkeypatch, same_drafter):
    """A first call finds a draft useless (never accepted; 6 ms a token against a 31 ms step):
    acceptance starts from 1/2, so it probes at its start. The next calls on the
    same target start from the first-draft rate pooled over the calls before, carried with the
    drafter, or for a new drafter object from its class's (with the drafting costs): once that
    rate holds a few samples they decode plainly from their first step, not probing at every
    call's start, and draft one token only as the forced probes do, after `PROBE_AFTER` plain
    steps, then twice that (a new drafter's wait starts over: it was not shown useless)."""
    spend = _clocked(monkeypatch)
    verify_s = lambda n, step: spend(0.030 + 0.001 * n)
    draft_s = lambda w: spend(0.006 * w)
    known, drafting = {}, {}
    first = [k for k, in in_loop_order(DraftLengths(8, 10**6, 1, True, known, drafting), [0], 48,
                                       lambda r, k: 0, verify_s, draft_s)]
    assert sum(k > 0 for k in first) >= 2, first
    calls = [[k for k, in in_loop_order(DraftLengths(8, 10**6, 1, True, known, drafting if same_drafter else {}),
                                        [0], 48, lambda r, k: 0, verify_s, draft_s)] for _ in range(5)]
    lengths = [k for call in calls for k in call]
    drafted = [i for i, k in enumerate(lengths) if k]
    assert set(lengths) <= {0, 1} and sum(call[0] for call in calls) <= 1, calls
    assert all(b - a >= _draft_lengths.PROBE_AFTER - 4 for a, b in zip(drafted[1:], drafted[2:], strict=False)), drafted
    assert len(drafted) <= (3 if same_drafter else 5), drafted


def test_a_useless_drafter_does_not_hold_back_a_good_one_of_its_class(monkeypatch):
    """Two drafters of one class on one target, drafting at 6 ms a token. After five calls of
    a useless one the class's prior is low: a new good drafter of the class starts from it, but
    its forced probe's wait starts over, so it drafts within `PROBE_AFTER` steps, then 3 or 4
    tokens a step. Another call of the useless one leaves the class's prior low again; the good
    one carries its own and drafts from its first step."""
    spend = _clocked(monkeypatch)
    verify_s, draft_s = (lambda n, step: spend(0.030 + 0.001 * n)), (lambda w: spend(0.006 * w))
    known, good, bad = {}, {}, {}
    run = lambda drafting, steps, accept: [k for k, in in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting),
                                                                      [0], steps, accept, verify_s, draft_s)]
    class_prior = lambda: (known["pooled"][1] + 1) / (known["pooled"][0] + 2)
    for _ in range(5):
        run(bad, 48, lambda r, k: 0)
    # (The forced probe's wait has grown to 256 steps, some 180 of them still to come.)
    assert class_prior() < 0.25 and known["stale"][1] - known["stale"][0] > 120, known
    first_call = run(good, 120, lambda r, k: k)
    first = next((i for i, k in enumerate(first_call) if k), len(first_call))
    assert first <= _draft_lengths.PROBE_AFTER + 2 and min(first_call[first + 8:]) >= 3, first_call
    run(bad, 48, lambda r, k: 0)
    assert class_prior() < 0.25, known
    again = run(good, 20, lambda r, k: k)
    assert min(again) >= 2 and min(again[8:]) >= 3, again


def test_a_probe_due_at_a_calls_start_waits_for_a_timed_step(monkeypatch):
    """A call starting with a forced probe due: its first verification is not timed (the carried
    costs stand in), so the probe waits for a timed step, where it is measured, not wasted there."""
    spend = _clocked(monkeypatch)
    verify_s = lambda n, step: spend(0.030 + 0.001 * n)
    known, drafting = {}, {}
    in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting), [0], 40, lambda r, k: k, verify_s,
                  lambda w: spend(0.020 * w))
    known["stale"] = [_draft_lengths.PROBE_AFTER, _draft_lengths.PROBE_AFTER]
    drafting["pooled"] = [0.0, 0.0]  # the pooled acceptance forgotten: the prior back at 1/2, priced out
    lengths = [k for k, in in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting), [0], 12, lambda r, k: k,
                                         verify_s, lambda w: spend(0.0003 * w))]
    assert lengths[:3] == [0, 0, 1] and set(lengths[5:]) == {4}, lengths


def scored_call(policy: DraftLengths, steps: int, spend) -> list[int]:
    """Drive ``policy`` as the loop drives a drafter of one row that always proposes the text's
    continuation as a deterministic chain (scored), each phase taking its seconds on the
    `_clocked` clock: a proposal 0.3 ms, verifying n tokens 30 ms + 1 ms per token. Returns the
    length verified at each step."""
    text, pos, committed, chosen, outcome = list(range(10_000)), 1, [0], [], None
    width = policy.plan([0], {})
    for _ in range(steps):
        proposal = text[pos: pos + width]
        draft_s = spend(0.0003) if width else 0.0
        policy.scores(True)
        policy.observe([0], *(outcome or ([0], 0.0)), draft_s, [committed], [proposal])
        k = policy.choose([0], [len(proposal)], [0])[0]
        policy.verifying([0], {0: k}, 1 + k)
        chosen.append(k)
        outcome = [k], spend(0.030 + 0.001 * (1 + k))
        committed = text[pos: pos + k + 1]
        pos += k + 1
        width = policy.plan([0], {})
    return chosen


def test_a_scored_drafters_first_offer_is_verified_whole_where_costs_are_carried(monkeypatch):
    """With costs carried from a call whose drafter made cheap deterministic chains, a new
    drafter of that class (as each call may make) starts from the drafting costs its class
    measured and shadows from its first step: asked for K at once, the whole offer verified
    where the costs say it pays, not one token until its drafting is timed. The first call,
    with nothing carried, starts with one-token drafts."""
    spend = _clocked(monkeypatch)
    known = {}
    first = scored_call(DraftLengths(4, 10**6, 1, True, known, {}), 30, spend)
    assert first[:2] == [1, 1] and set(first[-10:]) == {4} and known["deterministic"] is True, first
    policy = DraftLengths(4, 10**6, 1, True, known, {})
    assert policy.shadowing  # asks K and chooses once the offer is seen, from the first step
    second = scored_call(policy, 10, spend)
    assert set(second) == {4}, second


def test_a_verify_width_timed_under_load_does_not_lock_a_cheap_scored_drafter_out():
    """A cheap deterministic drafter (shadowing: offered drafts scored against the text, no
    verification needed) whose rows copy their text: carried verify times of 1 and 2 tokens,
    20 samples each, the second ten times too slow. Every offer is priced out until a forced
    probe verifies one draft; its time replaces the carried one and the copies are verified."""
    line = _draft_lengths._DecayedLine()
    for n, seconds in ((1, 0.031), (2, 0.32)) * 20:
        line.add(n, seconds)
    known = {"verify": line, "verify_at": {1: (0.031 * 20, 20.0), 2: (0.32 * 20, 20.0)}, "overhead": 0.0005,
             "stale": [0, _draft_lengths.PROBE_AFTER]}
    policy = DraftLengths(4, 10**6, 1, True, known)
    policy.draft_seconds, policy.draft_tokens, policy.proposal_seconds, policy.proposals = 0.0003, 4.0, 0.0003, 1.0
    policy.steady_drafting = True  # (as timed on a proposal made right after another)
    chosen = [k for k, _ in scored_steps(policy, 160, lambda step: True, lambda n: 0.030 + 0.001 * n)]
    forced = next(i for i, k in enumerate(chosen) if k)
    assert _draft_lengths.PROBE_AFTER <= forced <= _draft_lengths.PROBE_AFTER + 3 and chosen[forced] == 1, chosen
    assert policy.verify_at[2][0] / policy.verify_at[2][1] < 0.05, policy.verify_at
    assert sum(chosen[forced + 5:]) / len(chosen[forced + 5:]) > 3, chosen


def test_a_forced_probe_offered_nothing_waits_anew(monkeypatch):
    """A drafter that has stopped offering anything (after its first steps did): a forced probe
    it answers with nothing counts as a probe, so the policy asks it as rarely as it would without
    forced probes (16 times in these 1,000 steps, in pairs as its share f recovers), not every step."""
    spend = _clocked(monkeypatch)
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    asked, outcome = [], None
    width = policy.plan([0], {})
    for step in range(1000):
        if outcome is not None:
            policy.observe([0], *outcome, spend(0.012 * width))
        offered = [width if step < 4 else 0]
        lengths = policy.choose([0], offered, [0])
        policy.verifying([0], {0: lengths[0]}, 1 + lengths[0])
        asked.append(width)
        outcome = [0], spend(0.030 + 0.001 * (1 + lengths[0]))
        width = policy.plan([0], {})
    later = [i for i, w in enumerate(asked) if w and i > 20]
    assert 2 <= len(later) <= 20, later


def test_forced_probes_of_a_useless_draft_grow_apart(monkeypatch):
    """A draft that never pays (80% of a step per token, never accepted): the forced probes come
    after `PROBE_AFTER` plain steps, then twice as many, and so on, so over 2,000 steps they cost
    under 1% of the time; a probe the policy chooses itself is not forced."""
    spend = _clocked(monkeypatch)
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    chosen = in_loop_order(policy, [0], 2000, lambda r, k: 0, lambda n, step: spend(0.030 + 0.001 * n),
                           lambda w: spend(0.025 * w))
    drafting = [i for i, (k,) in enumerate(chosen) if k]
    gaps = [b - a for a, b in zip(drafting[1:], drafting[2:], strict=False)]
    assert 6 <= len(drafting) <= 8 and all(g > 60 for g in gaps), drafting
    assert all(b >= 1.9 * a for a, b in zip(gaps, gaps[1:], strict=False)), gaps
    assert sum(0.026 * k for k, in chosen[2:]) < 0.01 * 0.031 * len(chosen)


def test_speculative_generate_keeps_verify_costs_per_target_and_way_of_running(target):
    """Costs are kept per target and batch size, device, CUDA graphs, greedy or sampled and
    drafter class, and drafting costs per drafter object likewise; a second call starts from
    them and still gives greedy `generate`'s tokens."""
    ids, mask = ragged_prompts(B=2, seed=1)
    plain = generate(target, ids, mask, max_new_tokens=40, temperature=0)
    truth = generate(target, ids, mask, max_new_tokens=44, temperature=0).tokens
    drafter = Oracle(truth)
    for _ in range(2):
        spec = speculative_generate(target, drafter, ids, mask, max_new_tokens=40, temperature=0)
        assert torch.equal(spec.tokens, plain.tokens)
        known = _draft_lengths.known_costs(target, (2, "cpu", False, True, "OracleDraft"))
        assert set(known) == CARRIED_KEYS
        assert known["deterministic"] is True  # the oracle's proposals: deterministic chains
        drafting = _draft_lengths.known_costs(drafter, ("drafting", 2, "cpu", False, True, "OracleDraft"))
        assert set(drafting) == {"drafting", "pooled"}
    assert _draft_lengths.known_costs(Oracle(truth), ("drafting", 2, "cpu", False, True, "OracleDraft")) == {}
    assert _draft_lengths.known_costs(target, (1, "cpu", False, True, "OracleDraft")) == {}
    assert _draft_lengths.known_costs(target, (2, "cpu", False, False, "OracleDraft")) == {}
    assert _draft_lengths.known_costs(3, (2, "cpu", False, True, "OracleDraft")) == {}  # no weak reference: not kept


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_no_row_commits_tokens_past_its_budget(target, adaptive):
    """The plan cuts each row's drafts by its token count one verification old; with every draft
    accepted the row has since gained K + 1 tokens, so the loop cuts them again by the fresh
    count: no commit runs past ``max_new_tokens``, whose room is all the drafters' caches hold
    (`Drafter.prefill`'s ``max_len``: a `FeatureHeadDraft` would write past its cache)."""
    K, N = 4, 13
    input_ids, mask = ragged_prompts(B=3, P=6, seed=2)
    truth = generate(target, input_ids, mask, max_new_tokens=N + K + 1, temperature=0).tokens
    most = []

    class Counting(Oracle):
        def commit(self, token_ids, num_tokens):
            super().commit(token_ids, num_tokens)
            most.append(int(self.committed.max()))

    out = speculative_generate(target, Counting(truth), input_ids, mask, num_draft_tokens=K, max_new_tokens=N,
                               temperature=0, adaptive=adaptive)
    assert torch.equal(out.tokens, truth[:, :N])
    assert max(most) == N


def _catching_up(spend, per_token: float, per_plain_step: float):
    """``draft_s(width)`` for `in_loop_order` of a drafter that reads, at each proposal, every
    token committed since its last one (a head or a model in its own cache): ``per_token`` a
    draft token, plus ``per_plain_step`` for each step since it last proposed."""
    since = [0]

    def draft_s(width: int) -> float:
        if not width:
            since[0] += 1
            return 0.0
        seconds, since[0] = per_token * width + per_plain_step * since[0], 0
        return spend(seconds)
    return draft_s


def test_a_proposal_catching_up_after_plain_steps_is_not_a_drafting_cost(monkeypatch):
    """A drafter at 2.5 ms a draft token, plus 0.5 ms for each plain step since it last proposed
    (it reads every token committed since). A useless one is probed now and then, after tens of
    plain steps, each probe paying 20-70 ms to catch up: the drafting cost stays the steady 2.5 ms
    a token (those seconds are paid once per probe, not per token drafted). A good one, kept off
    for a while, drafts 3 or 4 tokens a step again soon after its forced probe: the probe's
    catch-up does not price it out."""
    spend = _clocked(monkeypatch)
    verify_s = lambda n, step: spend(0.030 + 0.001 * n)
    policy = DraftLengths(4, 10**6, 1, adaptive=True)
    draft_s = _catching_up(spend, 0.0025, 0.0005)
    chosen = [k for k, in in_loop_order(policy, [0], 700, lambda r, k: 0, verify_s, draft_s)]
    assert 4 <= sum(k > 0 for k in chosen) <= 16, chosen  # probed now and then
    assert policy.draft_seconds / policy.draft_tokens == pytest.approx(0.0025, rel=1e-3), policy.draft_seconds
    known, drafting, draft_s = {}, {}, _catching_up(spend, 0.0025, 0.0005)
    run = lambda steps, accept: [k for k, in in_loop_order(DraftLengths(4, 10**6, 1, True, known, drafting), [0],
                                                            steps, accept, verify_s, draft_s)]
    assert min(run(48, lambda r, k: k)[-8:]) >= 3
    run(48, lambda r, k: 0)
    drafting["pooled"] = [50.0, 1.0]  # a long useless spell: the prior low, only forced probes draft
    again = run(200, lambda r, k: k)
    first = next(i for i, k in enumerate(again) if k)
    assert first <= _draft_lengths.PROBE_AFTER + 2 and min(again[first + 8:]) >= 3, again
    seconds, tokens, _, _ = drafting["drafting"]
    assert seconds / tokens == pytest.approx(0.0025, rel=1e-3), drafting
