"""Trained draft heads: the feature head as a Drafter, its training, its files."""

import functools

import pytest
import torch

from specdec_kernels import (
    ExitHead,
    ExitHeadDraft,
    FeatureHead,
    FeatureHeadDraft,
    LookupFirstDraft,
    generate,
    speculative_generate,
)
from specdec_kernels.draft_data import Shard, _features
from specdec_kernels.draft_training import (
    TrainSettings,
    _collate,
    _Trainer,
    draft_vocabulary,
    evaluate,
    load_sequences,
    new_head,
    train_head,
)
from specdec_kernels.matmul import Linear, bfloat16_matmuls_available, bfloat16_plan, mkl_packing_available

from tiny_models import V, greedy_divergence_allowed, ragged_prompts, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3, layers=2)


def random_head(target, vocab_size=V, seed=0, scale=1.0):
    """A head with random weights over the first ``vocab_size`` ids, shuffled."""
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:vocab_size]
    head = new_head(target, vocab, seed)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(scale)
    return head.eval()


@pytest.mark.parametrize("vocab_size", [V, 40])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_speculative_output_equals_generate_with_a_head(target, vocab_size, adaptive, K):
    input_ids, mask = ragged_prompts(B=5, P=7, seed=K)
    plain = generate(target, input_ids, mask, max_new_tokens=14, temperature=0)
    spec = speculative_generate(target, FeatureHeadDraft(target, random_head(target, vocab_size)), input_ids, mask,
                                num_draft_tokens=K, max_new_tokens=14, temperature=0, adaptive=adaptive)
    for row in range(input_ids.shape[0]):
        differ = (plain.tokens[row] != spec.tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(target, input_ids, mask, plain.tokens, row, int(differ[0]))
    assert (spec.stats.num_generated == plain.stats.num_generated).all()


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("branches, depth, K", [(2, 1, 3), (2, 3, 5), (4, 4, 9), (3, None, 15)])
def test_greedy_tree_speculation_with_a_head_equals_generate(target, branches, depth, K, adaptive):
    input_ids, mask = ragged_prompts(B=5, P=7, seed=K)
    plain = generate(target, input_ids, mask, max_new_tokens=14, temperature=0)
    drafter = FeatureHeadDraft(target, random_head(target, 60, seed=K, scale=3.0), branches=branches, depth=depth)
    spec = speculative_generate(target, drafter, input_ids, mask, num_draft_tokens=K, max_new_tokens=14,
                                temperature=0, adaptive=adaptive)
    for row in range(input_ids.shape[0]):
        differ = (plain.tokens[row] != spec.tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(target, input_ids, mask, plain.tokens, row, int(differ[0]))
    assert (spec.stats.num_generated == plain.stats.num_generated).all()


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("branches, K", [(1, 4), (3, 7)])
def test_greedy_speculation_with_lookup_first_and_a_head_equals_generate(target, branches, K, adaptive):
    """The head skips the steps the lookup serves (commits without proposals, many in a row
    where rows repeat themselves) and still drafts from the right features afterwards."""
    input_ids, mask = ragged_prompts(B=4, P=12, seed=5)
    input_ids[:2, -6:] = input_ids[:2, -12:-6].clone()
    mask[:2] = 1
    plain = generate(target, input_ids, mask, max_new_tokens=40, temperature=0)
    head = FeatureHeadDraft(target, random_head(target, 60, seed=1, scale=3.0), branches=branches, depth=3)
    for rows in (slice(None), slice(0, 1)):  # at batch 1 the lookup serves whole steps alone
        spec = speculative_generate(target, LookupFirstDraft(head, draft_tokens=3), input_ids[rows], mask[rows],
                                    num_draft_tokens=K, max_new_tokens=40, temperature=0, adaptive=adaptive)
        for row in range(spec.tokens.shape[0]):
            differ = (plain.tokens[rows][row] != spec.tokens[row]).nonzero()
            if len(differ):
                assert greedy_divergence_allowed(target, input_ids[rows], mask[rows], plain.tokens[rows], row,
                                                 int(differ[0]))
        assert (spec.stats.num_generated == plain.stats.num_generated[rows]).all()


def _reference_tree(next_log_probs, branches: int, depth: int, num_tokens: int) -> list[tuple[float, tuple]]:
    """EAGLE-2's dynamic tree by brute force: ``next_log_probs(path)`` gives the head's log-probs
    [Vd] of the token after ``path`` (draft-vocabulary indices); the ``branches`` best children of
    the root, then ``depth - 1`` times the ``branches`` best children of each of the
    ``branches`` best paths of the last level; the ``num_tokens`` best candidates, best first."""
    def children(score, path):
        top = (score + next_log_probs(path)).topk(branches)
        return [(value, (*path, index)) for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True)]

    beam = children(0.0, ())
    candidates = list(beam)
    for _ in range(depth - 1):
        level = [child for score, path in beam for child in children(score, path)]
        candidates += level
        beam = sorted(level, key=lambda c: -c[0])[:branches]
    return sorted(candidates, key=lambda c: -c[0])[:num_tokens]


def _forced_chain_log_probs(target, head, committed, hidden, path) -> torch.Tensor:
    """The head's log-probs [Vd] of the token after ``committed`` [n] then ``path`` (draft-
    vocabulary indices), drafting a chain forced along ``path`` (``hidden`` [n - 1, H]: the
    target's features of the committed positions but the last)."""
    n = len(committed)
    chain = FeatureHeadDraft(target, head)
    chain.prefill(committed[None, :n - 1], torch.tensor([n - 1]), 64, hidden_states=hidden[None])
    chain.commit(committed[None, n - 1:], torch.tensor([1]), hidden_states=hidden[None, n - 2:])
    forced = iter([*head.draft_vocab[list(path)].tolist(), 0])
    logits = chain.propose(len(path) + 1, lambda _: torch.tensor([next(forced)])).logits[0, -1]
    return torch.log_softmax(logits[head.draft_vocab].float(), -1)


@pytest.mark.parametrize("branches, depth, K, scale", [(2, 3, 6, 3.0), (4, 2, 20, 3.0), (3, 3, 21, 0.6),
                                                     (2, 4, 14, 0.6)])
def test_a_heads_tree_holds_the_most_likely_paths_it_drafts(target, branches, depth, K, scale):
    """Each row's tree (after ragged commits) is the brute-force dynamic tree whose path
    probabilities come from chain drafting forced along each path; nodes in topological order,
    most likely first. (A flatter head, ``scale`` 0.6, mixes parents in a level's best paths; K is
    then every candidate, so that the deepest levels are kept.)"""
    head = random_head(target, 50, seed=3, scale=scale)
    g = torch.Generator().manual_seed(branches)
    B, P = 3, 8
    text = torch.randint(0, V, (B, P), generator=g)
    lengths = torch.tensor([8, 4, 6])  # committed tokens per row: a prompt of lengths - 1, then one token
    hidden = torch.stack([_sequence_hidden(target, row) for row in text])
    prompt = torch.where(torch.arange(P) < (lengths - 1)[:, None], text, 0)
    drafter = FeatureHeadDraft(target, head, branches=branches, depth=depth)
    drafter.prefill(prompt, lengths - 1, 64, hidden_states=hidden)
    last = (lengths - 1)[:, None]
    drafter.commit(text.gather(1, last), torch.ones(B, dtype=torch.int64),
                   hidden_states=hidden.gather(1, (last - 1)[..., None].expand(-1, -1, hidden.shape[-1])))
    tree = drafter.propose(K, lambda logits: logits.argmax(-1))
    assert tree.logits is None and tree.parents is not None
    local = torch.full((V,), -1, dtype=torch.int64)
    local[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    for row in range(B):
        n = int(lengths[row])

        next_log_probs = functools.partial(_forced_chain_log_probs, target, head, text[row, :n], hidden[row, :n - 1])
        expected = _reference_tree(next_log_probs, branches, depth, K)
        parents, paths = tree.parents[row].tolist(), []
        for i, (token, parent) in enumerate(zip(local[tree.token_ids[row]].tolist(), parents, strict=True)):
            assert -1 <= parent < i
            paths.append((*(paths[parent] if parent >= 0 else ()), token))
        assert paths == [path for _, path in expected]


def _sequence_hidden(target, ids):
    with torch.no_grad():
        _, hidden = target(ids[None], target.new_cache(1, len(ids)), return_hidden=True)
    return hidden[0]


def test_drafting_reads_what_the_unrolled_training_step_reads(target):
    """Draft token k at run time (the head over its own predicted features) has the logits of
    unrolled training step k at the same position: training-time test trains what runs."""
    head = random_head(target, 60, seed=1, scale=3.0)
    g = torch.Generator().manual_seed(2)
    n, K = 9, 4
    prefix = torch.randint(0, V, (n + 1,), generator=g)  # prompt x_0 .. x_{n-1}, then the first token x_n
    drafter = FeatureHeadDraft(target, head)
    hidden = _sequence_hidden(target, prefix)
    drafter.prefill(prefix[None, :n], torch.tensor([n]), 64, hidden_states=hidden[None, :n])
    drafter.commit(prefix[None, n:], torch.tensor([1]), hidden_states=hidden[None, n - 1:n])
    proposal = drafter.propose(K, lambda logits: logits.argmax(-1))
    drafts = proposal.token_ids[0]

    # The same pairs for training: (h_t, x_{t+1}); positions past n - 1 hold the drafts (their
    # features are never read by the steps compared).
    sequence = torch.cat([prefix, drafts[:-1]])
    features = _sequence_hidden(target, sequence)
    L = len(sequence)
    index = torch.full((V,), -1, dtype=torch.int64)
    index[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    from specdec_kernels.draft_training import _Sequence

    seq = _Sequence(features.half().float(), sequence, torch.zeros(L, 2, dtype=torch.int64), torch.zeros(L, 2), n)
    batch = _collate([seq], [0], index)
    batch.features = features[None, :-1]  # exact features (the shard stores float16)
    outputs = _Trainer(target, head).forward(batch, K)
    for k in range(1, K + 1):
        trained = outputs[k - 1][0][0, n - 1 + (k - 1)]
        ran = proposal.logits[0, k - 1, head.draft_vocab]
        torch.testing.assert_close(ran, trained, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, branches, K", [("feature", 1, 2), ("feature", 3, 4), ("early-exit", 1, 2)])
def test_sampling_with_a_head_is_lossless(kind, branches, K):
    """Chi-square of the first three sampled tokens against the target's exact distribution,
    with chains (sampled drafts), trees (deterministic siblings, the point-mass rule) and the
    early-exit head."""
    from test_generation import P_THRESHOLD, chi_square_pvalue, exact_first_tokens_distribution

    small = dict(layers=2, hidden=32, heads=4, kv_heads=1)
    target = tiny_llama(seed=1, scale=4.0, vocab_size=64, **small)
    vocab = torch.arange(40)  # drafts never propose ids 40..63, which the target still samples
    head = new_head(target, vocab, 0, kind=kind, exit_layer=1)
    if kind == "feature":
        with torch.no_grad():
            for p in head.parameters():
                p.mul_(8.0)
    prompt = torch.tensor([3, 1, 4])
    joint, marginal3 = exact_first_tokens_distribution(target, prompt)
    ids = prompt.expand(6000, -1).contiguous()
    drafter = (FeatureHeadDraft(target, head.eval(), branches=branches, depth=2) if kind == "feature"
               else ExitHeadDraft(target, head.eval()))
    out = speculative_generate(target, drafter, ids, num_draft_tokens=K, max_new_tokens=3, seed=7, adaptive=False,
                               temperature=1.0)
    t = out.tokens
    assert chi_square_pvalue(torch.bincount(t[:, 0] * 64 + t[:, 1], minlength=64 * 64).reshape(64, 64), joint) \
        > P_THRESHOLD
    assert chi_square_pvalue(torch.bincount(t[:, 2], minlength=64), marginal3) > P_THRESHOLD
    assert out.stats.num_accepted.sum() > 0 and (t >= 40).any()


@pytest.mark.parametrize("options, message", [
    (dict(branches=0), "branches must be an int >= 1"),
    (dict(branches=2.0), "branches must be an int >= 1"),
    (dict(branches=2, depth=0), "depth must be None or an int >= 1"),
    (dict(branches=V + 1), f"exceeds the draft vocabulary of {V} ids"),
    (dict(branches=5, draft_vocab_size=4), "exceeds the draft vocabulary of 4 ids"),
    (dict(draft_vocab_size=0), rf"draft_vocab_size must be None or an int in \[1, {V}\]"),
    (dict(draft_vocab_size=V + 1), rf"draft_vocab_size must be None or an int in \[1, {V}\]"),
    (dict(draft_vocab_size=8.0), rf"draft_vocab_size must be None or an int in \[1, {V}\]"),
])
def test_bad_tree_options_are_refused(target, options, message):
    with pytest.raises(ValueError, match=message):
        FeatureHeadDraft(target, random_head(target), **options)


def _with_vocab(head, vocab):
    """A copy of ``head`` drafting from ``vocab`` (its weights do not depend on the vocabulary)."""
    other = FeatureHead(head.config, vocab) if isinstance(head, FeatureHead) else ExitHead(
        head.config, head.exit_layer, vocab)
    other.load_state_dict({**head.state_dict(), "draft_vocab": vocab})
    return other.eval()


@pytest.mark.parametrize("kind, branches", [("feature", 1), ("feature", 3), ("early-exit", 1)])
def test_a_drafter_over_its_heads_first_ids_drafts_as_a_head_of_those_ids(target, kind, branches):
    """``draft_vocab_size=n``: the drafts of a head whose vocabulary is the first n ids, and
    greedy output stays `generate`'s."""
    head = (random_head(target, 50, seed=4, scale=3.0) if kind == "feature"
            else new_head(target, torch.randperm(V, generator=torch.Generator().manual_seed(4)), 0,
                          kind="early-exit", exit_layer=1))
    make = ((lambda h, **o: FeatureHeadDraft(target, h, branches=branches, depth=3, **o)) if kind == "feature"
            else (lambda h, **o: ExitHeadDraft(target, h, **o)))
    ids, mask = ragged_prompts(B=4, P=8, seed=6)
    plain = generate(target, ids, mask, max_new_tokens=16, temperature=0)

    def run(drafter):
        """The drafter's proposals' tokens, in order, checking the greedy output."""
        proposals, propose = [], drafter.propose

        def recorded(num_tokens, sample):
            proposal = propose(num_tokens, sample)
            proposals.append(proposal.token_ids.clone())
            return proposal

        drafter.propose = recorded
        out = speculative_generate(target, drafter, ids, mask, num_draft_tokens=4, max_new_tokens=16,
                                   temperature=0, adaptive=False)
        assert torch.equal(out.tokens, plain.tokens)
        return proposals

    first, alone = run(make(head, draft_vocab_size=20)), run(make(_with_vocab(head, head.draft_vocab[:20])))
    assert len(first) == len(alone) and all(torch.equal(a, b) for a, b in zip(first, alone, strict=True))
    drafted = lambda proposals: torch.isin(torch.cat([p.flatten() for p in proposals]), head.draft_vocab[:20])
    assert drafted(first).all()
    assert not drafted(run(make(head))).all()  # the cut changed the drafts
    assert len(head.draft_vocab) == (50 if kind == "feature" else V)  # the head itself is unchanged


def test_a_head_for_another_target_is_refused(target):
    other = tiny_llama(seed=3, layers=2, hidden=32)
    with pytest.raises(ValueError, match="trained for another target"):
        FeatureHeadDraft(other, random_head(target))
    with pytest.raises(TypeError, match="built-in Llama"):
        FeatureHeadDraft(torch.nn.Linear(2, 2), random_head(target))


@pytest.mark.parametrize("vocab, message", [(torch.tensor([1, 1]), "distinct"), (torch.tensor([V]), "distinct"),
                                            (torch.tensor([1.0]), "int64"), (torch.tensor([], dtype=torch.int64),
                                                                             "non-empty")])
def test_a_bad_draft_vocabulary_is_refused(target, vocab, message):
    with pytest.raises(ValueError, match=message):
        FeatureHead(target.config, vocab)


def test_a_saved_head_loads_to_the_same_drafts(target, tmp_path):
    head = random_head(target, 50, seed=4, scale=3.0)
    head.save(tmp_path / "head.pt", dtype=torch.float32)
    loaded = FeatureHead.load(tmp_path / "head.pt")
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    (tmp_path / "bad.pt").write_bytes(b"not a head")
    with pytest.raises(ValueError, match="bad.pt is not a draft head of kind 'feature'"):
        FeatureHead.load(tmp_path / "bad.pt")


# --------------------------------------------------------------------------- training

def _tiny_shards(target, folder, count=2, per_shard=6, seed=0):
    """Shards as `write_shards` writes them, from the tiny target's own greedy answers."""
    paths = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed + i)
        prompts = [torch.randint(0, V, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
                   for _ in range(per_shard)]
        sequences = []
        for p in prompts:
            out = generate(target, p[None], max_new_tokens=12, temperature=0)
            sequences.append(torch.cat([p, out.tokens[0]]))
        hidden, top_ids, top_logits = _features(target, sequences, 8, max_tokens_per_pass=64)
        path = folder / f"shard-{i:05d}.pt"
        torch.save({"token_ids": torch.cat(sequences), "lengths": torch.tensor([len(s) for s in sequences]),
                    "prompt_lengths": torch.tensor([len(p) for p in prompts]), "hidden": hidden,
                    "top_ids": top_ids, "top_logits": top_logits}, path)
        paths.append(path)
    return paths


def test_shards_hold_the_targets_features_and_top_logits(target, tmp_path):
    paths = _tiny_shards(target, tmp_path, count=1)
    shard = Shard.load(paths[0])
    first = shard.token_ids[: int(shard.lengths[0])]
    with torch.no_grad():
        logits, hidden = target(first[None], target.new_cache(1, len(first)), return_hidden=True)
    torch.testing.assert_close(shard.hidden[: len(first)].float(), hidden[0], rtol=1e-3, atol=1e-3)
    assert torch.equal(shard.top_ids[: len(first), 0], logits[0].argmax(-1))
    (tmp_path / "broken.pt").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="broken.pt is not a draft-data shard"):
        Shard.load(tmp_path / "broken.pt")


def test_training_reduces_the_loss_and_raises_agreement(target, tmp_path):
    sequences = load_sequences(_tiny_shards(target, tmp_path, count=2))
    settings = TrainSettings(steps=40, tokens_per_batch=64, lr=3e-3, warmup=5, unroll=2, draft_vocab_size=64,
                             checkpoint_every=1000)
    head = train_head(target, sequences, tmp_path / "run", TrainSettings(**{**settings.__dict__, "steps": 1}),
                      log=lambda _: None)
    before = evaluate(target, head, sequences, unroll=2)
    head = train_head(target, sequences, tmp_path / "run2", settings, log=lambda _: None)
    after = evaluate(target, head, sequences, unroll=2)
    assert after["top1_step1"] > before["top1_step1"] + 0.2
    assert after["top1_step2"] > before["top1_step2"] + 0.1


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(target, tmp_path):
    sequences = load_sequences(_tiny_shards(target, tmp_path, count=1))
    settings = TrainSettings(steps=6, tokens_per_batch=48, warmup=2, unroll=2, draft_vocab_size=50,
                             checkpoint_every=3)
    straight = train_head(target, sequences, tmp_path / "straight", settings, log=lambda _: None)
    train_head(target, sequences, tmp_path / "pieces", TrainSettings(**{**settings.__dict__}), max_seconds=0.0,
               log=lambda _: None)  # stops after its first step
    assert torch.load(tmp_path / "pieces" / "checkpoint.pt", weights_only=True)["step"] == 1
    resumed = train_head(target, sequences, tmp_path / "pieces", settings, log=lambda _: None)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="other settings"):
        train_head(target, sequences, tmp_path / "pieces", TrainSettings(**{**settings.__dict__, "lr": 1.0}))
    with pytest.raises(ValueError, match="other data"):
        train_head(target, sequences, tmp_path / "pieces", settings, data_id="2 shards")
    (tmp_path / "pieces" / "checkpoint.pt").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="checkpoint.pt is not a training checkpoint"):
        train_head(target, sequences, tmp_path / "pieces", settings)


def test_a_run_from_a_head_file_fine_tunes_that_head(target, tmp_path):
    """``init``: training starts from the file's weights, not fresh ones, and drafts from the
    data's most frequent ids (most frequent first) then the file's ids those lack."""
    sequences = load_sequences(_tiny_shards(target, tmp_path, count=2))
    settings = TrainSettings(steps=40, tokens_per_batch=64, lr=3e-3, warmup=5, unroll=2, draft_vocab_size=64,
                             checkpoint_every=1000)
    trained = train_head(target, sequences, tmp_path / "first", settings, log=lambda _: None)
    trained.save(tmp_path / "head.pt", dtype=torch.float32)
    once = lambda folder, **changes: train_head(target, sequences, tmp_path / folder, TrainSettings(
        **{**settings.__dict__, "steps": 1, "lr": 1e-9, **changes}), log=lambda _: None)
    tuned, fresh = once("tuned", init=str(tmp_path / "head.pt")), once("fresh")
    assert torch.equal(tuned.draft_vocab, trained.draft_vocab)
    scores = [evaluate(target, head, sequences, unroll=2)["top1_step1"] for head in (trained, tuned, fresh)]
    assert scores[1] == pytest.approx(scores[0], abs=0.02) and scores[1] > scores[2] + 0.2
    # A head of other ids gains the data's most frequent ones, only those the data holds (these
    # shards hold fewer than 64 distinct ids), first; then its own ids, in its order.
    seen = draft_vocabulary(sequences, 64, V, seen_only=True)
    assert 8 < len(seen) < 64 and torch.equal(seen, trained.draft_vocab[:len(seen)])
    rare = torch.tensor([i for i in range(V) if i not in set(seen.tolist())][:5] + seen[:3].tolist())
    new_head(target, rare, 0).save(tmp_path / "rare.pt", dtype=torch.float32)
    grown = once("grown", init=str(tmp_path / "rare.pt"))
    assert torch.equal(grown.draft_vocab, torch.cat([seen, rare[:5]]))
    # A fine-tune resumed from its checkpoint ends where an uninterrupted one does, without the file.
    tune = TrainSettings(**{**settings.__dict__, "steps": 4, "checkpoint_every": 2, "init": str(tmp_path / "rare.pt")})
    straight = train_head(target, sequences, tmp_path / "straight", tune, log=lambda _: None)
    train_head(target, sequences, tmp_path / "pieces", tune, max_seconds=0.0, log=lambda _: None)
    (tmp_path / "rare.pt").rename(tmp_path / "moved.pt")
    resumed = train_head(target, sequences, tmp_path / "pieces", tune, log=lambda _: None)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    exit_head = new_head(target, trained.draft_vocab, 0, kind="early-exit", exit_layer=1)
    exit_head.save(tmp_path / "exit.pt")
    with pytest.raises(ValueError, match="not a draft head of kind 'feature'"):
        once("bad", init=str(tmp_path / "exit.pt"))
    with pytest.raises(ValueError, match="init head .*exit.pt exits after layer 1, but exit_layer=2"):
        once("bad2", head="early-exit", exit_layer=2, init=str(tmp_path / "exit.pt"))


def test_the_draft_vocabulary_is_the_most_frequent_answer_ids(target, tmp_path):
    sequences = load_sequences(_tiny_shards(target, tmp_path, count=1))
    vocab = draft_vocabulary(sequences, 10, V)
    counts = torch.zeros(V, dtype=torch.int64)
    for s in sequences:
        counts += torch.bincount(s.token_ids[s.prompt_length:], minlength=V)
        counts += torch.bincount(s.top_ids[s.prompt_length - 1:, 0], minlength=V)
    assert len(vocab) == 10 and counts[vocab].min() >= counts[counts.argsort(descending=True)[9]]


def test_write_shards_resumes_and_refuses_other_settings(target, tmp_path):
    """Shards are written whole, skipped when present (a resumed run writes the rest), and a
    folder written with other settings is refused by name."""
    from test_demo import _CharTokenizer

    from specdec_kernels.draft_data import write_shards

    prompts = ["abc", "hello there", "x", "list: a, b, c", "copy this", "zz"]
    first = write_shards(target, _CharTokenizer(), prompts, tmp_path, shard_size=2, max_new_tokens=5, batch_size=2,
                         top_k=4, max_seconds=0.0)
    assert [p.name for p in first] == ["shard-00000.pt"]  # the budget ran out after one shard
    before = first[0].stat().st_mtime_ns
    paths = write_shards(target, _CharTokenizer(), prompts, tmp_path, shard_size=2, max_new_tokens=5, batch_size=2,
                         top_k=4)
    assert [p.name for p in paths] == ["shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    assert first[0].stat().st_mtime_ns == before
    shard = Shard.load(paths[1])
    assert shard.prompt_lengths.tolist() == [len("<user>x<assistant>"), len("<user>list: a, b, c<assistant>")]
    assert ((shard.lengths - shard.prompt_lengths) >= 1).all() and ((shard.lengths - shard.prompt_lengths) <= 5).all()
    assert shard.hidden.dtype == torch.float16 and shard.top_ids.shape == (int(shard.lengths.sum()), 4)
    with pytest.raises(ValueError, match="other settings"):
        write_shards(target, _CharTokenizer(), prompts, tmp_path, shard_size=2, max_new_tokens=6, batch_size=2,
                     top_k=4)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        write_shards(target, _CharTokenizer(), prompts, tmp_path / "other", batch_size=0)
    from specdec_kernels.draft_training import train_draft

    with pytest.raises(ValueError, match="data_batch_size must be an int >= 1, got 0"):
        train_draft(stage="data", data_batch_size=0)


def test_held_out_prompts_are_never_training_prompts():
    from specdec_kernels.draft_data import build_prompts, is_held_out

    train, held_out = build_prompts()
    assert (train, held_out) == build_prompts()  # the data's settings record a hash of the list
    assert held_out and len(train) > 10 * len(held_out)
    assert not set(train) & set(held_out)
    assert all(is_held_out(p) for p in held_out) and not any(is_held_out(p) for p in train[:500])


def test_prompt_kinds_alternate_and_keep_the_documents_order():
    from specdec_kernels.draft_data import OPEN_TEMPLATES, OPEN_TOPICS, build_prompts

    documents, open_, both = build_prompts(kinds=("documents",)), build_prompts(kinds=("open",)), build_prompts()
    assert build_prompts(kinds=("open", "documents")) == both
    assert len(open_[0]) + len(open_[1]) == len(OPEN_TOPICS) * len(OPEN_TEMPLATES)
    assert not set(open_[0] + open_[1]) & set(documents[0] + documents[1])
    train, held_out = both
    # Each kind keeps its own order; a prefix holds as many of each while both last.
    open_set = set(open_[0])
    kinds = [p in open_set for p in train]
    assert [p for p, o in zip(train, kinds, strict=True) if o] == open_[0]
    assert [p for p, o in zip(train, kinds, strict=True) if not o] == documents[0]
    assert abs(sum(kinds[:1024]) - 512) <= 32
    assert sorted(held_out) == sorted(documents[1] + open_[1])
    for bad in ((), ("open", "open"), ("chat",)):
        with pytest.raises(ValueError, match="kinds must be a non-empty subset"):
            build_prompts(kinds=bad)


@pytest.mark.parametrize("name", ["prompts.json", "prompts.json.gz"])
def test_prompt_files_round_trip_and_refuse_bad_files(tmp_path, name):
    from specdec_kernels.draft_data import is_held_out, load_prompts, save_prompts

    prompts = [f"Explain item {i}." for i in range(60)]
    train = [p for p in prompts if not is_held_out(p)]
    held_out = [p for p in prompts if is_held_out(p)]
    assert held_out  # the split below is checked in both directions
    save_prompts(tmp_path / name, train, held_out)
    assert load_prompts(tmp_path / name) == (train, held_out)
    for moved in ((train + held_out[:1], held_out[1:]), (train[1:], held_out + train[:1])):
        save_prompts(tmp_path / name, *moved)
        with pytest.raises(ValueError, match="split is not is_held_out's"):
            load_prompts(tmp_path / name)
    (tmp_path / name).write_text('{"format": "specdec_kernels prompts 1", "train": "abc", "held_out": []}')
    with pytest.raises(ValueError, match="lists of strings"):
        load_prompts(tmp_path / name)
    (tmp_path / name).write_bytes(b'{"train": []}')
    with pytest.raises(ValueError, match=f"{name} is not a prompts file"):
        load_prompts(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no prompts file"):
        load_prompts(tmp_path / "missing.json")


def test_train_draft_writes_this_machines_prompts_for_another(tmp_path, capsys):
    from specdec_kernels.__main__ import main
    from specdec_kernels.draft_data import build_prompts, load_prompts

    assert main(["train-draft", "--stage", "prompts", "--prompts-file", str(tmp_path / "p.json.gz")]) == 0
    assert load_prompts(tmp_path / "p.json.gz") == build_prompts()
    assert "prompts written to" in capsys.readouterr().out
    assert main(["train-draft", "--stage", "prompts", "--prompt-kinds", "open",
                 "--prompts-file", str(tmp_path / "open.json")]) == 0
    assert load_prompts(tmp_path / "open.json") == build_prompts(kinds=("open",))


@pytest.mark.parametrize("argv, message", [
    (["--stage", "prompts"], "--stage prompts writes the prompts to --prompts-file"),
    (["--data-batch-size", "0"], "--data-batch-size must be > 0"),
    (["--minutes", "0"], "--minutes must be > 0"),
    (["--steps", "-3"], "--steps must be > 0"),
    (["--prompts", "0"], "--prompts must be > 0"),
    (["--head", "early-exit", "--exit-layer", "0"], "--exit-layer must be > 0"),
    (["--exit-layer", "3"], "--exit-layer is for --head early-exit"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--head", "early-exit", "--init", "shipped"], "--init shipped is the feature head"),
    (["--stage", "train", "--init", "/nonexistent/head.pt"], "no draft head file at /nonexistent/head.pt"),
    (["--prompt-kinds", "open", "open", "--stage", "prompts", "--prompts-file", "/nonexistent/p.json"],
     "--prompt-kinds must not repeat a kind, got open open"),
    (["--stage", "data", "--init", "shipped"], "--init does nothing with --stage data"),
    (["--stage", "prompts", "--prompts-file", "/nonexistent/p.json", "--lr", "1e-4"],
     "--lr does nothing with --stage prompts"),
    (["--stage", "train", "--prompt-kinds", "open"], "--prompt-kinds does nothing with --stage train"),
    (["--prompts-file", "/nonexistent/p.json", "--prompt-kinds", "open"],
     "--prompt-kinds does nothing with --prompts-file"),
])
def test_train_draft_refuses_bad_options(capsys, argv, message):
    from specdec_kernels.__main__ import main

    assert main(["train-draft", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL")
def test_a_head_on_a_packed_target_drafts_as_unpacked(target):
    """With the target's dtype, a packed target's plan is applied to the head's matmuls: the
    same drafts, to rounding."""
    import copy

    from specdec_kernels.matmul import MKL_PACKED_PLAN

    packed = copy.deepcopy(target).pack_weights(plan=MKL_PACKED_PLAN)
    input_ids, mask = ragged_prompts(B=3, P=6, seed=5)
    drafters = [FeatureHeadDraft(t, random_head(target, 50, seed=2, scale=3.0), matmul_dtype=torch.float32)
                for t in (target, packed)]
    assert drafters[1].head.fc.plan is MKL_PACKED_PLAN and drafters[1].model.output.plan is MKL_PACKED_PLAN
    assert drafters[1].model.layers[0].attention.wqkv.plan is MKL_PACKED_PLAN and drafters[0].head.fc.plan is None
    outs = [speculative_generate(t, d, input_ids, mask, num_draft_tokens=3, max_new_tokens=10, temperature=0,
                                 adaptive=False) for t, d in zip((target, packed), drafters, strict=True)]
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].stats.num_accepted, outs[1].stats.num_accepted)


needs_bfloat16 = pytest.mark.skipif(not bfloat16_matmuls_available(), reason="no native bfloat16 matmul here")


def _head_linears(drafter) -> list:
    return [drafter.head.fc, *(m for m in drafter.model.modules() if isinstance(m, Linear))]


@needs_bfloat16
def test_a_head_drafts_in_bfloat16_by_default_and_greedy_outputs_stay_the_targets(target):
    """On a CPU with native bfloat16 the head's own matmuls read bfloat16 copies of its weights
    (the target's, and an exit head's shared first layers, never do); greedy tokens still equal
    plain generate's."""
    input_ids, mask = ragged_prompts(B=3, P=6, seed=5)
    drafter = FeatureHeadDraft(target, random_head(target, 50, seed=2, scale=3.0))
    assert all(m.plan == bfloat16_plan() for m in _head_linears(drafter))
    exit_drafter = ExitHeadDraft(target, random_exit_head(target, 50, seed=2, scale=3.0))
    assert exit_drafter.model.output.plan == exit_drafter.head.adapter.w13.plan == bfloat16_plan()
    assert all(m.plan is None for m in target.modules() if isinstance(m, Linear))
    plain = generate(target, input_ids, mask, max_new_tokens=12, temperature=0)
    for d in (drafter, exit_drafter):
        spec = speculative_generate(target, d, input_ids, mask, num_draft_tokens=3, max_new_tokens=12,
                                    temperature=0, adaptive=False)
        assert torch.equal(spec.tokens, plain.tokens)
        assert spec.stats.num_accepted.sum() > 0


@needs_bfloat16
def test_bfloat16_drafts_follow_the_float32_ones_to_rounding(target):
    """The same head drafting in bfloat16 and in float32 gives draft logits that differ by
    bfloat16's rounding, not more (and not less: the bfloat16 copies are used)."""
    head = random_head(target, 50, seed=2, scale=3.0)
    ids, lengths = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1)), torch.tensor([7, 5])
    hidden = torch.stack([_sequence_hidden(target, row) for row in ids])
    logits = []
    for dtype in (torch.float32, torch.bfloat16):
        drafter = FeatureHeadDraft(target, head, matmul_dtype=dtype)
        with torch.inference_mode():  # as the loop runs it (autograd would take the plain path)
            drafter.prefill(ids, lengths, 32, hidden_states=hidden)
            logits.append(drafter.propose(3, lambda x: x.argmax(-1)).logits)
    finite = logits[0].isfinite()
    assert torch.equal(finite, logits[1].isfinite())
    difference = (logits[0][finite] - logits[1][finite]).abs().max()
    assert 0 < difference < 0.05 * logits[0][finite].abs().max()


@needs_bfloat16
@pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL")
def test_an_exit_head_in_bfloat16_leaves_a_packed_targets_layers_as_they_are(target):
    import copy

    from specdec_kernels.matmul import MKL_PACKED_PLAN

    packed = copy.deepcopy(target).pack_weights(plan=MKL_PACKED_PLAN)
    drafter = ExitHeadDraft(packed, random_exit_head(target, 50, seed=2))
    assert drafter.head.adapter.w13.plan == drafter.model.output.plan == bfloat16_plan()
    assert all(m.plan is MKL_PACKED_PLAN for m in packed.modules() if isinstance(m, Linear))


def test_a_heads_matmul_dtype_is_checked_and_a_reused_head_follows_its_latest_drafter(target, monkeypatch):
    head = random_head(target, 50, seed=2)
    for bad in (torch.float16, torch.float64, "bfloat16"):
        with pytest.raises(ValueError, match="matmul_dtype must be None, the target's dtype"):
            FeatureHeadDraft(target, head, matmul_dtype=bad)
        with pytest.raises(ValueError, match="matmul_dtype must be None, the target's dtype"):
            ExitHeadDraft(target, random_exit_head(target, 50, seed=2), matmul_dtype=bad)
    float32 = FeatureHeadDraft(target, head, matmul_dtype=torch.float32)
    assert all(m.plan is None for m in _head_linears(float32))
    from specdec_kernels import draft_heads

    monkeypatch.setattr(draft_heads, "bfloat16_matmuls_available", lambda: False)
    monkeypatch.setattr(draft_heads, "bfloat16_plan", lambda: None)
    with pytest.raises(RuntimeError, match="needs oneDNN's native bfloat16 matmul .* or the panels form"):
        FeatureHeadDraft(target, head, matmul_dtype=torch.bfloat16)
    assert all(m.plan is None for m in _head_linears(FeatureHeadDraft(target, head)))  # the default follows


@needs_bfloat16
def test_a_head_set_up_for_bfloat16_then_float32_computes_in_float32(target):
    head = random_head(target, 50, seed=2)
    FeatureHeadDraft(target, head, matmul_dtype=torch.bfloat16)
    again = FeatureHeadDraft(target, head, matmul_dtype=torch.float32)
    assert all(m.plan is None for m in _head_linears(again))


def test_the_drafters_bookkeeping_follows_ragged_commits_plain_steps_and_select(target):
    """Uneven commits, a step without a proposal (commits pile up) and a row selection: each
    row's proposal equals that of a fresh drafter given the row's committed text at once."""
    head = random_head(target, 70, seed=6, scale=3.0)
    g = torch.Generator().manual_seed(4)
    B, P, extra = 3, 6, 9
    text = torch.randint(0, V, (B, P + extra), generator=g)  # every row's committed tokens, in order
    lengths = torch.tensor([6, 3, 5])  # prompt lengths (right-padded)
    hidden = torch.stack([_sequence_hidden(target, row) for row in text])
    prompt = torch.where(torch.arange(P) < lengths[:, None], text[:, :P], 0)
    drafter = FeatureHeadDraft(target, head)
    drafter.prefill(prompt, lengths, 64, hidden_states=torch.where((torch.arange(P) < lengths[:, None])[..., None],
                                                                    hidden[:, :P], 0.0))
    done = lengths.clone()  # committed tokens per row

    def commit(counts):
        counts = torch.tensor(counts)
        N = int(counts.max())
        index = (done[:, None] + torch.arange(N)).clamp(max=P + extra - 1)
        drafter.commit(text.gather(1, index), counts, hidden_states=hidden.gather(
            1, (index - 1)[..., None].expand(-1, -1, hidden.shape[-1])))
        done.add_(counts)

    commit([1, 1, 1])
    drafter.propose(3, lambda logits: logits.argmax(-1))
    commit([2, 1, 3])
    commit([1, 2, 1])  # a plain step: no proposal in between
    drafter.select(torch.tensor([2, 0]))
    proposal = drafter.propose(3, lambda logits: logits.argmax(-1))
    for i, row in enumerate([2, 0]):
        n = int(done[row])
        fresh = FeatureHeadDraft(target, head)
        fresh.prefill(text[row:row + 1, :n - 1], torch.tensor([n - 1]), 64, hidden_states=hidden[row:row + 1, :n - 1])
        fresh.commit(text[row:row + 1, n - 1:n], torch.tensor([1]), hidden_states=hidden[row:row + 1, n - 2:n - 1])
        alone = fresh.propose(3, lambda logits: logits.argmax(-1))
        assert torch.equal(proposal.token_ids[i], alone.token_ids[0])
        torch.testing.assert_close(proposal.logits[i], alone.logits[0], rtol=1e-4, atol=1e-4)


def test_commits_padding_never_piles_up_between_proposals(target):
    """Twelve commits of one real token padded to six, without a proposal (as when
    `LookupFirstDraft`'s lookup serves every row), then a proposal: it equals a fresh drafter's
    given the same text, though the padding alone is three times the cache's capacity."""
    head = random_head(target, 70, seed=6, scale=3.0)
    P, steps, max_len = 6, 12, 24
    text = torch.randint(0, V, (1, P + steps), generator=torch.Generator().manual_seed(5))
    hidden = _sequence_hidden(target, text[0])[None]
    drafter = FeatureHeadDraft(target, head)
    drafter.prefill(text[:, :P], torch.tensor([P]), max_len, hidden_states=hidden[:, :P])
    for n in range(P, P + steps):
        padded = torch.cat([text[:, n:n + 1], torch.zeros(1, 5, dtype=torch.int64)], 1)
        drafter.commit(padded, torch.tensor([1]), hidden_states=torch.cat(
            [hidden[:, n - 1:n], torch.zeros(1, 5, hidden.shape[-1])], 1))
    proposal = drafter.propose(3, lambda logits: logits.argmax(-1))
    fresh = FeatureHeadDraft(target, head)
    n = P + steps
    fresh.prefill(text[:, :n - 1], torch.tensor([n - 1]), max_len, hidden_states=hidden[:, :n - 1])
    fresh.commit(text[:, n - 1:n], torch.tensor([1]), hidden_states=hidden[:, n - 2:n - 1])
    alone = fresh.propose(3, lambda logits: logits.argmax(-1))
    assert torch.equal(proposal.token_ids, alone.token_ids)
    torch.testing.assert_close(proposal.logits, alone.logits, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- early exit with a trained adapter

def random_exit_head(target, vocab_size=V, seed=0, scale=1.0, exit_layer=1):
    """An `ExitHead` with random weights (the adapter's output too) over ``vocab_size`` shuffled ids."""
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:vocab_size]
    head = ExitHead(target.config, exit_layer, vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in head.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.1 * scale)
    return head.eval()


def test_an_exit_heads_drafts_are_the_targets_first_layers_then_the_adapter(target):
    """Each draft token's logits are those of a dense reference: the target's first layers over
    the committed text and the drafts before it (a cache of their own), the adapter, the final
    norm and the draft vocabulary's rows of the LM head; -inf outside the draft vocabulary."""
    head = random_exit_head(target, 60, seed=2, scale=3.0)
    input_ids, mask = ragged_prompts(B=3, P=6, seed=2)
    K = 3
    seen = []

    class Recording(ExitHeadDraft):
        def propose(self, num_tokens, sample):
            proposal = super().propose(num_tokens, sample)
            seen.append((self.cache.lengths.clone(), self.last.clone(), proposal))
            return proposal

    # float32 matmuls: the logits are compared with a float32 reference
    speculative_generate(target, Recording(target, head, matmul_dtype=torch.float32), input_ids, mask,
                         num_draft_tokens=K, max_new_tokens=8, temperature=0, adaptive=False)
    out = speculative_generate(target, ExitHeadDraft(target, head, matmul_dtype=torch.float32), input_ids, mask,
                               num_draft_tokens=K,
                               max_new_tokens=8, temperature=0, adaptive=False)
    prompts = [row[m.bool()] for row, m in zip(input_ids, mask, strict=True)]
    prefix = target.truncated(1)
    outside = torch.ones(V, dtype=torch.bool)
    outside[head.draft_vocab] = False
    for lengths, last, proposal in seen[:3]:
        for b in range(len(prompts)):
            committed = torch.cat([prompts[b], out.tokens[b]])[:int(lengths[b]) + 1]
            assert committed[-1] == last[b, 0]
            text = torch.cat([committed, proposal.token_ids[b, :-1]])
            with torch.no_grad():
                _, hidden = prefix(text[None], prefix.new_cache(1, len(text)), return_hidden=True)
                n = target.norm
                expected = torch.nn.functional.rms_norm(head(hidden[0]), n.weight.shape, n.weight, n.eps) \
                    @ target.output.weight[head.draft_vocab].T
            got = proposal.logits[b]
            torch.testing.assert_close(got[:, head.draft_vocab], expected[len(committed) - 1:], rtol=1e-4, atol=1e-4)
            assert torch.isneginf(got[:, outside]).all()


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("K", [1, 4])
def test_greedy_speculation_with_an_exit_head_equals_generate(target, K, adaptive):
    """Rows finishing at different steps; the draft writes in the target's cache, which stays the
    target's: greedy tokens are `generate`'s, and drafts are accepted."""
    ids, mask = ragged_prompts(B=6, seed=5)
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0)
    eos = int(plain.tokens[2, 3])
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=eos)
    head = new_head(target, torch.arange(V), 0, kind="early-exit", exit_layer=1)  # the logit lens at layer 1
    spec = speculative_generate(target, ExitHeadDraft(target, head), ids, mask, num_draft_tokens=K,
                                max_new_tokens=20, temperature=0, eos_token_id=eos, adaptive=adaptive)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.stats.num_accepted.sum() > 0


@pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL")
def test_an_exit_head_on_a_packed_target_drafts_as_unpacked(target):
    import copy

    from specdec_kernels.matmul import MKL_PACKED_PLAN

    packed = copy.deepcopy(target).pack_weights(plan=MKL_PACKED_PLAN)
    input_ids, mask = ragged_prompts(B=3, P=6, seed=5)
    drafters = [ExitHeadDraft(t, random_exit_head(target, 50, seed=2, scale=3.0), matmul_dtype=torch.float32)
                for t in (target, packed)]
    assert drafters[1].head.adapter.w13.plan is MKL_PACKED_PLAN and drafters[1].model.output.plan is MKL_PACKED_PLAN
    assert drafters[0].head.adapter.w13.plan is None
    outs = [speculative_generate(t, d, input_ids, mask, num_draft_tokens=3, max_new_tokens=10, temperature=0,
                                 adaptive=False) for t, d in zip((target, packed), drafters, strict=True)]
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].stats.num_accepted, outs[1].stats.num_accepted)


def test_an_exit_head_saves_loads_and_refuses_what_does_not_fit(target, tmp_path):
    head = random_exit_head(target, 50, seed=4)
    head.save(tmp_path / "exit.pt", dtype=torch.float32)
    loaded = ExitHead.load(tmp_path / "exit.pt")
    assert loaded.exit_layer == 1
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="exit.pt is not a draft head of kind 'feature'"):
        FeatureHead.load(tmp_path / "exit.pt")
    random_head(target).save(tmp_path / "feature.pt")
    with pytest.raises(ValueError, match="feature.pt is not a draft head of kind 'early-exit'"):
        ExitHead.load(tmp_path / "feature.pt")
    with pytest.raises(ValueError, match="exit_layer must be an int in"):
        ExitHead(target.config, 2, torch.arange(V))
    with pytest.raises(TypeError, match="head must be an ExitHead"):
        ExitHeadDraft(target, random_head(target))
    with pytest.raises(TypeError, match="head must be a FeatureHead"):
        FeatureHeadDraft(target, head)
    with pytest.raises(ValueError, match="trained for another target"):
        ExitHeadDraft(tiny_llama(seed=0, layers=2, hidden=32, heads=4, kv_heads=1), head)


