"""lookahead_generate: greedy output equals greedy generate token for token (ragged rows, EOS
inside an accepted n-gram, steps wider than the budget, adaptive or not), sampling follows the
target's distribution (chi-square), one host sync per step, and the n-gram pools' bounds."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_sampling_distribution import chi_square_pvalue

from specdec_kernels import generate, lookahead_generate
from specdec_kernels._draft_lengths import COST_DECAY, DECAY, known_costs
from specdec_kernels.lookahead import (
    GAIN_PRIOR_SAMPLES,
    LOOKAHEAD,
    PLAIN,
    VERIFY,
    LookaheadSwitch,
    NgramPool,
    _ancestors,
    candidate_tree,
    lookahead_mask,
)
from specdec_kernels.model import tree_depths
from specdec_kernels.testing import SyncCounter

from tiny_models import V, ragged_prompts, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, scale=3.0, layers=2)


def repetitive_prompts(B: int, seed: int):
    """Ragged prompts whose last 6 tokens come twice more: the pools find n-grams to verify."""
    ids, mask = ragged_prompts(B=B, seed=seed)
    ids = torch.cat([ids, ids[:, -6:], ids[:, -6:]], 1)
    return ids, torch.cat([mask, torch.ones(B, 12, dtype=mask.dtype)], 1)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("window,ngram,guesses", [(1, 2, 1), (4, 4, 4), (3, 3, 5), (8, 5, 2)])
def test_equals_greedy_generate(target, window, ngram, guesses, adaptive):
    ids, mask = repetitive_prompts(B=5, seed=2)
    plain = generate(target, ids, mask, max_new_tokens=24, temperature=0)
    out = lookahead_generate(target, ids, mask, window=window, ngram=ngram, guesses=guesses, max_new_tokens=24,
                             adaptive=adaptive)
    assert torch.equal(out.tokens, plain.tokens)
    assert out.stats.num_generated.tolist() == [24] * 5
    if not adaptive:
        assert out.stats.num_accepted.sum() > 0  # the repeated tokens' n-grams were verified and kept


class StepChunks:
    """A streamer keeping, per row, the tokens each step added (lists of ints)."""

    def __init__(self, batch_size: int) -> None:
        self.chunks = [[] for _ in range(batch_size)]

    def put(self, token_ids) -> None:
        for row, tokens in enumerate(token_ids):
            if len(tokens):
                self.chunks[row].append(tokens.tolist())

    def end(self) -> None:
        pass


def test_eos_inside_an_accepted_ngram_ends_the_row(target):
    ids, mask = repetitive_prompts(B=4, seed=3)
    chunks = StepChunks(4)
    lookahead_generate(target, ids, mask, max_new_tokens=20, adaptive=False, streamer=chunks)
    # A token that came in one step with tokens after it, and not earlier in its row: as EOS it
    # ends the row inside the accepted n-gram.
    found = None
    for row, steps in enumerate(chunks.chunks):
        before = []
        for step in steps:
            for i, token in enumerate(step[:-1]):
                if token not in before + step[:i]:
                    found = found or (row, token)
            before += step
    assert found is not None, "no step accepted an n-gram: the test needs one"
    row, eos = found
    expected = generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=eos, pad_token_id=0)
    got = lookahead_generate(target, ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0, adaptive=False)
    assert torch.equal(got.tokens, expected.tokens)
    assert torch.equal(got.stats.num_generated, expected.stats.num_generated)
    assert got.stats.num_generated[row] < 20


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_steps_wider_than_the_budget(target, max_new_tokens):
    ids, mask = repetitive_prompts(B=3, seed=5)
    plain = generate(target, ids, mask, max_new_tokens=max_new_tokens, temperature=0)
    out = lookahead_generate(target, ids, mask, window=8, ngram=5, guesses=4, max_new_tokens=max_new_tokens,
                             adaptive=False)
    assert torch.equal(out.tokens, plain.tokens)


def test_max_cache_len_must_hold_a_whole_step(target):
    ids, mask = repetitive_prompts(B=2, seed=5)
    options = dict(window=8, ngram=5, guesses=4, max_new_tokens=2, temperature=0)
    needed = ids.shape[1] + 2 - 1 + (8 + 4) * 4
    with pytest.raises(ValueError, match=f"max_cache_len={needed - 1} is too small"):
        lookahead_generate(target, ids, mask, max_cache_len=needed - 1, **options)
    out = lookahead_generate(target, ids, mask, max_cache_len=needed, **options)
    assert torch.equal(out.tokens, generate(target, ids, mask, max_new_tokens=2, temperature=0).tokens)


class Successor(torch.nn.Module):
    """The tiny model with a bonus on token ``input + 1`` after each input: the prompt's
    ``t, t + 1, t + 2`` n-grams then make likely candidates."""

    def __init__(self, inner, bonus: float) -> None:
        super().__init__()
        self.inner, self.bonus, self.vocab_size = inner, bonus, inner.vocab_size

    def new_cache(self, batch_size, max_len, **kwargs):
        return self.inner.new_cache(batch_size, max_len, **kwargs)

    def forward(self, input_ids, cache, q_seqlens=None, tree_mask=None):
        logits = self.inner(input_ids, cache, q_seqlens, tree_mask=tree_mask)
        return logits + self.bonus * torch.nn.functional.one_hot((input_ids + 1) % V, V)


@pytest.mark.parametrize("steps", [[LOOKAHEAD], [VERIFY]])
def test_sampling_follows_the_target(monkeypatch, steps):
    """The first two sampled tokens of many copies of one prompt: their joint distribution is the
    target's (chi-square), with lookahead steps and with verify steps. The prompt holds every
    token followed by two different continuations (its successor, which the model favours, and a
    random one), so each row's second token comes from a step verifying two sibling candidates
    after its first: accepted often, rejected often (then sampled from the residual)."""
    force_kinds(monkeypatch, steps)
    model = Successor(tiny_llama(seed=1, scale=3.0, layers=2), bonus=5.0)
    shuffled = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([torch.arange(V), shuffled])[None]  # (rows x prompt^2 attention scores: keep both small)
    rows = 2000
    out = lookahead_generate(model, prompt.expand(rows, -1), window=2, ngram=3, guesses=2, max_new_tokens=2,
                             temperature=1.0, seed=0, adaptive=False)
    assert (out.stats.num_proposed >= 2).all()  # every row verified candidates after its first token
    assert (out.stats.num_proposed >= 4).float().mean() > 0.9  # most of them two siblings
    accepted = (out.stats.num_accepted > 0).float().mean()
    assert 0.2 < accepted < 0.8, accepted  # both the accept and the residual paths are exercised
    first, second = out.tokens[:, 0], out.tokens[:, 1]
    with torch.inference_mode():
        p1 = torch.softmax(generate_logits(model, prompt), -1)[0]                    # [V]
        p2 = torch.softmax(generate_logits(model, torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)), -1)
    joint = (p1[:, None] * p2).flatten()
    assert chi_square_pvalue(first * V + second, joint) > 1e-3


def generate_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's next-token logits after each row of ``ids`` (a fresh cache)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    return model(ids, cache)[:, -1].float()


def test_sampling_is_seeded(target):
    ids, mask = repetitive_prompts(B=3, seed=6)
    runs = [lookahead_generate(target, ids, mask, max_new_tokens=16, temperature=0.8, top_k=20, seed=3,
                               adaptive=False) for _ in range(2)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert ((runs[0].tokens >= 0) & (runs[0].tokens < V)).all()


def test_one_host_sync_per_step(target):
    ids, mask = repetitive_prompts(B=3, seed=4)
    with SyncCounter() as syncs:
        out = lookahead_generate(target, ids, mask, max_new_tokens=12, adaptive=False)
    in_loop = [e for e in syncs.events if "_prepare" not in e.where and "prefill" not in e.where]
    seeding = [e for e in in_loop if "lookahead_generate" in e.where]  # the prompts, once, for the pools
    assert len(seeding) == 1
    in_loop = [e for e in in_loop if e not in seeding]
    assert all("_rows_still_running" in e.where for e in in_loop), in_loop
    assert len(in_loop) == int(out.stats.num_steps.max()) + 1


def test_mask_gives_each_lookahead_token_its_trajectory():
    mask = lookahead_mask(window=3, ngram=3)
    # Inputs: the last token, level 0 (3 tokens), level 1 (3 tokens).
    assert mask.shape == (7, 7)
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 2, 5]        # level 1, column 1
    depths = tree_depths(mask[None], None, 7, torch.device("cpu"))[0]
    assert depths.tolist() == [0, 1, 2, 3, 2, 3, 4]                     # positions after the last token


def test_candidates_sharing_a_prefix_share_its_nodes():
    tokens, parents = candidate_tree([(6, 8), (6, 7), (5, 1), (6, 8)])
    assert tokens == [6, 8, 7, 5, 1] and parents == [-1, 0, 0, -1, 3]
    assert _ancestors([-1, 0, 0], 4) == [True, False, False, False, True, True, False, False,
                                         True, False, True, False, False, False, False, True]


def test_a_shared_first_token_verifies_every_continuation(target):
    """The pool lists two continuations of the last token with one first token, the wrong one
    newest: merged into a tree, both are verified and the right one is kept whole (as separate
    chains, greedy verification would follow the first and keep one token)."""
    model = Successor(target, bonus=100.0)  # greedy: each token's successor
    prompt = torch.tensor([[10, 11, 12, 30, 10, 11, 50, 31, 9]])  # 10 -> (11, 50) newest, then (11, 12)
    out = lookahead_generate(model, prompt, window=1, ngram=3, guesses=4, max_new_tokens=4, adaptive=False)
    assert out.tokens[0].tolist() == [10, 11, 12, 13]
    assert out.stats.num_steps.tolist() == [1] and out.stats.num_accepted.tolist() == [2]


def test_pool_bounds():
    pool = NgramPool(n=3, per_key=2, max_keys=3)
    pool.add_text([1, 2, 3, 1, 2, 4, 1, 2, 5])
    assert pool.continuations(1) == [(2, 5), (2, 4)]                    # newest first, at most 2
    pool.add((1, 2, 4))
    assert pool.continuations(1) == [(2, 4), (2, 5)]                    # added again: newest
    for key in (7, 8, 9):
        pool.add((key, 0, 0))
    assert pool.continuations(1) == [] and len(pool._pool) == 3        # the oldest key dropped


@pytest.mark.parametrize("name,value", [("window", 0), ("ngram", 1), ("guesses", 0), ("pool_size", 0)])
def test_bad_options_are_refused(target, name, value):
    ids, mask = ragged_prompts(B=2)
    with pytest.raises(ValueError, match=name):
        lookahead_generate(target, ids, mask, max_new_tokens=4, **{name: value})


def test_a_non_bool_adaptive_is_refused(target):
    ids, mask = ragged_prompts(B=2)
    with pytest.raises(TypeError, match="adaptive must be True or False"):
        lookahead_generate(target, ids, mask, max_new_tokens=4, adaptive="yes")


def _switch_after_two_plain_steps(prefill_seconds: float, plain_seconds: float = 0.01, rows: int = 1
                                  ) -> LookaheadSwitch:
    """A switch for ``rows`` rows (N = 3) whose plain steps are timed, after a prefill of 100
    tokens more than rows (its seconds beyond a plain step's / 100: a token's price)."""
    switch = LookaheadSwitch(adaptive=True, ngram=3)
    switch.prefilled(prefill_seconds, 100 + rows, rows)
    texts = [[1, 2, 3]] * rows
    for _ in range(2):  # the first plain step is not timed
        assert switch.choose(list(range(rows)), [[]] * rows, texts, 5 * rows, rows) == PLAIN
        switch.observe(plain_seconds, [0] * rows)
    return switch


def set_gain(switch: LookaheadSwitch, kind: str, sums: list[float]) -> None:
    """Set a one-row switch's gain of ``kind`` (forgotten sums), the row's and the batch's alike."""
    switch.gain[kind], switch.batch_gain[kind] = list(sums), list(sums)


