"""Hugging Face causal LMs as models of the package's protocol.

`HFCausalLM` runs a transformers decoder-only model's own modeling code on the package's ragged
`KVCache` and `ragged_attention`: its attention calls are routed through transformers'
attention-function registry (the implementation ``"specdec_ragged"``, switched on for the
duration of each call), which appends each layer's new keys and values at every row's own cache
length and attends over the row's cache. Positions are per row; the cache's `crop` and `select`
work as for the built-in `Llama`. `generate` and `speculative_generate` wrap a transformers model
given to them in `HFCausalLM` themselves (`specdec_kernels._model_calls.as_protocol_model`)::

    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(...)      # any family in SUPPORTED_MODEL_TYPES
    out = generate(target, input_ids, attention_mask, max_new_tokens=64)

Layers with a sliding window (Mistral, Qwen2's upper layers, Gemma 3's local layers) attend within
it (`ragged_attention`'s ``sliding_window``). Only families whose attention is checked against
Hugging Face's own forward are taken (`SUPPORTED_MODEL_TYPES`); any other model type, and
attention this path does not compute (logit soft-capping, attention sinks), is refused with an
error naming it: never a silently different model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ._checks import is_int
from .attention import RaggedAttentionPlan, ragged_attention
from .cache import AppendPlan, KVCache
from .matmul import Linear, MatmulPlan, matmul_sample, measured_matmul_plan
from .model import positions_read, tree_depths

#: ``config.model_type`` of the families checked logit for logit against transformers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt2", "phi3", "gemma3_text")
#: Learned absolute position embeddings: the cache may not outgrow them.
_LEARNED_POSITIONS = {"gpt2": "n_positions"}
_ATTENTION = "specdec_ragged"
#: Names of the base model's final norm across the supported families (Llama-like, GPT-NeoX, GPT-2).
_FINAL_NORMS = ("norm", "final_layer_norm", "ln_f")
#: Rotary embeddings that rescale with the longest position seen, which they read on the host.
_HOST_DECIDED_ROPE = {"dynamic", "longrope"}


@dataclass
class _Pass:
    """What every attention call of one forward pass shares: the cache and its append plan, and
    one attention plan per sliding window its layers use (None: full causal attention)."""

    cache: KVCache
    append: AppendPlan
    cache_seqlens: torch.Tensor
    q_seqlens: torch.Tensor | None
    num_queries: int
    max_len: int  # positions of each row attention reads
    min_seqlen: int | None
    tree_mask: torch.Tensor | None = None  # [B, T, T] bool: the new tokens form a tree
    plans: dict = field(default_factory=dict)
    calls: int = 0  # attention calls made (one per layer, when the model routes them here)

    def plan(self, sliding_window: int | None) -> RaggedAttentionPlan:
        if sliding_window not in self.plans:
            self.plans[sliding_window] = RaggedAttentionPlan(
                self.cache_seqlens, self.q_seqlens, num_queries=self.num_queries, max_len=self.max_len,
                min_seqlen=self.min_seqlen, sliding_window=sliding_window, tree_mask=self.tree_mask)
        return self.plans[sliding_window]


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
               specdec_pass: _Pass | None = None, sliding_window: int | None = None,
               softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs) -> tuple:
    """transformers' attention-function signature (query [B, H, T, D], key and value [B, Hkv, T, D]
    of the new tokens) on the package's cache: append, then ragged attention over each row's cache.
    The causal mask is the cache lengths' (transformers builds none for this implementation)."""
    if specdec_pass is None:
        raise RuntimeError(f"the attention implementation {_ATTENTION!r} runs only inside HFCausalLM.forward")
    name = type(module).__name__
    if softcap is not None:
        raise ValueError(f"{name} soft-caps its attention logits (softcap={softcap}), which ragged_attention "
                         "does not compute")
    if s_aux is not None:
        raise ValueError(f"{name} uses attention sinks, which ragged_attention does not compute")
    if dropout:
        raise ValueError(f"{name} applies attention dropout ({dropout}): the model is in training mode; call "
                         "model.eval() for decoding")
    specdec_pass.calls += 1
    plan = specdec_pass.plan(sliding_window)
    layer, cache = module.layer_idx, specdec_pass.cache
    cache.append(layer, key.transpose(1, 2), value.transpose(1, 2), plan=specdec_pass.append)
    S = plan.max_len
    out = ragged_attention(query.transpose(1, 2).contiguous(), cache.k[layer][:, :S], cache.v[layer][:, :S],
                           plan.cache_seqlens, plan.q_seqlens, plan=plan, scale=scaling, sliding_window=sliding_window,
                           tree_mask=plan.tree_mask)
    return out, None


def _register() -> None:
    import transformers

    if not hasattr(transformers, "AttentionInterface"):
        raise ImportError(f"HFCausalLM needs transformers' attention-function registry (AttentionInterface), "
                          f"which transformers {transformers.__version__} lacks: pip install -U transformers "
                          "(checked with 5.17 and 5.24)")
    transformers.AttentionInterface.register(_ATTENTION, _attention)


