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
see `RaggedAttentionPlan`). A fifth, ``return_hidden=True`` (return ``(logits, hidden states
[B, T, H])``, the last layer's before the final norm), is needed only for a drafter that reads
the target's features (`Drafter`, ``needs_target_hidden``), and a sixth, ``tree_mask=`` (a
[B, T, T] bool mask: the new tokens form a tree; the cache must then have ``compact``), only
for a drafter that proposes token trees (`DraftProposal.parents`).

Both loops are batched over ragged prompts and ragged acceptance. Inside a step nothing
reads a device value on the host except the one "which rows are done?" check, which
also drops finished rows from the batch so they stop costing compute. On CUDA the decoding
forwards are replayed as CUDA graphs (`specdec_kernels.cuda_graphs`): a shape (batch size and
verify width) runs eagerly the first time, is recorded the second (which synchronizes the device
once), and is replayed after that.

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
from ._draft_lengths import DraftLengths, known_costs
from ._model_calls import (
    _accepts,
    _check_model,
    _decoding_forward,
    _forward,
    _hidden_keyword,
    _last_logits,
    _LogitsCheck,
    _new_cache,
    _use_cuda_graphs,
    allocating,
    as_protocol_model,
)
from ._sampling_checks import check_sampling_params
from .drafts import Drafter, DraftProposal, ModelDraft, PromptLookupDraft, _checked_proposal
from .sampling import rejection_sample_logits, sample_logits
from .tree_sampling import tree_rejection_sample

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
        draft_lengths: [B, K + 1] int64, how many steps row b verified a length of k = 0 .. K
            drafts: the length chosen (by adaptive speculation, else K) cut to what the drafter
            offered and, for a chain, to the tokens the row's budget has left (a tree is
            verified whole while one draft can be kept) (`speculative_generate`; [B, 1] for
            `generate`).
        target_forwards: batched target forward calls, the prefill included.
        draft_calls: proposals asked of the drafter.
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
    draft_lengths: torch.Tensor
    target_forwards: int = 0
    draft_calls: int = 0
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
    def mean_draft_length(self) -> float:
        """Draft tokens asked for per decoding step, over the whole batch (nan without steps)."""
        steps = int(self.draft_lengths.sum())
        lengths = torch.arange(self.draft_lengths.shape[1])
        return float((self.draft_lengths * lengths).sum()) / steps if steps else float("nan")

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
        self.latest: dict[str, float] = {}
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
            self.latest[phase] = time.perf_counter() - t0
            self.host[phase] = self.host.get(phase, 0.0) + self.latest[phase]

    def last(self, phase: str) -> float:
        """Seconds of the phase's latest run (0 if none). On CUDA its events must have completed:
        read after a host synchronization that followed them (the loop's transfer)."""
        if self.cuda:
            runs = self.events.get(phase)
            return runs[-1][0].elapsed_time(runs[-1][1]) / 1e3 if runs else 0.0
        return self.latest.get(phase, 0.0)

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