def test_the_switch_learns_the_gain_in_the_shadow_of_plain_steps():
    """Candidates a row had at a plain step are scored once it has committed as many tokens:
    their longest common prefix with what it committed."""
    switch = _switch_after_two_plain_steps(prefill_seconds=100.0)  # wide steps priced out: plain
    texts = {0: [1, 2, 3]}
    assert switch.choose([0], [[(4, 5), (4, 9)]], texts, 7, 3) == PLAIN
    switch.observe(0.01, [0])
    texts[0] += [4]
    assert switch.choose([0], [[(7, 7)]], texts, 7, 3) == PLAIN  # one token committed since: not scored yet
    assert switch.gain[VERIFY][0] == 0
    switch.observe(0.01, [0])
    texts[0] += [9]  # (4, 9) matches both committed tokens; (7, 7) waits for a second token
    switch.choose([0], [[]], texts, 5, 1)
    assert switch.gain[VERIFY] == switch.batch_gain[VERIFY] == pytest.approx([2.0, GAIN_PRIOR_SAMPLES * DECAY + 1])
    texts[0] += [7]
    switch.choose([0], [[]], texts, 5, 1)
    assert switch.gain[VERIFY] == switch.batch_gain[VERIFY] == pytest.approx(
        [2.0 * DECAY, GAIN_PRIOR_SAMPLES * DECAY ** 2 + DECAY + 1])  # a 0


