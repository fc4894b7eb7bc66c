"""Decoding API: greedy equality, lossless sampling, ragged batches, finished rows, bad input, syncs."""

import pytest
import torch

from specdec_kernels import EarlyExitDraft, PromptLookupDraft, generate, process_logits, speculative_generate
from specdec_kernels.testing import SyncCounter

from tiny_models import V, greedy_divergence_allowed, ragged_prompts, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, scale=3.0, layers=3)


@pytest.mark.parametrize("k, left", [(1, True), (3, False), (4, True), (7, False)],
                         ids=["K1-left-padded", "K3-right-padded", "K4-left-padded", "K7-right-padded"])
@pytest.mark.parametrize("draft_kind", ["truncated", "other-model", "prompt-lookup", "self"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_greedy_speculative_equals_greedy_generate(target, draft_kind, k, left, adaptive):
    drafts = {"truncated": target.truncated(1), "other-model": tiny_llama(seed=7, scale=3.0, layers=1),
              "prompt-lookup": PromptLookupDraft(), "self": target}
    input_ids, mask = ragged_prompts(left=left, seed=k)
    plain = generate(target, input_ids, mask, max_new_tokens=24, temperature=0)
    spec = speculative_generate(target, drafts[draft_kind], input_ids, mask, num_draft_tokens=k,
                                max_new_tokens=24, temperature=0, adaptive=adaptive)
    allowances = 0
    for row in range(input_ids.shape[0]):
        differ = (plain.tokens[row] != spec.tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(target, input_ids, mask, plain.tokens, row, int(differ[0])), \
                f"row {row} diverges at {int(differ[0])} with a clear top-2 gap"
            allowances += 1
    assert allowances <= 1
    assert spec.stats.num_generated.tolist() == [24] * input_ids.shape[0]
    if draft_kind == "self" and not adaptive:  # a perfect draft is always accepted
        assert spec.stats.acceptance_rate == 1.0
        assert spec.stats.target_forwards <= 1 + -(-23 // (k + 1)) + 1


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
def test_greedy_speculative_equals_generate_without_grouped_heads(kv_heads):
    """G = 1 (multi-head) and Hkv = 1 (multi-query) attention through decode and verification."""
    model = tiny_llama(seed=3, scale=3.0, layers=2, heads=4, kv_heads=kv_heads)
    input_ids, mask = ragged_prompts(B=4, seed=5)
    plain = generate(model, input_ids, mask, max_new_tokens=12, temperature=0)
    spec = speculative_generate(model, model.truncated(1), input_ids, mask, num_draft_tokens=3,
                                max_new_tokens=12, temperature=0)
    for row in range(input_ids.shape[0]):
        differ = (plain.tokens[row] != spec.tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(model, input_ids, mask, plain.tokens, row, int(differ[0]))


def exact_joint(model, prompt, n: int, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    """Exact P(t1, ..., tn) [V] * n float64 of the first n generated tokens after ``prompt``."""
    V = model.vocab_size
    with torch.no_grad():
        probs = torch.ones(1, dtype=torch.float64)
        for i in range(n):  # probs [V ** i] over the first i tokens, then their next token's
            tails = torch.arange(V ** i)[:, None] // V ** torch.arange(i - 1, -1, -1) % V  # digits, first token first
            ctx = torch.cat([prompt.expand(V ** i, -1), tails], 1)
            logits = model(ctx, model.new_cache(V ** i, ctx.shape[1]))[:, -1]
            probs = (probs[:, None] * process_logits(logits, temperature, top_k, top_p).double()).flatten()
    return probs.reshape([V] * n)


def exact_first_tokens_distribution(model, prompt, temperature=1.0, top_k=None, top_p=None):
    """Exact P(t1, t2) [V, V] and P(t3) [V] of the first generated tokens after ``prompt``."""
    joint = exact_joint(model, prompt, 3, temperature, top_k, top_p)
    return joint.sum(2), joint.sum((0, 1))


def chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit, cells with expected count < 5 pooled into one."""
    from scipy import stats as scipy_stats  # here, not at the top: tests/test_cuda.py imports this module

    n = int(observed.sum())
    expected = probs.flatten() * n
    observed = observed.flatten().double()
    small = expected < 5
    if int(observed[probs.flatten() == 0].sum()):
        return 0.0  # a token with zero probability was emitted
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    keep = exp > 0
    return float(scipy_stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


# A correct sampler fails one of these checks with probability 1e-5; each test makes 6 of them,
# so a correct implementation fails a test less than once in 10^4 runs (6e-5).
P_THRESHOLD = 1e-5


@pytest.mark.parametrize("sampling, k", [(dict(temperature=1.0), 1), (dict(temperature=0.7, top_k=8, top_p=0.9), 2)],
                         ids=["t1-K1", "t0.7-topk8-topp0.9-K2"])
def test_sampling_matches_the_target_distribution(sampling, k):
    # K=1: t3 often comes from a second step whose draft input is two tokens (all accepted
    # before); K=2: accepted prefixes, corrections and bonus tokens within one step.
    small = dict(vocab_size=12, layers=2, hidden=32, heads=4, kv_heads=1)
    target = tiny_llama(seed=1, scale=4.0, **small)
    draft = target.truncated(1)  # agrees with the target sometimes, disagrees often
    prompt = torch.tensor([3, 1, 4])
    joint, marginal3 = exact_first_tokens_distribution(target, prompt, **sampling)
    N = 6000
    ids = prompt.expand(N, -1).contiguous()
    for name, out in {
        "generate": generate(target, ids, max_new_tokens=3, seed=11, **sampling),
        "speculative": speculative_generate(target, draft, ids, num_draft_tokens=k, max_new_tokens=3,
                                            seed=12, **sampling),
        "prompt-lookup": speculative_generate(target, PromptLookupDraft(), ids, num_draft_tokens=k,
                                              max_new_tokens=3, seed=13, **sampling),
        "early-exit": speculative_generate(target, EarlyExitDraft(target, 1), ids, num_draft_tokens=k,
                                           max_new_tokens=3, seed=14, **sampling),
    }.items():
        t = out.tokens
        observed = torch.bincount(t[:, 0] * 12 + t[:, 1], minlength=144).reshape(12, 12)
        assert chi_square_pvalue(observed, joint) > P_THRESHOLD, f"{name}: (t1, t2) not distributed as p"
        assert chi_square_pvalue(torch.bincount(t[:, 2], minlength=12), marginal3) > P_THRESHOLD, \
            f"{name}: t3 not distributed as p"
        if name in ("speculative", "early-exit"):
            assert 0.05 < out.stats.acceptance_rate < 0.95  # the draft really disagrees sometimes


def test_same_seed_same_tokens(target):
    """Fixed draft lengths: the same seed, the same sampled tokens (adaptive lengths follow the
    run's timings, so only fixed ones promise this)."""
    ids, mask = ragged_prompts()
    draft = target.truncated(1)
    a = speculative_generate(target, draft, ids, mask, max_new_tokens=10, seed=3, adaptive=False)
    b = speculative_generate(target, draft, ids, mask, max_new_tokens=10, seed=3, adaptive=False)
    c = speculative_generate(target, draft, ids, mask, max_new_tokens=10, seed=4, adaptive=False)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


class CountingModel(torch.nn.Module):
    """Wraps a model and records the batch size of every forward."""

    def __init__(self, model):
        super().__init__()
        self.model, self.batch_sizes = model, []
        self.vocab_size, self.config = model.vocab_size, model.config

    def new_cache(self, batch_size, max_len):
        return self.model.new_cache(batch_size, max_len)

    def forward(self, input_ids, cache, q_seqlens=None):
        self.batch_sizes.append(input_ids.shape[0])
        return self.model(input_ids, cache, q_seqlens)


@pytest.mark.parametrize("speculative", [False, True], ids=["generate", "speculative"])
def test_rows_finish_independently_and_stop_costing_compute(target, speculative):
    ids, mask = ragged_prompts(B=4)
    free = generate(target, ids, mask, max_new_tokens=16, temperature=0)
    eos = int(free.tokens[1, 2])  # row 1 ends at its third token (others maybe later or never)
    counting = CountingModel(target)
    kwargs = dict(max_new_tokens=16, temperature=0, eos_token_id=eos, pad_token_id=-7)
    out = (speculative_generate(counting, target.truncated(2), ids, mask, num_draft_tokens=3, **kwargs)
           if speculative else generate(counting, ids, mask, **kwargs))
    for row in range(4):
        hits = (free.tokens[row] == eos).nonzero()
        n = int(hits[0]) + 1 if len(hits) else 16
        assert int(out.stats.num_generated[row]) == n
        assert out.tokens[row, :n].tolist() == free.tokens[row, :n].tolist()
        assert (out.tokens[row, n:] == -7).all()
    assert out.stats.num_generated[1] == 3
    assert min(counting.batch_sizes) < 4 and counting.batch_sizes[-1] < 4  # finished rows were dropped
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)


def test_model_without_last_only_support(target):
    ids, mask = ragged_prompts(B=3)
    wrapped = CountingModel(target)
    a = speculative_generate(wrapped, target.truncated(1), ids, mask, max_new_tokens=8, temperature=0)
    b = speculative_generate(target, target.truncated(1), ids, mask, max_new_tokens=8, temperature=0)
    assert torch.equal(a.tokens, b.tokens)


def test_loops_tell_the_model_how_many_tokens_are_real(target):
    """Prefill (ragged prompts) and ragged prompt-lookup verifies pass num_tokens = q_seqlens.sum()."""
    seen = []

    class Recording(type(target)):
        def forward(self, input_ids, cache, q_seqlens=None, *, last_only=False, num_tokens=None):
            if num_tokens is not None:
                assert num_tokens == int(q_seqlens.sum()) < input_ids.numel()
                seen.append(input_ids.shape[1])
            return super().forward(input_ids, cache, q_seqlens, last_only=last_only, num_tokens=num_tokens)

    recording = Recording.__new__(Recording)
    recording.__dict__ = target.__dict__
    ids, mask = ragged_prompts(B=5)
    ids = torch.cat([ids, ids[:, -4:], ids[:, -4:]], 1)  # repeats for prompt lookup to find
    mask = torch.cat([mask, torch.ones(5, 8, dtype=mask.dtype)], 1)
    out = speculative_generate(recording, PromptLookupDraft(), ids, mask, num_draft_tokens=3,
                               max_new_tokens=12, temperature=0, adaptive=False)
    assert torch.equal(out.tokens, generate(target, ids, mask, max_new_tokens=12, temperature=0).tokens)
    assert seen[0] == ids.shape[1] and len(seen) > 1  # the prefill, then ragged verifies


@pytest.mark.parametrize("draft", [None, "layers", "early-exit", "prompt_lookup"])
def test_loops_bound_the_cache_lengths_for_the_model(target, draft):
    """Every forward is told max_seqlen, a bound on the rows' cache lengths after the call (read in
    the loop's one transfer per step, over the rows still running): never below them, at most
    one step's drafts above the longest row (a draft model's bound may count the drafts the
    last step rejected, but that slack never adds up over steps), and exact for plain decoding.
    Tokens are those of a model that reads the whole (large) capacity."""
    calls = []

    class Recording(type(target)):
        def forward(self, input_ids, cache, q_seqlens=None, *, last_only=False, num_tokens=None, max_seqlen=None):
            logits = super().forward(input_ids, cache, q_seqlens, last_only=last_only, num_tokens=num_tokens,
                                     max_seqlen=max_seqlen)
            calls.append((max_seqlen, int(cache.lengths.max())))
            return logits

    class Unbounded(type(target)):  # the same model without the max_seqlen keyword
        def forward(self, input_ids, cache, q_seqlens=None, *, last_only=False, num_tokens=None):
            return super().forward(input_ids, cache, q_seqlens, last_only=last_only, num_tokens=num_tokens)

    def as_(cls, model):
        wrapped = cls.__new__(cls)
        wrapped.__dict__ = model.__dict__
        return wrapped

    ids, mask = ragged_prompts(B=5)
    ids = torch.cat([ids, ids[:, -4:], ids[:, -4:]], 1)  # repeats for prompt lookup to find
    mask = torch.cat([mask, torch.ones(5, 8, dtype=mask.dtype)], 1)

    def run(cls, adaptive=True):
        model = as_(cls, target)
        if draft is None:
            return generate(model, ids, mask, max_new_tokens=10, temperature=0, max_cache_len=200)
        if draft == "layers":
            drafter = as_(cls, target.truncated(1))
        elif draft == "early-exit":
            drafter = EarlyExitDraft(model, 1)
            drafter.model = as_(cls, drafter.model)
        else:
            drafter = draft
        return speculative_generate(model, drafter, ids, mask, num_draft_tokens=K, max_new_tokens=40,
                                    temperature=0, max_cache_len=200, adaptive=adaptive)

    K = 3
    for adaptive in (False, True):  # adaptive lengths add plain steps and narrower drafts
        calls.clear()
        out = run(Recording, adaptive)
        assert len(calls) > 3
        for bound, after in calls:
            assert bound is not None and after <= bound <= after + K, calls
    if draft is None:  # one token per row and step: the bound is exact
        assert all(bound == after for bound, after in calls[1:]), calls
    assert torch.equal(out.tokens, run(Unbounded).tokens)


def test_prompt_lookup_proposals():
    context = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 0, 0], [5, 6, 5, 0, 0, 0, 0, 0, 0],
                            [4, 8, 15, 16, 23, 42, 0, 0, 0], [7, 1, 7, 2, 7, 3, 7, 0, 0]])
    lengths = torch.tensor([7, 3, 6, 7])
    ids, num = PromptLookupDraft(max_ngram=3).lookup(context, lengths, 3)
    assert num.tolist() == [3, 2, 0, 2]
    assert ids[0].tolist() == [9, 1, 2]  # the trigram [1, 2, 3] occurred before, followed by 9 1 2
    assert ids[1, :2].tolist() == [6, 5]
    assert ids[3, :2].tolist() == [3, 7]  # most recent earlier [7] (position 4): followed by 3 7
    assert (ids[2] == 0).all()
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDraft(max_ngram=1, min_ngram=2)


def test_one_host_sync_per_step(target):
    ids, mask = ragged_prompts(B=4)
    for draft in (target.truncated(1), PromptLookupDraft()):
        with SyncCounter() as syncs:
            out = speculative_generate(target, draft, ids, mask, max_new_tokens=12, num_draft_tokens=3, seed=0)
        in_loop = [e for e in syncs.events if "_prepare" not in e.where and "prefill" not in e.where]
        assert all("_rows_still_running" in e.where for e in in_loop), in_loop
        assert len(in_loop) == int(out.stats.num_steps.max()) + 1


def test_numpy_integers_are_taken_for_ints(target):
    import numpy as np

    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    plain = generate(target, ids, max_new_tokens=np.int64(4), max_cache_len=np.int64(16), eos_token_id=np.int64(3),
                     pad_token_id=np.int64(0), temperature=0)
    spec = speculative_generate(target, target.truncated(1), ids, max_new_tokens=np.int64(4), eos_token_id=[3],
                                num_draft_tokens=np.int32(2), pad_token_id=0, temperature=0)
    assert plain.tokens.shape == (2, 4) and torch.equal(plain.tokens, spec.tokens)


@pytest.mark.parametrize("draft_kind", ["model", "prompt_lookup"])
@pytest.mark.parametrize("max_new", [1, 2, 6])
def test_cache_capacity_is_exactly_what_is_written(target, draft_kind, max_new):
    """The least capacity is the default (longest prompt + max_new_tokens - 1, plus K drafts for
    speculative decoding): it gives the default's tokens, and one position less is refused. The
    prompts are padded wider than the longest one (as `pad_to_multiple_of` does): padding columns
    take no room."""
    ids, mask = ragged_prompts(B=3, P=7)
    ids, mask = (torch.cat([torch.zeros(3, 5, dtype=x.dtype), x], 1) for x in (ids, mask))  # left-padded wider
    P = int(mask.sum(1).max())
    draft = target.truncated(1) if draft_kind == "model" else "prompt_lookup"
    K = 3
    need = {"plain": P + max_new - 1, "spec": P + max_new - 1 + min(K, max_new - 1)}
    runs = {"plain": lambda **kw: generate(target, ids, mask, max_new_tokens=max_new, temperature=0, **kw),
            "spec": lambda **kw: speculative_generate(target, draft, ids, mask, num_draft_tokens=K,
                                                      max_new_tokens=max_new, temperature=0, **kw)}
    for name, run in runs.items():
        assert torch.equal(run(max_cache_len=need[name]).tokens, run().tokens)
        with pytest.raises(ValueError, match=f"max_cache_len={need[name] - 1} is too small.* needs {need[name]}"):
            run(max_cache_len=need[name] - 1)


def test_drafts_past_the_token_budget_are_not_made(target):
    """num_draft_tokens larger than the budget: at most max_new_tokens - 1 drafts per step (more
    could never be kept), so a huge K costs nothing and changes no token."""
    ids, mask = ragged_prompts(B=3)
    draft = target.truncated(1)
    plain = generate(target, ids, mask, max_new_tokens=4, temperature=0)
    spec = speculative_generate(target, draft, ids, mask, num_draft_tokens=10**9, max_new_tokens=4, temperature=0)
    assert torch.equal(spec.tokens, plain.tokens)
    assert (spec.stats.num_proposed <= 3 * spec.stats.num_steps).all()
    assert spec.stats.draft_lengths.shape == (3, 4)  # lengths 0 .. 3 (= max_new_tokens - 1)
    assert spec.stats.draft_calls <= int(spec.stats.num_steps.max())


def test_phase_times_add_up(target):
    """The phase timers are within the call's wall time; the drafter's prefill is part of
    ``time_prefill_s``."""
    ids, mask = ragged_prompts(B=3)
    runs = {"generate": generate(target, ids, mask, max_new_tokens=5, temperature=0),
            "lookup": speculative_generate(target, PromptLookupDraft(), ids, mask, max_new_tokens=5, temperature=0),
            "model": speculative_generate(target, target.truncated(1), ids, mask, max_new_tokens=5, temperature=0)}
    for name, out in runs.items():
        st = out.stats
        phases = (st.time_prefill_s, st.time_target_s, st.time_draft_s, st.time_sampler_s)
        assert min(phases) >= 0 and sum(phases) <= st.time_total_s, name
        assert 0 <= st.time_draft_prefill_s <= st.time_prefill_s
        assert (st.time_draft_prefill_s > 0) == (name != "generate"), name


def test_numpy_numbers_are_taken_for_sampling_arguments(target):
    import numpy as np

    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    python = generate(target, ids, max_new_tokens=4, temperature=0.5, top_k=5, top_p=0.75, seed=2**63 + 5)
    numpy = generate(target, ids, max_new_tokens=4, temperature=np.float32(0.5), top_k=np.int64(5),
                     top_p=np.float32(0.75), seed=np.uint64(2**63 + 5))
    assert torch.equal(numpy.tokens, python.tokens)
    from fractions import Fraction  # any real number

    fraction = generate(target, ids, max_new_tokens=4, temperature=Fraction(1, 2), top_k=5, top_p=Fraction(3, 4),
                        seed=2**63 + 5)
    assert torch.equal(fraction.tokens, python.tokens)


def test_bad_input_is_a_clear_error(target):
    ids = torch.randint(0, V, (2, 5))
    draft = target.truncated(1)
    with pytest.raises(ValueError, match="input_ids"):
        generate(target, torch.zeros(2, 0, dtype=torch.int64), max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompts"):
        generate(target, ids, torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, draft, ids, max_new_tokens=4, num_draft_tokens=0)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, tiny_llama(vocab_size=50), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate(target, ids, max_new_tokens=4, max_cache_len=6)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(target, ids, max_new_tokens=600)
    with pytest.raises(ValueError, match="contiguous"):
        generate(target, ids, torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        generate(target, ids + 100, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, ids, max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, ids, max_new_tokens=4, temperature=float("nan"))
    with pytest.raises(ValueError, match="temperature"):
        generate(target, ids, max_new_tokens=4, temperature=10**400)
    with pytest.raises(TypeError, match="temperature"):
        generate(target, ids, max_new_tokens=4, temperature=True)
    with pytest.raises(TypeError, match="top_p"):
        generate(target, ids, max_new_tokens=4, top_p="0.5")
    with pytest.raises(TypeError, match="seed"):
        generate(target, ids, max_new_tokens=4, seed=1.5)
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(target, ids, max_new_tokens=4, eos_token_id=V)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(target, ids, torch.full((2, 5), 0.5), max_new_tokens=4)
    with pytest.raises(ValueError, match="logits torch.bfloat16 .* must be None or torch.float32"):
        speculative_generate(target, tiny_llama().to(torch.bfloat16), ids, max_new_tokens=4)
    with pytest.raises(TypeError, match="target"):
        speculative_generate(object(), draft, ids, max_new_tokens=4)
    with pytest.raises(TypeError, match="protocol"):
        speculative_generate(target, object(), ids, max_new_tokens=4)
    # A bool is not taken for an int, nor a tensor temperature for the loop's single temperature.
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, ids, max_new_tokens=True)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, draft, ids, max_new_tokens=4, num_draft_tokens=True)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate(target, ids, max_new_tokens=4, max_cache_len=64.0)
    with pytest.raises(TypeError, match="pad_token_id"):
        generate(target, ids, max_new_tokens=4, pad_token_id=1.0)
    with pytest.raises(TypeError, match="temperature"):
        generate(target, ids, max_new_tokens=4, temperature=torch.ones(2))
    with pytest.raises(ValueError, match="cache is on meta"):  # ids on the CPU, the model elsewhere
        generate(tiny_llama().to("meta"), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="seed"):
        generate(target, ids, max_new_tokens=4, seed=2**64)
    with pytest.raises(ValueError, match="pad_token_id"):
        generate(target, ids, max_new_tokens=4, pad_token_id=10**30)
    with pytest.raises(TypeError, match="attention_mask"):
        generate(target, ids, [[1] * 5] * 2, max_new_tokens=4)
    with pytest.raises(ValueError, match='"prompt_lookup"'):
        speculative_generate(target, "prompt-lookup", ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="cuda_graphs=True needs"):
        generate(target, ids, max_new_tokens=4, cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs"):
        speculative_generate(target, draft, ids, max_new_tokens=4, cuda_graphs="yes")
    context = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="k must"):
        PromptLookupDraft().lookup(context, torch.tensor([3, 1]), 0)
    with pytest.raises(ValueError, match="context_lengths"):
        PromptLookupDraft().lookup(context, torch.tensor([4, 1]), 2)
    with pytest.raises(ValueError, match="context must"):
        PromptLookupDraft().lookup(context.int(), torch.tensor([3, 1]), 2)
    with pytest.raises(ValueError, match="at least one column"):
        PromptLookupDraft().lookup(context[:, :0], torch.tensor([0, 0]), 2)
    for min_ngram, max_ngram in ((True, 3), (1, 2.5), (2, 1), (0, 2)):
        with pytest.raises(ValueError, match="min_ngram"):
            PromptLookupDraft(max_ngram=max_ngram, min_ngram=min_ngram)


def fake_capture(self, input_ids, q_seqlens):
    """`GraphedForward._capture` for the CPU: the same static inputs and output buffer, and a
    "graph" whose replay runs the forward again into that buffer (CUDA graphs need a GPU: the
    real ones are tested in `tests/test_cuda.py`). Like a capture, it leaves the lengths as they were."""
    static_ids, static_q = input_ids.clone(), None if q_seqlens is None else q_seqlens.clone()
    start = self.cache.lengths.clone()
    out = self.forward(static_ids, static_q).clone()
    self.cache.crop(start)
    self.captures += 1

    def replay():
        out.copy_(self.forward(static_ids, static_q))

    return replay, static_ids, static_q, out


@pytest.mark.parametrize("draft_kind", [None, "truncated", "prompt-lookup"])
def test_graph_replay_path_gives_the_eager_tokens(target, draft_kind, monkeypatch):
    """The loops' CUDA-graph path: static inputs and outputs, one recording per shape, new ones
    once rows are dropped (EOS ends rows at different steps) or the verify width changes; tokens
    equal to the eager loop's (the same top-2 gap allowance as above:
    the graphs' attention reads the whole cache capacity, the eager loop a bound on the lengths)."""
    from specdec_kernels import cuda_graphs, generation
    from specdec_kernels import drafts as drafts_module

    input_ids, mask = ragged_prompts(seed=9)
    drafts = {"truncated": target.truncated(1), "prompt-lookup": PromptLookupDraft()}

    def run(**kwargs):
        if draft_kind is None:
            return generate(target, input_ids, mask, max_new_tokens=20, temperature=0, **kwargs)
        return speculative_generate(target, drafts[draft_kind], input_ids, mask, num_draft_tokens=3,
                                    max_new_tokens=20, temperature=0, **kwargs)

    eos = int(run().tokens[1, 4])  # row 1 (and maybe others) ends early
    eager = run(eos_token_id=eos, cuda_graphs=False)
    captures = []
    monkeypatch.setattr(generation, "_use_cuda_graphs", lambda *args: True)
    monkeypatch.setattr(drafts_module, "_use_cuda_graphs", lambda *args: True)
    monkeypatch.setattr(cuda_graphs.GraphedForward, "_capture",
                        lambda self, ids, q: captures.append((id(self), *ids.shape)) or fake_capture(self, ids, q))
    graphed = run(eos_token_id=eos)
    # At most one recording per forward (target, draft), batch size and verify width.
    assert len(set(captures)) > 1 and len(captures) == len(set(captures)), captures
    assert {T for _, _, T in captures} <= {1, 2, 3, 4}, captures
    assert eager.stats.num_generated.min() < 20  # rows were dropped
    for row in range(input_ids.shape[0]):
        differ = (eager.tokens[row] != graphed.tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(target, input_ids, mask, eager.tokens, row, int(differ[0]))
    assert (eager.tokens != graphed.tokens).any(1).sum() <= 1


def test_graphs_are_recorded_again_when_the_cache_tensors_change(target, monkeypatch):
    """A shape runs eagerly at its first call and is recorded at its second. `KVCache.select`
    replaces the cache's tensors, also when the batch size stays: the old graphs would write to
    the old tensors, so they are dropped and the shape starts over."""
    from specdec_kernels.cuda_graphs import GraphedForward

    monkeypatch.setattr(GraphedForward, "_capture", fake_capture)
    cache = target.new_cache(3, 16)
    step = GraphedForward(lambda ids, q_seqlens: target(ids, cache, q_seqlens, last_only=True), cache)
    ids = torch.randint(0, V, (3, 2))
    expected = target(ids, target.new_cache(3, 16))[:, -1:]
    version, slow_calls = cache.version, GraphedForward.slow_calls
    assert torch.allclose(step(ids), expected, atol=1e-5) and step.captures == 0  # first use: eager
    assert torch.equal(cache.lengths, torch.full((3,), 2)) and cache.version > version
    version = cache.version
    step(ids)  # second use: recorded and replayed
    assert step.captures == 1 and torch.equal(cache.lengths, torch.full((3,), 4)) and cache.version > version
    step(ids)
    assert step.captures == 1 and torch.equal(cache.lengths, torch.full((3,), 6))
    assert GraphedForward.slow_calls == slow_calls + 2
    cache.select(torch.tensor([2, 0, 1]))  # same batch size, new tensors
    step(ids)
    step(ids)
    assert step.captures == 2 and torch.equal(cache.lengths, torch.full((3,), 10))


def test_cuda_graphs_need_a_kv_cache(target, monkeypatch):
    from specdec_kernels import generation

    class OtherCache:
        def __init__(self, cache):
            self.lengths, self.inner = cache.lengths, cache

        def crop(self, lengths):
            self.inner.crop(lengths)

        def select(self, rows):
            self.inner.select(rows)
            self.lengths = self.inner.lengths
            return self

    class OtherModel(CountingModel):
        def new_cache(self, batch_size, max_len):
            return OtherCache(self.model.new_cache(batch_size, max_len))

        def forward(self, input_ids, cache, q_seqlens=None):
            return self.model(input_ids, cache.inner, q_seqlens)

    monkeypatch.setattr(generation, "_use_cuda_graphs", lambda *args: True)
    with pytest.raises(ValueError, match="cuda_graphs needs the model's cache to be a KVCache"):
        generate(OtherModel(target), torch.randint(0, V, (2, 3)), max_new_tokens=3, cuda_graphs=True)


def test_one_row_decodes_with_exact_length_bounds(monkeypatch):
    """With one row, the loops know its cache length exactly (from their one transfer per step):
    every decoding forward of the target (plain steps, verifications) builds an attention plan
    whose rows are all full (`RaggedAttentionPlan` min_seqlen == max_len); only the prefill gets
    no lower bound. (A `ModelDraft` proposes before the transfer and bounds its own lengths
    from above only: its plans are not checked here.)"""
    import specdec_kernels.model as model_module
    from specdec_kernels import RaggedAttentionPlan

    plans = []

    class Recorded(RaggedAttentionPlan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            plans.append((self.num_queries, self.full))

    monkeypatch.setattr(model_module, "RaggedAttentionPlan", Recorded)
    model = tiny_llama(seed=9)
    prompt = torch.tensor([[5, 6, 7, 8] * 3])  # repeats: prompt lookup proposes
    plain = generate(model, prompt, max_new_tokens=6, temperature=0)
    assert plans == [(12, False)] + [(1, True)] * 5
    plans.clear()
    spec = speculative_generate(model, PromptLookupDraft(), prompt, num_draft_tokens=3, max_new_tokens=6,
                                temperature=0, adaptive=False)
    assert torch.equal(spec.tokens, plain.tokens)
    assert [full for _, full in plans] == [False] + [True] * (len(plans) - 1)
    assert any(T > 1 for T, _ in plans[1:])  # verifications of drafts
