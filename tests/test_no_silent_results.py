"""No silent wrong results: a model whose logits no token can come from (NaN, +inf, a row of only
-inf) or whose logits are wider than its vocabulary makes both decoding loops raise a clear
error, at every temperature and with every kind of draft, never emit a made-up token."""

import pytest
import torch

from specdec_kernels import DeviceCheckError, PromptLookupDraft, generate, generation, speculative_generate

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