def test_the_switch_takes_lookahead_steps_only_where_they_pay():
    cheap = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.0001)  # a token: 1% of a plain step
    costly = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.01)   # a token: a plain step
    for switch in (cheap, costly):
        set_gain(switch, LOOKAHEAD, [8.0, 8.0])  # every row with candidates gained a token in lookahead steps
    assert cheap.choose([0], [[]], {0: [1, 2, 3]}, 5, 1) == PLAIN  # nothing to verify
    cheap.observe(0.01, [0])
    assert cheap.choose([0], [[(4, 5)]], {0: [1, 2, 3, 4]}, 7, 3) == LOOKAHEAD
    assert costly.choose([0], [[(4, 5)]], {0: [1, 2, 3]}, 7, 3) == PLAIN
    # Once a lookahead step is timed, its own cost decides: here it costs 6 plain steps.
    cheap.observe(0.02, [1])  # the first lookahead step: not timed
    assert cheap.choose([0], [[(4, 5)]], {0: [1, 2, 3, 4, 5, 6]}, 7, 3) == LOOKAHEAD
    cheap.observe(0.06, [1])
    assert cheap.choose([0], [[(4, 5)]], {0: [1, 2, 3, 4, 5, 6, 7, 8]}, 7, 3) == PLAIN
    assert LookaheadSwitch(adaptive=False, ngram=3).choose([0], [[]], {0: [1]}, 5, 1) == LOOKAHEAD


