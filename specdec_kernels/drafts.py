"""Drafts: where the speculative tokens come from.

`speculative_generate` asks a `Drafter` for tokens and knows nothing else about it. A drafter
follows the committed text of each row (`Drafter.commit`), proposes continuations
(`Drafter.propose`) and forgets finished rows (`Drafter.select`). These drafters ship:

- `ModelDraft` wraps any model that follows the model protocol and shares the target's
  vocabulary, in a KV cache of its own;
- `EarlyExitDraft` drafts with the target's own first layers, its final norm and head
  (layer-skip self-speculation) in the target's KV cache: nothing is prefilled or read twice;
- `PromptLookupDraft` proposes what followed the last n-gram earlier in the text (no model);
- `LookupFirstDraft` tries prompt lookup first and asks a draft for the rows it cannot serve.

A drafter of your own (the proposals of the next token's most common successor, say) needs
only the four methods::

    class RepeatLastToken:
        '''Propose the last committed token again, num_tokens times.'''

        def prefill(self, input_ids, q_seqlens, max_len):
            self.last = input_ids.gather(1, (q_seqlens - 1)[:, None])  # [B, 1]

        def propose(self, num_tokens, sample):
            return DraftProposal(self.last.expand(-1, num_tokens), None, None)

        def commit(self, token_ids, num_tokens):
            self.last = token_ids.gather(1, (num_tokens - 1)[:, None])

        def select(self, rows):
            self.last = self.last[rows]

Every method runs inside the loop's step and must not synchronize the device (no ``.item()``,
``.tolist()`` or ``bool(tensor)``) to keep the loop at one host synchronization per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ._checks import check_lengths_tensor, device_check, is_int
from ._model_calls import _check_model, _decoding_forward, _last_logits, _new_cache, _use_cuda_graphs, as_protocol_model
from .cache import KVCache


@dataclass
class DraftProposal:
    """Tokens a drafter proposes to continue each row.

    Attributes:
        token_ids: [B, K] int64, the proposed continuation of each row (ids in [0, V)).
        num_tokens: [B] int64 in 0..K, how many of them are real (the rest is padding, never
            read); None: all K in every row.
        logits: [B, K, V] float, the draft logits the tokens were sampled from (with the
            ``sample`` function `Drafter.propose` is given), in the target's dtype; None for
            deterministic proposals (n-gram, greedy, oracle): the draft distribution is then
            one-hot on the proposed token.
        parents: [B, K] int64, or None for a chain: the tokens form a tree in topological
            order, token i continuing token ``parents[b, i] < i``, or the row's last committed
            token (-1). The target verifies the tree in one forward (`ragged_attention`'s
            ``tree_mask``; the built-in `Llama` and `HFCausalLM` take it) and keeps the longest
            path it accepts
            (`tree_rejection_sample`: siblings with logits must have been sampled independently,
            each from its own row of ``logits``). A row cut to fewer tokens keeps the first ones;
            near the end of a row's token budget the loop keeps every node and stops the
            accepted path at the budget (a chain is cut to the drafts the budget keeps).
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    parents: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """What `speculative_generate` asks of a draft. Rows are the loop's running rows, in order:
    B is the prompt count at `prefill` and shrinks when `select` drops finished rows.

    A drafter that reads the target's features (EAGLE-style heads) sets the class attribute
    ``needs_target_hidden = True``; its `commit` then also receives ``hidden_states=`` [B, N, H]:
    the target's last-layer hidden state (before the final norm) at the position that produced
    each committed token (the prefill's last position for the first token), and its `prefill`
    ``hidden_states=`` [B, P, H], those of every prompt position (right-padded as the prompts).
    Nothing is computed for drafters that do not ask.

    A drafter that runs the target's own first layers (`EarlyExitDraft`) sets
    ``needs_target_cache = True``; its `prefill` then also receives ``target_cache=``, the
    target's `KVCache` holding the prompt. When the drafter proposes, the cache holds every
    committed token but the last; the drafter may write its layers' keys and values past each
    row's length but must leave the lengths as it found them (the target's verification then
    writes over those positions). The loop selects that cache's rows itself.

    A drafter that bounds its model's reads by the committed length (`ModelDraft`,
    `EarlyExitDraft`) sets ``needs_committed_bound = True``; its `commit` then also receives
    ``committed_bound=``, a host int >= every row's committed token count after that commit,
    at most the step's rejected drafts above the longest row (read in the loop's one transfer;
    a drafter's own sum of step widths would drift further above with every rejection).
    """

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int) -> None:
        """Start from right-padded prompts ``input_ids`` [B, P] int64 with lengths ``q_seqlens``
        [B] int64; ``max_len`` bounds every row's final length (prompt, generated tokens and one
        step's drafts)."""

    def propose(self, num_tokens: int, sample: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        """Up to ``num_tokens`` tokens per row (an int >= 1) continuing each row's committed
        tokens. ``sample`` maps logits [B, V] to ids [B] with the run's temperature, top-k / top-p
        and random generator, so a model draft samples exactly the distribution the verifier is
        given (and its logits are checked as the target's are)."""

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """The tokens each row gained this step (``token_ids`` [B, N] int64, the first
        ``num_tokens[b]`` of row b real, always >= 1): its accepted drafts then the target's
        token. The first commit carries the token sampled from the target's prefill."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch positions ``rows`` ([b] int64), in this order."""


def _append(buffer: torch.Tensor, lengths: torch.Tensor, token_ids: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """Write row b's first ``num_tokens[b]`` of ``token_ids`` [B, N] into ``buffer`` [B, L] from
    column ``lengths[b]`` on; the rest goes to the spare last column, never read."""
    offsets = torch.arange(token_ids.shape[1], device=token_ids.device)
    columns = torch.where(offsets < num_tokens[:, None], lengths[:, None] + offsets, buffer.shape[1] - 1)
    buffer.scatter_(1, columns, token_ids)


class ModelDraft:
    """A `Drafter` from a model that follows the model protocol (see `specdec_kernels.generation`)
    and shares the target's vocabulary: it samples its proposals one forward per token, in a KV
    cache of its own that follows the committed text.

    Committed tokens it has not read yet (one or two after a speculative step, more after steps
    the loop decoded without drafting) are read in one ragged forward when it next proposes;
    drafts the target rejected are dropped by cropping its cache.

    Args:
        model: the draft model: the built-in `Llama`, a transformers causal LM, or any model
            following the protocol.
        cuda_graphs: replay its one-token forwards as CUDA graphs, as in `generate`.
        vocab_size: the target's vocabulary size, when the draft's differs from it by padding
            only (`check_padded_vocabularies`): the draft's logits are cut or padded with -inf to
            this width, so ids the draft lacks have draft probability 0 and the target's
            distribution is never truncated (lossless either way); committed ids the draft lacks
            are read by it as id 0. None: the draft's own size, which must then be the target's.

    Example::

        draft = ModelDraft(target.truncated(6))
        out = speculative_generate(target, draft, input_ids, max_new_tokens=64)
    """

    needs_committed_bound = True

    def __init__(self, model, *, cuda_graphs: bool | None = None, vocab_size: int | None = None) -> None:
        model = as_protocol_model(model)
        _check_model(model, "draft")
        self.model = model
        self.cuda_graphs = cuda_graphs
        self.vocab_size = model.vocab_size if vocab_size is None else vocab_size
        check_padded_vocabularies(model.vocab_size, self.vocab_size)

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int) -> None:
        B, P = input_ids.shape
        device = input_ids.device
        self.cache = _new_cache(self.model, "draft", B, max_len, device)
        graphs = _use_cuda_graphs(self.cuda_graphs, (self.model,), device)
        self._step = _decoding_forward(self.model, self.cache, "draft", graphs, last_only=True)
        # Committed tokens of each row; the cache holds the first cache.lengths of them.
        # (A last step may commit up to max_len + 1 tokens per row; the spare last column takes
        # the padding of every commit.)
        self.tokens = torch.zeros(B, max_len + 2, dtype=torch.int64, device=device)
        self.tokens[:, :P] = self._readable(input_ids)
        self.committed = q_seqlens.clone()
        self.longest = P  # host bound on every row's committed count (the loop's committed_bound tightens it)
        self.unread, self.proposed = 0, False  # host bound on committed tokens not in the cache
        # The prompt's token count, read on the host once before decoding starts, lets the model
        # skip the padding of ragged prompts.
        _last_logits(self.model, self.tokens[:, :P], self.cache, q_seqlens, int(q_seqlens.sum()), max_seqlen=P)

    def propose(self, num_tokens: int, sample: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        start = self.cache.lengths
        offsets = torch.arange(self.unread, device=start.device)
        unread = self.tokens.gather(1, (start[:, None] + offsets).clamp(max=self.tokens.shape[1] - 1))
        logits = self._aligned(_last_logits(self.model, unread, self.cache, self.committed - start,
                                            max_seqlen=self.longest))
        B = unread.shape[0]
        draft_logits = torch.empty(B, num_tokens, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        ids = torch.empty(B, num_tokens, dtype=torch.int64, device=logits.device)
        for i in range(num_tokens):
            draft_logits[:, i] = logits
            ids[:, i] = sample(logits)
            if i + 1 < num_tokens:
                logits = self._aligned(self._step(ids[:, i: i + 1], self.cache, max_seqlen=self.longest + i + 1,
                                                  min_seqlen=None))
        self.unread, self.proposed = 0, True
        return DraftProposal(ids, None, draft_logits)

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor, *, committed_bound: int | None = None
               ) -> None:
        N = token_ids.shape[1]
        _append(self.tokens, self.committed, self._readable(token_ids), num_tokens)
        # The cache holds the committed tokens it read, then the drafts it proposed; the accepted
        # drafts (num_tokens - 1 of this step's tokens) stay, the rest is cropped.
        self.cache.crop(torch.minimum(self.cache.lengths, self.committed + num_tokens - 1))
        self.committed = self.committed + num_tokens
        self.longest = _tighter(self.longest + N, committed_bound)
        # After a proposal at most two committed tokens are unread (the last draft, if all were
        # accepted, and the target's token); after a step without one, all N may be.
        # (N is the commit's padded width: a row's unread tokens never outnumber its committed ones.)
        self.unread = min(N, 2) if self.proposed else min(self.unread + N, self.longest)
        self.proposed = False

    def select(self, rows: torch.Tensor) -> None:
        self.cache = self.cache.select(rows)
        self.tokens, self.committed = self.tokens[rows], self.committed[rows]

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V_draft] logits as [B, vocab_size]: the padded tail cut, or padded with -inf."""
        width = self.model.vocab_size
        if self.vocab_size == width:  # the loop checks the width against the vocabulary
            return logits
        if logits.shape[-1] != width:
            raise ValueError(f"the draft model returned logits of width {logits.shape[-1]} but its vocab_size "
                             f"is {width}")
        extra = self.vocab_size - width
        if extra < 0:
            return logits[:, : self.vocab_size]
        return torch.cat([logits, logits.new_full((logits.shape[0], extra), float("-inf"))], -1)

    def _readable(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids`` with ids the draft has no embedding for (a target's padded tail) as 0:
        what the draft reads only steers its guesses."""
        if self.vocab_size <= self.model.vocab_size:
            return token_ids
        return token_ids.masked_fill(token_ids >= self.model.vocab_size, 0)


class EarlyExitDraft:
    """A `Drafter` from the target's own first ``num_layers`` layers, final norm and LM head
    (layer-skip self-speculation), running in the target's KV cache.

    Those layers' keys and values for every committed token are exactly the target's, already
    in its cache, so the draft has no prefill and never reads a committed token twice: each
    proposal runs ``num_tokens`` one-token forwards of ``num_layers`` layers (the last committed
    token, then its own drafts), written past each row's cache length, and restores the
    lengths; the target's verification overwrites those positions with the same values for
    those layers. Its proposals are those of ``ModelDraft(target.truncated(num_layers))``
    without that draft's own cache to fill.

    Args:
        target: the built-in `Llama` that ``speculative_generate`` verifies with (the same
            object: the draft writes into its cache).
        num_layers: how many of the target's first layers draft (1 .. its depth).
        cuda_graphs: replay the draft's one-token forwards as CUDA graphs, as in `generate`.

    Example::

        out = speculative_generate(target, EarlyExitDraft(target, 6), input_ids, max_new_tokens=64)
    """

    needs_target_cache = needs_committed_bound = True

    def __init__(self, target, num_layers: int, *, cuda_graphs: bool | None = None) -> None:
        truncated = getattr(target, "truncated", None)
        if not callable(truncated):
            raise TypeError(f"EarlyExitDraft needs a target with truncated(num_layers) (the built-in Llama), got "
                            f"{type(target).__name__}")
        self.target, self.model = target, truncated(num_layers)
        self.cuda_graphs = cuda_graphs

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int, *,
                target_cache: KVCache) -> None:
        config = self.target.config
        expected = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        found = tuple(getattr(target_cache, a, None) for a in ("num_layers", "num_kv_heads", "head_dim"))
        if not isinstance(target_cache, KVCache) or found != expected:
            raise ValueError(f"EarlyExitDraft drafts in the KV cache of the target it was made from (layers, KV "
                             f"heads, head dim {expected}), got {type(target_cache).__name__} {found}: pass the same "
                             "target to speculative_generate")
        self.cache = target_cache
        graphs = _use_cuda_graphs(self.cuda_graphs, (self.model,), input_ids.device)
        self._step = _decoding_forward(self.model, self.cache, "draft", graphs, last_only=True)
        self.last = input_ids.gather(1, (q_seqlens - 1)[:, None])  # [B, 1]: replaced by the first commit
        self.longest = input_ids.shape[1]  # host bound on every row's committed count

    def propose(self, num_tokens: int, sample: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        start = self.cache.lengths.clone()
        ids, logits = self.last, []
        for i in range(num_tokens):
            # The cache holds every committed token but the last: after i drafts, at most longest + i.
            logits.append(self._logits(self._step(ids[:, -1:], self.cache, max_seqlen=self.longest + i,
                                                  min_seqlen=None)))
            ids = torch.cat([ids, sample(logits[-1])[:, None]], 1)
        self.cache.crop(start)
        return DraftProposal(ids[:, 1:], None, torch.stack(logits, 1))

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor, *, committed_bound: int | None = None
               ) -> None:
        self.last = token_ids.gather(1, (num_tokens - 1)[:, None])
        self.longest = _tighter(self.longest + token_ids.shape[1], committed_bound)

    def select(self, rows: torch.Tensor) -> None:
        self.last = self.last[rows]  # the loop selects the shared cache's rows

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V] over the target's vocabulary from the draft model's (a subclass
        with a pruned vocabulary widens them)."""
        return logits


def _tighter(own_bound: int, committed_bound: int | None) -> int:
    """The smaller of a drafter's own host bound on its rows' committed counts and the loop's."""
    return own_bound if committed_bound is None else min(own_bound, committed_bound)


