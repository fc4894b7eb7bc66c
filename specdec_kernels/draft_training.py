"""Training a draft head on distillation shards (`specdec_kernels.draft_data`), in resumable pieces.

Two kinds (`TrainSettings.head`): a `FeatureHead` (below) and an `ExitHead`, trained to give the
target's distribution at position t from the target's own hidden state after its first
``exit_layer`` layers there (computed from the shard's tokens by the frozen target, each batch).

The head at pair position t reads ``(target feature h_t, token x_{t+1})`` and is trained to give
the target's distribution at position t + 1 (its top logits in the shard: distillation) and the
target's feature there (``h_{t+1}``, compared after the target's final norm, which keeps the
feature's outlier dimensions from ruling the loss). Losses count only positions whose next token
the head would draft at run time: inside the answer.

Training-time test (EAGLE-3, HASS): at run time the 2nd .. K-th draft token reads the head's own
predicted features. Step k of an unrolled pass feeds the previous step's outputs one position
on, and its query at t attends to the true pairs up to t - k + 1 and to the predicted entries of
steps 2 .. k at positions t - k + 2 .. t, exactly the keys its cache holds when drafting.

Everything is deterministic for a seed: the batch order of epoch e depends on (seed, e) only, so
a run resumed from a checkpoint (`train_head` writes one every ``checkpoint_every`` steps and at
the end of each piece) continues as if never stopped.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .draft_data import Shard
from .draft_heads import ExitHead, FeatureHead, _check_head_fits
from .model import Llama


@dataclass
class TrainSettings:
    """How `train_head` trains (saved with each checkpoint; a resumed run must use the same).

    Attributes:
        steps: optimizer steps in all (across pieces).
        tokens_per_batch: padded pair positions per batch (sequences of similar lengths together).
        lr: peak AdamW learning rate, after ``warmup`` steps, then cosine down to ``lr / 10``.
        unroll: training-time test steps (1: the head reads true features only).
        step_decay: weight of unrolled step k is ``step_decay ** (k - 1)``.
        feature_weight: weight of the feature loss against the distillation loss.
        draft_vocab_size: ids in the draft vocabulary: the data's most frequent answer tokens,
            most frequent first (with ``init``, followed by the file's other ids).
        seed: seeds the head's initial weights (without ``init``) and the batch order.
        checkpoint_every: steps between checkpoints.
        head: ``"feature"`` (`FeatureHead`) or ``"early-exit"`` (`ExitHead`; ``unroll``,
            ``step_decay`` and ``feature_weight`` do not apply to it).
        exit_layer: the target layers an ``"early-exit"`` head runs.
        init: a head file of this kind whose weights training starts from (fine-tuning it); empty:
            fresh weights. Its draft vocabulary becomes the data's ``draft_vocab_size`` most
            frequent ids that the data holds, most frequent first, then the file's ids that these
            lack, in the file's order (the head's weights do not depend on the vocabulary: it
            drafts from the target's LM-head rows), so text of a new kind can be drafted and a
            drafter's ``draft_vocab_size`` keeps the ids this data uses most. Read when training
            starts, not when it resumes (a resumed run keeps its checkpoint's vocabulary).
    """

    steps: int = 4000
    tokens_per_batch: int = 4096
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    unroll: int = 3
    step_decay: float = 0.8
    feature_weight: float = 0.5
    draft_vocab_size: int = 8192
    seed: int = 0
    checkpoint_every: int = 100
    head: str = "feature"
    exit_layer: int = 2
    init: str = ""


@dataclass
class _Sequence:
    features: torch.Tensor    # [L, H] float16
    token_ids: torch.Tensor   # [L] int64
    top_ids: torch.Tensor     # [L, k] int64
    top_logits: torch.Tensor  # [L, k] float32
    prompt_length: int


def load_sequences(paths: list[Path]) -> list[_Sequence]:
    """Every sequence of the shards at ``paths``, in order."""
    sequences = []
    for path in paths:
        shard = Shard.load(path)
        starts = [0, *shard.lengths.cumsum(0).tolist()]
        for i, p in enumerate(shard.prompt_lengths.tolist()):
            a, b = starts[i], starts[i + 1]
            sequences.append(_Sequence(shard.hidden[a:b], shard.token_ids[a:b], shard.top_ids[a:b],
                                       shard.top_logits[a:b], p))
    return sequences


def draft_vocabulary(sequences: list[_Sequence], size: int, vocab_size: int, *, seen_only: bool = False
                     ) -> torch.Tensor:
    """[size] int64: the ids the target produces most often in the answers (its argmax at each
    answer position and the answer tokens), most frequent first; with ``seen_only``, fewer when
    fewer ids occur."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in sequences:
        counts += torch.bincount(s.token_ids[s.prompt_length:], minlength=vocab_size)
        counts += torch.bincount(s.top_ids[s.prompt_length - 1:, 0], minlength=vocab_size)
    size = min(size, int((counts > 0).sum()) if seen_only else vocab_size)
    return counts.argsort(descending=True, stable=True)[:size].clone()


def _batches(sequences: list[_Sequence], tokens_per_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Epoch ``epoch``'s batches: sequences sorted by length, cut so each batch pads to at most
    ``tokens_per_batch`` positions, in an order fixed by (seed, epoch)."""
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i].token_ids), i))
    batches, current = [], []
    for i in order:
        width = len(sequences[i].token_ids) - 1
        if current and width * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    random.Random(seed * 1_000_003 + epoch).shuffle(batches)
    return batches


@dataclass
class _Batch:
    features: torch.Tensor   # [B, T, H] float32: h_t for t < L - 1
    ids: torch.Tensor        # [B, T] int64: x_{t+1}
    next_features: torch.Tensor  # [B, T, H]: h_{t+1}
    top_ids: torch.Tensor    # [B, T, k]: draft-vocabulary index of the target's top ids at t + 1, or -1
    top_probs: torch.Tensor  # [B, T, k]: their probabilities (softmax over the top k)
    target_argmax: torch.Tensor  # [B, T]: the target's argmax at t + 1 (a target-vocabulary id)
    first: torch.Tensor      # [B] int64: the first position whose next token is drafted (prompt length - 1)
    lengths: torch.Tensor    # [B] int64: positions per row (L - 1)


def _collate(sequences: list[_Sequence], index: list[int], vocab_index: torch.Tensor,
             device: torch.device | str = "cpu") -> _Batch:
    rows = [sequences[i] for i in index]
    T = max(len(s.token_ids) for s in rows) - 1
    B, H, k = len(rows), rows[0].features.shape[1], rows[0].top_ids.shape[1]
    features, next_features = torch.zeros(B, T, H), torch.zeros(B, T, H)
    ids, top_ids = torch.zeros(B, T, dtype=torch.int64), torch.full((B, T, k), -1, dtype=torch.int64)
    top_probs, argmax = torch.zeros(B, T, k), torch.zeros(B, T, dtype=torch.int64)
    for b, s in enumerate(rows):
        n = len(s.token_ids) - 1
        features[b, :n], next_features[b, :n] = s.features[:n].float(), s.features[1:].float()
        ids[b, :n] = s.token_ids[1:]
        top_ids[b, :n] = vocab_index[s.top_ids[1:]]
        top_probs[b, :n] = s.top_logits[1:].softmax(-1)
        argmax[b, :n] = s.top_ids[1:, 0]
    first = torch.tensor([s.prompt_length - 1 for s in rows])
    lengths = torch.tensor([len(s.token_ids) - 1 for s in rows])
    return _Batch(*(t.to(device) for t in (features, ids, next_features, top_ids, top_probs, argmax, first,
                                           lengths)))


def _vocab_index(head: FeatureHead | ExitHead, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64 on the CPU: each target id's index in the head's draft vocabulary, or -1."""
    index = torch.full((vocab_size,), -1, dtype=torch.int64)
    index[head.draft_vocab.cpu()] = torch.arange(len(head.draft_vocab))
    return index


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, heads, D] (half-split, as `Llama`), ``sin`` carrying the sign."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def _final_norm(target: Llama, x: torch.Tensor) -> torch.Tensor:
    """The frozen target's final norm of ``x`` [..., H], in float32."""
    n = target.norm
    return F.rms_norm(x, n.weight.shape, n.weight.detach().float(), n.eps)


def _draft_rows(target: Llama, head: FeatureHead | ExitHead) -> torch.Tensor:
    """[Vd, H] float32: the frozen target's LM-head rows of the head's draft vocabulary."""
    return target.output.weight.detach().index_select(0, head.draft_vocab).float()


class _Trainer:
    """The unrolled training forward of a head against a frozen target (dense, differentiable)."""

    def __init__(self, target: Llama, head: FeatureHead) -> None:
        self.target, self.head = target, head
        config = target.config
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.out_weight = _draft_rows(target, head)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return _final_norm(self.target, x)

    def forward(self, batch: _Batch, unroll: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(draft-vocabulary logits [B, T, Vd], output features [B, T, H]) of unrolled steps 1 .. unroll."""
        layer, (B, T) = self.head.layer, batch.ids.shape
        Hq, Hkv, D = self.heads, self.kv_heads, self.head_dim
        device = batch.ids.device
        cos, sin = self.target.rope_angles(torch.arange(T, device=device)[None])  # [1, T, 1, D/2]
        cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        embeddings = self.target.tok_embeddings(batch.ids).detach().float()
        scale = 1 / math.sqrt(D)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        keys, values, outputs, features = [], [], [], batch.features
        for k in range(1, unroll + 1):
            x = self.head.input_vectors(features, embeddings)
            qkv = layer.attention.wqkv(layer.attention_norm(x)).view(B, T, Hq + 2 * Hkv, D)
            q, key = _rope(qkv[:, :, :Hq], cos, sin), _rope(qkv[:, :, Hq:Hq + Hkv], cos, sin)
            value = qkv[:, :, Hq + Hkv:]
            expand = lambda t: t.repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)  # [B, Hq, T, D]
            keys.append(expand(key))
            values.append(expand(value))
            q = q.transpose(1, 2)
            # True pairs up to t - k + 1; the entry of step s (2 .. k) at position t - (k - s).
            scores = (q @ keys[0].transpose(-1, -2)) * scale
            scores = scores.masked_fill(~causal.tril(-(k - 1)), float("-inf"))
            extra = [(q * _shift(keys[s - 1], k - s)).sum(-1, keepdim=True) * scale for s in range(2, k + 1)]
            weights = torch.cat([scores, *extra], -1).softmax(-1)  # every query sees itself: no empty row
            out = weights[..., :T] @ values[0]
            for s in range(2, k + 1):
                out = out + weights[..., T + s - 2:T + s - 1] * _shift(values[s - 1], k - s)
            h = x + layer.attention.wo(out.transpose(1, 2).reshape(B, T, Hq * D))
            h = h + layer.feed_forward(layer.ffn_norm(h))
            outputs.append((self.norm(h) @ self.out_weight.T, h))
            features = _shift(h, 1)  # step k + 1 at t reads step k's output at t - 1
        return outputs

    def losses(self, batch: _Batch, settings: TrainSettings) -> tuple[torch.Tensor, dict]:
        """The weighted loss and, per unrolled step, the top-1 agreement with the target's argmax."""
        T = batch.ids.shape[1]
        position = torch.arange(T, device=batch.ids.device)[None]
        total, stats = 0.0, {}
        target_features = self.norm(batch.next_features)
        vocab = self.head.draft_vocab
        for k, (logits, h) in enumerate(self.forward(batch, settings.unroll), start=1):
            mask = (position >= batch.first[:, None] + (k - 1)) & (position < batch.lengths[:, None])
            count = mask.sum().clamp(min=1)
            distill = _distillation(logits, batch.top_ids, batch.top_probs)
            feature = F.smooth_l1_loss(self.norm(h), target_features, reduction="none").mean(-1)
            loss = ((distill + settings.feature_weight * feature) * mask).sum() / count
            total = total + settings.step_decay ** (k - 1) * loss
            agree = (vocab[logits.argmax(-1)] == batch.target_argmax) & mask
            stats[f"top1_step{k}"] = (agree.sum() / count).item()
            stats[f"positions_step{k}"] = int(mask.sum())  # 0 when no position counts
        return total, stats


def _distillation(logits: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor) -> torch.Tensor:
    """[...] cross-entropy of draft-vocabulary ``logits`` [..., Vd] against the target's top-k
    distribution (``top_ids`` [..., k] draft-vocabulary indices, -1 outside it; ``top_probs``)."""
    picked = logits.log_softmax(-1).gather(-1, top_ids.clamp(min=0)) * (top_ids >= 0)
    return -(top_probs * picked).sum(-1)


@dataclass
class _TokenBatch:
    tokens: torch.Tensor     # [B, L] int64: whole sequences, right-padded
    top_ids: torch.Tensor    # [B, L, k]: draft-vocabulary index of the target's top ids at t, or -1
    top_probs: torch.Tensor  # [B, L, k]
    target_argmax: torch.Tensor  # [B, L]: the target's argmax at t (predicting token t + 1)
    first: torch.Tensor      # [B]: the first position whose next token is drafted (the prompt length: the
                             # token after the prompt is the target's own, from its prefill)
    lengths: torch.Tensor    # [B]: tokens per row


def _collate_tokens(sequences: list[_Sequence], index: list[int], vocab_index: torch.Tensor,
                    device: torch.device | str = "cpu") -> _TokenBatch:
    rows = [sequences[i] for i in index]
    B, L, k = len(rows), max(len(s.token_ids) for s in rows), rows[0].top_ids.shape[1]
    tokens, argmax = torch.zeros(B, L, dtype=torch.int64), torch.zeros(B, L, dtype=torch.int64)
    top_ids, top_probs = torch.full((B, L, k), -1, dtype=torch.int64), torch.zeros(B, L, k)
    for b, s in enumerate(rows):
        n = len(s.token_ids)
        tokens[b, :n], argmax[b, :n] = s.token_ids, s.top_ids[:, 0]
        top_ids[b, :n], top_probs[b, :n] = vocab_index[s.top_ids], s.top_logits.softmax(-1)
    first = torch.tensor([s.prompt_length for s in rows])
    lengths = torch.tensor([len(s.token_ids) for s in rows])
    return _TokenBatch(*(t.to(device) for t in (tokens, top_ids, top_probs, argmax, first, lengths)))


class _ExitTrainer:
    """The training forward of an `ExitHead`: the frozen target's first layers over whole
    sequences (no gradient), then the head, against the target's distribution at each position."""

    def __init__(self, target: Llama, head: ExitHead) -> None:
        self.target, self.head = target, head
        self.prefix = target.truncated(head.exit_layer)
        self.out_weight = _draft_rows(target, head)

    def logits(self, batch: _TokenBatch) -> torch.Tensor:
        """Draft-vocabulary logits [B, L, Vd] at every position."""
        B, L = batch.tokens.shape
        with torch.no_grad():
            hidden = self.prefix(batch.tokens, self.prefix.new_cache(B, L), batch.lengths, hidden_only=True)
        return _final_norm(self.target, self.head(hidden.float())) @ self.out_weight.T

    def losses(self, batch: _TokenBatch, settings: TrainSettings) -> tuple[torch.Tensor, dict]:
        """The distillation loss over answer positions, and the top-1 agreement there (``top1_step1``)."""
        logits = self.logits(batch)
        position = torch.arange(logits.shape[1], device=logits.device)[None]
        mask = (position >= batch.first[:, None]) & (position < batch.lengths[:, None])
        count = mask.sum().clamp(min=1)
        loss = (_distillation(logits, batch.top_ids, batch.top_probs) * mask).sum() / count
        agree = (self.head.draft_vocab[logits.argmax(-1)] == batch.target_argmax) & mask
        return loss, {"top1_step1": (agree.sum() / count).item(), "positions_step1": int(mask.sum())}


def _trainer(target: Llama, head: FeatureHead | ExitHead):
    """The trainer of ``head``'s kind, and the batch maker it takes."""
    if isinstance(head, ExitHead):
        return _ExitTrainer(target, head), _collate_tokens
    return _Trainer(target, head), _collate


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x`` moved ``by`` positions later along dim -2 ([..., T, C]), zeros first."""
    if by == 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:-2], by, x.shape[-1]), x[..., :-by, :]], -2)


def _schedule(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def new_head(target: Llama, vocabulary: torch.Tensor, seed: int, *, kind: str = "feature",
             exit_layer: int = 2) -> FeatureHead | ExitHead:
    """A freshly initialised head of ``kind`` (``"feature"`` or ``"early-exit"``) in float32
    (weights seeded by ``seed``). An early-exit head's adapter starts as the identity (its output
    projection zero): it begins as the target's own logit lens at ``exit_layer``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = _blank_head(target, kind, exit_layer, vocabulary)
        for p in head.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        if isinstance(head, ExitHead):
            torch.nn.init.zeros_(head.adapter.w2.weight)
    return head


def _initial_head(target: Llama, settings: TrainSettings, frequent: torch.Tensor) -> FeatureHead | ExitHead:
    """The head in ``settings.init`` (float32), checked against the settings and the target,
    drafting from the ``frequent`` ids (most frequent first) and then its own ids those lack."""
    loaded = (FeatureHead.load(settings.init) if settings.head == "feature" else ExitHead.load(settings.init))
    if isinstance(loaded, ExitHead) and loaded.exit_layer != settings.exit_layer:
        raise ValueError(f"init head {settings.init} exits after layer {loaded.exit_layer}, but "
                         f"exit_layer={settings.exit_layer}: pass the same")
    try:
        _check_head_fits(target, loaded)
    except (TypeError, ValueError) as e:
        raise type(e)(f"init head {settings.init}: {e}") from e
    vocabulary = torch.cat([frequent, loaded.draft_vocab[~torch.isin(loaded.draft_vocab, frequent)]])
    head = _blank_head(target, settings.head, settings.exit_layer, vocabulary)
    head.load_state_dict({**loaded.state_dict(), "draft_vocab": vocabulary})
    return head


def _blank_head(target: Llama, kind: str, exit_layer: int, vocabulary: torch.Tensor) -> FeatureHead | ExitHead:
    if kind == "feature":
        return FeatureHead(target.config, vocabulary)
    if kind == "early-exit":
        return ExitHead(target.config, exit_layer, vocabulary)
    raise ValueError(f"head must be 'feature' or 'early-exit', got {kind!r}")


@torch.no_grad()
def evaluate(target: Llama, head: FeatureHead | ExitHead, sequences: list[_Sequence], unroll: int = 3,
             tokens_per_batch: int = 4096) -> dict:
    """Top-1 agreement with the target's argmax per draft position (1 .. unroll) over ``sequences``.
    An `ExitHead` has one (``unroll`` 1): its later draft tokens read the target's own layers over
    the draft's tokens, as exact as the first when the drafts before them are right."""
    head = head.to(target.output.weight.device, torch.float32)
    trainer, collate = _trainer(target, head)
    index = _vocab_index(head, target.vocab_size)
    unroll = 1 if isinstance(head, ExitHead) else unroll
    settings = TrainSettings(unroll=unroll)
    agree, count = [0.0] * unroll, [0] * unroll
    for batch_index in _batches(sequences, tokens_per_batch, 0, 0):
        _, stats = trainer.losses(collate(sequences, batch_index, index, target.output.weight.device), settings)
        for k in range(unroll):
            n = stats[f"positions_step{k + 1}"]
            agree[k] += stats[f"top1_step{k + 1}"] * n
            count[k] += n
    return {f"top1_step{k + 1}": agree[k] / max(1, count[k]) for k in range(unroll)}


def train_head(target: Llama, sequences: list[_Sequence], folder: str | os.PathLike, settings: TrainSettings,
               *, max_seconds: float | None = None, log: Callable[[str], None] = print,
               data_id: str = "") -> FeatureHead | ExitHead:
    """Train a head of ``settings.head``'s kind for ``target`` on ``sequences``, resuming from
    ``folder``'s checkpoint.

    Writes ``folder/checkpoint.pt`` every ``settings.checkpoint_every`` steps and when
    ``max_seconds`` has passed (the piece then returns; run again to go on) or training ends.
    ``data_id`` names the data (`train_draft` passes the shard names); a checkpoint written with
    other settings or other data is refused, so a resumed run continues the same run.

    Returns:
        The head as trained so far (float32, eval mode).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint_path = folder / "checkpoint.pt"
    for p in target.parameters():
        p.requires_grad_(False)
    if checkpoint_path.exists():
        try:
            state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
            recorded = (state["settings"], state["data"])
        except Exception as e:
            raise ValueError(f"{checkpoint_path} is not a training checkpoint ({type(e).__name__}: {e}); delete it "
                             "to start again") from e
        if {**asdict(TrainSettings()), **recorded[0]} != asdict(settings):  # fields added later: their defaults
            raise ValueError(f"{checkpoint_path} was written with other settings {state['settings']}; pass the "
                             "same settings to resume, or another folder to start again")
        if recorded[1] != data_id:
            raise ValueError(f"{checkpoint_path} was written for other data ({recorded[1]!r}, now {data_id!r}); "
                             "resume on the same shards (--prompts), or use another folder to start again")
        head = _blank_head(target, settings.head, settings.exit_layer, state["head"]["draft_vocab"])
        head.load_state_dict(state["head"])
        step = state["step"]
    else:
        vocabulary = draft_vocabulary(sequences, settings.draft_vocab_size, target.vocab_size,
                                      seen_only=bool(settings.init))
        head = (_initial_head(target, settings, vocabulary) if settings.init else
                new_head(target, vocabulary, settings.seed, kind=settings.head, exit_layer=settings.exit_layer))
        step, state = 0, None
    device = target.output.weight.device
    head = head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    trainer, collate = _trainer(target, head)
    index = _vocab_index(head, target.vocab_size)

    def save() -> None:
        tmp = checkpoint_path.with_suffix(".tmp")
        torch.save({"settings": asdict(settings), "data": data_id, "step": step, "head": head.state_dict(),
                    "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, checkpoint_path)

    epoch_batches: dict[int, list[list[int]]] = {}
    per_epoch = len(_batches(sequences, settings.tokens_per_batch, settings.seed, 0))
    t_start, start_step = time.perf_counter(), step
    while step < settings.steps:
        epoch, position = divmod(step, per_epoch)
        if epoch not in epoch_batches:
            epoch_batches = {epoch: _batches(sequences, settings.tokens_per_batch, settings.seed, epoch)}
        batch = collate(sequences, epoch_batches[epoch][position], index, device)
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * _schedule(step, settings)
        loss, stats = trainer.losses(batch, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - t_start
        if step % 20 == 0 or step == settings.steps:
            eta = elapsed / (step - start_step) * (settings.steps - step)
            log(f"step {step}/{settings.steps} epoch {epoch} loss {loss.item():.3f} "
                + " ".join(f"{v:.2f}" for k, v in stats.items() if k.startswith("top1"))
                + f"  {elapsed / 60:.1f} min, ETA {eta / 60:.1f} min")
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            save()
        if max_seconds is not None and elapsed > max_seconds:
            save()
            log(f"stopped after {elapsed / 60:.1f} min at step {step}; run again to resume")
            break
    return head.eval()


# --------------------------------------------------------------------------- the recipe

HELD_OUT_SHARDS = 2  # held-out prompts answered for evaluation: 2 shards of 64


def train_draft(*, target: str = "smollm2", head: str = "feature", data_dir: str | os.PathLike | None = None,
                out_dir: str | os.PathLike | None = None, stage: str = "all", max_minutes: float | None = None,
                settings: TrainSettings | None = None, num_prompts: int | None = None,
                device: str | None = None, prompts_file: str | os.PathLike | None = None,
                data_batch_size: int = 32, prompt_kinds: tuple[str, ...] = ("documents", "open"),
                log: Callable[[str], None] = print) -> Path | None:
    """The training recipe, in resumable pieces: answer prompts (``stage="data"``), train a head
    (``"train"``), or both (``"all"``); run it again to go on where the last piece stopped.
    ``stage="prompts"`` only writes this machine's prompts to ``prompts_file``, for a GPU machine
    to answer and train on.

    Data: `build_prompts` on this machine, of ``prompt_kinds`` (or the lists in ``prompts_file``);
    held-out shards first (``data_dir/held-out``, never trained on), then training shards
    (``data_dir``). Training reads every training shard on disk when the piece starts and
    checkpoints in ``out_dir``; when ``settings.steps`` are done it writes ``out_dir/head.pt``
    (float16) and logs the held-out top-1 agreement per draft position.

    Args:
        target: ``"smollm2"`` (SmolLM2-135M-Instruct, `load_smollm2`).
        head: ``"feature"`` (`FeatureHead`) or ``"early-exit"`` (`ExitHead` after
            ``settings.exit_layer`` layers).
        data_dir, out_dir: default ``cache_dir()/draft-data-<target>`` and
            ``cache_dir()/draft-<head>-<target>``.
        max_minutes: wall-time budget of this piece (None: run to the end).
        num_prompts: training prompts to answer and train on, rounded up to whole shards of 64
            (None: all `build_prompts` gives, and every shard on disk).
        device: ``"cpu"`` or ``"cuda"``; None: a GPU when present.
        prompts_file: the prompt lists to answer (`load_prompts`; written by ``stage="prompts"``);
            None: `build_prompts` on this machine.
        data_batch_size: prompts answered together (recorded with the shards: a data folder keeps
            one batch size).
        prompt_kinds: the kinds of prompts `build_prompts` makes (its ``kinds``; a data folder
            keeps one list of prompts).

    Returns:
        The path of the finished head, or None while training is unfinished.

    Example::

        train_draft(stage="data", max_minutes=60)   # answer prompts for an hour
        train_draft(stage="train", max_minutes=60)  # then train; repeat until it returns a path

        # prompts from this machine, answered and trained on by a GPU machine
        train_draft(stage="prompts", prompts_file="prompts.json.gz")
        train_draft(prompts_file="prompts.json.gz", device="cuda", data_batch_size=64)  # there
    """
    from .draft_data import build_prompts, load_prompts, save_prompts, write_shards
    from .pretrained import cache_dir, load_smollm2

    if target != "smollm2":
        raise ValueError(f"target must be 'smollm2', got {target!r}")
    if head not in ("feature", "early-exit"):
        raise ValueError(f"head must be 'feature' or 'early-exit', got {head!r}")
    if not isinstance(data_batch_size, int) or isinstance(data_batch_size, bool) or data_batch_size < 1:
        raise ValueError(f"data_batch_size must be an int >= 1, got {data_batch_size!r}")
    if stage not in ("prompts", "data", "train", "all"):
        raise ValueError(f"stage must be 'prompts', 'data', 'train' or 'all', got {stage!r}")
    if stage == "prompts":
        if prompts_file is None:
            raise ValueError("stage 'prompts' writes the prompts to prompts_file: pass one")
        train, held_out = build_prompts(kinds=prompt_kinds)
        save_prompts(prompts_file, train, held_out)
        log(f"prompts: {len(train)} training and {len(held_out)} held-out prompts written to {prompts_file}")
        return None
    settings = settings or TrainSettings(head=head)
    if settings.head != head:
        raise ValueError(f"head={head!r} but settings.head={settings.head!r}: pass the same kind")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    data_dir = Path(data_dir) if data_dir is not None else cache_dir() / f"draft-data-{target}"
    out_dir = Path(out_dir) if out_dir is not None else cache_dir() / f"draft-{head}-{target}"
    # The head to fine-tune is read when training starts (a resumed run has it in its checkpoint).
    starting = bool(settings.init) and stage in ("train", "all") and not (out_dir / "checkpoint.pt").exists()
    if starting:  # a bad head file is named before the model loads
        (FeatureHead if head == "feature" else ExitHead).load(settings.init)
    deadline = None if max_minutes is None else time.perf_counter() + 60 * max_minutes
    left = lambda: None if deadline is None else max(0.0, deadline - time.perf_counter())
    max_shards = None if num_prompts is None else -(-num_prompts // 64)
    if stage in ("data", "all"):  # a bad prompts file is named before the model loads
        train, held_out = build_prompts(kinds=prompt_kinds) if prompts_file is None else load_prompts(prompts_file)
    model, tokenizer = load_smollm2(device=device)
    depth = model.config.num_hidden_layers
    if settings.head == "early-exit" and not 1 <= settings.exit_layer < depth:
        raise ValueError(f"exit_layer must be in [1, {depth - 1}] for {target}, got {settings.exit_layer}")
    if starting:  # and one that does not fit the target, before the data stage
        _initial_head(model, settings, torch.zeros(0, dtype=torch.int64))
    if stage in ("data", "all"):
        if device == "cpu" and model.can_pack_weights():
            model.pack_weights()
        progress = lambda done, total, seconds: log(f"data: shard {done}/{total}, {seconds:.0f} s per shard, "
                                                    f"ETA {(total - done) * seconds / 60:.0f} min")
        write_shards(model, tokenizer, held_out[:64 * HELD_OUT_SHARDS], data_dir / "held-out", max_seconds=left(),
                     batch_size=data_batch_size, progress=progress)
        write_shards(model, tokenizer, train, data_dir, max_shards=max_shards, max_seconds=left(),
                     batch_size=data_batch_size, progress=progress)
        if device == "cpu" and model.can_pack_weights():
            model.pack_weights(False)
    if stage == "data" or (left() is not None and left() <= 0):
        return None
    paths = sorted(data_dir.glob("shard-*.pt"))[:max_shards]
    if not paths:
        raise FileNotFoundError(f"no training shards in {data_dir}: run the data stage first")
    sequences = load_sequences(paths)
    log(f"train: {len(paths)} shards, {len(sequences)} sequences, "
        f"{sum(len(s.token_ids) - s.prompt_length for s in sequences)} answer tokens")
    trained = train_head(model, sequences, out_dir, settings, max_seconds=left(), log=log,
                         data_id=f"{len(paths)} shards: {paths[0].name} .. {paths[-1].name}")
    if torch.load(out_dir / "checkpoint.pt", weights_only=True)["step"] < settings.steps:
        return None
    held = sorted((data_dir / "held-out").glob("shard-*.pt"))
    if held:
        scores = evaluate(model, trained, load_sequences(held), unroll=settings.unroll)
        log("held-out top-1 agreement per draft position: " + ", ".join(f"{v:.3f}" for v in scores.values()))
    trained.save(out_dir / "head.pt")
    log(f"head written to {out_dir / 'head.pt'}")
    return out_dir / "head.pt"