def test_the_switch_verifies_without_the_window_where_only_the_candidates_pay():
    """A token costs a fifth of a plain step: a verify step (3 tokens) gaining one token pays,
    a lookahead step (7 tokens) must gain three to beat it; once verify steps are timed dearer,
    plain steps win."""
    switch = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.002)
    set_gain(switch, VERIFY, [8.0, 8.0])  # the candidates gained a token per row
    texts, candidates = {0: [1, 2, 3]}, [[(4, 5)]]
    assert switch.choose([0], candidates, texts, 7, 3) == VERIFY
    set_gain(switch, LOOKAHEAD, [16.0, 8.0])  # 3 tokens in 0.022 s against 2 in 0.014 s: still verify
    assert switch.choose([0], candidates, texts, 7, 3) == VERIFY
    set_gain(switch, LOOKAHEAD, [24.0, 8.0])  # 4 tokens in 0.022 s
    assert switch.choose([0], candidates, texts, 7, 3) == LOOKAHEAD
    set_gain(switch, LOOKAHEAD, [0.0, 1.0])
    assert switch.choose([0], candidates, texts, 7, 3) == VERIFY
    switch.observe(0.03, [1])  # the first verify step: not timed
    assert switch.choose([0], candidates, texts, 7, 3) == VERIFY
    switch.observe(0.03, [1])  # 0.01 s a token: 2 tokens in 0.03 s lose to a plain step's 1 in 0.01 s
    assert switch.gain[VERIFY][0] > 0
    assert switch.choose([0], candidates, texts, 7, 3) == PLAIN


def test_a_batch_gains_only_where_its_least_advanced_rows_do():
    """A batch runs until its last row is done. Four rows, a token 5% of a plain step: a token
    per row pays for a verify step only where the batch's least advanced rows gain it too; rows
    ahead gaining alone only leave the batch early."""
    switch = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.0005, rows=4)
    texts = {row: [1, 2, 3] for row in range(4)}
    every, half = [[(4, 5)]] * 4, [[(4, 5)], [(4, 5)], [], []]
    switch.gain[VERIFY] = [8.0, 8.0]  # a token per row with candidates
    switch.batch_gain[VERIFY] = [0.0, 8.0]  # never the batch's
    assert switch.choose([0, 1, 2, 3], every, texts, 36, 12) == PLAIN
    switch.batch_gain[VERIFY] = [8.0, 8.0]  # the batch's too
    assert switch.choose([0, 1, 2, 3], every, texts, 36, 12) == VERIFY
    assert switch.choose([0, 1, 2, 3], half, texts, 32, 8) == PLAIN  # rows 2 and 3 cannot gain
    texts[0].append(4)  # rows 0 and 1 a token ahead: 2 and 3 are the least advanced
    texts[1].append(4)
    assert switch.choose([0, 1, 2, 3], half, texts, 32, 8) == PLAIN
    assert switch.choose([0, 1, 2, 3], half[::-1], texts, 32, 8) == VERIFY


