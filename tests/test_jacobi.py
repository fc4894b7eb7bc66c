"""jacobi_generate: greedy Jacobi decoding equals greedy generate token for token (ragged rows,
EOS inside a kept run, windows past the budget), one host sync per step, and it keeps more than
one token per forward where the model's guesses settle early."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels import generate, jacobi_generate
from specdec_kernels.testing import SyncCounter

from tiny_models import ragged_prompts, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, scale=3.0, layers=2)


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_equals_greedy_generate(target, window):
    ids, mask = ragged_prompts(B=5, seed=2)
    plain = generate(target, ids, mask, max_new_tokens=24, temperature=0)
    out = jacobi_generate(target, ids, mask, window=window, max_new_tokens=24)
    assert torch.equal(out.tokens, plain.tokens)
    assert out.stats.num_generated.tolist() == [24] * 5
    assert out.stats.tokens_per_target_forward >= 1.0


def test_eos_inside_a_kept_run_ends_the_row(target):
    ids, mask = ragged_prompts(B=4, seed=3)
    plain = generate(target, ids, mask, max_new_tokens=20, temperature=0)
    eos = int(plain.tokens[1, 6])  # row 1 stops there; other rows stop wherever they emit it
    expected = generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=eos, pad_token_id=0)
    out = jacobi_generate(target, ids, mask, window=6, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.tokens, expected.tokens)
    assert torch.equal(out.stats.num_generated, expected.stats.num_generated)


class PositionClock(torch.nn.Module):
    """A model whose next token depends on its position only (the tiny model's logits plus a
    large bonus for token ``position % 5``): whatever the guesses, every prediction is right, so
    Jacobi keeps whole windows once its first forward has predicted them."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.vocab_size = inner, inner.vocab_size

    def new_cache(self, batch_size, max_len, **kwargs):
        return self.inner.new_cache(batch_size, max_len, **kwargs)

    def forward(self, input_ids, cache, q_seqlens=None):
        T = input_ids.shape[1]
        position = cache.lengths[:, None] + torch.arange(T) + 1  # of the token each output predicts
        logits = self.inner(input_ids, cache, q_seqlens)
        return logits + 100.0 * torch.nn.functional.one_hot(position % 5, self.vocab_size)


def test_guesses_that_settle_are_kept_several_at_a_time(target):
    model = PositionClock(target)
    ids, mask = ragged_prompts(B=3, seed=1)
    plain = generate(model, ids, mask, max_new_tokens=30, temperature=0)
    out = jacobi_generate(model, ids, mask, window=5, max_new_tokens=30)
    assert torch.equal(out.tokens, plain.tokens)
    # Guesses made from a full window's predictions are all right (5 kept, and one more); after
    # such a step only the last prediction is left to guess from (repeated), so the next step
    # keeps one: 1, 6, 1, 6, ... tokens for the 29 after the prefill's.
    assert out.stats.num_steps.tolist() == [9] * 3 and out.stats.tokens_per_target_forward == 29 / 9


def test_one_host_sync_per_step(target):
    ids, mask = ragged_prompts(B=3, seed=4)
    with SyncCounter() as syncs:
        out = jacobi_generate(target, ids, mask, window=4, max_new_tokens=12)
    in_loop = [e for e in syncs.events if "_prepare" not in e.where and "prefill" not in e.where]
    assert all("_rows_still_running" in e.where for e in in_loop), in_loop
    assert len(in_loop) == int(out.stats.num_steps.max()) + 1


def test_bad_window_is_refused(target):
    ids, mask = ragged_prompts(B=2)
    with pytest.raises(ValueError, match="window"):
        jacobi_generate(target, ids, mask, window=0, max_new_tokens=4)
