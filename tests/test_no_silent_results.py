"""No silent wrong results: a model whose logits no token can come from (NaN, +inf, a row of only
-inf) or whose logits are wider than its vocabulary makes both decoding loops raise a clear
error, at every temperature and with every kind of draft, never emit a made-up token; greedy
sampling of such logits raises; a temperature too small for float32 is greedy everywhere."""

import pytest
import torch

from specdec_kernels import (
    DeviceCheckError,
    PromptLookupDraft,
    generate,
    generation,
    process_logits,
    rejection_sample_logits,
    sample_logits,
    speculative_generate,
)
from specdec_kernels.reference import sampling as reference

from tiny_models import tiny_llama

FAULTS = {
    "nan-everywhere": lambda x: x.fill_(float("nan")),
    "one-nan": lambda x: x[0, 0, 5].fill_(float("nan")),
    "plus-inf": lambda x: x[0, 0, 7].fill_(float("inf")),
    "row-of-minus-inf": lambda x: x[0, 0].fill_(float("-inf")),
}


class Faulty(torch.nn.Module):
    """A protocol model around ``inner`` whose ``fault_at``-th forward (1 = the prefill) returns
    corrupted logits; ``vocab_size`` may claim fewer entries than the logits have."""

    def __init__(self, inner, fault=None, fault_at=2, vocab_size=None):
        super().__init__()
        self.inner, self.fault, self.fault_at, self.calls = inner, fault, fault_at, 0
        self.vocab_size = vocab_size or inner.vocab_size

    def new_cache(self, batch_size, max_len):
        return self.inner.new_cache(batch_size, max_len)

    def forward(self, input_ids, cache, q_seqlens=None):
        self.calls += 1
        logits = self.inner(input_ids, cache, q_seqlens).clone()
        if self.fault is not None and self.calls == self.fault_at:
            self.fault(logits)
        return logits


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, scale=3.0)