def test_the_shadow_measures_the_batch_gain_by_its_least_advanced_row():
    """Plain steps' candidates scored in the shadow: each row's gain, and the batch's where
    every least advanced row had candidates (the least it would have moved beyond one)."""
    switch = _switch_after_two_plain_steps(prefill_seconds=100.0, rows=2)  # wide steps priced out
    texts = {0: [1, 2, 3], 1: [1, 2, 3]}
    assert switch.choose([0, 1], [[(4, 5)], [(6, 7)]], texts, 10, 6) == PLAIN
    texts[0] += [4, 5]
    texts[1] += [6, 9]  # row 0 would have gained 2 tokens, row 1 one
    assert switch.choose([0, 1], [[(8, 8)], []], texts, 10, 6) == PLAIN
    prior = GAIN_PRIOR_SAMPLES * DECAY ** 2
    assert switch.gain[VERIFY] == pytest.approx([3.0, prior + 2])
    assert switch.batch_gain[VERIFY] == pytest.approx([1.0, GAIN_PRIOR_SAMPLES * DECAY + 1])
    texts[0] += [8, 8]
    texts[1] += [1, 1]  # row 0's candidates matched; row 1 had none: no batch sample
    switch.choose([0, 1], [[], []], texts, 10, 6)
    assert switch.gain[VERIFY] == pytest.approx([3.0 * DECAY + 2, (prior + 2) * DECAY + 1])
    assert switch.batch_gain[VERIFY] == pytest.approx([1.0, GAIN_PRIOR_SAMPLES * DECAY + 1])


def test_a_verify_step_measures_the_batch_gain_over_the_rows_still_running():
    """After a verify step the batch's gain is its least advanced running row's: a row that
    finished in the step (EOS, budget) no longer bounds the batch."""
    switch = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.0001, rows=3)  # cheap tokens
    for kind in (VERIFY, LOOKAHEAD):
        switch.gain[kind], switch.batch_gain[kind] = [8.0, 8.0], [8.0, 8.0]
    texts = {row: [1, 2, 3] for row in range(3)}
    assert switch.choose([0, 1, 2], [[(4, 5)]] * 3, texts, 21, 9) == VERIFY
    switch.observe(0.02, [1, 0, 2], running=[0, 2])  # row 1 finished with no gain
    assert switch.gain[VERIFY] == pytest.approx([8.0 * DECAY ** 3 + 3, 8.0 * DECAY ** 3 + 3])
    assert switch.batch_gain[VERIFY] == pytest.approx([8.0 * DECAY + 1, 8.0 * DECAY + 1])


def test_one_row_values_a_step_by_its_own_gain():
    """A batch down to one row: the row is the batch, whatever the batch's gain measured while
    more rows ran."""
    switch = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.002)  # a token: a fifth of a step
    switch.gain[VERIFY], switch.batch_gain[VERIFY] = [8.0, 8.0], [0.0, 8.0]
    assert switch.choose([0], [[(4, 5)]], {0: [1, 2, 3]}, 7, 3) == VERIFY


def force_kinds(monkeypatch, kinds) -> None:
    """Make the switch return ``kinds`` in turn (its estimates unused)."""
    turn = itertools.count()

    def choose(self, rows, candidates, texts, lookahead_tokens, verify_tokens):
        self.step = None
        return kinds[next(turn) % len(kinds)]

    monkeypatch.setattr(LookaheadSwitch, "choose", choose)