def test_exit_head_training_raises_agreement_and_resumes(target, tmp_path):
    sequences = load_sequences(_tiny_shards(target, tmp_path, count=2))
    settings = TrainSettings(steps=30, tokens_per_batch=64, lr=3e-3, warmup=5, draft_vocab_size=64,
                             checkpoint_every=1000, head="early-exit", exit_layer=1)
    lens = new_head(target, draft_vocabulary(sequences, 64, V), 0, kind="early-exit", exit_layer=1)
    before = evaluate(target, lens, sequences)
    assert list(before) == ["top1_step1"]
    head = train_head(target, sequences, tmp_path / "run", settings, log=lambda _: None)
    assert isinstance(head, ExitHead)
    assert evaluate(target, head, sequences)["top1_step1"] > before["top1_step1"] + 0.1
    short = TrainSettings(**{**settings.__dict__, "steps": 4, "checkpoint_every": 2})
    straight = train_head(target, sequences, tmp_path / "straight", short, log=lambda _: None)
    train_head(target, sequences, tmp_path / "pieces", short, max_seconds=0.0, log=lambda _: None)
    resumed = train_head(target, sequences, tmp_path / "pieces", short, log=lambda _: None)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="other settings"):
        train_head(target, sequences, tmp_path / "pieces", TrainSettings(**{**short.__dict__, "head": "feature"}))


