"""Batched autoregressive and speculative generation over the package's model protocol.

A model is any callable ``model(input_ids [B, T], cache, q_seqlens=None) -> logits [B, T, V]``
that appends its keys and values at each row's own cache length and advances
``cache.lengths``, with ``model.vocab_size`` and ``model.new_cache(batch_size, max_len)``
returning a cache that has ``lengths`` [B], ``crop(lengths)`` and ``select(rows)``
(`specdec_kernels.KVCache`; `specdec_kernels.Llama` is the built-in model). Four optional
keywords are used when the model's ``forward`` takes them: ``last_only=True`` (logits of each
row's last real token only, [B, 1, V]), ``num_tokens=`` (``q_seqlens.sum()`` as a host int,
known to the loops without an extra sync, so the model can skip padding positions),
``max_seqlen=`` (a host int >= every row's cache length after the call: the prompt width for the
prefill, then read in the loop's one transfer per step; attention can then read that many
positions instead of the cache's capacity) and ``min_seqlen=`` (a host int <= every row's cache
length after a decoding call, read in the same transfer; with one row it equals ``max_seqlen``:
see `RaggedAttentionPlan`).

Both loops are batched over ragged prompts and ragged acceptance. Inside a step nothing
reads a device value on the host except the one "which rows are done?" check, which
also drops finished rows from the batch so they stop costing compute. On CUDA the decoding
forwards are replayed as CUDA graphs (`specdec_kernels.cuda_graphs`); a step that records a
new graph (the first step at each batch size) also synchronizes the device once.

The two loops share one module on purpose: they share their argument checks, output bookkeeping
and statistics, and are meant to be read side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ._checks import is_int, is_real
from ._model_calls import (
    _check_model,
    _decoding_forward,
    _last_logits,
    _LogitsCheck,
    _new_cache,
    _use_cuda_graphs,
    allocating,
)
from ._sampling_checks import check_sampling_params
from .drafts import PromptLookupDraft
from .sampling import rejection_sample_logits, sample_logits

# --------------------------------------------------------------------------- results

@dataclass
class GenerationStats:
    """What a generation run did. Tensors are [B] int64 on the CPU, in input row order.

    Attributes:
        num_generated: tokens generated per row (EOS included, if emitted).
        num_steps: decoding steps per row (target forwards after the prefill).
        num_proposed: draft tokens proposed per row (speculative only).
        num_accepted: draft tokens the verification accepted per row (speculative only). Accepted
            tokens that EOS or the token budget then cut off count too: this measures the draft.
            Without such cuts ``num_generated = 1 + num_steps + num_accepted`` (the first token
            comes from the prefill); with them it is less.
        target_forwards, draft_forwards: batched forward calls, the prefill included.
        time_prefill_s: prompt prefill of target and draft; time_draft_prefill_s: the draft
            model's part of it (0 for prompt lookup and plain generation).
        time_target_s, time_draft_s, time_sampler_s: decoding steps' target forwards, drafting
            (draft forwards, or n-gram proposals: those are made after the prefill and after
            every step, so the last one, never verified, counts too), sampling (the first
            token's included); time_total_s: the whole call.
    """

    num_generated: torch.Tensor
    num_steps: torch.Tensor
    num_proposed: torch.Tensor
    num_accepted: torch.Tensor
    target_forwards: int = 0
    draft_forwards: int = 0
    time_prefill_s: float = 0.0
    time_draft_prefill_s: float = 0.0
    time_target_s: float = 0.0
    time_draft_s: float = 0.0
    time_sampler_s: float = 0.0
    time_total_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens over the whole batch (nan without proposals)."""
        proposed = int(self.num_proposed.sum())
        return int(self.num_accepted.sum()) / proposed if proposed else float("nan")

    @property
    def tokens_per_target_forward(self) -> float:
        """Generated tokens per decoding step, averaged over the batch's rows (the first token,
        which comes from the prefill, is not counted)."""
        steps = int(self.num_steps.sum())
        return (int(self.num_generated.sum()) - len(self.num_generated)) / steps if steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return int(self.num_generated.sum()) / self.time_total_s if self.time_total_s else float("nan")


@dataclass
class GenerationOutput:
    """Generated tokens and statistics.

    Attributes:
        tokens: [B, max_new_tokens] int64, each row's generated tokens then ``pad_token_id``.
        sequences: [B, P + max_new_tokens] int64, ``input_ids`` as given followed by ``tokens``
            (with right-padded input the padding stays between prompt and generated tokens).
        stats: `GenerationStats`.
    """

    tokens: torch.Tensor
    sequences: torch.Tensor
    stats: GenerationStats

    def row_tokens(self, row: int) -> list[int]:
        """Generated token ids of ``row`` (without padding)."""
        return self.tokens[row, : int(self.stats.num_generated[row])].tolist()


# --------------------------------------------------------------------------- helpers

class _PhaseTimer:
    """Wall time per phase: host clocks on CPU, CUDA events on GPU (read once at the end, so
    timing adds no synchronization inside the loop)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: dict[str, float] = {}
        self.events: dict[str, list] = {}

    @contextmanager
    def __call__(self, phase: str):
        if self.cuda:  # events on the tensors' device, which need not be the current one
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self.events.setdefault(phase, []).append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host[phase] = self.host.get(phase, 0.0) + time.perf_counter() - t0

    def seconds(self, phase: str) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return sum(s.elapsed_time(e) for s, e in self.events.get(phase, [])) / 1e3
        return self.host.get(phase, 0.0)


@dataclass
class _Request:
    """Validated generation arguments, shared by both loops."""

    prompt: torch.Tensor  # [B, P] real tokens first (right-padded with 0)
    prompt_lengths: torch.Tensor  # [B]
    prompt_tokens: int  # prompt_lengths.sum(), read on the host before the loop
    max_new_tokens: int
    max_len: int
    drafts: int  # drafts per step the cache has room for: lookahead capped at max_new_tokens - 1
    eos: torch.Tensor  # [E] int64 (may be empty)
    sample: Callable[[torch.Tensor], torch.Tensor]
    sampling: dict = field(default_factory=dict)
    generator: torch.Generator | None = None


def _prepare(model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos_token_id,
             pad_token_id, seed, max_cache_len, lookahead: int) -> _Request:
    """Validate arguments (on the host, once, before the loop) and compact prompts to the left."""
    _check_model(model, "model")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, P] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
    B, P = input_ids.shape
    if B == 0 or P == 0:
        raise ValueError(f"input_ids must hold at least one non-empty prompt, got shape {tuple(input_ids.shape)}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)  # NumPy ints become Python ints from here on
    if isinstance(temperature, torch.Tensor):  # the loop samples with one temperature
        raise TypeError("temperature must be a float (per-row temperatures: rejection_sample_logits / "
                        "sample_logits)")
    # NumPy scalars become Python numbers (the samplers take Python ints and floats).
    temperature, top_p = (float(x) if is_real(x) and not isinstance(x, int) else x for x in (temperature, top_p))
    top_k = int(top_k) if is_int(top_k) else top_k
    temperature = check_sampling_params(temperature, top_k, top_p, B, input_ids.device)
    if seed is not None and not is_int(seed):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must lie in [-2**63, 2**64) (a torch.Generator seed), got {seed}")
    if pad_token_id is not None and not is_int(pad_token_id):
        raise TypeError(f"pad_token_id must be an int or None, got {type(pad_token_id).__name__}")
    if pad_token_id is not None and not -(2**63) <= pad_token_id < 2**63:
        raise ValueError(f"pad_token_id must fit int64 (the output's dtype), got {pad_token_id}")
    if max_cache_len is not None and (not is_int(max_cache_len) or max_cache_len < 1):
        raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
    max_cache_len = None if max_cache_len is None else int(max_cache_len)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    if ((attention_mask != 0) & (attention_mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    mask = attention_mask.to(device=input_ids.device) != 0
    lengths = mask.sum(1)
    if (lengths == 0).any():
        raise ValueError(f"input_ids rows {(lengths == 0).nonzero().flatten().tolist()} are empty prompts "
                         "(attention_mask has no ones there)")
    if ((mask[:, 1:] != mask[:, :-1]).sum(1) > 1).any():
        raise ValueError("attention_mask must mark one contiguous block per row (left or right padding)")
    vocab = model.vocab_size
    real = input_ids[mask]
    if ((real < 0) | (real >= vocab)).any():
        raise ValueError(f"input_ids must be in [0, {vocab}) where attention_mask is 1")
    # The cache holds the prompt and every generated token but the newest; a speculative step
    # (there is none when the prefill's token is the only one) also writes its drafts past them.
    longest = int(lengths.max())
    drafts = min(lookahead, max_new_tokens - 1)  # drafts past the token budget are never made
    needed = longest + max_new_tokens - 1 + drafts
    if max_cache_len is None:
        max_cache_len = needed
    elif max_cache_len < needed:
        raise ValueError(f"max_cache_len={max_cache_len} is too small: the longest prompt "
                         f"({longest} tokens) + max_new_tokens ({max_new_tokens}) - 1"
                         + (f" + {drafts} drafts per step" if drafts else "") + f" needs {needed}")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's max_position_embeddings ({limit})")
    eos_ids = ([] if eos_token_id is None else list(eos_token_id) if isinstance(eos_token_id, Sequence)
               else [eos_token_id])
    if not all(is_int(i) and 0 <= i < vocab for i in eos_ids):
        raise ValueError(f"eos_token_id must be None, an int or ints in [0, {vocab}), got {eos_token_id!r}")
    eos = torch.tensor(eos_ids, dtype=torch.int64, device=input_ids.device)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first
    # Columns past the longest prompt are padding in every row.
    prompt = torch.where(torch.arange(longest, device=input_ids.device) < lengths[:, None],
                         input_ids.gather(1, order[:, :longest]), 0).long()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(int(seed))
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
    return _Request(prompt, lengths, int(lengths.sum()), max_new_tokens, max_cache_len, drafts, eos,
                    lambda logits: sample_logits(logits, **sampling, generator=generator), sampling, generator)


class _Outputs:
    """Generated tokens in input row order, written sync-free at each row's own offset."""

    def __init__(self, batch_size: int, max_new_tokens: int, device: torch.device) -> None:
        self.max_new = max_new_tokens
        # One spare column takes the writes that fall past a row's end (after EOS or budget).
        with allocating(f"the output for {batch_size} rows of max_new_tokens={max_new_tokens}", "lower max_new_tokens"):
            self.tokens = torch.full((batch_size, max_new_tokens + 1), -1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def write(self, rows: torch.Tensor, new: torch.Tensor, num_new: torch.Tensor, eos: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``new`` [b, T] (first ``num_new`` valid) to ``rows``; stop rows at EOS or budget.

        Returns (kept [b, T] bool: which new tokens were written, done [b] bool)."""
        offsets = torch.arange(new.shape[1], device=new.device)
        counts = self.counts[rows]
        kept = (offsets < num_new[:, None]) & (counts[:, None] + offsets < self.max_new)
        is_eos = (new[..., None] == eos).any(-1) & kept  # torch.isin syncs for long EOS lists
        kept &= (is_eos.cumsum(1) - is_eos.long()) == 0  # nothing after the first EOS
        columns = torch.where(kept, counts[:, None] + offsets, self.max_new)
        self.tokens[rows[:, None], columns] = new
        counts = counts + kept.sum(1)
        self.counts[rows] = counts
        return kept, is_eos.any(1) | (counts >= self.max_new)


def _finish(request: _Request, input_ids, outputs: _Outputs, stats: GenerationStats, timer, t_start,
            pad_token_id) -> GenerationOutput:
    tokens = outputs.tokens[:, : request.max_new_tokens]
    pad = pad_token_id if pad_token_id is not None else (int(request.eos[0]) if len(request.eos) else 0)
    tokens = torch.where(tokens < 0, pad, tokens)
    stats.time_draft_prefill_s = timer.seconds("draft prefill")
    stats.time_prefill_s = timer.seconds("prefill") + stats.time_draft_prefill_s
    stats.time_target_s, stats.time_draft_s, stats.time_sampler_s = (
        timer.seconds("target"), timer.seconds("draft"), timer.seconds("sampler"))
    stats.num_generated, stats.num_steps = outputs.counts.cpu(), stats.num_steps.cpu()
    stats.num_proposed, stats.num_accepted = stats.num_proposed.cpu(), stats.num_accepted.cpu()
    stats.time_total_s = time.perf_counter() - t_start
    return GenerationOutput(tokens, torch.cat([input_ids.long(), tokens], 1), stats)


def _new_stats(batch_size: int, device) -> GenerationStats:
    zeros = lambda: torch.zeros(batch_size, dtype=torch.int64, device=device)
    return GenerationStats(zeros(), zeros(), zeros(), zeros())


def _rows_still_running(done: torch.Tensor, check: _LogitsCheck, *values: torch.Tensor
                        ) -> tuple[list[int], list[int]]:
    """The loop's one host synchronization per step: which batch positions are still running,
    and the 0-d integer ``values`` (cache lengths, draft counts) read in the same transfer, with
    the logits check's flags (raising if a model returned logits no token can come from)."""
    flat = torch.cat([done.long(), check.failed.long(), *(v.view(1).long() for v in values)]).tolist()
    B, M = done.shape[0], len(check.names)
    check.raise_if_failed(flat[B: B + M])
    return [i for i, d in enumerate(flat[:B]) if not d], flat[B + M:]


def _running_range(values: torch.Tensor, done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d max and min of the non-negative ``values`` [B] over the rows still running (cache
    lengths, draft counts: bounds for their next forward; meaningless when no row runs)."""
    return values.masked_fill(done, 0).max(), values.masked_fill(done, torch.iinfo(values.dtype).max).min()


# --------------------------------------------------------------------------- plain generation

@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, seed: int | None = None,
             max_cache_len: int | None = None, cuda_graphs: bool | None = None) -> GenerationOutput:
    """Plain autoregressive generation (the baseline speculative decoding must match).

    Args:
        model: a model following the protocol (see the module docstring).
        input_ids: [B, P] int64 prompts, left- or right-padded.
        attention_mask: [B, P], 1 on real tokens (None: no padding).
        max_new_tokens: tokens to generate per row at most (>= 1).
        temperature: 0 means greedy; top_k / top_p filter as in `specdec_kernels.process_logits`.
        eos_token_id: an id or ids that end a row (the EOS token is kept in the output).
        pad_token_id: fills ``tokens`` past each row's end (default: the first EOS id, else 0).
        seed: seeds a private generator (same seed, same tokens); None uses torch's global RNG.
        max_cache_len: KV-cache capacity per row (default and least: longest prompt +
            max_new_tokens - 1; the newest token is never written).
        cuda_graphs: replay each decoding step as a CUDA graph (`GraphedForward`; recorded
            once per batch size, attention then reads the whole cache capacity). None (default):
            on CUDA with the built-in `Llama`; True: also for other models whose cache is a
            `KVCache` (their forward must not synchronize); False: never.

    Returns:
        `GenerationOutput` with ``tokens`` [B, max_new_tokens] and ``stats``.
    """
    t_start = time.perf_counter()
    request = _prepare(model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p,
                       eos_token_id, pad_token_id, seed, max_cache_len, lookahead=0)
    device, B = input_ids.device, input_ids.shape[0]
    graphs = _use_cuda_graphs(cuda_graphs, (model,), device)
    timer, stats, outputs = _PhaseTimer(device), _new_stats(B, device), _Outputs(B, request.max_new_tokens, device)
    rows = torch.arange(B, device=device)  # input row of each batch position
    cache = _new_cache(model, "model", B, request.max_len, device)
    check = _LogitsCheck(device, ("model",))
    step = check.checked("model", model, _decoding_forward(model, cache, "model", graphs, last_only=True))
    with timer("prefill"):
        logits = check("model", model, _last_logits(model, request.prompt, cache, request.prompt_lengths,
                                                     request.prompt_tokens, max_seqlen=request.prompt.shape[1]))
    stats.target_forwards += 1
    while True:
        with timer("sampler"):
            token = request.sample(logits)
        _, done = outputs.write(rows, token[:, None], torch.ones_like(token), request.eos)
        running, (longest, shortest) = _rows_still_running(done, check, *_running_range(cache.lengths, done))
        if not running:
            break
        if len(running) < len(rows):
            keep = torch.tensor(running, device=device)
            rows, token, cache = rows[keep], token[keep], cache.select(keep)
        stats.num_steps[rows] += 1
        with timer("target"):
            logits = step(token[:, None], cache, max_seqlen=longest + 1, min_seqlen=shortest + 1)
        stats.target_forwards += 1
    return _finish(request, input_ids, outputs, stats, timer, t_start, pad_token_id)


# --------------------------------------------------------------------------- speculative generation

@torch.inference_mode()
def speculative_generate(target, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         *, num_draft_tokens: int = 4, max_new_tokens: int, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None,
                         eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                         seed: int | None = None, max_cache_len: int | None = None,
                         cuda_graphs: bool | None = None) -> GenerationOutput:
    """Lossless speculative decoding, batched over ragged prompts and ragged acceptance.

    Each step the draft proposes ``num_draft_tokens`` (K) tokens per row, the target scores all
    K+1 positions in one forward, and `rejection_sample_logits` keeps the longest prefix that
    sampling the target alone would have produced, plus one corrected or bonus token. Rows
    finish independently; finished rows are dropped from the batch.

    Args:
        target: the model whose distribution is reproduced exactly.
        draft: a model sharing the target's vocabulary (it samples from the same processed
            distribution the sampler is given), or ``"prompt_lookup"`` / a `PromptLookupDraft`
            (model-free n-gram proposals; rows without a match propose nothing).
        num_draft_tokens: K >= 1 tokens proposed per step (at most ``max_new_tokens - 1`` are:
            drafts past the budget could never be kept).
        other arguments: as in `generate`; the cache capacity also needs room for one step's K
            drafts (default and least: longest prompt + max_new_tokens - 1 + K). With CUDA
            graphs the target verifies K + 1 positions every step, also for prompt-lookup rows
            with fewer drafts (padding), so that one graph serves each batch size.

    Returns:
        `GenerationOutput`; ``stats`` has acceptance counts, forward counts and phase times.
    """
    if not is_int(num_draft_tokens) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    _check_model(target, "target")
    if isinstance(draft, str):
        if draft != "prompt_lookup":
            raise ValueError(f"draft must be a model, a PromptLookupDraft or \"prompt_lookup\", got {draft!r}")
        draft = PromptLookupDraft()
    lookup = isinstance(draft, PromptLookupDraft)
    if not lookup:
        _check_model(draft, "draft")
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"draft must share the target's vocabulary: draft.vocab_size={draft.vocab_size}, "
                             f"target.vocab_size={target.vocab_size}")
    t_start = time.perf_counter()
    request = _prepare(target, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p,
                       eos_token_id, pad_token_id, seed, max_cache_len, lookahead=int(num_draft_tokens))
    # Drafts past the token budget could never be kept: at most max_new_tokens - 1 per step (K = 1
    # when that is 0: the prefill's token is then the only one, and no step runs).
    K = max(1, request.drafts)
    device, B = input_ids.device, input_ids.shape[0]
    graphs = _use_cuda_graphs(cuda_graphs, (target,) if lookup else (target, draft), device)
    timer, stats, outputs = _PhaseTimer(device), _new_stats(B, device), _Outputs(B, request.max_new_tokens, device)
    rows = torch.arange(B, device=device)

    target_cache = _new_cache(target, "target", B, request.max_len, device)
    check = _LogitsCheck(device, ("target", "draft"))
    verify = check.checked("target", target, _decoding_forward(target, target_cache, "target", graphs,
                                                                 last_only=False))
    with timer("prefill"):
        logits = check("target", target, _last_logits(target, request.prompt, target_cache, request.prompt_lengths,
                                                       request.prompt_tokens, max_seqlen=request.prompt.shape[1]))
    stats.target_forwards += 1
    if lookup:  # token history: prompt, then everything emitted
        context = torch.zeros(B, request.prompt.shape[1] + request.max_new_tokens + K + 1, dtype=torch.int64,
                              device=device)
        context[:, : request.prompt.shape[1]] = request.prompt
        context_lengths = request.prompt_lengths.clone()
    else:
        draft_cache = _new_cache(draft, "draft", B, request.max_len, device)
        draft_step = check.checked("draft", draft, _decoding_forward(draft, draft_cache, "draft", graphs,
                                                                     last_only=True))
        with timer("draft prefill"):
            draft_prefill = check("draft", draft, _last_logits(draft, request.prompt, draft_cache,
                                                               request.prompt_lengths, request.prompt_tokens,
                                                               max_seqlen=request.prompt.shape[1]))
        stats.draft_forwards += 1
        if (draft_prefill.dtype, draft_prefill.device) != (logits.dtype, logits.device):
            raise ValueError(f"draft must produce logits like the target's ({logits.dtype} on {logits.device}), "
                             f"got {draft_prefill.dtype} on {draft_prefill.device}")
        # Tokens the draft has not seen yet: [second to last (if the draft skipped it), last].
        pending = torch.zeros(B, 2, dtype=torch.int64, device=device)
        pending_lengths = torch.ones(B, dtype=torch.int64, device=device)
    with timer("sampler"):
        last = request.sample(logits)
    _, done = outputs.write(rows, last[:, None], torch.ones_like(last), request.eos)
    num_drafts = None
    if lookup:
        context.scatter_(1, context_lengths[:, None], last[:, None])
        context_lengths += 1
        with timer("draft"):
            draft_ids, num_drafts = draft.propose(context, context_lengths, K)
    else:
        pending[:, 0] = last

    while True:
        # Prompt lookup proposes before the check, so that the verify width (1 + the most
        # drafts any row has) is known on the host without a second synchronization.
        if lookup:
            running, (target_longest, target_shortest, widest, fewest_drafts, total_drafts) = _rows_still_running(
                done, check, *_running_range(target_cache.lengths, done), *_running_range(num_drafts, done),
                num_drafts.masked_fill(done, 0).sum())
        else:
            running, (target_longest, target_shortest, draft_longest, draft_shortest, most_pending,
                      fewest_pending) = _rows_still_running(
                done, check, *_running_range(target_cache.lengths, done),
                *_running_range(draft_cache.lengths, done),
                *_running_range(pending_lengths, done))
        if not running:
            break
        if len(running) < len(rows):
            keep = torch.tensor(running, device=device)
            rows, last, target_cache = rows[keep], last[keep], target_cache.select(keep)
            if lookup:
                context, context_lengths = context[keep], context_lengths[keep]
                draft_ids, num_drafts = draft_ids[keep], num_drafts[keep]
            else:
                draft_cache, pending, pending_lengths = draft_cache.select(keep), pending[keep], pending_lengths[keep]
        b = len(rows)

        # 1. Draft K tokens (prompt lookup: already proposed, trimmed to the widest row).
        with timer("draft"):
            if lookup:  # (a graph verifies all K columns: one graph per batch size)
                draft_ids, draft_logits = draft_ids[:, :K if graphs else widest], None
            else:
                draft_start = draft_cache.lengths.clone()
                # Bounds on the draft's cache lengths after the pending tokens (plus i after step i).
                low, high = draft_shortest + fewest_pending, draft_longest + most_pending
                step_logits = draft_step(pending, draft_cache, pending_lengths, max_seqlen=high, min_seqlen=low)
                draft_logits = torch.empty(b, K, target.vocab_size, dtype=step_logits.dtype, device=device)
                draft_ids = torch.empty(b, K, dtype=torch.int64, device=device)
                for i in range(K):
                    draft_logits[:, i] = step_logits
                    draft_ids[:, i] = request.sample(step_logits)
                    if i + 1 < K:
                        step_logits = draft_step(draft_ids[:, i: i + 1], draft_cache, max_seqlen=high + i + 1,
                                                 min_seqlen=low + i + 1)
                num_drafts = torch.full((b,), K, dtype=torch.int64, device=device)
        stats.draft_forwards += 0 if lookup else K

        # 2. Verify: the target scores the last token and the drafts in one forward.
        with timer("target"):
            target_start = target_cache.lengths.clone()
            # Every row verifies 1 + K tokens unless prompt lookup left some rows with fewer.
            ragged = lookup and (widest > 0 or graphs)
            verify_ids = torch.cat([last[:, None], draft_ids], 1)
            # Ragged: b + total_drafts real tokens, known on the host (the model may skip padding).
            q_seqlens, num_tokens = (num_drafts + 1, b + total_drafts) if ragged else (None, None)
            fewest_verified = fewest_drafts + 1 if ragged else verify_ids.shape[1]
            target_logits = verify(verify_ids, target_cache, q_seqlens, num_tokens,
                                   max_seqlen=target_longest + verify_ids.shape[1],
                                   min_seqlen=target_shortest + fewest_verified)
        stats.target_forwards += 1

        # 3. Accept a prefix, emit one corrected or bonus token.
        with timer("sampler"):
            result = rejection_sample_logits(target_logits, draft_logits, draft_ids, num_drafts,
                                             **request.sampling, generator=request.generator, validate=False)
        accepted, emitted = result.num_accepted, result.token_ids
        last = emitted.gather(1, accepted[:, None])[:, 0]

        # 4. Roll caches back to what was accepted (lengths only) and record the output.
        target_cache.crop(target_start + accepted + 1)
        if lookup:
            _, done = outputs.write(rows, emitted, accepted + 1, request.eos)
            steps = torch.arange(emitted.shape[1], device=device)
            columns = torch.where(steps < accepted[:, None] + 1, context_lengths[:, None] + steps, context.shape[1] - 1)
            context.scatter_(1, columns, emitted.clamp(min=0))
            context_lengths += accepted + 1
        else:
            # The draft saw pending + drafts 1..K-1: keep pending + the accepted ones it saw.
            draft_cache.crop(draft_start + pending_lengths + accepted.clamp(max=K - 1))
            all_accepted = accepted == K
            pending = torch.stack([torch.where(all_accepted, draft_ids[:, -1], last), last], 1)
            pending_lengths = 1 + all_accepted.long()
            _, done = outputs.write(rows, emitted, accepted + 1, request.eos)
        stats.num_steps[rows] += 1
        stats.num_proposed[rows] += num_drafts
        stats.num_accepted[rows] += accepted
        if lookup:
            with timer("draft"):
                draft_ids, num_drafts = draft.propose(context, context_lengths, K)
    return _finish(request, input_ids, outputs, stats, timer, t_start, pad_token_id)
