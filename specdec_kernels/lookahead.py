"""Lookahead decoding: Jacobi trajectories feed an n-gram pool, the pool's n-grams are verified.

Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding") needs no draft model. Each lookahead step runs one batched forward whose
rows each hold three parts, under one ``tree_mask``:

- the row's last committed token;
- the *lookahead branch*: a window of W columns and N - 1 levels of guesses (level 0 oldest).
  Column i's tokens form a trajectory: level 0's tokens are a chain after the last token, and the
  token at level l >= 1 of column i sees level 0 up to column i, then levels 1 .. l - 1 of
  column i. The argmax after the last level's tokens becomes the new last level (the levels
  shift up, the oldest is dropped), and each column with that argmax is an n-gram of N tokens;
- the *verification branch*: up to G (N - 1)-grams from the row's pool that follow its last
  token, merged into a token tree after it (shared prefixes once, `candidate_tree`) and
  verified by `tree_rejection_sample` (greedily, or losslessly with temperature > 0: the
  candidates are deterministic proposals).

The accepted candidate's K/V are kept with `KVCache.compact`; the lookahead branch's are dropped.
Where the pools already know the text, a *verify step* (the last token and the candidates, no
lookahead branch) gains as much for fewer tokens: the adaptive switch (`LookaheadSwitch`)
chooses each step's kind from the costs and gains it measures.
The pools also take the prompt's n-grams and those of the text as it is generated, so text that
repeats its prompt is found as prompt lookup finds it.

The pools live on the host: each step's one transfer reads the committed tokens of every row
and, after a lookahead step, its W new n-grams, and the candidates go back in one copy (no
host sync per row). A pool keeps at most ``pool_size`` first tokens per row, each with its
``guesses`` most recent continuations of N - 1 tokens: at most ``pool_size * (1 + guesses *
(N - 1))`` token ids per row (with the defaults 4096 * 9, held as Python tuples of ints: a few
MB per row at most).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch

from ._checks import is_int
from ._draft_lengths import COST_DECAY, DECAY, known_costs
from ._model_calls import (
    _accepts,
    _decoding_forward,
    _forward,
    _last_logits,
    _LogitsCheck,
    _new_cache,
    _use_cuda_graphs,
    as_protocol_model,
)
from .cuda_graphs import GraphedForward
from .generation import (
    GenerationOutput,
    _finish,
    _host_list_to,
    _keep_running,
    _new_stats,
    _Outputs,
    _PhaseTimer,
    _prepare,
    _rows_still_running,
    _running_range,
    _Stream,
)
from .tree_sampling import tree_rejection_sample


class NgramPool:
    """One row's n-grams: for each first token, its most recent continuations of N - 1 tokens.

    Holds at most ``max_keys`` first tokens (the least recently extended is dropped) with at most
    ``per_key`` continuations each (the oldest is dropped; adding one again makes it the newest).

    Example::

        pool = NgramPool(n=3, per_key=2, max_keys=100)
        pool.add_text([5, 6, 7, 5, 6, 8])
        pool.continuations(5)   # [(6, 8), (6, 7)]
    """

    def __init__(self, n: int, per_key: int, max_keys: int) -> None:
        self.n, self.per_key, self.max_keys = n, per_key, max_keys
        self._pool: collections.OrderedDict[int, list[tuple[int, ...]]] = collections.OrderedDict()

    def add(self, ngram: tuple[int, ...]) -> None:
        """One n-gram of N tokens."""
        key, rest = ngram[0], ngram[1:]
        conts = self._pool.pop(key, [])
        if rest in conts:
            conts.remove(rest)
        conts.insert(0, rest)
        del conts[self.per_key:]
        self._pool[key] = conts
        if len(self._pool) > self.max_keys:
            self._pool.popitem(last=False)

    def add_text(self, tokens: list[int], new: int | None = None) -> None:
        """The n-grams of ``tokens`` (a row's text) that end in its last ``new`` tokens (None: all)."""
        first = 0 if new is None else max(0, len(tokens) - new - self.n + 1)
        for start in range(first, len(tokens) - self.n + 1):
            self.add(tuple(tokens[start: start + self.n]))

    def continuations(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of ``key``, newest first."""
        return self._pool.get(key, [])


#: A probe (a wider step the estimates advise against) may add at most this share to the time
#: of the steps since the last step of its kind, priced as plain ones.
PROBE_SHARE = 1 / 50
#: The candidates' gain (verify steps and the shadow of plain steps) starts as this many
#: (forgotten) samples of 0, so that the first few lucky matches do not start wider steps on
#: text that rarely repeats.
GAIN_PRIOR_SAMPLES = 4
#: A wider step must promise this many times a plain step's worth per second: near a tie the
#: estimates' noise would make the choice a coin toss that costs more than it gains.
MARGIN = 1.05
#: The kinds of step `LookaheadSwitch.choose` returns: one token per row; the last token and the
#: pool's candidates; the last token, the lookahead branch and the candidates.
PLAIN, VERIFY, LOOKAHEAD = "plain", "verify", "lookahead"


class LookaheadSwitch:
    """Each step, a plain step (one token per row), a verify step (the rows' candidates, no
    lookahead branch) or a lookahead step, from what the run measured.

    - **Gain**: the tokens a row with candidates gains beyond the one every step gives (forgotten
      by `DECAY`), kept apart for the candidates alone and for lookahead steps (from one sample
      of 0 on). The candidates' gain is measured by verify steps and in the shadow of plain
      steps: the candidates a row had at a plain step are compared, once it has committed as
      many tokens more, with what it committed; their longest common prefix is what verifying
      them would have accepted greedily (and, sampling, a first candidate token is accepted as
      often as it is sampled). So the switch learns whether the pools know the text without
      paying for wider steps to find out (from `GAIN_PRIOR_SAMPLES` samples of 0 on, so that a
      few lucky matches start nothing). A lookahead step verifies the same candidates and its
      window feeds the pools: its expected gain is the larger of the two.
    - **The batch's gain**: a batch runs until its last row is done, so what a step gains the
      batch as a whole is how far its least advanced row (of tokens committed since the first
      step) moves beyond one token: ``min(progress + gained) - min(progress)`` over the rows.
      It is measured alike (verify steps, lookahead steps, the shadow of plain steps) on the
      steps where every least advanced row has candidates, and counted as 0 on the others: a
      gain of some rows only lets them leave the batch early.
    - **Cost**: the seconds of a plain step, and of each token a verify or a lookahead step adds
      to it, per kind (forgotten by `COST_DECAY`; the first step of each kind in a call without
      carried costs, which may pay one-time costs, is not counted). Until a kind is timed, its
      tokens are priced as the other wide kind's, or before either is timed at the prefill's
      seconds per token beyond a plain step's. The costs belong to the model and the way it
      runs, not to the text: with ``known`` (`known_costs` of the model, per batch size and way
      of running) a call starts from those earlier calls measured and keeps them current, so
      only a process's first call prices its first wide step by a prior (at batch 8 on a CPU
      the prefill's token costs a third of a wide step's).
    - **Choice**: plain steps until one is timed; then, when a row has candidates, the wider
      kind with the more plain steps' worth per second, ``(1 + value / plain) / seconds``, if it
      promises `MARGIN` times a plain step's, else a plain step. ``value``, the seconds of plain
      steps a step saves: ``row * r * gain + (plain - B * row) * batch``, with ``r`` of the B
      running rows having candidates, ``row`` a row's share of a plain step (priced as a token
      more in a wider step: a row that gains leaves the batch that much earlier) and ``batch``
      the batch's gain. For one row this is ``plain * gain``. A step of the other kinds is a
      probe, to measure what the estimates may have wrong, once the steps since the last one of
      its kind took 1 / `PROBE_SHARE` times the extra seconds it is expected to cost: a lookahead
      step (whose window may find what the candidates miss) in place of a verify or plain step,
      a verify step in place of a plain one where the candidates' gain would pay at no cost.
      A probe's timed cost weighs as much as all the samples of its kind before it, so that one
      probe corrects an estimate gone stale (carried from calls timed under another load).

    ``adaptive=False``: always lookahead (nothing carried). Host arithmetic on the numbers and
    tokens the loop's transfer brings: no synchronization.
    """

    def __init__(self, adaptive: bool, ngram: int, known: dict | None = None) -> None:
        self.adaptive, self.length = adaptive, ngram - 1
        self.plain = [0.0, 0.0]          # forgotten sums: plain step seconds, samples
        # Forgotten sums per wider kind: a step's seconds per token it adds to a plain step, samples.
        self.per_token = {VERIFY: [0.0, 0.0], LOOKAHEAD: [0.0, 0.0]}
        self.known = known if adaptive else None  # the costs earlier calls run alike measured, kept current
        self.carried = bool(self.known)
        if self.carried:
            self.plain = list(self.known["plain"])
            self.per_token = {kind: list(sums) for kind, sums in self.known["per_token"].items()}
        self.prefill_per_token = 0.0     # the prior of per_token
        self.prefill: tuple[float, int, int] | None = None  # seconds, tokens, rows
        self.seen = {PLAIN: 0, VERIFY: 0, LOOKAHEAD: 0}
        # Forgotten sums (tokens gained beyond one, rows with candidates): the candidates' (verify
        # steps and the shadow of plain steps) and lookahead steps'.
        self.gain = {VERIFY: [0.0, float(GAIN_PRIOR_SAMPLES)], LOOKAHEAD: [0.0, 1.0]}
        # The same for the batch's gain (tokens its least advanced row gained beyond one, steps).
        self.batch_gain = {VERIFY: [0.0, float(GAIN_PRIOR_SAMPLES)], LOOKAHEAD: [0.0, 1.0]}
        # Plain steps' shadow candidates: per step, each row's (text length, progress, candidates).
        self.pending: list[dict[int, tuple[int, int, list[tuple[int, ...]]]]] = []
        self.first_length: dict[int, int] = {}  # row -> its text's length at its first choice
        # kind, rows with candidates, their progress, whether the batch's gain is measured, tokens,
        # rows, whether it is a probe
        self.step: tuple[str, list[bool], list[int], bool, int, int, bool] | None = None
        self.since = {VERIFY: 0, LOOKAHEAD: 0}  # steps since the last step of each wider kind
        self.slow_calls = GraphedForward.slow_calls  # graphed forwards that did not replay, so far

    def prefilled(self, seconds: float, tokens: int, rows: int) -> None:
        """The prefill's seconds over ``tokens`` prompt tokens in ``rows`` rows: the price of a
        wider step's tokens until one of its kind is timed (once a plain step is)."""
        self.prefill = (seconds, tokens, rows)

    def observe(self, seconds: float, gained: list[int], running=None) -> None:
        """The last step's seconds (target forward and sampling) and each of its rows' tokens
        beyond one (in the step's row order); ``running``: the indices, in that order, of the rows
        still running after it (None: all), the rows that bound the batch from now on. A plain
        step that ran its CUDA-graph shape eagerly or recorded it (`GraphedForward`) did one-time
        work: its seconds are left out."""
        slow_calls, self.slow_calls = self.slow_calls, GraphedForward.slow_calls
        if self.step is None:
            return
        (kind, had, progress, least_have, tokens, rows, probe), self.step = self.step, None
        self.seen[kind] += 1
        # The first step of each kind may pay one-time costs: left out, unless the costs are
        # carried (earlier calls paid them), where it may be the probe that corrects them.
        if (self.seen[kind] > 1 or self.carried) and slow_calls == self.slow_calls:
            if kind == PLAIN:
                self.plain[0], self.plain[1] = COST_DECAY * self.plain[0] + seconds, COST_DECAY * self.plain[1] + 1
                if self.prefill is not None:  # the call's first timed plain step gives the prior
                    (t, n, b), self.prefill = self.prefill, None
                    self.prefill_per_token = max(0.0, t - seconds) / max(n - b, 1)
            elif self.plain[1] and tokens > rows:
                extra = max(0.0, seconds - self._plain_seconds()) / (tokens - rows)
                total, samples = self.per_token[kind]
                if probe and samples > 1:  # a probe re-measures: it weighs as much as the samples before it
                    total, samples = total / samples, 1.0
                self.per_token[kind] = [COST_DECAY * total + extra, COST_DECAY * samples + 1]
            if self.known is not None and self.plain[1]:  # for the next call run alike
                self.known.update(plain=list(self.plain), per_token={k: list(v) for k, v in self.per_token.items()})
        if kind != PLAIN:
            _add(self.gain[kind], [g for g, h in zip(gained, had, strict=True) if h])
            left = range(len(gained)) if running is None else running
            if least_have and left:
                _add(self.batch_gain[kind], [_batch_gain([progress[i] for i in left], [gained[i] for i in left])])

    def choose(self, rows: list[int], candidates: list[list[tuple[int, ...]]], texts: list[list[int]],
               lookahead_tokens: int, verify_tokens: int) -> str:
        """The next step's kind: `PLAIN`, `VERIFY` or `LOOKAHEAD`. ``rows``: the running input
        rows; ``candidates[i]``: row ``rows[i]``'s candidates; ``texts[row]``: each row's
        committed tokens; ``lookahead_tokens`` and ``verify_tokens``: the input tokens of a
        lookahead and of a verify step, all rows together."""
        self._resolve(rows, texts)
        has = [bool(c) for c in candidates]
        progress = [len(texts[row]) - self.first_length.setdefault(row, len(texts[row])) for row in rows]
        # Whether every least advanced row has candidates: else the batch cannot gain this step.
        least = min(progress)
        least_have = all(h for h, p in zip(has, progress, strict=True) if p == least)
        probe = False  # a step the estimates did not choose, taken to measure what they may have wrong
        if not self.adaptive:
            kind = LOOKAHEAD
        elif not self.plain[1] or not any(has):
            kind = PLAIN  # plain steps are timed first; without candidates nothing can be gained
        else:
            plain_s = self._plain_seconds()
            seconds = {VERIFY: self._seconds(VERIFY, verify_tokens, len(rows)),
                       LOOKAHEAD: self._seconds(LOOKAHEAD, lookahead_tokens, len(rows))}
            gain = {VERIFY: _mean(self.gain[VERIFY])}
            gain[LOOKAHEAD] = max(gain[VERIFY], _mean(self.gain[LOOKAHEAD]))
            if len(rows) == 1:  # the row is the batch (its batch gain may still hold more rows' samples)
                batch = gain
            else:
                batch = {k: _mean(self.batch_gain[k]) if least_have else 0.0 for k in gain}
                batch[LOOKAHEAD] = max(batch[VERIFY], batch[LOOKAHEAD])
            # A token a row gains saves its share of a plain step (priced as a token more in a
            # wider step); one the batch gains, the rest of the step too: plain steps' worth per step,
            # 1 + (row_s * rows with candidates * gain + (plain_s - rows * row_s) * batch) / plain_s.
            row_s = min(self._token_seconds(VERIFY), plain_s / len(rows))
            worth = {k: 1 + batch[k] + row_s * (sum(has) * gain[k] - len(rows) * batch[k]) / plain_s for k in gain}
            # The kind with the more plain steps' worth per second (compared crosswise: no division).
            best = LOOKAHEAD if worth[LOOKAHEAD] * seconds[VERIFY] > worth[VERIFY] * seconds[LOOKAHEAD] else VERIFY
            kind = best if worth[best] * plain_s >= MARGIN * seconds[best] else PLAIN
            due = {k: self.since[k] * plain_s * PROBE_SHARE >= seconds[k] - plain_s for k in seconds}
            if kind != LOOKAHEAD and due[LOOKAHEAD]:
                kind, probe = LOOKAHEAD, True
            elif kind == PLAIN and due[VERIFY] and worth[VERIFY] >= MARGIN:
                kind, probe = VERIFY, True
        if kind == PLAIN and any(has):  # measure in the shadow what verifying the candidates would have gained
            self.pending.append({row: (len(texts[row]), p, c) for row, p, c in zip(rows, progress, candidates,
                                                                                 strict=True)})
        for k in self.since:
            self.since[k] = 0 if kind == k else self.since[k] + 1
        tokens = {PLAIN: len(rows), VERIFY: verify_tokens, LOOKAHEAD: lookahead_tokens}[kind]
        self.step = (kind, has, progress, least_have, tokens, len(rows), probe)
        return kind

    def _plain_seconds(self) -> float:
        return self.plain[0] / self.plain[1]

    def _seconds(self, kind: str, tokens: int, rows: int) -> float:
        """A step of ``kind`` over ``tokens`` input tokens in ``rows`` rows, as priced now."""
        return self._plain_seconds() + self._token_seconds(kind) * max(0, tokens - rows)

    def _token_seconds(self, kind: str) -> float:
        """The seconds each token beyond one per row adds to a step of ``kind``, as priced now: as
        measured, else as the other wide kind's, else at the prefill's price."""
        other = LOOKAHEAD if kind == VERIFY else VERIFY
        for total, samples in (self.per_token[kind], self.per_token[other]):
            if samples:
                return total / samples
        return self.prefill_per_token

    def _resolve(self, rows: list[int], texts: list[list[int]]) -> None:
        """Score the shadow candidates of plain steps whose running rows have all committed
        enough tokens since (finished rows no longer count): each row's, and the batch's gain."""
        running, pending = set(rows), []
        for step in self.pending:
            step = {row: entry for row, entry in step.items() if row in running}
            after = {row: texts[row][start: start + self.length] for row, (start, _, _) in step.items()}
            if any(len(a) < self.length for a in after.values()):
                pending.append(step)
                continue
            gained = {row: max((_common_prefix(c, after[row]) for c in cands), default=0)
                      for row, (_, _, cands) in step.items()}
            _add(self.gain[VERIFY], [gained[row] for row, (_, _, cands) in step.items() if cands])
            progress = [p for _, p, _ in step.values()]
            if step and all(cands for _, p, cands in step.values() if p == min(progress)):
                _add(self.batch_gain[VERIFY], [_batch_gain(progress, list(gained.values()))])
        self.pending = pending