class _Stream:
    """Hands each step's accepted tokens to a streamer: an object with ``put(token_ids)`` and
    ``end()``. The tokens of a step are read in the next step's one transfer (so streaming adds
    no synchronization) and put in input row order: with one row as a [1, n] int64 tensor (what
    transformers' ``TextStreamer`` and ``TextIteratorStreamer`` take), with B > 1 as a list of B
    int64 tensors [n_b], empty for rows that gained nothing. The prompt is not put (transformers'
    ``generate`` puts it first: a ``TextStreamer(skip_prompt=True)`` would skip the first tokens)."""

    def __init__(self, streamer, batch_size: int) -> None:
        if streamer is not None and not (callable(getattr(streamer, "put", None))
                                         and callable(getattr(streamer, "end", None))):
            raise TypeError(f"streamer must have put(token_ids) and end() methods, got {type(streamer).__name__}")
        self.streamer, self.batch_size = streamer, batch_size
        self.rows: list[int] = []
        self.tokens = torch.empty(0, dtype=torch.int64)

    def add(self, rows: list[int], kept: torch.Tensor, new: torch.Tensor) -> None:
        """The step's ``new`` [b, T] tokens of the batch's input ``rows``, where ``kept``."""
        if self.streamer is not None:
            self.rows, self.tokens = rows, torch.where(kept, new, -1)

    def values(self) -> tuple[torch.Tensor, ...]:
        """What the next transfer reads for the streamer."""
        return (self.tokens,) if self.streamer is not None else ()

    def put(self, read: list[list[int]] | None = None) -> None:
        """Put the tokens of the last `add`, as read in the transfer (a list per row)."""
        if self.streamer is None or not self.rows:
            return
        new = {row: [t for t in read[i] if t >= 0] for i, row in enumerate(self.rows)}
        self.rows = []
        if self.batch_size == 1:
            if new[0]:
                self.streamer.put(torch.tensor([new[0]], dtype=torch.int64))
        else:
            self.streamer.put([torch.tensor(new.get(row, []), dtype=torch.int64) for row in range(self.batch_size)])

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        if self.streamer is not None:
            self.streamer.end()


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
    if stats.draft_lengths.shape[1] == 1:  # plain generation: every step drafts nothing
        stats.draft_lengths[:, 0] = stats.num_steps
    stats.num_proposed, stats.num_accepted = stats.num_proposed.cpu(), stats.num_accepted.cpu()
    stats.time_total_s = time.perf_counter() - t_start
    return GenerationOutput(tokens, torch.cat([input_ids.long(), tokens], 1), stats)


def _new_stats(batch_size: int, device, max_drafts: int) -> GenerationStats:
    zeros = lambda: torch.zeros(batch_size, dtype=torch.int64, device=device)
    lengths = torch.zeros(batch_size, max_drafts + 1, dtype=torch.int64)
    return GenerationStats(zeros(), zeros(), zeros(), zeros(), lengths)


def _rows_still_running(done: torch.Tensor, check: _LogitsCheck, *values: torch.Tensor
                        ) -> tuple[list[int], list]:
    """The loop's one host synchronization per step: which batch positions are still running,
    and ``values`` read in the same transfer (0-d tensors become ints: cache lengths, bounds for
    the next forward; 1-d ones lists: per-row counts; 2-d ones lists of rows: tokens written,
    proposals), with the check's flags (raising if a model returned logits no token can come
    from)."""
    flat = torch.cat([done.long(), check.failed.long(), *(v.reshape(-1).long() for v in values)]).tolist()
    B, M = done.shape[0], len(check.names)
    check.raise_if_failed(flat[B: B + M])
    read, at = [], B + M
    for v in values:
        part = flat[at] if v.dim() == 0 else flat[at: at + v.numel()]
        if v.dim() == 2:
            part = [part[i * v.shape[1]: (i + 1) * v.shape[1]] for i in range(v.shape[0])]
        read.append(part)
        at += v.numel()
    return [i for i, d in enumerate(flat[:B]) if not d], read


