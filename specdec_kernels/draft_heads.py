"""Trained draft heads: a small network that drafts for the target from the target's own features.

`FeatureHead` is an EAGLE-style head: one decoder layer over ``fc([feature, embedding])``, where
the feature is the target's last-layer hidden state (before the final norm) at a position and the
embedding is that of the token that position produced. Its output predicts the target's feature
one position on; the target's final norm and (pruned) LM head turn that into draft logits. For
the 2nd .. K-th draft token the head reads its own predicted features (EAGLE-1).

The head shares the target's embedding, final norm and LM head (frozen): only ``fc`` and the
layer are trained (`specdec_kernels.draft_training`). Its LM head keeps the rows of a *draft
vocabulary*, the ids the target most often produces (FR-Spec / EAGLE-3), so drafting costs a
fraction of a full head; the draft's distribution is zero outside it, and verification still
runs over the whole vocabulary, so speculative decoding stays lossless.

`FeatureHeadDraft` is the head as a `Drafter` (``needs_target_hidden``): it follows the committed
text in a one-layer KV cache of its own.

`ExitHead` is early exit with a trained adapter (Kangaroo, Liu et al. 2024): the
target's own first layers, then a small trained adapter block, then the target's final norm and
(pruned) LM head. `ExitHeadDraft` drafts with it in the target's KV cache, as `EarlyExitDraft`
does: the first layers' keys and values of committed tokens are the target's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ._checks import is_int
from .cache import KVCache
from .config import LlamaConfig
from .drafts import DraftProposal, EarlyExitDraft, _tighter
from .matmul import Linear, MatmulPlan, bfloat16_matmuls_available, bfloat16_plan
from .model import Block, FeedForward, Llama, RMSNorm

HEAD_FORMAT = 1  # version of the file layout `FeatureHead.save` and `ExitHead.save` write
DEFAULT_TREE_DEPTH = 4  # a tree's levels when `FeatureHeadDraft` is not told


class FeatureHead(nn.Module):
    """EAGLE-style draft head for a `Llama` target (trainable part only).

    Args:
        config: the target's `LlamaConfig` (the layer has the target's width, heads and MLP size).
        draft_vocab: [Vd] int64, distinct ids of the target vocabulary the head drafts from.

    Attributes:
        feature_norm, embedding_norm: `RMSNorm` of the features and of the token embeddings.
        fc: ``Linear(2H, H)`` over ``[normalized feature, normalized embedding]``.
        layer: one decoder `Block` of the target's shape.
        draft_vocab: the ids (a buffer, saved with the head); training orders them most frequent
            first in its data, so a drafter's ``draft_vocab_size`` keeps the most frequent.

    Example::

        head = FeatureHead.load("head.pt")             # or FeatureHead(target.config, ids)
        out = speculative_generate(target, FeatureHeadDraft(target, head), input_ids, max_new_tokens=64)
    """

    def __init__(self, config: LlamaConfig, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        _check_vocab(draft_vocab, config.vocab_size)
        self.config = config
        self.feature_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = Linear(2 * config.hidden_size, config.hidden_size)
        self.layer = Block(config)
        self.register_buffer("draft_vocab", draft_vocab.clone())

    def input_vectors(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """The layer's input [..., H] from features and token embeddings (both [..., H]). Both are
        normalized first: a target's hidden states carry a few huge dimensions, and its token
        embeddings are an order of magnitude smaller than the normalized features."""
        return self.fc(torch.cat([self.feature_norm(features), self.embedding_norm(embeddings)], -1))

    def save(self, path: str | os.PathLike, *, dtype: torch.dtype = torch.float16) -> None:
        """Write the head (config, draft vocabulary, weights in ``dtype``) to ``path``, atomically."""
        _save_head(self, "feature", {}, path, dtype)

    @staticmethod
    def load(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> FeatureHead:
        """Read a head `save` wrote; a ValueError names a file that is not one."""
        return _load_head(path, "feature", lambda data, vocab: FeatureHead(LlamaConfig(**data["config"]), vocab),
                          dtype, device)


class ExitHead(nn.Module):
    """Early exit with a trained adapter, for a `Llama` target (trainable part only): the target's
    hidden state after its first ``exit_layer`` layers goes through ``h + adapter(norm(h))`` (a
    SwiGLU block of the target's MLP shape), then the target's final norm and the rows of its LM
    head for ``draft_vocab``. The adapter reads no other position: the target's own first layers
    have mixed the context, so drafting needs no cache beyond the target's.

    Args:
        config: the target's `LlamaConfig`.
        exit_layer: how many of the target's first layers run (1 .. its depth - 1).
        draft_vocab: [Vd] int64, distinct ids of the target vocabulary the head drafts from
            (training orders them most frequent first, as for `FeatureHead`).

    Example::

        head = ExitHead.load("exit-head.pt")
        out = speculative_generate(target, ExitHeadDraft(target, head), input_ids, max_new_tokens=64)
    """

    def __init__(self, config: LlamaConfig, exit_layer: int, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        if not is_int(exit_layer) or not 1 <= exit_layer < config.num_hidden_layers:
            raise ValueError(f"exit_layer must be an int in [1, {config.num_hidden_layers - 1}], got {exit_layer!r}")
        _check_vocab(draft_vocab, config.vocab_size)
        self.config, self.exit_layer = config, int(exit_layer)
        self.adapter_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.adapter = FeedForward(config)
        self.register_buffer("draft_vocab", draft_vocab.clone())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The adapted hidden state [..., H] from the exit layer's output [..., H]."""
        return hidden + self.adapter(self.adapter_norm(hidden))

    def save(self, path: str | os.PathLike, *, dtype: torch.dtype = torch.float16) -> None:
        """Write the head (config, exit layer, draft vocabulary, weights in ``dtype``) to ``path``, atomically."""
        _save_head(self, "early-exit", {"exit_layer": self.exit_layer}, path, dtype)

    @staticmethod
    def load(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> ExitHead:
        """Read a head `save` wrote; a ValueError names a file that is not one."""
        return _load_head(path, "early-exit",
                          lambda data, vocab: ExitHead(LlamaConfig(**data["config"]), data["exit_layer"], vocab),
                          dtype, device)


def _check_vocab(draft_vocab: torch.Tensor, vocab_size: int) -> None:
    if (not isinstance(draft_vocab, torch.Tensor) or draft_vocab.dim() != 1 or draft_vocab.dtype != torch.int64
            or len(draft_vocab) == 0):
        raise ValueError(f"draft_vocab must be a non-empty [Vd] int64 tensor, got "
                         f"{getattr(draft_vocab, 'dtype', type(draft_vocab).__name__)} "
                         f"{list(getattr(draft_vocab, 'shape', []))}")
    if draft_vocab.min() < 0 or draft_vocab.max() >= vocab_size or len(draft_vocab.unique()) != len(draft_vocab):
        raise ValueError(f"draft_vocab must hold distinct ids in [0, {vocab_size})")


def _save_head(head: nn.Module, kind: str, extra: dict, path: str | os.PathLike, dtype: torch.dtype) -> None:
    state = {k: (v.to(dtype) if v.is_floating_point() else v).cpu() for k, v in head.state_dict().items()}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": HEAD_FORMAT, "kind": kind, "config": asdict(head.config), **extra, "state": state}, tmp)
    os.replace(tmp, path)


def _load_head(path: str | os.PathLike, kind: str, build, dtype: torch.dtype, device: torch.device | str):
    """The head of ``kind`` at ``path``: ``build(data, draft_vocab)`` makes it, then its weights load."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no draft head file at {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("format") != HEAD_FORMAT or data.get("kind") != kind:
            raise ValueError(f"format {data.get('format')!r}, kind {data.get('kind')!r}")
        head = build(data, data["state"]["draft_vocab"])
        head.load_state_dict(data["state"])
    except Exception as e:
        raise ValueError(f"{path} is not a draft head of kind {kind!r} that this version reads "
                         f"({type(e).__name__}: {e})") from e
    return head.to(device=device, dtype=dtype).eval()


def _drafting_vocab(head: FeatureHead | ExitHead, draft_vocab_size: int | None) -> torch.Tensor:
    """The ids a drafter drafts from: the first ``draft_vocab_size`` of ``head.draft_vocab``, or
    all of them (None)."""
    if draft_vocab_size is None:
        return head.draft_vocab
    if not is_int(draft_vocab_size) or not 1 <= draft_vocab_size <= len(head.draft_vocab):
        raise ValueError(f"draft_vocab_size must be None or an int in [1, {len(head.draft_vocab)}] (the head's "
                         f"draft vocabulary), got {draft_vocab_size!r}")
    return head.draft_vocab[:draft_vocab_size]


def _check_head_fits(target, head: FeatureHead | ExitHead) -> None:
    config = getattr(target, "config", None)
    if not isinstance(target, Llama) or not isinstance(config, LlamaConfig):
        raise TypeError(f"a draft head needs the built-in Llama as its target, got {type(target).__name__}")
    mine = {k: v for k, v in asdict(head.config).items() if k != "num_hidden_layers"}
    theirs = {k: v for k, v in asdict(config).items() if k != "num_hidden_layers"}
    if mine != theirs:
        diff = {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}
        raise ValueError(f"the head was trained for another target: (head, target) differ in {diff}")


def _head_plan(target: Llama, matmul_dtype: torch.dtype | None) -> MatmulPlan | None:
    """The plan of a head's own matmuls (its layer or adapter, ``fc``, its LM head) for
    ``matmul_dtype`` (see `FeatureHeadDraft`): `bfloat16_plan` for bfloat16, else the target's
    plan (None: unpacked)."""
    weight = target.output.weight
    cpu_float32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if matmul_dtype is None:
        matmul_dtype = torch.bfloat16 if cpu_float32 and bfloat16_matmuls_available() else weight.dtype
    if matmul_dtype == weight.dtype:
        return getattr(target.output, "plan", None)
    if matmul_dtype != torch.bfloat16 or not cpu_float32:
        raise ValueError(f"matmul_dtype must be None, the target's dtype ({weight.dtype}) or torch.bfloat16 for a "
                         f"CPU float32 target, got {matmul_dtype!r} for a {weight.dtype} target on {weight.device}")
    plan = bfloat16_plan()
    if plan is None:
        raise RuntimeError("matmul_dtype=torch.bfloat16 needs oneDNN's native bfloat16 matmul (a CPU with "
                           "AVX-512 BF16 or AMX) or the panels form (specdec_kernels.matmul.panels_available), "
                           "which this machine or torch build lacks")
    return plan


def _set_matmuls(modules: list[nn.Module], plan: MatmulPlan | None) -> None:
    """Pack every `Linear` in ``modules`` with ``plan``, or unpack them (None)."""
    for module in modules:
        for linear in (m for m in module.modules() if isinstance(m, Linear)):
            linear.unpack() if plan is None else linear.pack(plan)


def _draft_model(target: Llama, layers: list[nn.Module], vocab: torch.Tensor) -> Llama:
    """``layers`` as a `Llama` over the target's embedding and final norm, with an LM head of the
    rows ``vocab`` of the target's (a copy: the target may lay out its own weight otherwise)."""
    config = LlamaConfig(**{**asdict(target.config), "num_hidden_layers": len(layers), "vocab_size": len(vocab),
                            "tie_word_embeddings": False})
    model = Llama.__new__(Llama)
    nn.Module.__init__(model)
    model.config = config
    model.tok_embeddings, model.norm = target.tok_embeddings, target.norm
    model.layers = nn.ModuleList(layers)
    weight = target.output.weight
    model.output = Linear(config.hidden_size, config.vocab_size).to(weight)
    with torch.no_grad():
        model.output.weight.copy_(weight.index_select(0, vocab.to(weight.device)))
    model._inv_freq = None
    model.weights_lock = target.weights_lock
    return model.eval()


def _append_ragged(buffer: torch.Tensor, lengths: torch.Tensor, new: torch.Tensor, num_new: torch.Tensor
                   ) -> torch.Tensor:
    """[B, W + N, ...]: row b's first ``lengths[b]`` entries of ``buffer`` [B, W, ...], then its
    first ``num_new[b]`` of ``new`` [B, N, ...]; what follows is padding, never read (the
    forwards' ``q_seqlens`` mask it). No host sync."""
    B, W, N = buffer.shape[0], buffer.shape[1], new.shape[1]
    out = torch.cat([buffer, new.new_zeros(B, N + 1, *new.shape[2:])], 1)  # + a spare column for padding
    offsets = torch.arange(N, device=new.device)
    columns = torch.where(offsets < num_new[:, None], lengths[:, None] + offsets, W + N)  # [B, N]
    index = columns.view(B, N, *([1] * (new.dim() - 2))).expand_as(new)
    return out.scatter_(1, index, new)[:, :W + N]


class FeatureHeadDraft:
    """A `Drafter` from a trained `FeatureHead`: the target's features in, draft tokens out.

    It keeps a one-layer KV cache of its own holding, at position t, the head's layer over
    ``(target feature at t, embedding of token t + 1)``. Committed tokens arrive with the target's
    features (``needs_target_hidden``); they are read in one ragged forward when it next proposes,
    whose last output drafts the first token; each further draft token is one one-token forward
    over the head's own predicted feature. Draft entries are cropped after proposing: the cache
    only ever holds the target's true features.

    With ``branches`` > 1 it proposes a token tree instead of a chain (EAGLE-2's dynamic tree):
    the ``branches`` most likely children of the root; then, ``depth - 1`` times, the
    ``branches`` most likely children of each of the ``branches`` frontier nodes whose paths the
    head finds most likely (the product of its probabilities along the path); of all those
    candidates, the ``num_tokens`` most likely paths' nodes, most likely first (a parent always
    precedes its children, so a row cut to fewer nodes keeps the best ones). Each depth is one
    forward of the head over every frontier node's path so far, under their ancestor mask. The
    tree's tokens are deterministic proposals (no draft logits; lossless under sampling too, by
    the point-mass rule of `tree_rejection_sample`).

    Args:
        target: the built-in `Llama` the head was trained for.
        head: the trained `FeatureHead`, moved in place to the target's device and dtype, its
            ``fc`` and layer set up in place for ``matmul_dtype`` (each drafter has its own copy
            of the LM head; a head shared by two drafters computes its ``fc`` and layer as the
            later one set them up).
        branches: 1 for a chain (each token sampled with the run's ``sample``, its draft logits
            given to the verifier), or the children per expanded node of a tree.
        depth: a tree's levels (one head forward each; the first reads the committed pairs),
            capped by ``num_tokens``; None: `DEFAULT_TREE_DEPTH`. Ignored for a chain.
        matmul_dtype: the dtype the head's matmuls (its layer, ``fc`` and LM head) read their
            weights in. ``torch.bfloat16`` (CPU float32 targets): copies of those weights in
            bfloat16, for the package's panels kernel at a few rows and oneDNN's matmul at
            more (`specdec_kernels.matmul.bfloat16_plan`); inputs, outputs, the head's cache
            and everything else stay float32. Drafting reads half the
            bytes (docs/performance.md measures what that saves); the draft
            logits move in their third significant digit, which verification takes as they
            are: outputs stay the target's (greedy) or distributed as the target's (sampling).
            The target's dtype: the head computes as the target does (on a packed target, with
            its plan). None (default): bfloat16 where the CPU computes it natively
            (`specdec_kernels.matmul.bfloat16_matmuls_available`) and the target is CPU
            float32, else the target's dtype.
        draft_vocab_size: draft from the first this many ids of ``head.draft_vocab`` (training
            orders them most frequent first in its data), or all of them (None, default). Each
            draft token runs an LM head over these ids, the largest matmul of a draft step: fewer
            ids draft faster and can propose fewer tokens (verification stays over the whole
            vocabulary, so the output never changes).

    Example::

        chain = load_smollm2_draft(target)                              # a FeatureHeadDraft
        out = speculative_generate(target, chain, input_ids, max_new_tokens=64, temperature=0)
        tree = load_smollm2_draft(target, branches=4)                   # trees of up to K nodes
        out = speculative_generate(target, tree, input_ids, num_draft_tokens=7, max_new_tokens=64)
    """

    needs_target_hidden = needs_committed_bound = True

    def __init__(self, target, head: FeatureHead, *, branches: int = 1, depth: int | None = None,
                 matmul_dtype: torch.dtype | None = None, draft_vocab_size: int | None = None) -> None:
        if not is_int(branches) or branches < 1:
            raise ValueError(f"branches must be an int >= 1, got {branches!r}")
        if depth is not None and (not is_int(depth) or depth < 1):
            raise ValueError(f"depth must be None or an int >= 1, got {depth!r}")
        if not isinstance(head, FeatureHead):
            raise TypeError(f"head must be a FeatureHead, got {type(head).__name__}")
        _check_head_fits(target, head)
        vocab = _drafting_vocab(head, draft_vocab_size)
        if branches > len(vocab):
            raise ValueError(f"branches={branches} exceeds the draft vocabulary of {len(vocab)} ids")
        if branches > 1 and target.config.sliding_window is not None:
            raise ValueError("token trees from a head need attention without a sliding window (the target has "
                             f"sliding_window={target.config.sliding_window}); use branches=1")
        self.branches, self.depth = int(branches), DEFAULT_TREE_DEPTH if depth is None else int(depth)
        plan = _head_plan(target, matmul_dtype)
        weight = target.output.weight
        self.target, self.head = target, head.to(device=weight.device, dtype=weight.dtype).eval()
        self.vocab = vocab.to(weight.device)
        self.model = _draft_model(target, [self.head.layer], self.vocab)
        _set_matmuls([self.head.fc, self.head.layer, self.model.output], plan)

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int, *,
                hidden_states: torch.Tensor) -> None:
        B, P = input_ids.shape
        if hidden_states.shape[:2] != (B, P):
            raise ValueError(f"hidden_states must be [B, P, H] = [{B}, {P}, H], got {list(hidden_states.shape)}")
        # A tree feeds up to (depth - 1) * branches pairs past the committed ones at once.
        spare = (self.depth - 1) * self.branches if self.branches > 1 else 0
        self.cache: KVCache = self.model.new_cache(B, max_len + spare)
        # Pending (feature at t, token t + 1) pairs the cache has not read: the prompt's, for now.
        self.ids, self.features, self.pending = input_ids[:, 1:], hidden_states[:, :-1], q_seqlens - 1
        self.longest = P  # host bound on every row's committed token count

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor, *, hidden_states: torch.Tensor,
               committed_bound: int | None = None) -> None:
        self.ids = _append_ragged(self.ids, self.pending, token_ids, num_tokens)
        self.features = _append_ragged(self.features, self.pending, hidden_states.to(self.features.dtype), num_tokens)
        self.pending = self.pending + num_tokens
        self.longest = _tighter(self.longest + token_ids.shape[1], committed_bound)
        if self.ids.device.type == "cpu":
            # Each commit widens the buffers by its padded width. Until the next proposal reads
            # them (steps without one: plain steps, `LookupFirstDraft`'s lookup steps) only the
            # longest row's pending pairs need keeping, and on the CPU reading that is free.
            width = int(self.pending.max())
            self.ids, self.features = self.ids[:, :width], self.features[:, :width]

    def propose(self, num_tokens: int, sample: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        # The cache reads the pending pairs (one per committed token but the first) in one forward;
        # each row's last output is the predicted feature of its next position.
        read = self.longest - 1  # host bound on the pairs in the cache after that forward
        width = self.ids.shape[1]
        logits, feature = self._forward(self.ids, self.features, self.pending, last_only=True,
                                        max_seqlen=max(read, width))
        committed = self.cache.lengths.clone()
        self.ids, self.features = self.ids[:, :0], self.features[:, :0]
        self.pending = torch.zeros_like(self.pending)
        if self.branches > 1:
            proposal = self._tree(logits[:, -1], feature, committed, read, num_tokens)
            self.cache.crop(committed)
            return proposal
        # The proposal's target-vocabulary logits, filled once: each draft token's row is written
        # in place (one op per token, not a fill, a copy and a final stack).
        full = logits.new_full((logits.shape[0], num_tokens, self.target.vocab_size), float("-inf"))
        tokens = []
        for i in range(num_tokens):
            token = sample(full[:, i].index_copy_(-1, self.vocab, logits[:, -1]))
            tokens.append(token)
            if i + 1 < num_tokens:  # the head's own feature and its draft token, one position on
                logits, feature = self._forward(token[:, None], feature[:, -1:], None, last_only=False,
                                                max_seqlen=read + i + 1)
        self.cache.crop(committed)
        return DraftProposal(torch.stack(tokens, 1), None, full)

    def _tree(self, logits: torch.Tensor, feature: torch.Tensor, committed: torch.Tensor, read: int,
              num_tokens: int) -> DraftProposal:
        """The tree (class docstring) grown from the root's draft logits ``logits`` [B, Vd] and
        predicted feature ``feature`` [B, 1, H]; the cache holds the committed pairs (lengths
        ``committed``, at most ``read``)."""
        B, k, H = logits.shape[0], self.branches, feature.shape[-1]
        device = logits.device
        score, local = torch.log_softmax(logits.float(), -1).topk(k, -1)  # the root's children [B, k]
        scores, ids, parents = [score], [local], [torch.full((B, k), -1, device=device)]  # candidates, by depth
        beam, beam_score = torch.arange(k, device=device).expand(B, k), score  # candidate index of each
        fed_ids = fed_features = None  # the pairs of every expanded node so far, [B, n] and [B, n, H]
        mask = torch.zeros(B, 0, 0, dtype=torch.bool, device=device)  # their ancestor mask [B, n, n]
        new_features, new_parents = feature.expand(B, k, H), torch.full((B, k), -1, device=device)
        for _ in range(1, min(self.depth, num_tokens)):
            # Expand the beam: its nodes' pairs (parent's predicted feature, node's token) join the
            # fed ones; each sees the committed pairs, its ancestors' pairs and itself.
            n = mask.shape[1]
            beam_ids = self.vocab[torch.cat(ids, 1).gather(1, beam)]
            fed_ids = beam_ids if fed_ids is None else torch.cat([fed_ids, beam_ids], 1)
            fed_features = new_features if fed_features is None else torch.cat([fed_features, new_features], 1)
            rows = torch.cat([mask, mask.new_zeros(B, n, k)], 2)
            itself = torch.eye(k, dtype=torch.bool, device=device)
            new_rows = torch.cat([mask.new_zeros(B, k, n), itself.expand(B, k, k)], 2)
            if n:  # and its ancestors' pairs: its parent's row
                new_rows |= rows.gather(1, new_parents[..., None].expand(B, k, n + k))
            mask = torch.cat([rows, new_rows], 1)
            self.cache.crop(committed)
            inputs = self.head.input_vectors(fed_features, self.target.tok_embeddings(fed_ids))
            hidden = self.model(fed_ids, self.cache, max_seqlen=read + n + k, hidden_only=True, inputs_embeds=inputs,
                                tree_mask=mask)
            hidden = hidden[:, n:]  # the beam's outputs: its nodes' children's features [B, k, H]
            child_logp = torch.log_softmax(self.model.output(self.model.norm(hidden)).float(), -1)
            score, local = (beam_score[..., None] + child_logp).topk(k, -1)  # [B, k beam nodes, k children]
            first = sum(s.shape[1] for s in scores)
            scores.append(score.flatten(1))
            ids.append(local.flatten(1))
            parents.append(beam[..., None].expand(B, k, k).flatten(1))
            # The next beam: the most likely of these children; their pairs carry their parents' outputs.
            beam_score, best = score.flatten(1).topk(k, -1)
            slot = best // k  # the beam node each is a child of
            beam = first + best
            new_features = hidden.gather(1, slot[..., None].expand(B, k, H))
            new_parents = n + slot
        # The num_tokens most likely candidates, in order; on equal scores the earlier (a parent
        # precedes its children), so the kept set holds every kept node's parent.
        score, ids, parents = (torch.cat(t, 1) for t in (scores, ids, parents))
        order = score.sort(dim=-1, descending=True, stable=True).indices[:, :num_tokens]  # [B, N]
        position = torch.full_like(score, -1, dtype=torch.int64).scatter_(
            1, order, torch.arange(order.shape[1], device=device).expand_as(order))
        parent = parents.gather(1, order)
        parent = torch.where(parent >= 0, position.gather(1, parent.clamp(min=0)), -1)
        return DraftProposal(self.vocab[ids.gather(1, order)], None, None, parent)

    def select(self, rows: torch.Tensor) -> None:
        self.cache = self.cache.select(rows)
        self.ids, self.features, self.pending = self.ids[rows], self.features[rows], self.pending[rows]

    def _forward(self, ids: torch.Tensor, features: torch.Tensor, q_seqlens: torch.Tensor | None, *,
                 last_only: bool, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-vocabulary logits and the head's output features (the last per row with
        ``last_only``), for the pairs (``features`` [B, T, H], ``ids`` [B, T])."""
        inputs = self.head.input_vectors(features, self.target.tok_embeddings(ids))
        logits, hidden = self.model(ids, self.cache, q_seqlens, last_only=last_only, max_seqlen=max_seqlen,
                                    return_hidden=True, inputs_embeds=inputs)
        if last_only:  # each row's last real pair (q_seqlens given)
            hidden = hidden.gather(1, (q_seqlens - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))
        return logits, hidden


def _full_vocab(logits: torch.Tensor, vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V] target-vocabulary logits from [..., Vd] draft-vocabulary ones (-inf elsewhere)."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab, logits)


class _Adapter(nn.Module):
    """An `ExitHead`'s adapter as a layer of a `Llama` (it reads no cache)."""

    def __init__(self, head: ExitHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int, step) -> torch.Tensor:
        return self.head(x)


class ExitHeadDraft(EarlyExitDraft):
    """A `Drafter` from a trained `ExitHead`: the target's first layers, in the target's own KV
    cache (as `EarlyExitDraft`: no prefill, no committed token read twice), then the adapter and
    the draft vocabulary's LM head; draft logits are -inf outside the draft vocabulary.

    Args:
        target: the built-in `Llama` the head was trained for (the same object is the target of
            ``speculative_generate``).
        head: the trained `ExitHead`, moved in place to the target's device and dtype.
        cuda_graphs: replay the draft's one-token forwards as CUDA graphs, as in `generate`.
        matmul_dtype: the dtype the adapter's and LM head's matmuls read their weights in, as
            for `FeatureHeadDraft` (default: bfloat16 on a CPU float32 target where the CPU
            computes it natively); the target's first layers always run as the target's.
        draft_vocab_size: draft from the first this many ids of ``head.draft_vocab``, as for
            `FeatureHeadDraft` (None, default: all).

    Example::

        head = ExitHead.load("exit-head.pt")
        out = speculative_generate(target, ExitHeadDraft(target, head), input_ids, max_new_tokens=64)
    """

    def __init__(self, target, head: ExitHead, *, cuda_graphs: bool | None = None,
                 matmul_dtype: torch.dtype | None = None, draft_vocab_size: int | None = None) -> None:
        if not isinstance(head, ExitHead):
            raise TypeError(f"head must be an ExitHead, got {type(head).__name__}")
        _check_head_fits(target, head)
        vocab = _drafting_vocab(head, draft_vocab_size)
        plan = _head_plan(target, matmul_dtype)
        super().__init__(target, head.exit_layer, cuda_graphs=cuda_graphs)
        weight = target.output.weight
        self.head = head.to(device=weight.device, dtype=weight.dtype).eval()
        self.vocab, self.vocab_size = vocab.to(weight.device), target.vocab_size
        # The target's first layers (shared: they write the target's cache), then the adapter.
        self.model = _draft_model(target, [*target.layers[:head.exit_layer], _Adapter(self.head)], self.vocab)
        _set_matmuls([self.head.adapter, self.model.output], plan)  # (not the target's layers it shares)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        return _full_vocab(logits, self.vocab, self.vocab_size)