def check_padded_vocabularies(draft_size: int, target_size: int) -> None:
    """Raise ValueError unless a draft and a target vocabulary may differ only by padding: equal,
    or the larger a multiple of 64 and fewer than 1024 rows longer (as 151936 and 152064 are). The
    ids below the smaller size must mean the same tokens in both (a shared tokenizer); that a
    model's size cannot show, so larger differences are refused."""
    small, large = sorted((draft_size, target_size))
    if small == large or (large % 64 == 0 and large - small < 1024):
        return
    raise ValueError(f"draft must share the target's vocabulary: draft.vocab_size={draft_size}, "
                     f"target.vocab_size={target_size} (sizes may differ only by padding: the larger a multiple "
                     f"of 64, fewer than 1024 rows longer)")


@dataclass(eq=False)  # compared and hashed by identity: its costs carry on the object (`speculative_generate`)
class PromptLookupDraft:
    """Model-free `Drafter`: propose the tokens that followed the most recent earlier occurrence
    of the text's last n-gram (prompt lookup decoding). Tries n = max_ngram down to min_ngram;
    rows without a match propose nothing that step. Proposals are deterministic (no draft
    logits), so verification accepts a draft exactly when the target would sample it.

    With ``branches`` > 1 it proposes a token tree: the continuations of up to ``branches``
    earlier occurrences (the most recent first, longest n-grams first, distinct start points),
    merged where they agree (a trie), so a wrong guess of the most recent occurrence still
    leaves the others to be accepted. The tree's nodes are ordered by ``depth * (branch + 1)``:
    the most recent continuation goes deepest, the later ones less deep, within the
    ``num_tokens`` the loop asks for (`tree_rejection_sample` verifies it).

    Example::

        out = speculative_generate(target, PromptLookupDraft(max_ngram=3), input_ids, max_new_tokens=64)
        trees = speculative_generate(target, PromptLookupDraft(branches=3), input_ids, max_new_tokens=64,
                                     num_draft_tokens=7)
    """

    max_ngram: int = 3
    min_ngram: int = 1
    branches: int = 1

    def __post_init__(self) -> None:
        if not (is_int(self.min_ngram) and is_int(self.max_ngram) and 1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(f"min_ngram and max_ngram must be ints with 1 <= min_ngram <= max_ngram, got "
                             f"{self.min_ngram!r}, {self.max_ngram!r}")
        if not is_int(self.branches) or self.branches < 1:
            raise ValueError(f"branches must be an int >= 1, got {self.branches!r}")

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int) -> None:
        B, P = input_ids.shape
        # One spare column takes the padding of every commit.
        self.context = torch.zeros(B, max_len + 2, dtype=torch.int64, device=input_ids.device)
        self.context[:, :P] = input_ids
        self.lengths = q_seqlens.clone()

    def propose(self, num_tokens: int, sample: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        if self.branches > 1:
            return DraftProposal(*self.lookup_tree(self.context[:, :-1], self.lengths, num_tokens))
        ids, num = self.lookup(self.context[:, :-1], self.lengths, num_tokens)
        return DraftProposal(ids, num, None)

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor) -> None:
        _append(self.context, self.lengths, token_ids, num_tokens)
        self.lengths = self.lengths + num_tokens

    def select(self, rows: torch.Tensor) -> None:
        self.context, self.lengths = self.context[rows], self.lengths[rows]

    def lookup(self, context: torch.Tensor, context_lengths: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose up to ``k`` tokens per row of a token history, sync-free (stateless).

        Args:
            context: [B, L] int64 token history; row b's first ``context_lengths[b]`` are real.
            context_lengths: [B] int64.
            k: tokens to propose at most.

        Returns:
            (draft_token_ids [B, k] int64, zero-padded; num_draft_tokens [B] int64 in [0, k]).

        Raises:
            ValueError: bad shapes or dtypes, ``k`` not an int >= 1; a length outside ``0 .. L``
                (`DeviceCheckError` on CPU, a device assert on CUDA).
        """
        _check_lookup(context, context_lengths, k)
        B, L = context.shape
        device, k = context.device, int(k)
        found = torch.zeros(B, dtype=torch.bool, device=device)
        start = torch.zeros(B, dtype=torch.int64, device=device)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n >= L:
                continue
            latest = _occurrences(context, context_lengths, n).amax(1)  # most recent occurrence
            take = (latest >= 0) & ~found
            start = torch.where(take, latest + n, start)
            found |= take
        num = torch.where(found, (context_lengths - start).clamp(max=k), 0)
        offsets = torch.arange(k, device=device)
        ids = context.gather(1, (start[:, None] + offsets).clamp(max=L - 1))
        return torch.where(offsets < num[:, None], ids, 0), num

    def lookup_tree(self, context: torch.Tensor, context_lengths: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
        """Propose a tree of up to ``k`` nodes per row from the continuations of up to
        ``branches`` earlier occurrences of the last n-gram, sync-free (stateless; arguments as
        in `lookup`).

        Returns:
            ``(token_ids [B, k], num_tokens [B], None, parents [B, k])``, the fields of a
            `DraftProposal`: nodes in topological order, -1 for children of the last token.
        """
        _check_lookup(context, context_lengths, k)
        B, L = context.shape
        device, m, k = context.device, self.branches, int(k)
        starts, valid = [], []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):  # candidates, longest n-grams first
            if n >= L:
                continue
            occurred = _occurrences(context, context_lengths, n)
            latest = occurred.topk(min(m, L - n + 1), dim=1).values  # most recent first
            starts.append(latest + n)
            valid.append(latest >= 0)
        if not starts:
            zeros = torch.zeros(B, k, dtype=torch.int64, device=device)
            return zeros, zeros[:, 0], None, zeros - 1
        start, ok = torch.cat(starts, 1), torch.cat(valid, 1)                    # [B, C]
        C = start.shape[1]
        earlier = torch.ones(C, C, dtype=torch.bool, device=device).tril(-1)     # [j, i]: i < j
        ok &= ~((start[:, :, None] == start[:, None, :]) & ok[:, None, :] & earlier).any(-1)  # distinct starts
        order = torch.where(ok, torch.arange(C, device=device), C).argsort(1)[:, :m]
        start, ok = start.gather(1, order), ok.gather(1, order)                  # [B, m'] valid ones first
        m = start.shape[1]
        depth = torch.arange(k, device=device)
        cont = context.gather(1, (start[:, :, None] + depth).clamp(max=L - 1).view(B, -1)).view(B, m, k)
        real = ok[:, :, None] & (start[:, :, None] + depth < context_lengths[:, None, None])   # [B, m, k]
        # owner[b, c, d]: the first branch whose continuation agrees with branch c's up to depth d.
        same = (cont[:, :, None] == cont[:, None, :]) & real[:, :, None] & real[:, None, :]       # [B, c', c, k]
        same = same.cumprod(-1).bool() & torch.ones(m, m, dtype=torch.bool, device=device).triu()[:, :, None]
        owner = same.int().argmax(1)                                                             # [B, m, k]
        branch = torch.arange(m, device=device)[:, None]
        new = real & (owner == branch)
        key = torch.where(new, (depth * (branch + 1)) * (m * k) + branch * k + depth, 2**62).view(B, -1)
        nodes = key.argsort(1)[:, :k]                                                            # [B, k]
        num = new.view(B, -1).sum(1).clamp(max=k)
        rank = torch.empty_like(key).scatter_(1, key.argsort(1), torch.arange(m * k, device=device).expand(B, -1))
        parent_slot = (owner.gather(2, (depth - 1).clamp(min=0).expand(B, m, k)) * k + depth - 1).view(B, -1)
        parent = torch.where((depth > 0).expand(B, m, k).reshape(B, -1), rank.gather(1, parent_slot.clamp(min=0)), -1)
        real_node = torch.arange(k, device=device) < num[:, None]
        ids = torch.where(real_node, cont.view(B, -1).gather(1, nodes), 0)
        parents = torch.where(real_node, parent.gather(1, nodes), -1)
        return ids, num, None, parents


class LookupFirstDraft:
    """A `Drafter` that tries prompt lookup first: rows whose last n-gram occurred earlier in
    their text propose what followed it, the other rows take ``draft``'s proposal. Lookup costs
    next to nothing; a model draft or head costs a share of a target step per token. Where the
    text repeats itself (summaries, rewrites, code edits) the lookup's guesses are right more
    often than a small draft's and cost nothing; elsewhere the draft carries on.

    On the CPU a step where every row found a match does not run ``draft`` at all (reading that
    costs no device synchronization there), once ``draft`` has proposed in the call; its proposal
    is still shaped as ``draft``'s last one (draft logits, a tree), so that adaptive lengths see
    one kind of drafter. On other devices ``draft`` proposes every step and the rows are merged
    on the device, as the decision would synchronize the loop.

    Lossless like its parts: lookup tokens are deterministic proposals. When ``draft`` gives
    draft logits, the rows that took the lookup's tokens get logits that are one-hot on them
    (the point-mass rule). When either side proposes trees, the other side's chains are given
    as trees of one branch.

    Args:
        draft: the drafter for rows without a match (`FeatureHeadDraft`, `EarlyExitDraft`,
            ...). Its needs (``needs_target_hidden`` and the like) are passed on
            to the loop. It sees every commit, whether it proposed that step or not, and must
            take each commit as the text: a row the lookup served commits tokens the draft did
            not propose. `ModelDraft` keeps its own drafts' keys and values as the accepted
            tokens', so it is refused.
        lookup: the `PromptLookupDraft` tried first. Default: ``PromptLookupDraft(min_ngram=2)``.
            A single recurring token is a weak guess, which a trained draft usually beats.
        draft_tokens: ask ``draft`` for at most this many tokens (None: as many as the loop
            asks). Lookup tokens cost nothing to propose, so the loop's ``num_draft_tokens`` can
            be set above the length that pays for ``draft``.

    Example::

        draft = LookupFirstDraft(load_smollm2_draft(target), draft_tokens=4)
        out = speculative_generate(target, draft, input_ids, num_draft_tokens=7, max_new_tokens=64)
    """

    def __init__(self, draft: Drafter, lookup: PromptLookupDraft | None = None, *,
                 draft_tokens: int | None = None) -> None:
        if not isinstance(draft, Drafter):
            raise TypeError(f"draft must be a Drafter (prefill, propose, commit, select), got {type(draft).__name__}")
        if isinstance(draft, ModelDraft):
            raise TypeError("draft must take each commit as the text; ModelDraft keeps its own drafts in its cache as "
                            "the accepted tokens, which the lookup's rows replace: use a FeatureHeadDraft or an "
                            "EarlyExitDraft")
        if lookup is None:
            lookup = PromptLookupDraft(min_ngram=2)
        if not isinstance(lookup, PromptLookupDraft):
            raise TypeError(f"lookup must be a PromptLookupDraft, got {type(lookup).__name__}")
        if draft_tokens is not None and (not is_int(draft_tokens) or draft_tokens < 1):
            raise ValueError(f"draft_tokens must be None or an int >= 1, got {draft_tokens!r}")
        self.draft, self.lookup, self.draft_tokens = draft, lookup, draft_tokens
        for need in ("needs_target_hidden", "needs_target_cache", "needs_committed_bound"):
            setattr(self, need, getattr(draft, need, False) is True)

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int, **shared) -> None:
        self.lookup.prefill(input_ids, q_seqlens, max_len)
        self.draft.prefill(input_ids, q_seqlens, max_len, **shared)
        self.template: DraftProposal | None = None  # the draft's last proposal, emptied: what its proposals are like

    def propose(self, num_tokens: int, sample: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        found = self.lookup.propose(num_tokens, sample)
        matched = found.num_tokens > 0
        if self.template is not None and matched.device.type == "cpu" and bool(matched.all()):
            # Shaped as the draft's proposals are (draft logits, trees), so that the loop's
            # draft lengths see one kind of drafter.
            return _merged(matched, found, _emptied(self.template, len(matched)))
        asked = num_tokens if self.draft_tokens is None else min(num_tokens, self.draft_tokens)
        drafted = self.draft.propose(asked, sample)
        self.template = _emptied(drafted, 1)
        return _merged(matched, found, drafted)

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor, **extras) -> None:
        self.lookup.commit(token_ids, num_tokens)
        self.draft.commit(token_ids, num_tokens, **extras)

    def select(self, rows: torch.Tensor) -> None:
        self.lookup.select(rows)
        self.draft.select(rows)


def _emptied(proposal: DraftProposal, rows: int) -> DraftProposal:
    """A proposal of ``rows`` rows and no tokens, with draft logits and parents where
    ``proposal`` has them (one zero column each)."""
    ids = proposal.token_ids.new_zeros(rows, 1)
    logits = None if proposal.logits is None else proposal.logits.new_zeros(rows, 1, proposal.logits.shape[-1])
    return DraftProposal(ids, ids[:, 0], logits, None if proposal.parents is None else ids - 1)


def _merged(matched: torch.Tensor, found: DraftProposal, drafted: DraftProposal) -> DraftProposal:
    """Row b of ``found`` where ``matched[b]``, else of ``drafted``, at the wider of their widths
    (`LookupFirstDraft`): one-hot logits for ``found``'s rows when ``drafted`` has logits, chains
    as one-branch trees when either has parents."""
    B, K = found.token_ids.shape[0], max(found.token_ids.shape[1], drafted.token_ids.shape[1])
    device, take = matched.device, matched[:, None]

    def widened(t: torch.Tensor, fill: float) -> torch.Tensor:
        pad = K - t.shape[1]
        return t if pad == 0 else torch.cat([t, t.new_full((B, pad, *t.shape[2:]), fill)], 1)

    ids = torch.where(take, widened(found.token_ids, 0), widened(drafted.token_ids, 0))
    drafted_num = drafted.num_tokens
    if drafted_num is None:
        drafted_num = torch.full((B,), drafted.token_ids.shape[1], dtype=torch.int64, device=device)
    num = torch.where(matched, found.num_tokens, drafted_num)
    parents = None
    if found.parents is not None or drafted.parents is not None:
        chain = torch.arange(-1, K - 1, device=device).expand(B, K)
        parents = torch.where(take, chain if found.parents is None else widened(found.parents, -1),
                              chain if drafted.parents is None else widened(drafted.parents, -1))
    logits = drafted.logits
    if logits is not None:
        logits = widened(logits, 0.0)
        one_hot = torch.full_like(logits, float("-inf")).scatter_(2, ids[..., None], 0.0)
        logits = torch.where(take[..., None], one_hot, logits)
    return DraftProposal(ids, num, logits, parents)


def _occurrences(context: torch.Tensor, context_lengths: torch.Tensor, n: int) -> torch.Tensor:
    """[B, L - n + 1] int64: where each row's last n-gram occurred earlier (start position at
    that position, -1 elsewhere). A match must end before the n-gram itself, so that a
    continuation exists."""
    L, device = context.shape[1], context.device
    tail = context.gather(1, (context_lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0))
    match = (context.unfold(1, n, 1) == tail[:, None, :]).all(-1)
    positions = torch.arange(L - n + 1, device=device)
    match &= (positions[None, :] + n < context_lengths[:, None]) & (context_lengths >= n + 1)[:, None]
    return torch.where(match, positions, -1)


def _check_lookup(context: torch.Tensor, context_lengths: torch.Tensor, k: int) -> None:
    """`PromptLookupDraft.lookup`'s argument checks (ValueError naming the argument; lengths on
    the device)."""
    if not is_int(k) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not isinstance(context, torch.Tensor) or context.dim() != 2 or context.dtype != torch.int64:
        got = f"{context.dtype} {tuple(context.shape)}" if isinstance(context, torch.Tensor) else type(context).__name__
        raise ValueError(f"context must be a [B, L] int64 tensor, got {got}")
    B, L = context.shape
    if L < 1:
        raise ValueError("context must have at least one column")
    check_lengths_tensor("context_lengths", context_lengths, B, context.device, on=f"{context.device} like context")
    device_check(((context_lengths >= 0) & (context_lengths <= L)).all(),
                 f"context_lengths must lie in 0..L={L} for every row")


def _checked_proposal(drafter, proposal, batch_size: int, asked: int, target_logits: torch.Tensor, check
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(token_ids [B, k], num_tokens [B], logits [B, k, V] or None, parents [B, k] or None)`` of
    ``drafter``'s answer to ``propose(asked, ...)``, checked: shapes, dtypes and devices on the
    host, ids in [0, V), counts in 0..k and parents in -1..i-1 on the device
    (`_LogitsCheck.flag` under "drafter": raised at once on CPU, at the step's transfer on CUDA,
    where out-of-range values are made harmless until then)."""
    name = type(drafter).__name__
    device, V = target_logits.device, target_logits.shape[-1]
    if not isinstance(proposal, DraftProposal):
        raise TypeError(f"drafter {name}.propose must return a DraftProposal, got {type(proposal).__name__}")
    ids, num, logits = proposal.token_ids, proposal.num_tokens, proposal.logits
    if not (isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 2
            and ids.shape[0] == batch_size and 1 <= ids.shape[1] <= asked and ids.device == device):
        got = f"{ids.dtype} {list(ids.shape)} on {ids.device}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"drafter {name} proposed token_ids {got}; asked for up to {asked} tokens of "
                         f"{batch_size} rows, it must return an int64 [{batch_size}, k] tensor with "
                         f"1 <= k <= {asked} on {device}")
    k = ids.shape[1]
    if num is None:
        num = torch.full((batch_size,), k, dtype=torch.int64, device=device)
    elif not (isinstance(num, torch.Tensor) and num.dtype == torch.int64 and num.shape == (batch_size,)
              and num.device == device):
        got = f"{num.dtype} {list(num.shape)} on {num.device}" if isinstance(num, torch.Tensor) else type(num).__name__
        raise ValueError(f"drafter {name} proposed num_tokens {got}; it must be None or an int64 "
                         f"[{batch_size}] tensor on {device}")
    if logits is not None and not (isinstance(logits, torch.Tensor) and logits.shape == (batch_size, k, V)
                                   and logits.dtype == target_logits.dtype and logits.device == device):
        got = (f"{logits.dtype} {list(logits.shape)} on {logits.device}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise ValueError(f"drafter {name} proposed logits {got}; they must be None or {target_logits.dtype} "
                         f"[{batch_size}, {k}, {V}] on {device} like the target's")
    parents = proposal.parents
    if parents is not None and not (isinstance(parents, torch.Tensor) and parents.dtype == torch.int64
                                    and parents.shape == ids.shape and parents.device == device):
        got = (f"{parents.dtype} {list(parents.shape)} on {parents.device}" if isinstance(parents, torch.Tensor)
               else type(parents).__name__)
        raise ValueError(f"drafter {name} proposed parents {got}; they must be None or int64 {list(ids.shape)} "
                         f"on {device} like its token_ids")
    steps = torch.arange(k, device=device)
    real = steps < num[:, None]
    bad = (((ids < 0) | (ids >= V)) & real).any() | ((num < 0) | (num > k)).any()
    if parents is not None:
        bad |= (((parents < -1) | (parents >= steps)) & real).any()
    check.flag("drafter", bad, f"drafter {name} proposed token ids outside [0, {V}), num_tokens outside "
                               f"0..{k} (the width of its token_ids) or parents outside -1..i-1")
    if check.deferred:  # harmless until the step's transfer raises
        num = num.clamp(0, k)
        real = steps < num[:, None]
    if parents is not None:  # padding nodes hang from the root, never read
        parents = torch.where(real, parents.clamp(-1, k - 1).minimum(steps - 1), -1)
    # Padding is fed to the target with the drafts (and never kept): make it a valid id.
    return torch.where(real, ids.clamp(0, V - 1) if check.deferred else ids, 0), num, logits, parents