_register()


class HFCausalLM(nn.Module):
    """A transformers decoder-only causal LM following the package's model protocol.

    Args:
        model: a transformers ``PreTrainedModel`` with a language-modelling head, of a family in
            `SUPPORTED_MODEL_TYPES` (``LlamaForCausalLM``, ``MistralForCausalLM``,
            ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``GPTNeoXForCausalLM``,
            ``GPT2LMHeadModel``, ``Phi3ForCausalLM``, ``Gemma3ForCausalLM``). Its weights are
            shared, not copied; its own attention implementation is left as it was between calls.

    Raises:
        ValueError: another model type, an encoder-decoder, or a model without an LM head.

    Example::

        model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(folder))
        cache = model.new_cache(batch_size=2, max_len=64)
        logits = model(input_ids, cache, q_seqlens)            # [2, T] -> [2, T, V]
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} (model_type={model_type!r}) is an encoder-decoder model; "
                             "only decoder-only causal LMs are supported")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{type(model).__name__} has model_type={model_type!r}; supported Hugging Face "
                             f"families: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if not callable(getattr(model, "get_output_embeddings", None)) or model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} has no language-modelling head: pass the *ForCausalLM / "
                             "*LMHeadModel class")
        self.hf = model
        heads = config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.max_positions = getattr(config, _LEARNED_POSITIONS[model_type]) if model_type in _LEARNED_POSITIONS \
            else None
        self._replaced: list[tuple[nn.Module, str, nn.Linear]] = []  # layers `pack_weights` replaced

    @property
    def capturable(self) -> bool:
        """Whether its decoding forwards can be replayed as CUDA graphs, which the loops then do
        by default on CUDA: every supported family's forward is free of host synchronization,
        except rotary embeddings that rescale with the longest position (``dynamic``,
        ``longrope``): those decide on the host every call."""
        config = self.hf.config
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        groups = [v for v in rope.values() if isinstance(v, dict)] or [rope]  # Gemma 3: one per layer type
        return not {g.get("rope_type", g.get("type", "default")) for g in groups} & _HOST_DECIDED_ROPE

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the LM head's rows, padded tail included)."""
        return self.hf.get_output_embeddings().weight.shape[0]

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """An empty KV cache for ``batch_size`` rows of up to ``max_len`` tokens each, in the
        model's dtype and on its device unless given."""
        if self.max_positions is not None and is_int(max_len) and max_len > self.max_positions:
            raise ValueError(f"max_len={max_len} exceeds the {self.max_positions} positions "
                             f"{type(self.hf).__name__} has embeddings for")
        weight = self.hf.get_output_embeddings().weight
        return KVCache(self.num_layers, batch_size, max_len, self.num_kv_heads, self.head_dim,
                       dtype=dtype or weight.dtype, device=device or weight.device)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, q_seqlens: torch.Tensor | None = None, *,
                last_only: bool = False, max_seqlen: int | None = None, min_seqlen: int | None = None,
                return_hidden: bool = False, tree_mask: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run ``input_ids`` [B, T] int64 through the model, appending to ``cache``.

        Args and returns as `Llama.forward` (without ``num_tokens``: transformers' layers run on
        all B * T positions): row b's first ``q_seqlens[b]`` tokens are real, at positions
        ``cache.lengths[b] ..``; the cache advances by ``q_seqlens``; logits [B, T, V] (or [B, 1, V]
        with ``last_only``, each row's last real token) in the model's dtype. ``return_hidden``:
        also the last layer's hidden states before the final norm (the norm's input: what
        EAGLE-style draft heads read, `specdec_kernels.Drafter`) at every position, [B, T, H],
        ``last_only`` or not.
        ``tree_mask``: [B, T, T] bool, the new tokens form a tree (`Llama.forward`): each sits
        at the row's length plus its depth; sliding-window layers raise a ValueError once their
        window hides keys of the positions the pass reads.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(getattr(input_ids, 'shape', ()))}")
        B, T = input_ids.shape
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (from new_cache), got {type(cache).__name__}")
        if B != cache.batch_size:
            raise ValueError(f"input_ids has {B} rows but the cache has {cache.batch_size}")
        append = cache.plan_append(T, q_seqlens)  # validates q_seqlens
        q_seqlens = append.q_seqlens
        cache_seqlens = cache.lengths + (T if q_seqlens is None else q_seqlens)
        attention = _Pass(cache, append, cache_seqlens, q_seqlens, T,
                          positions_read(cache_seqlens, max_seqlen, T, cache.max_len), min_seqlen, tree_mask)
        # Real tokens sit below the capacity; padding positions past it are clamped (their
        # outputs are never read), so learned position tables are never indexed beyond it.
        positions = (cache.lengths[:, None] + tree_depths(tree_mask, q_seqlens, T, input_ids.device)
                     ).clamp_(max=cache.max_len - 1)
        ragged_last = last_only and q_seqlens is not None
        hidden: list[torch.Tensor] = []
        with self._implementation(), self._last_rows(q_seqlens if ragged_last else None), \
                self._norm_input(hidden if return_hidden else None):
            out = self.hf(input_ids=input_ids, position_ids=positions, use_cache=False,
                          logits_to_keep=1 if last_only and not ragged_last else 0,
                          specdec_pass=attention)
        if attention.calls != self.num_layers:  # the model chose its attention some other way
            raise RuntimeError(f"{type(self.hf).__name__} ran {attention.calls} of its {self.num_layers} attention "
                               f"layers through {_ATTENTION!r}: this transformers version routes attention "
                               "otherwise; its logits would not use the cache")
        cache.advance(T if q_seqlens is None else q_seqlens)
        if not return_hidden:
            return out.logits
        return out.logits, hidden[0]

    def pack_weights(self, enable: bool = True, *, plan: MatmulPlan | None = None) -> HFCausalLM:
        """Compute the model's ``nn.Linear`` layers (projections and LM head) in the matmul forms
        this machine runs fastest, as `Llama.pack_weights` does for the built-in model (CPU
        float32; the plan is measured once per machine and weight shapes, or ``plan=``).

        Each ``nn.Linear`` is replaced, in the transformers model itself, by a
        `specdec_kernels.matmul.Linear` holding the same weight and bias parameters (ties kept),
        stored in the plan's layout; transformers' own forward and ``generate`` then use them too.
        ``enable=False`` puts the original layers back and stores the weights row-major again
        (do that before ``save_pretrained``: input-major weights are not contiguous). Other layer
        types (GPT-2's ``Conv1D``) stay as they are. Not while the model runs in another thread.

        Returns:
            self.

        Raises:
            ValueError: a weight is not a CPU float32 tensor.
        """
        if not enable:
            for parent, name, original in self._replaced:
                getattr(parent, name).unpack()
                setattr(parent, name, original)
            self._replaced = []
            return self
        if not self._replaced:
            found = [(parent_name, parent, name, child) for parent_name, parent in self.hf.named_modules()
                     for name, child in parent.named_children() if type(child) is nn.Linear]
            for parent_name, _, name, child in found:  # every weight checked before any layer changes
                if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
                    raise ValueError(f"{parent_name}.{name}: packing needs a CPU float32 weight, got "
                                     f"{child.weight.dtype} on {child.weight.device}")
            for _, parent, name, child in found:
                setattr(parent, name, _PlannedLinear(child))
                self._replaced.append((parent, name, child))
        layers = [getattr(parent, name) for parent, name, _ in self._replaced]
        if plan is None:
            # The LM head comes last in module order; each other layer is a group of its own.
            *projections, head = (layer.weight for layer in layers)
            plan = measured_matmul_plan(matmul_sample([[w] for w in projections], head))
        for layer in layers:
            layer.pack(plan)
        return self

    @contextlib.contextmanager
    def _implementation(self) -> Iterator[None]:
        """The model's attention routed to ``"specdec_ragged"`` for one call (not thread-safe:
        the setting lives on the model's config)."""
        config = self.hf.config
        previous = config._attn_implementation
        config._attn_implementation = _ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = previous

    @contextlib.contextmanager
    def _norm_input(self, into: list | None) -> Iterator[None]:
        """With a list ``into``, the final norm's input (the last layer's hidden states [B, T, H])
        is appended to it during the call."""
        if into is None:
            yield
            return
        base = self.hf.base_model
        norm = next((getattr(base, name) for name in _FINAL_NORMS if isinstance(getattr(base, name, None), nn.Module)),
                    None)
        if norm is None:
            raise TypeError(f"{type(self.hf).__name__} has no final norm named {' or '.join(_FINAL_NORMS)} on its "
                            "base model: its hidden states before the norm cannot be read")
        handle = norm.register_forward_pre_hook(lambda module, args: into.append(args[0]))
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def _last_rows(self, q_seqlens: torch.Tensor | None) -> Iterator[None]:
        """With ``q_seqlens``, the LM head sees only each row's last real position ([B, 1, H]):
        whatever the model does after its head (soft-capping, scaling) runs on those rows only."""
        if q_seqlens is None:
            yield
            return
        index = (q_seqlens - 1).view(-1, 1, 1)

        def last(module, args):
            hidden = args[0]
            return (hidden.gather(1, index.expand(-1, 1, hidden.shape[-1])), *args[1:])

        handle = self.hf.get_output_embeddings().register_forward_pre_hook(last)
        try:
            yield
        finally:
            handle.remove()


class _PlannedLinear(Linear):
    """A transformers ``nn.Linear`` computed by the package's `Linear`: the same weight and bias
    parameters, the bias added after the planned product."""

    def __init__(self, original: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight, self.bias = original.weight, original.bias
        self.plan, self._packed = None, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.bias is None else out + self.bias