def _mean(sums: list[float]) -> float:
    """The mean of forgotten sums ``[total, weight]``."""
    return sums[0] / sums[1]


def _add(sums: list[float], samples: list[int]) -> None:
    """Forget ``sums`` (``[total, weight]``) by `DECAY` per sample, then add ``samples``."""
    sums[0] = DECAY ** len(samples) * sums[0] + sum(samples)
    sums[1] = DECAY ** len(samples) * sums[1] + len(samples)


def _batch_gain(progress: list[int], gained: list[int]) -> int:
    """How far a step moves the least advanced of rows at ``progress`` beyond one token, each row
    gaining ``gained`` tokens beyond one."""
    return min(p + g for p, g in zip(progress, gained, strict=True)) - min(progress)


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` (of equal lengths) share."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def lookahead_mask(window: int, ngram: int) -> torch.Tensor:
    """``[P, P]`` bool, P = 1 + window * (ngram - 1): what the last token and the lookahead
    branch's tokens see, in input order (the last token, then the levels, level-major,
    ``window`` tokens each). The candidates' tokens follow them (`candidate_tree`)."""
    W, L = window, ngram - 1
    mask = torch.eye(1 + W * L, dtype=torch.bool)
    mask[:, 0] = True
    level = lambda lv, i: 1 + lv * W + i                          # input index of a lookahead token
    for i in range(W):
        mask[level(0, i), [level(0, j) for j in range(i)]] = True
        for lv in range(1, L):
            mask[level(lv, i)] = mask[level(lv - 1, i)]
            mask[level(lv, i), level(lv, i)] = True
    return mask


def candidate_tree(candidates: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """The candidates (each a continuation of the last token) as one token tree, shared
    prefixes merged: its nodes' tokens and parents (-1: a child of the last token), in
    topological order. Siblings differ, so each candidate's path is verified whole.

    Example::

        candidate_tree([(6, 8), (6, 7), (5, 1)])   # ([6, 8, 7, 5, 1], [-1, 0, 0, -1, 3])
    """
    tokens, parents, node = [], [], {}
    for candidate in candidates:
        parent = -1
        for token in candidate:
            if (parent, token) not in node:
                node[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node[parent, token]
    return tokens, parents


@torch.inference_mode()
def lookahead_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                       window: int = 2, ngram: int = 3, guesses: int = 4, max_new_tokens: int,
                       temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                       eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                       seed: int | None = None, max_cache_len: int | None = None, pool_size: int = 4096,
                       adaptive: bool = True, cuda_graphs: bool | None = None, streamer=None) -> GenerationOutput:
    """Lookahead decoding (see the module docstring), batched over ragged rows: greedy output
    equals `generate(..., temperature=0)` token for token; with temperature > 0 the output is
    distributed as `generate`'s (the candidates are verified by `tree_rejection_sample`).

    Args:
        model: a model following the protocol (`specdec_kernels.generation`) whose forward takes
            ``tree_mask`` (the built-in `Llama`, transformers models in `HFCausalLM`; models
            with sliding-window layers, e.g. Gemma 3 and Mistral, raise once the window hides
            cached keys, as token trees do: `ragged_attention` takes no tree with such a window).
        input_ids, attention_mask, max_new_tokens, top_k, top_p, eos_token_id, pad_token_id,
            seed, max_cache_len, cuda_graphs, streamer: as in `generate` (CUDA graphs replay
            the plain steps; verify and lookahead steps run eagerly; the cache also needs room for one
            step's input: longest prompt + max_new_tokens - 1 + (W + G) * (N - 1)).
        temperature: as in `generate`, but greedy (0) by default: the tokens of greedy
            `generate`, found in fewer forwards.
        window: W >= 1, the lookahead branch's columns.
        ngram: N >= 2, the n-gram size: N - 1 lookahead levels and candidates of N - 1 tokens.
        guesses: G >= 1, the most candidates verified per row and step (and kept per key).
        pool_size: the most first tokens a row's pool keeps.
        adaptive: choose each step between a lookahead step, a verify step (the candidates
            without the lookahead branch) and a plain one from the measured costs and gains
            (`LookaheadSwitch`), so that lookahead costs little where it does not pay; the
            step costs carry over to the next call on the same ``model`` object run alike
            (batch size, device, CUDA graphs, greedy or sampled, W, N, G), as
            `speculative_generate`'s verify costs do. False: every step is a lookahead step.

    A lookahead step scores T = 1 + W * (N - 1) + n tokens per row, n the most candidate tree
    nodes any row has that step (at most G * (N - 1): candidates sharing a prefix share its
    nodes; 0 when no row's pool knows its last token); a verify step 1 + n; a plain step one. The
    defaults are the best all-round setting measured on a 2-core CPU (docs/performance.md); on
    a GPU, where a wider forward costs little more, wider windows pay.

    Returns:
        `GenerationOutput`; ``stats.num_proposed`` / ``num_accepted`` count candidate tokens
        verified and accepted, ``stats.tokens_per_target_forward`` the compression.

    Example::

        out = lookahead_generate(model, input_ids, max_new_tokens=64)   # W=2, N=3, G=4, greedy
        print(out.stats.tokens_per_target_forward)
    """
    for name, value, least in (("window", window, 1), ("ngram", ngram, 2), ("guesses", guesses, 1),
                               ("pool_size", pool_size, 1)):
        if not is_int(value) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if not isinstance(adaptive, bool):
        raise TypeError(f"adaptive must be True or False, got {adaptive!r}")
    t_start = time.perf_counter()
    given, model = model, as_protocol_model(model)
    if not _accepts(model, "tree_mask"):
        raise TypeError(f"lookahead_generate needs a model whose forward takes tree_mask (the built-in Llama and "
                        f"HFCausalLM do), got {type(model).__name__}")
    W, L, G = int(window), int(ngram) - 1, int(guesses)
    widest = (W + G) * L                                  # the most tokens a step appends after the last one
    request = _prepare(model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                       pad_token_id, seed, max_cache_len, lookahead=widest)
    # _prepare counts only the drafts that fit the token budget; a lookahead step appends all.
    needed = request.prompt.shape[1] + request.max_new_tokens - 1 + widest
    if request.max_len < needed:
        if max_cache_len is not None:
            raise ValueError(f"max_cache_len={max_cache_len} is too small: the longest prompt "
                             f"({request.prompt.shape[1]} tokens) + max_new_tokens ({request.max_new_tokens}) - 1 "
                             f"+ {widest} tokens a lookahead step appends after the last one needs {needed}")
        request = dataclasses.replace(request, max_len=needed)
    V, device, B = model.vocab_size, input_ids.device, input_ids.shape[0]
    timer, stats = _PhaseTimer(device), _new_stats(B, device, G * L)
    outputs = _Outputs(B, request.max_new_tokens, device)
    stream = _Stream(streamer, B)
    rows, host_rows = torch.arange(B, device=device), list(range(B))
    cache = _new_cache(model, "model", B, request.max_len, device)
    check = _LogitsCheck(device, ("model",))
    graphs = _use_cuda_graphs(cuda_graphs, (model,), device)
    plain_step = check.checked("model", V, _decoding_forward(model, cache, "model", graphs, last_only=True))
    branch_mask = lookahead_mask(W, L + 1).to(device)
    P = 1 + W * L                                         # the last token and the lookahead branch

    # The prompts on the host, in one transfer before the loop: they seed the pools.
    texts = [row[1: 1 + row[0]] for row in torch.cat([request.prompt_lengths[:, None], request.prompt], 1).tolist()]
    pools = [NgramPool(L + 1, G, pool_size) for _ in range(B)]
    for pool, text in zip(pools, texts, strict=True):
        pool.add_text(text)
    # The first guesses: tokens of the row's own prompt, drawn with a fixed seed (any guess is
    # valid; the window's trajectories replace them).
    picks = torch.randint(0, 2**62, (B, L, W), generator=torch.Generator().manual_seed(0))
    levels = torch.stack([torch.tensor(text)[picks[b] % len(text)] for b, text in enumerate(texts)]).to(device)

    with timer("prefill"):
        logits = _last_logits(model, request.prompt, cache, request.prompt_lengths, request.prompt_tokens,
                              max_seqlen=request.prompt.shape[1])
        token = request.sample(check("model", V, logits))
    stats.target_forwards += 1
    new, accepted = token[:, None], torch.zeros_like(rows)
    grams = torch.empty(B, 0, L + 1, dtype=torch.int64, device=device)
    # The step costs of earlier calls on this model run alike (the gains belong to the text: not carried).
    way = ("lookahead", B, str(device), graphs, temperature == 0, W, L + 1, G)
    switch = LookaheadSwitch(adaptive, L + 1, known_costs(given, way) if adaptive else None)
    prompt_tokens, first_step = sum(map(len, texts)), True
    with stream:
        while True:
            kept, done = outputs.write(rows, new, accepted + 1, request.eos)
            stream.add(host_rows, kept, new)
            running, (longest, shortest, new_host, kept_host, grams_host, *streamed) = _rows_still_running(
                done, check, *_running_range(cache.lengths, done), new, kept, grams, *stream.values())
            stream.put(*streamed)
            # The pools learn the committed text and the window's n-grams of every row still running.
            per_row = grams.shape[1] * (L + 1)
            candidates, gained = [], []
            for i in range(len(host_rows)):
                committed = [t for t, k in zip(new_host[i], kept_host[i], strict=True) if k]
                gained.append(len(committed) - 1)
                if i not in running:
                    continue
                row = host_rows[i]
                texts[row] += committed
                pools[row].add_text(texts[row], len(committed))
                flat = grams_host[i * per_row: (i + 1) * per_row]
                for j in range(0, per_row, L + 1):
                    pools[row].add(tuple(flat[j: j + L + 1]))
                candidates.append(pools[row].continuations(texts[row][-1])[:G])
            if first_step:  # the prefill's time is known after the first transfer
                switch.prefilled(timer.last("prefill"), prompt_tokens, B)
                first_step = False
            else:
                switch.observe(timer.last("target") + timer.last("sampler"), gained, running)
            if not running:
                break
            if len(running) < len(rows):
                _, rows, host_rows, cache, token, levels = _keep_running(running, rows, host_rows, cache, token,
                                                                         levels)
            b = len(running)
            trees = [candidate_tree(c) for c in candidates]
            n = max(len(tokens) for tokens, _ in trees)
            kind = switch.choose(host_rows, candidates, texts, b * (P + n), b * (1 + n))
            if kind == PLAIN:
                with timer("target"):
                    logits = plain_step(token[:, None], cache, max_seqlen=longest + 1, min_seqlen=shortest + 1)
                stats.target_forwards += 1
                with timer("sampler"):
                    token = request.sample(logits)
                    new, accepted = token[:, None], torch.zeros_like(rows)
                    grams = grams[:, :0]
                stats.num_steps[rows] += 1
                stats.draft_lengths[host_rows, 0] += 1
                continue
            num_nodes = [len(tokens) for tokens, _ in trees]
            for row, count in zip(host_rows, num_nodes, strict=True):
                stats.draft_lengths[row, count] += 1  # steps by candidate tokens verified
            # A verify step's input is the last token and the candidates; a lookahead step's has
            # the lookahead branch between them.
            branch = P if kind == LOOKAHEAD else 1
            T = branch + n
            ids = token[:, None] if kind == VERIFY else torch.cat([token[:, None], levels.reshape(b, W * L)], 1)
            mask = torch.zeros(b, T, T, dtype=torch.bool, device=device)
            mask[:, :branch, :branch] = branch_mask[:branch, :branch]
            if n:  # the candidate trees: tokens, parents and ancestor masks, padded to n nodes, in one copy
                host = [t for tokens, _ in trees for t in tokens + [0] * (n - len(tokens))]
                host += [q for _, parents in trees for q in parents + [-1] * (n - len(parents))]
                host += [int(seen) for _, parents in trees for seen in _ancestors(parents, n)]
                host = _host_list_to(host, device)
                ids = torch.cat([ids, host[: b * n].view(b, n)], 1)
                parents = host[b * n: 2 * b * n].view(b, n)
                mask[:, branch:, 0] = True
                mask[:, branch:, branch:] = host[2 * b * n:].view(b, n, n) != 0
            with timer("target"):
                start = cache.lengths.clone()
                logits = check("model", V, _forward(model, ids, cache, max_seqlen=longest + T, min_seqlen=shortest + T,
                                                    tree_mask=mask))
            stats.target_forwards += 1
            with timer("sampler"):
                if kind == LOOKAHEAD:
                    last = logits[:, 1 + (L - 1) * W: P].argmax(-1)                  # [b, W]: after the last level
                    grams = torch.cat([levels.transpose(1, 2), last[..., None]], 2)  # [b, W, N]: column n-grams
                    levels = torch.cat([levels[:, 1:], last[:, None]], 1)
                else:  # the window waits for the next lookahead step
                    grams = grams[:, :0]
                if n:
                    nodes = _host_list_to(num_nodes, device)
                    result = tree_rejection_sample(
                        torch.cat([logits[:, :1], logits[:, branch:]], 1), None, ids[:, branch:], parents, nodes,
                        **request.sampling, generator=request.generator, validate=False)
                    new, accepted = result.token_ids.clamp(min=0), result.num_accepted
                    path = torch.where(result.path >= 0, result.path + branch, 0)
                    cache.compact(torch.cat([torch.zeros_like(accepted)[:, None], path], 1), accepted + 1, start=start)
                    stats.num_proposed[rows] += nodes
                else:
                    new, accepted = request.sample(logits[:, 0])[:, None], torch.zeros_like(rows)
                    cache.crop(start + 1)
                token = new.gather(1, accepted[:, None])[:, 0]
            stats.num_steps[rows] += 1
            stats.num_accepted[rows] += accepted
    return _finish(request, input_ids, outputs, stats, timer, t_start, pad_token_id)


def _ancestors(parents: list[int], n: int) -> list[bool]:
    """Row-major ``[n, n]``: node i sees node j iff j is i or one of its ancestors (padding
    nodes, past ``parents``, see only themselves)."""
    seen = [[i == j for j in range(n)] for i in range(n)]
    for i, parent in enumerate(parents):  # parents come first: their rows are complete
        if parent >= 0:
            seen[i] = [a or b for a, b in zip(seen[i], seen[parent], strict=True)]
    return [x for row in seen for x in row]