def _keep_running(running: list[int], rows: torch.Tensor, host_rows: list[int], cache, *state: torch.Tensor
                  ) -> tuple:
    """The loop's batch positions still ``running`` (host ints, ascending): ``(keep, rows,
    host_rows, cache, *state)`` with each selected (``keep``: the positions as a tensor on the
    rows' device, for whatever else the caller selects)."""
    keep = _host_list_to(running, rows.device)
    return keep, rows[keep], [host_rows[i] for i in running], cache.select(keep), *(t[keep] for t in state)


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
             max_cache_len: int | None = None, cuda_graphs: bool | None = None, streamer=None) -> GenerationOutput:
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
        cuda_graphs: replay each decoding step as a CUDA graph (`GraphedForward`; recorded at
            a batch size's second step, attention then reads the whole cache capacity). None (default):
            on CUDA with the built-in `Llama` and transformers models (`HFCausalLM.capturable`);
            True: also for other models whose cache is a `KVCache` (their forward must not
            synchronize); False: never.
        streamer: an object with ``put(token_ids)`` and ``end()``, given the tokens as they are
            generated, a step late (one row: [1, n] tensors, so transformers' ``TextStreamer`` works
            unchanged; B > 1: a list of B tensors [n_b]); ``end()`` once at the end.

    Returns:
        `GenerationOutput` with ``tokens`` [B, max_new_tokens] and ``stats``.

    Example::

        out = generate(model, input_ids, max_new_tokens=32, temperature=0,
                       streamer=transformers.TextStreamer(tokenizer))
    """
    t_start = time.perf_counter()
    model = as_protocol_model(model)
    request = _prepare(model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p,
                       eos_token_id, pad_token_id, seed, max_cache_len, lookahead=0)
    device, B = input_ids.device, input_ids.shape[0]
    graphs = _use_cuda_graphs(cuda_graphs, (model,), device)
    timer, stats, outputs = _PhaseTimer(device), _new_stats(B, device, 0), _Outputs(B, request.max_new_tokens, device)
    stream = _Stream(streamer, B)
    rows, host_rows = torch.arange(B, device=device), list(range(B))  # input row of each batch position
    cache = _new_cache(model, "model", B, request.max_len, device)
    check = _LogitsCheck(device, ("model",))
    step = check.checked("model", model.vocab_size, _decoding_forward(model, cache, "model", graphs, last_only=True))
    with timer("prefill"):
        logits = _last_logits(model, request.prompt, cache, request.prompt_lengths, request.prompt_tokens,
                              max_seqlen=request.prompt.shape[1])
        logits = check("model", model.vocab_size, logits)
    stats.target_forwards += 1
    with stream:  # ends the streamer however the loop ends
        while True:
            with timer("sampler"):
                token = request.sample(logits)
            kept, done = outputs.write(rows, token[:, None], torch.ones_like(token), request.eos)
            stream.add(host_rows, kept, token[:, None])
            running, (longest, shortest, *streamed) = _rows_still_running(
                done, check, *_running_range(cache.lengths, done), *stream.values())
            stream.put(*streamed)
            if not running:
                break
            if len(running) < len(rows):
                _, rows, host_rows, cache, token = _keep_running(running, rows, host_rows, cache, token)
            stats.num_steps[rows] += 1
            with timer("target"):
                logits = step(token[:, None], cache, max_seqlen=longest + 1, min_seqlen=shortest + 1)
            stats.target_forwards += 1
    return _finish(request, input_ids, outputs, stats, timer, t_start, pad_token_id)


# --------------------------------------------------------------------------- speculative generation

@torch.inference_mode()
def speculative_generate(target, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         *, num_draft_tokens: int = 4, adaptive: bool = True, max_new_tokens: int,
                         temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                         eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                         seed: int | None = None, max_cache_len: int | None = None,
                         cuda_graphs: bool | None = None, streamer=None) -> GenerationOutput:
    """Lossless speculative decoding, batched over ragged prompts and ragged acceptance.

    Each step the drafter proposes up to ``num_draft_tokens`` (K) tokens per row, the target
    scores them and the row's last token in one forward, and `rejection_sample_logits` keeps the
    longest prefix that sampling the target alone would have produced, plus one corrected or
    bonus token. A drafter may propose a token tree instead (`DraftProposal.parents`): the
    target scores every node in the same one forward and `tree_rejection_sample` keeps the
    longest path it accepts. Rows finish independently; finished rows leave the batch. Whatever
    is drafted, greedy output equals `generate`'s and sampled output follows the target's
    distribution.

    Args:
        target: the model whose distribution is reproduced exactly.
        draft: a `Drafter` (`PromptLookupDraft`, `ModelDraft`, your own), a model following the
            protocol and sharing the target's vocabulary (wrapped in `ModelDraft`), or
            ``"prompt_lookup"``.
        num_draft_tokens: K >= 1, the most tokens a row drafts per step (at most
            ``max_new_tokens - 1`` are: drafts past the budget could never be kept).
        adaptive: choose each row's draft length (0 .. K) every step from the acceptance and the
            draft and verify costs measured while generating (`specdec_kernels._draft_lengths`); a step
            where no draft pays for its verification decodes plainly. The verify costs carry
            over to the next call on the same ``target`` object run alike (batch size, device,
            CUDA graphs, greedy or sampled, the drafter's class), and the drafting costs to the
            next such call given the same ``draft`` object, else from the last drafter of its
            class (a new object, or a draft given by name), so that call's first steps are
            already priced; acceptance carries over only as the prior a row's first-draft rate
            starts from. False: K every step, nothing carried.
        seed: as in `generate`, with one limit: the same seed repeats sampled tokens only with the
            same draft lengths, so use ``adaptive=False`` for runs repeatable token for token
            (adaptive lengths follow the timings of this run and of earlier ones; every run follows the target's
            distribution exactly, and greedy tokens never depend on the lengths).
        other arguments: as in `generate`; the cache capacity also needs room for one step's K
            drafts (default and least: longest prompt + max_new_tokens - 1 + K). With CUDA
            graphs one graph is recorded per batch size and verify width used twice (none for a
            drafter that needs the target's hidden states: the target's forward must take
            ``return_hidden``).

    Returns:
        `GenerationOutput`; ``stats`` has acceptance counts, the draft lengths chosen, forward
        counts and phase times.

    Example::

        out = speculative_generate(model, PromptLookupDraft(), input_ids, max_new_tokens=64, temperature=0)
        print(out.stats.acceptance_rate, out.stats.mean_draft_length)
    """
    _check_speculation_options(num_draft_tokens, adaptive)
    given, target = target, as_protocol_model(target)
    _check_model(target, "target")
    drafter = _as_drafter(draft, target, cuda_graphs)
    t_start = time.perf_counter()
    request = _prepare(target, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p,
                       eos_token_id, pad_token_id, seed, max_cache_len, lookahead=int(num_draft_tokens))
    # Drafts past the token budget could never be kept: at most max_new_tokens - 1 per step (K = 1
    # when that is 0: the prefill's token is then the only one, and no step runs).
    K, V = max(1, request.drafts), target.vocab_size
    device, B = input_ids.device, input_ids.shape[0]
    timer, stats, outputs = _PhaseTimer(device), _new_stats(B, device, K), _Outputs(B, request.max_new_tokens, device)
    hidden = getattr(drafter, "needs_target_hidden", False) is True  # the target's features, for the drafter
    graphs = _use_cuda_graphs(cuda_graphs, (target,), device) and not hidden
    # Earlier calls' costs, for calls run alike: the verify costs on the target (the sampler's
    # work and the drafter's proposals, trees, draft logits, scoring, are in them too), the
    # drafting costs on the draft as given (a model given as the draft is wrapped anew each call).
    way = (B, str(device), graphs, temperature == 0, type(drafter).__qualname__)
    known = known_costs(given, way) if adaptive else None
    drafting = known_costs(draft, ("drafting", *way)) if adaptive else None
    stream, lengths = _Stream(streamer, B), DraftLengths(K, request.max_new_tokens, B, adaptive, known, drafting)
    rows, host_rows = torch.arange(B, device=device), list(range(B))
    cache = _new_cache(target, "target", B, request.max_len, device)
    check = _LogitsCheck(device, ("target model", "draft model", "drafter"))
    verify = _verifier(target, cache, check, graphs, hidden)
    sample_draft = lambda logits: request.sample(check("draft model", V, logits))

    with timer("prefill"):
        out = _last_logits(target, request.prompt, cache, request.prompt_lengths, request.prompt_tokens,
                           max_seqlen=request.prompt.shape[1], return_hidden=hidden)
        logits, states = out if hidden else (out, None)
        check("target model", V, logits)
    stats.target_forwards += 1
    with timer("draft prefill"):
        shared = {"target_cache": cache} if getattr(drafter, "needs_target_cache", False) is True else {}
        if hidden:  # the prompt's features; the first commit carries the last prompt position's
            if states.shape[:2] != request.prompt.shape:
                raise ValueError(f"{type(target).__name__}.forward(return_hidden=True, last_only=True) returned hidden "
                                 f"states {list(states.shape)}: a drafter reading the target's features needs every "
                                 f"prompt position's, [B, P, H] = {[*request.prompt.shape, 'H']}")
            shared["hidden_states"] = states
            states = states.gather(1, (request.prompt_lengths - 1).view(-1, 1, 1).expand(-1, 1, states.shape[-1]))
        drafter.prefill(request.prompt, request.prompt_lengths, request.max_len, **shared)
    with timer("sampler"):
        token = request.sample(logits)
    new, accepted, width = token[:, None], torch.zeros_like(rows), lengths.plan(host_rows, {})
    committed_bound = request.prompt.shape[1] + 1  # host bound on every row's committed tokens
    with stream:  # ends the streamer however the loop ends
        while True:
            kept, done = outputs.write(rows, new, accepted + 1, request.eos)
            stream.add(host_rows, kept, new)
            _commit(drafter, new, accepted + 1, states, committed_bound)
            if width == 0:  # a plain decoding step
                drafts = DraftProposal(token.new_zeros(len(host_rows), 0), torch.zeros_like(rows))
            else:
                stats.draft_calls += 1
                with timer("draft"):
                    drafts = _propose(drafter, len(host_rows), width, sample_draft, logits, check)
                lengths.trees = drafts.parents is not None  # near the budget a tree is verified whole
            scored = lengths.scores(drafts.logits is None and drafts.parents is None)
            texts = stream.values() or ((torch.where(kept, new, -1),) if scored else ())
            proposed = (drafts.token_ids,) if scored and width else ()
            # The one transfer: finished rows, bounds for the verify forward, this step's drafts and
            # the last step's acceptance (for the draft lengths), the tokens written (the streamer's,
            # and the text scored proposals are compared with).
            running, (longest, shortest, offered, accepted_list, generated, *read) = _rows_still_running(
                done, check, *_running_range(cache.lengths, done), drafts.num_tokens, accepted,
                outputs.counts[rows], *texts, *proposed)
            text, proposal = (read + [None, None])[:2]
            stream.put(text)
            scoring = (text, proposal and [ids[:n] for ids, n in zip(proposal, offered, strict=True)]) if scored else ()
            lengths.observe(host_rows, accepted_list, timer.last("verify"), timer.last("draft"), *scoring)
            if not running:
                break
            offered, generated = [offered[i] for i in running], [generated[i] for i in running]
            if len(running) < len(rows):
                keep, rows, host_rows, cache, token = _keep_running(running, rows, host_rows, cache, token)
                drafts = _select_rows(drafts, keep)
                drafter.select(keep)
            b = len(rows)
            drafted = lengths.choose(host_rows, offered, generated)
            widest, fewest, total = max(drafted), min(drafted), sum(drafted)
            if drafted != offered:  # rows cut to their chosen lengths (a tree keeps its first nodes)
                drafts = DraftProposal(drafts.token_ids, _host_list_to(drafted, device), drafts.logits, drafts.parents)
            lengths.verifying(host_rows, dict(zip(host_rows, drafted, strict=True)), b + total)

            # Verify: the target scores the last token and the drafts in one forward, and the sampler
            # keeps the longest prefix the target agrees with, plus one token of its own.
            with timer("verify"):
                with timer("target"):
                    start = cache.lengths.clone()
                    ragged = fewest < widest  # rows with fewer drafts: the model may skip their padding
                    out = verify(torch.cat([token[:, None], drafts.token_ids[:, :widest]], 1), cache, drafts, widest,
                                 ragged, b + total, max_seqlen=longest + widest + 1, min_seqlen=shortest + fewest + 1)
                    target_logits, states = out if hidden else (out, None)
                stats.target_forwards += 1
                with timer("sampler"):
                    # The drafts each row's budget keeps: a tree's accepted path stops there.
                    room = None if drafts.parents is None else request.max_new_tokens - 1 - outputs.counts[rows]
                    new, accepted, token, kept = _accept(request, target_logits, drafts, widest, room)
            states = _keep_accepted(cache, start, accepted, kept, states)
            committed_bound = longest + widest + 2  # the cache's tokens after the verify, and this step's token
            stats.num_steps[rows] += 1
            stats.num_proposed[rows] += drafts.num_tokens
            stats.num_accepted[rows] += accepted
            width = lengths.plan(host_rows, dict(zip(host_rows, generated, strict=True)))
    stats.draft_lengths = torch.tensor(lengths.counts, dtype=torch.int64)
    return _finish(request, input_ids, outputs, stats, timer, t_start, pad_token_id)


def _commit(drafter: Drafter, token_ids: torch.Tensor, num_tokens: torch.Tensor, hidden_states: torch.Tensor | None,
            committed_bound: int) -> None:
    """``drafter.commit``, with the keywords its class asks for (`Drafter`)."""
    extras = {}
    if getattr(drafter, "needs_target_hidden", False) is True:
        extras["hidden_states"] = hidden_states
    if getattr(drafter, "needs_committed_bound", False) is True:
        extras["committed_bound"] = committed_bound
    drafter.commit(token_ids, num_tokens, **extras)


def _propose(drafter: Drafter, rows: int, width: int, sample: Callable[[torch.Tensor], torch.Tensor],
             logits_like: torch.Tensor, check: _LogitsCheck) -> DraftProposal:
    """The drafter's proposal of up to ``width`` tokens for each of its ``rows``, checked,
    ``num_tokens`` always given."""
    return DraftProposal(*_checked_proposal(drafter, drafter.propose(width, sample), rows, width, logits_like, check))


def _select_rows(drafts: DraftProposal, rows: torch.Tensor) -> DraftProposal:
    """The proposal's batch positions ``rows``."""
    return DraftProposal(*(None if t is None else t[rows] for t in
                           (drafts.token_ids, drafts.num_tokens, drafts.logits, drafts.parents)))


def _keep_accepted(cache, start: torch.Tensor, accepted: torch.Tensor, kept: torch.Tensor | None,
                   states: torch.Tensor | None) -> torch.Tensor | None:
    """Keep the verify input's last committed token and accepted drafts in the target's cache:
    a chain's prefix (a crop), or a tree's path ``kept`` (moved behind ``start``, the lengths
    before the verify); returns the hidden states at the kept positions (or None)."""
    if kept is None:
        cache.crop(start + accepted + 1)
        return states
    cache.compact(kept, accepted + 1, start=start)
    return None if states is None else states.gather(1, kept[..., None].expand(*kept.shape, states.shape[-1]))


def _ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[b, K+1, K+1] bool: the verify input's token 0 (the row's last committed token) and draft
    i (input i + 1, child of input ``parents[:, i] + 1``) each see themselves and their ancestors."""
    b, K = parents.shape
    mask = torch.eye(K + 1, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)
    rows = torch.arange(b, device=parents.device)
    for i in range(K):  # parents come first: their rows are complete
        mask[:, i + 1] |= mask[rows, parents[:, i] + 1]
    return mask


def _verifier(target, cache, check: _LogitsCheck, graphs: bool, hidden: bool) -> Callable:
    """The loop's verify forward: ``fn(ids [b, widest + 1], cache, drafts, widest, ragged,
    num_tokens, *, max_seqlen, min_seqlen)`` -> the target's logits (and hidden states with
    ``hidden``), checked. A chain goes through `_decoding_forward` (CUDA graphs where asked, on
    ``cache``, which `KVCache.select` keeps); a token tree (``drafts.parents``) runs eagerly with
    its ancestor mask: no graph records a tree."""
    V = target.vocab_size
    chain = check.checked("target model", V, _decoding_forward(target, cache, "target", graphs, last_only=False,
                                                                  return_hidden=hidden))
    tree = check.checked("target model", V, lambda ids, cache, q_seqlens, num_tokens, **kwargs: _forward(
        target, ids, cache, q_seqlens, num_tokens, **kwargs, **_hidden_keyword(target, hidden)))

    def verify(ids, cache, drafts: DraftProposal, widest: int, ragged: bool, num_tokens: int, *, max_seqlen: int,
               min_seqlen: int):
        q_seqlens, num_tokens = (drafts.num_tokens + 1, num_tokens) if ragged else (None, None)
        if drafts.parents is None or widest == 0:
            return chain(ids, cache, q_seqlens, num_tokens, max_seqlen=max_seqlen, min_seqlen=min_seqlen)
        if not _accepts(target, "tree_mask"):
            raise TypeError(f"the drafter proposed a token tree (DraftProposal.parents), but "
                            f"{type(target).__name__}.forward takes no tree_mask keyword (the built-in Llama and "
                            "HFCausalLM do)")
        return tree(ids, cache, q_seqlens, num_tokens, max_seqlen=max_seqlen, min_seqlen=min_seqlen,
                    tree_mask=_ancestor_mask(drafts.parents[:, :widest]))

    return verify


def _check_speculation_options(num_draft_tokens: int, adaptive: bool) -> None:
    if not is_int(num_draft_tokens) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    if not isinstance(adaptive, bool):
        raise TypeError(f"adaptive must be True or False, got {adaptive!r}")


def _accept(request: _Request, target_logits: torch.Tensor, drafts: DraftProposal, widest: int,
            room: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A verified step's new tokens [b, widest + 1] (each row's accepted drafts, then the target's
    own token), the drafts each row accepted [b], its last token [b] and, for a tree, the verify
    input's positions to keep [b, widest + 1] (token 0, then the accepted path's nodes):
    `rejection_sample_logits` over a chain, `tree_rejection_sample` over a tree (``parents``), or
    a plain sample from the target where no row drafted. A tree's path stops after ``room`` [b]
    drafts, the most its row's budget keeps (chains are cut to that before they are verified):
    the token after them, an accepted draft or the target's, is the target's sample there."""
    if widest == 0:
        token = request.sample(target_logits[:, 0])
        return token[:, None], torch.zeros_like(token), token, None
    draft_ids, num_drafts = drafts.token_ids[:, :widest], drafts.num_tokens
    draft_logits = None if drafts.logits is None else drafts.logits[:, :widest]
    if drafts.parents is not None:
        result = tree_rejection_sample(target_logits, draft_logits, draft_ids, drafts.parents[:, :widest], num_drafts,
                                       **request.sampling, generator=request.generator, validate=False)
        new, accepted = result.token_ids.clamp(min=0), torch.minimum(result.num_accepted, room)
        kept = torch.cat([torch.zeros_like(accepted)[:, None], result.path + 1], 1)
        return new, accepted, new.gather(1, accepted[:, None])[:, 0], kept
    result = rejection_sample_logits(target_logits, draft_logits, draft_ids, num_drafts, **request.sampling,
                                     generator=request.generator, validate=False)
    new, accepted = result.token_ids.clamp(min=0), result.num_accepted
    return new, accepted, new.gather(1, accepted[:, None])[:, 0], None


def _host_list_to(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` without waiting for the device: on CUDA copied
    asynchronously from pinned memory (the driver may synchronize a copy from pageable memory)."""
    values = torch.tensor(values, dtype=torch.int64)
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values.to(device)


def _as_drafter(draft, target, cuda_graphs: bool | None) -> Drafter:
    """``draft`` as a `Drafter`: drafters as they are, ``"prompt_lookup"`` as a `PromptLookupDraft`,
    models as a `ModelDraft` (whose vocabulary may differ from the target's by padding only)."""
    if isinstance(draft, str):
        if draft != "prompt_lookup":
            raise ValueError(f"draft must be a Drafter, a model or \"prompt_lookup\", got {draft!r}")
        return PromptLookupDraft()
    if isinstance(draft, Drafter):
        return draft
    if hasattr(draft, "propose") and not hasattr(draft, "vocab_size"):
        missing = [m for m in ("prefill", "propose", "commit", "select") if not callable(getattr(draft, m, None))]
        raise TypeError(f"draft {type(draft).__name__} looks like a Drafter but has no {', '.join(missing)} "
                        "method(s): a Drafter has prefill, propose, commit and select")
    return ModelDraft(draft, cuda_graphs=cuda_graphs, vocab_size=target.vocab_size)