@pytest.mark.parametrize("kinds", [[VERIFY], [VERIFY, LOOKAHEAD, PLAIN], [LOOKAHEAD, VERIFY, VERIFY, PLAIN, LOOKAHEAD]])
def test_verify_and_plain_steps_between_lookahead_steps_equal_greedy_generate(target, monkeypatch, kinds):
    """Verify steps (candidates only) and plain steps leave the window as it was: any order of
    the three kinds gives greedy generate's tokens, and candidates are accepted (by verify steps
    alone in the first case)."""
    force_kinds(monkeypatch, kinds)
    ids, mask = repetitive_prompts(B=5, seed=2)
    plain = generate(target, ids, mask, max_new_tokens=24, temperature=0)
    out = lookahead_generate(target, ids, mask, window=3, ngram=3, guesses=4, max_new_tokens=24)
    assert torch.equal(out.tokens, plain.tokens)
    assert out.stats.num_accepted.sum() > 0


def test_the_switch_probes_lookahead_steps_while_verify_steps_win():
    """Verify steps pay, and lookahead steps were never measured: once the steps since the last
    lookahead step took 1 / PROBE_SHARE times its extra cost, one runs."""
    switch = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.00009)  # a token: 0.9% of a plain step
    set_gain(switch, VERIFY, [8.0, 8.0])
    switch.since[LOOKAHEAD] = 0
    kinds = [switch.choose([0], [[(4, 5)]], {0: [1, 2, 3]}, 7, 3) for _ in range(4)]
    assert kinds == [VERIFY, VERIFY, VERIFY, LOOKAHEAD]  # a lookahead step adds 0.00054 s: due after 3 steps


def test_the_switch_shadow_counts_against_a_stale_verify_gain():
    """Verify steps and the shadow of plain steps feed one estimate: zeros scored in the shadow
    pull down a gain verify steps measured earlier."""
    switch = _switch_after_two_plain_steps(prefill_seconds=100.0)
    set_gain(switch, VERIFY, [8.0, 8.0])
    texts = {0: [1, 2, 3]}
    assert switch.choose([0], [[(4, 5)]], texts, 7, 3) == PLAIN  # priced out
    texts[0] += [7, 7]
    switch.choose([0], [[]], texts, 5, 1)
    assert switch.gain[VERIFY] == switch.batch_gain[VERIFY] == pytest.approx([8.0 * DECAY, 8.0 * DECAY + 1])


def test_an_adaptive_run_takes_verify_steps_where_they_pay(target, monkeypatch):
    """With verify steps priced cheap and lookahead steps dear, the switch runs verify steps
    between plain ones: greedy generate's tokens, one host sync per step."""
    monkeypatch.setattr(LookaheadSwitch, "_seconds", lambda self, kind, tokens, rows: 1e-6 if kind == VERIFY else 1e6)
    monkeypatch.setattr(LookaheadSwitch, "_plain_seconds", lambda self: 1.0)
    kinds = []
    choose = LookaheadSwitch.choose
    monkeypatch.setattr(LookaheadSwitch, "choose", lambda self, *a: kinds.append(choose(self, *a)) or kinds[-1])
    ids, mask = repetitive_prompts(B=3, seed=4)
    with SyncCounter() as syncs:
        out = lookahead_generate(target, ids, mask, max_new_tokens=16)
    assert VERIFY in kinds and LOOKAHEAD not in kinds
    assert out.stats.num_accepted.sum() > 0
    in_loop = [e for e in syncs.events if "_prepare" not in e.where and "prefill" not in e.where
               and "lookahead_generate" not in e.where]
    assert all("_rows_still_running" in e.where for e in in_loop), in_loop
    assert len(in_loop) == int(out.stats.num_steps.max()) + 1
    assert torch.equal(out.tokens, generate(target, ids, mask, max_new_tokens=16, temperature=0).tokens)


def test_an_untimed_wide_kind_is_priced_as_the_other_wide_kind():
    """The prefill prices a token at 10% of a plain step; a verify step timed at a token per
    plain step prices the lookahead step's tokens alike until one is timed: it does not pay."""
    switch = _switch_after_two_plain_steps(prefill_seconds=0.01 + 100 * 0.001)
    set_gain(switch, VERIFY, [8.0, 8.0])  # a token per step: a verify step pays at 10% a token
    assert switch._token_seconds(LOOKAHEAD) == pytest.approx(0.001)
    assert switch.choose([0], [[(4, 5)]], {0: [1, 2, 3]}, 7, 3) == VERIFY
    switch.observe(0.03, [1])  # the first verify step: not timed
    assert switch.choose([0], [[(4, 5)]], {0: [1, 2, 3, 4, 5]}, 7, 3) == VERIFY
    switch.observe(0.03, [1])  # timed: each of its 2 extra tokens costs a plain step
    assert switch._token_seconds(LOOKAHEAD) == pytest.approx(0.01)
    assert switch.choose([0], [[(4, 5)]], {0: [1, 2, 3, 4, 5, 6, 7]}, 7, 3) == PLAIN