def prompts():
    ids = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def run(loop, model, draft, temperature):
    ids, mask = prompts()
    if loop == "generate":
        return generate(model, ids, mask, max_new_tokens=8, temperature=temperature, seed=0)
    return speculative_generate(model, draft, ids, mask, num_draft_tokens=3, max_new_tokens=8,
                                temperature=temperature, seed=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
@pytest.mark.parametrize("loop", ["generate", "prompt-lookup", "model-draft"])
def test_bad_target_logits_raise(model, loop, fault, temperature):
    faulty = Faulty(model, FAULTS[fault], fault_at=2)
    draft = PromptLookupDraft() if loop == "prompt-lookup" else model.truncated(1)
    with pytest.raises(DeviceCheckError, match="model returned NaN or infinite logits"):
        run(loop, faulty, draft, temperature)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
def test_bad_draft_logits_raise(model, temperature):
    draft = Faulty(model.truncated(1), FAULTS["one-nan"], fault_at=3)
    with pytest.raises(DeviceCheckError, match="the draft model returned NaN"):
        run("model-draft", model, draft, temperature)


@pytest.mark.parametrize("loop", ["generate", "model-draft"])
def test_flags_read_in_the_steps_transfer_raise_too(model, loop, monkeypatch):
    """The CUDA path: the check sets a flag that the step's one transfer reads, then raises."""

    class Deferred(generation._LogitsCheck):
        def __init__(self, device, names):
            super().__init__(device, names)
            self.deferred = True

    monkeypatch.setattr(generation, "_LogitsCheck", Deferred)
    with pytest.raises(DeviceCheckError, match="model returned NaN or infinite logits"):
        run(loop, Faulty(model, FAULTS["one-nan"], fault_at=2), model.truncated(1), 0.8)
    run(loop, model, model.truncated(1), 0.8)  # and good logits pass


@pytest.mark.parametrize("loop", ["generate", "prompt-lookup", "model-draft"])
def test_logits_wider_than_the_vocabulary_raise(loop):
    wide = tiny_llama(seed=1, vocab_size=105)
    draft = PromptLookupDraft() if loop == "prompt-lookup" else Faulty(wide.truncated(1), vocab_size=97)
    with pytest.raises(ValueError, match="logits of width 105 but its vocab_size is 97"):
        run(loop, Faulty(wide, vocab_size=97), draft, 0.8)


def test_draft_logits_wider_than_the_targets_raise(model):
    wide_draft = Faulty(tiny_llama(seed=1, vocab_size=105).truncated(1), vocab_size=97)
    with pytest.raises(ValueError, match="the draft model returned logits of width 105"):
        run("model-draft", model, wide_draft, 0.8)


# --------------------------------------------------------------------------- samplers

@pytest.mark.parametrize("row", ["nan", "one-nan", "plus-inf", "minus-inf"])
def test_greedy_sampling_of_logits_without_an_argmax_raises(row):
    logits = torch.randn(3, 11)
    logits[1] = {"nan": float("nan"), "plus-inf": 0.0, "minus-inf": float("-inf"), "one-nan": 0.0}[row]
    if row == "one-nan":
        logits[1, 5] = float("nan")
    if row == "plus-inf":
        logits[1, 7] = float("inf")
    with pytest.raises(ValueError, match="finite maximum in every greedy row"):
        sample_logits(logits, 0.0)
    # The distribution of a greedy row without an argmax is undefined: NaN, never a one-hot.
    for probs in (process_logits(logits, torch.tensor([1.0, 0.0, 1.0])), reference.process_logits(logits, 0.0)):
        assert probs[1].isnan().all() and not probs[[0, 2]].isnan().any()


@pytest.mark.parametrize("validate", [None, False])
@pytest.mark.parametrize("temperature", [0.0, "per-row"])
def test_non_finite_logits_the_sampler_never_reads_are_ignored_alike(backend, temperature, validate):
    """Ragged counts: positions past a row's count are not read, so NaN there changes nothing."""
    generator = torch.Generator().manual_seed(2)
    target, draft = torch.randn(2, 4, 30, generator=generator), torch.randn(2, 3, 30, generator=generator)
    ids, counts = target[:, :3].argmax(-1), torch.tensor([1, 3])
    clean = rejection_sample_logits(target, draft, ids, counts, temperature=0.0, seed=0, backend="reference")
    target[0, 3], draft[0, 2] = float("nan"), float("nan")
    t = torch.tensor([0.0, 0.0]) if temperature == "per-row" else temperature
    out = rejection_sample_logits(target, draft, ids, counts, temperature=t, seed=0, backend=backend,
                                  **({} if backend == "reference" else {"validate": validate}))
    assert torch.equal(out.num_accepted, clean.num_accepted)
    assert torch.equal(out.token_ids[0, :2], clean.token_ids[0, :2])
    assert torch.equal(out.token_ids[1], clean.token_ids[1])


TINY = [1e-300, 1e-45, 1e-39]  # below float32's smallest normal (1.18e-38): greedy


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_are_greedy_on_every_backend(temperature, backend):
    generator = torch.Generator().manual_seed(0)
    B, K, V = 4, 3, 50
    target = torch.randn(B, K + 1, V, generator=generator) * 3
    draft = torch.randn(B, K, V, generator=generator) * 3
    ids = torch.randint(0, V, (B, K), generator=generator)
    ids[:2] = target[:2, :K].argmax(-1)  # two rows whose drafts greedy decoding accepts
    greedy = rejection_sample_logits(target, draft, ids, temperature=0.0, backend=backend, seed=1)
    tiny = rejection_sample_logits(target, draft, ids, temperature=temperature, backend=backend, seed=1)
    per_row = rejection_sample_logits(target, draft, ids, temperature=torch.full((B,), temperature),
                                      backend=backend, seed=1)
    for out in (tiny, per_row):
        assert torch.equal(out.token_ids, greedy.token_ids) and torch.equal(out.num_accepted, greedy.num_accepted)
    assert torch.equal(sample_logits(target[:, 0], temperature, generator=generator), target[:, 0].argmax(-1))


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_decode_greedily(model, temperature):
    ids, mask = prompts()
    greedy = generate(model, ids, mask, max_new_tokens=6, temperature=0.0)
    tiny = generate(model, ids, mask, max_new_tokens=6, temperature=temperature, seed=5)
    spec = speculative_generate(model, PromptLookupDraft(), ids, mask, max_new_tokens=6, temperature=temperature,
                                seed=5)
    assert torch.equal(tiny.tokens, greedy.tokens) and torch.equal(spec.tokens, greedy.tokens)


# --------------------------------------------------------------------------- sizes


class NoLimit(Faulty):
    """A protocol model without ``config.max_position_embeddings``: nothing bounds the budget."""


@pytest.mark.parametrize("sizes", [dict(max_new_tokens=2**62), dict(max_new_tokens=8, max_cache_len=10**15)],
                         ids=["max_new_tokens", "max_cache_len"])
def test_sizes_the_allocator_refuses_name_the_argument(model, sizes):
    ids, mask = prompts()
    name = next(iter(sizes)) if "max_cache_len" not in sizes else "max_cache_len"
    for loop in (generate, lambda *a, **k: speculative_generate(a[0], PromptLookupDraft(), *a[1:], **k)):
        with pytest.raises(ValueError, match=name):
            loop(NoLimit(model), ids, mask, **sizes)


def test_truncated_takes_an_int_number_of_layers(model):
    with pytest.raises(TypeError, match="num_layers must be an int"):
        model.truncated(1.5)
