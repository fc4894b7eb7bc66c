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
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .cache import KVCache
from .config import LlamaConfig
from .drafts import DraftProposal, _tighter
from .matmul import Linear
from .model import Block, Llama, RMSNorm

HEAD_FORMAT = 1  # version of the file layout `FeatureHead.save` writes


class FeatureHead(nn.Module):
    """EAGLE-style draft head for a `Llama` target (trainable part only).

    Args:
        config: the target's `LlamaConfig` (the layer has the target's width, heads and MLP size).
        draft_vocab: [Vd] int64, distinct ids of the target vocabulary the head drafts from.

    Attributes:
        feature_norm, embedding_norm: `RMSNorm` of the features and of the token embeddings.
        fc: ``Linear(2H, H)`` over ``[normalized feature, normalized embedding]``.
        layer: one decoder `Block` of the target's shape.
        draft_vocab: the ids (a buffer, saved with the head).

    Example::

        head = FeatureHead.load("head.pt")             # or FeatureHead(target.config, ids)
        out = speculative_generate(target, FeatureHeadDraft(target, head), input_ids, max_new_tokens=64)
    """

    def __init__(self, config: LlamaConfig, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        if (not isinstance(draft_vocab, torch.Tensor) or draft_vocab.dim() != 1 or draft_vocab.dtype != torch.int64
                or len(draft_vocab) == 0):
            raise ValueError(f"draft_vocab must be a non-empty [Vd] int64 tensor, got "
                             f"{getattr(draft_vocab, 'dtype', type(draft_vocab).__name__)} "
                             f"{list(getattr(draft_vocab, 'shape', []))}")
        if (draft_vocab.min() < 0 or draft_vocab.max() >= config.vocab_size
                or len(draft_vocab.unique()) != len(draft_vocab)):
            raise ValueError(f"draft_vocab must hold distinct ids in [0, {config.vocab_size})")
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
        state = {k: (v.to(dtype) if v.is_floating_point() else v).cpu() for k, v in self.state_dict().items()}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"format": HEAD_FORMAT, "kind": "feature", "config": asdict(self.config), "state": state}, tmp)
        os.replace(tmp, path)

    @staticmethod
    def load(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> FeatureHead:
        """Read a head `save` wrote; a ValueError names a file that is not one."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"no draft head file at {path}")
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            if data.get("format") != HEAD_FORMAT or data.get("kind") != "feature":
                raise ValueError(f"format {data.get('format')!r}, kind {data.get('kind')!r}")
            head = FeatureHead(LlamaConfig(**data["config"]), data["state"]["draft_vocab"])
            head.load_state_dict(data["state"])
        except Exception as e:
            raise ValueError(f"{path} is not a feature draft head this version reads ({type(e).__name__}: {e})") from e
        return head.to(device=device, dtype=dtype).eval()


def _check_head_fits(target, head: FeatureHead) -> None:
    config = getattr(target, "config", None)
    if not isinstance(target, Llama) or not isinstance(config, LlamaConfig):
        raise TypeError(f"FeatureHeadDraft needs the built-in Llama as its target, got {type(target).__name__}")
    mine = {k: v for k, v in asdict(head.config).items() if k != "num_hidden_layers"}
    theirs = {k: v for k, v in asdict(config).items() if k != "num_hidden_layers"}
    if mine != theirs:
        diff = {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}
        raise ValueError(f"the head was trained for another target: (head, target) differ in {diff}")


def _head_model(target: Llama, head: FeatureHead) -> Llama:
    """The head as a one-layer `Llama` over the target's embedding and final norm, with an LM head
    of the draft vocabulary's rows (a copy: the target may lay out its own weight otherwise)."""
    config = LlamaConfig(**{**asdict(target.config), "num_hidden_layers": 1, "vocab_size": len(head.draft_vocab),
                            "tie_word_embeddings": False})
    model = Llama.__new__(Llama)
    nn.Module.__init__(model)
    model.config = config
    model.tok_embeddings, model.norm = target.tok_embeddings, target.norm
    model.layers = nn.ModuleList([head.layer])
    weight = target.output.weight
    model.output = Linear(config.hidden_size, config.vocab_size).to(weight)
    with torch.no_grad():
        model.output.weight.copy_(weight.index_select(0, head.draft_vocab.to(weight.device)))
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

    Args:
        target: the built-in `Llama` the head was trained for.
        head: the trained `FeatureHead`, moved in place to the target's device and dtype; when
            the target's weights are packed (`Llama.pack_weights`) at construction, the head's
            are packed with the same plan (read once: a later change of the target's is not
            followed).

    Example::

        head = load_smollm2_draft()
        out = speculative_generate(target, FeatureHeadDraft(target, head), input_ids, max_new_tokens=64,
                                   temperature=0)
    """

    needs_target_hidden = needs_committed_bound = True

    def __init__(self, target, head: FeatureHead) -> None:
        _check_head_fits(target, head)
        weight = target.output.weight
        self.target, self.head = target, head.to(device=weight.device, dtype=weight.dtype).eval()
        self.model = _head_model(target, self.head)
        self.vocab = self.head.draft_vocab
        plan = getattr(target.output, "plan", None)
        if plan is not None:  # a packed target: the head's matmuls take the same forms
            self.model.pack_weights(plan=plan)
            self.head.fc.pack(plan)

    def prefill(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor, max_len: int, *,
                hidden_states: torch.Tensor) -> None:
        B, P = input_ids.shape
        if hidden_states.shape[:2] != (B, P):
            raise ValueError(f"hidden_states must be [B, P, H] = [{B}, {P}, H], got {list(hidden_states.shape)}")
        self.cache: KVCache = self.model.new_cache(B, max_len)
        # Pending (feature at t, token t + 1) pairs the cache has not read: the prompt's, for now.
        self.ids, self.features, self.pending = input_ids[:, 1:], hidden_states[:, :-1], q_seqlens - 1
        self.longest = P  # host bound on every row's committed token count

    def commit(self, token_ids: torch.Tensor, num_tokens: torch.Tensor, *, hidden_states: torch.Tensor,
               committed_bound: int | None = None) -> None:
        self.ids = _append_ragged(self.ids, self.pending, token_ids, num_tokens)
        self.features = _append_ragged(self.features, self.pending, hidden_states.to(self.features.dtype), num_tokens)
        self.pending = self.pending + num_tokens
        self.longest = _tighter(self.longest + token_ids.shape[1], committed_bound)

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
        tokens, all_logits = [], []
        for i in range(num_tokens):
            full = self._full_vocab(logits[:, -1])
            token = sample(full)
            tokens.append(token)
            all_logits.append(full)
            if i + 1 < num_tokens:  # the head's own feature and its draft token, one position on
                logits, feature = self._forward(token[:, None], feature[:, -1:], None, last_only=False,
                                                max_seqlen=read + i + 1)
        self.cache.crop(committed)
        return DraftProposal(torch.stack(tokens, 1), None, torch.stack(all_logits, 1))

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

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] target-vocabulary logits from [B, Vd] draft-vocabulary ones (-inf elsewhere)."""
        full = logits.new_full((logits.shape[0], self.target.vocab_size), float("-inf"))
        return full.index_copy_(1, self.vocab, logits)