def test_lookahead_step_costs_carry_to_the_next_call_run_alike(target):
    """A second call on the same model, batch size and settings starts from the step costs the
    first measured (its wide steps are not priced by the prefill); another batch size or
    (W, N, G) starts afresh; greedy tokens stay `generate`'s."""
    ids, mask = ragged_prompts(B=2, seed=3)
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0)
    way = ("lookahead", 2, "cpu", False, True, 2, 3, 4)
    for _ in range(2):
        out = lookahead_generate(target, ids, mask, window=2, ngram=3, guesses=4, max_new_tokens=20)
        assert torch.equal(out.tokens, plain.tokens)
        known = known_costs(target, way)
        assert set(known) == {"plain", "per_token"} and known["plain"][1] > 1, known
    switch = LookaheadSwitch(adaptive=True, ngram=3, known=known)
    assert switch.plain == known["plain"] and switch.plain is not known["plain"]
    assert known_costs(target, ("lookahead", 1, "cpu", False, True, 2, 3, 4)) == {}
    assert known_costs(target, ("lookahead", 2, "cpu", False, True, 1, 3, 4)) == {}
    before = list(known["plain"])
    lookahead_generate(target, ids, mask, max_new_tokens=20, adaptive=False)
    assert known_costs(target, way)["plain"] == before  # fixed steps neither read nor keep them


def test_a_probe_corrects_a_stale_carried_cost():
    """Lookahead tokens carried at 10 times their cost (timed under another load) are priced out;
    the probes still come (their spacing priced by the stale cost), and the first (timed: the
    costs are carried) weighs as much as the 20 carried samples: the estimate falls halfway at once."""
    known = {"plain": [0.01 * 20, 20.0], "per_token": {VERIFY: [0.0, 0.0], LOOKAHEAD: [0.003 * 20, 20.0]}}
    switch = LookaheadSwitch(adaptive=True, ngram=3, known=known)
    set_gain(switch, LOOKAHEAD, [1.0, 8.0])
    texts, kinds = {0: [1, 2, 3]}, []
    while LOOKAHEAD not in kinds:
        kinds.append(switch.choose([0], [[(4, 5)]], texts, 9, 3))
        switch.observe(0.01 + (8 * 0.0003 if kinds[-1] == LOOKAHEAD else 2 * 0.0003 * (kinds[-1] == VERIFY)), [0])
        texts[0] = texts[0] + [7]
        assert len(kinds) < 1000
    assert kinds[0] == PLAIN and switch._token_seconds(LOOKAHEAD) == pytest.approx((0.003 + 0.0003) / 2, rel=0.1)
    assert known["per_token"][LOOKAHEAD][1] == pytest.approx(COST_DECAY * 1 + 1)  # kept for the next call


def test_a_carried_call_prices_untimed_wide_steps_by_its_own_prefill():
    """Carried costs with only plain steps timed: the next call still prices wide tokens by its
    prefill (here a token costs 100 plain steps), not at nothing."""
    known, texts = {}, [[1, 2, 3]]
    first = LookaheadSwitch(adaptive=True, ngram=3, known=known)
    first.prefilled(0.01 + 100 * 0.0001, 101, 1)
    for _ in range(3):
        assert first.choose([0], [[]], texts, 5, 1) == PLAIN
        first.observe(0.01, [0])
    assert known["per_token"] == {VERIFY: [0.0, 0.0], LOOKAHEAD: [0.0, 0.0]}
    switch = LookaheadSwitch(adaptive=True, ngram=3, known=known)
    switch.prefilled(0.01 + 100 * 1.0, 101, 1)
    assert switch.choose([0], [[]], texts, 5, 1) == PLAIN
    switch.observe(0.01, [0])  # timed (the costs are carried): the prefill's price is set
    set_gain(switch, LOOKAHEAD, [8.0, 8.0])
    set_gain(switch, VERIFY, [8.0, 8.0])
    assert switch._token_seconds(LOOKAHEAD) == pytest.approx(1.0)
    assert switch.choose([0], [[(4, 5)]], {0: [1, 2, 3, 4]}, 7, 3) == PLAIN
