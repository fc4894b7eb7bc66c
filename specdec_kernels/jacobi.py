"""Jacobi decoding: the model guesses its own next tokens, no draft at all.

Greedy decoding is a fixed point: token i + 1 is the argmax after tokens 0 .. i. Jacobi decoding
(Santilli et al. 2023, "Accelerating Transformer Inference for Translation via Parallel
Decoding") solves for a window of W future tokens at once: each step feeds the row's last token
and W guesses in one forward, and takes the argmax y_i after each input. y_0 is the next token;
guess i + 1 was right iff it equals y_i, and then y_{i+1} is right too. The row keeps the
longest run of right guesses plus one (``a + 1`` tokens), and the argmaxes past it become the
next guesses: the iteration converges to greedy decoding, at least one token per forward, and
more where the model's guesses settle before their prefix does (repeated or formulaic text).

Batched over ragged prompts and ragged progress like `speculative_generate`, on the same model
protocol, cache and one host synchronization per step; greedy only (the output equals
`generate(..., temperature=0)` token for token).
"""

from __future__ import annotations

import time

import torch

from ._checks import is_int
from ._model_calls import _decoding_forward, _last_logits, _LogitsCheck, _new_cache, _use_cuda_graphs, as_protocol_model
from .generation import (
    GenerationOutput,
    _finish,
    _keep_running,
    _new_stats,
    _Outputs,
    _PhaseTimer,
    _prepare,
    _rows_still_running,
    _running_range,
    _Stream,
)
from .sampling import first_rejection_index


@torch.inference_mode()
def jacobi_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, window: int = 8,
                    max_new_tokens: int, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                    max_cache_len: int | None = None, cuda_graphs: bool | None = None,
                    streamer=None) -> GenerationOutput:
    """Greedy decoding by Jacobi iteration over a window of guesses per row (see the module
    docstring): the tokens of `generate(..., temperature=0)`, in fewer forwards where the
    model's guesses settle early.

    Args:
        model: a model following the protocol (`specdec_kernels.generation`), e.g. the built-in
            `Llama` or a transformers model (wrapped in `HFCausalLM`).
        input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, max_cache_len,
            cuda_graphs, streamer: as in `generate` (the cache also needs room for one step's
            guesses: longest prompt + max_new_tokens - 1 + window).
        window: W >= 1, guesses per row and step (at most ``max_new_tokens - 1`` are made).
            Each forward scores W + 1 tokens per row.

    Returns:
        `GenerationOutput`; ``stats.num_proposed`` / ``num_accepted`` count guesses made and
        kept, and ``stats.tokens_per_target_forward`` the compression over plain decoding.

    Example::

        out = jacobi_generate(model, input_ids, max_new_tokens=64, window=8)
        print(out.stats.tokens_per_target_forward)
    """
    if not is_int(window) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    t_start = time.perf_counter()
    model = as_protocol_model(model)
    request = _prepare(model, input_ids, attention_mask, max_new_tokens, 0.0, None, None, eos_token_id,
                       pad_token_id, None, max_cache_len, lookahead=int(window))
    W, V = max(1, request.drafts), model.vocab_size
    device, B = input_ids.device, input_ids.shape[0]
    timer, stats, outputs = _PhaseTimer(device), _new_stats(B, device, W), _Outputs(B, request.max_new_tokens, device)
    stream = _Stream(streamer, B)
    rows, host_rows = torch.arange(B, device=device), list(range(B))
    cache = _new_cache(model, "model", B, request.max_len, device)
    check = _LogitsCheck(device, ("model",))
    graphs = _use_cuda_graphs(cuda_graphs, (model,), device)
    forward = check.checked("model", V, _decoding_forward(model, cache, "model", graphs, last_only=False))
    with timer("prefill"):
        logits = _last_logits(model, request.prompt, cache, request.prompt_lengths, request.prompt_tokens,
                              max_seqlen=request.prompt.shape[1])
        token = check("model", V, logits).argmax(-1)
    stats.target_forwards += 1
    # The first guesses: the first token again (any guess is valid; later ones are the model's).
    new, accepted, guesses = token[:, None], torch.zeros_like(rows), token[:, None].expand(B, W).contiguous()
    with stream:
        while True:
            kept, done = outputs.write(rows, new, accepted + 1, request.eos)
            stream.add(host_rows, kept, new)
            running, (longest, shortest, *streamed) = _rows_still_running(
                done, check, *_running_range(cache.lengths, done), *stream.values())
            stream.put(*streamed)
            if not running:
                break
            if len(running) < len(rows):
                _, rows, host_rows, cache, token, guesses = _keep_running(running, rows, host_rows, cache, token,
                                                                          guesses)
            with timer("target"):
                start = cache.lengths.clone()
                logits = forward(torch.cat([token[:, None], guesses], 1), cache, max_seqlen=longest + W + 1,
                                 min_seqlen=shortest + W + 1)
            stats.target_forwards += 1
            with timer("sampler"):
                new = logits.argmax(-1)                                        # [b, W + 1]: y_0 .. y_W
                accepted = first_rejection_index(guesses == new[:, :W])
                token = new.gather(1, accepted[:, None])[:, 0]
                # The argmaxes past the kept ones are the next guesses (the last repeated).
                later = (accepted[:, None] + 1 + torch.arange(W, device=device)).clamp(max=W)
                guesses = new.gather(1, later)
            cache.crop(start + accepted + 1)
            stats.num_steps[rows] += 1
            stats.num_proposed[rows] += W
            stats.num_accepted[rows] += accepted
    stats.draft_lengths[:, W] = stats.num_steps.cpu()
    return _finish(request, input_ids, outputs, stats, timer, t_start, pad_token_id)