def test_exit_head_training_counts_the_positions_the_feature_head_does(target, tmp_path):
    """Both kinds learn the target's distribution at the same positions (from the prompt length
    on: the token after the prompt is the target's own): the same count, and the exit head's
    distribution at position t is the target's own argmax there."""
    from specdec_kernels.draft_training import _collate_tokens, _ExitTrainer, _vocab_index

    sequences = load_sequences(_tiny_shards(target, tmp_path, count=1))
    feature, exit_head = random_head(target), new_head(target, torch.arange(V), 0, kind="early-exit", exit_layer=1)
    index = list(range(len(sequences)))
    _, feature_stats = _Trainer(target, feature).losses(_collate(sequences, index, _vocab_index(feature, V)),
                                                        TrainSettings(unroll=1))
    batch = _collate_tokens(sequences, index, _vocab_index(exit_head, V))
    _, exit_stats = _ExitTrainer(target, exit_head).losses(batch, TrainSettings())
    assert exit_stats["positions_step1"] == feature_stats["positions_step1"] > 0
    for b, s in enumerate(sequences):
        logits = target(s.token_ids[None], target.new_cache(1, len(s.token_ids)))[0]
        answer = slice(s.prompt_length, len(s.token_ids))
        assert torch.equal(batch.target_argmax[b, answer], logits[answer].argmax(-1))
        assert int(batch.first[b]) == s.prompt_length


def test_train_draft_refuses_settings_of_another_head_kind():
    from specdec_kernels.draft_training import train_draft

    with pytest.raises(ValueError, match="head='feature' but settings.head='early-exit'"):
        train_draft(head="feature", settings=TrainSettings(head="early-exit"), stage="train")


def test_a_feature_checkpoint_from_before_the_exit_head_fields_resumes(target, tmp_path):
    """A checkpoint whose settings lack fields added since (``head``, ``exit_layer``) resumes
    with their defaults."""
    sequences = load_sequences(_tiny_shards(target, tmp_path, count=1))
    settings = TrainSettings(steps=2, tokens_per_batch=48, warmup=1, unroll=1, draft_vocab_size=50)
    train_head(target, sequences, tmp_path / "run", TrainSettings(**{**settings.__dict__, "steps": 1}),
               log=lambda _: None)
    path = tmp_path / "run" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    state["settings"] = {k: v for k, v in settings.__dict__.items() if k not in ("head", "exit_layer", "init")}
    torch.save(state, path)
    train_head(target, sequences, tmp_path / "run", settings, log=lambda _: None)
    assert torch.load(path, weights_only=True)["step"] == 2
