"""A compact Llama-family decoder on the package's ragged attention and KV cache.

RMSNorm, rotary embeddings (RoPE), SwiGLU, grouped-query attention, tied or
untied embeddings. It loads Hugging Face Llama weights (a safetensors folder or
a loaded ``LlamaForCausalLM``) and follows the package's model protocol::

    logits = model(input_ids, cache, q_seqlens=None)   # [B, T] -> [B, T, V]

Row b's T new tokens (its first ``q_seqlens[b]``; the rest is padding) sit at
positions ``cache.lengths[b] + i``; their keys and values are appended at each
row's own cache length and ``cache.lengths`` moves forward by ``q_seqlens``.
Rolling back rejected tokens is ``cache.crop(lengths)``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import as_float32, device_check, is_int, is_real
from .attention import RaggedAttentionPlan, ragged_attention
from .cache import AppendPlan, KVCache
from .matmul import Linear, MatmulPlan, measured_matmul_plan


@dataclass
class LlamaConfig:
    """Shapes and constants of a Llama-family decoder (names follow Hugging Face's LlamaConfig)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        """Check every field before anything is built from it: a size of 0 or a negative ``rms_norm_eps``
        would otherwise surface as a ``ZeroDivisionError`` or as NaN logits.

        Raises:
            TypeError: a field of the wrong type (a string, a float size, a bool), naming it.
            ValueError: a value out of range or sizes that contradict each other, naming them.
        """
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            _check_positive(name, getattr(self, name), integer=True)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                                 f"({self.num_attention_heads}) when head_dim is not given")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive("head_dim", self.head_dim, integer=True)
        if self.head_dim % 2:  # rotary embeddings rotate the two halves of each head against each other
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        for name in ("rms_norm_eps", "rope_theta"):
            _check_positive(name, getattr(self, name), integer=False)
            setattr(self, name, float(getattr(self, name)))
        if not isinstance(self.tie_word_embeddings, bool):
            raise TypeError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        _check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config: Any) -> LlamaConfig:
        """From a ``transformers`` LlamaConfig (or its ``to_dict()``), old and new rope layouts alike.

        Raises:
            TypeError, ValueError: a value `LlamaConfig` refuses, or a variant this decoder does not
                compute (another model type, biases, another activation).
        """
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        if d.get("model_type", "llama") not in ("llama", "mistral"):
            raise ValueError(f"expected a Llama-family config, got model_type={d.get('model_type')!r}")
        # Variants this decoder does not implement: loading them would silently compute another model.
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"{key}=True is not supported (the built-in Llama has no biases)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (the built-in Llama uses silu)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise TypeError(f"rope_scaling must be a dict or null, got {rope!r}")
        rope = dict(rope)
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        known = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        config = cls(**{k: v for k, v in d.items() if k in known}, rope_theta=theta, rope_scaling=rope or None)
        # Sliding-window attention equals full attention up to the window: cap the context there
        # (Mistral-7B-v0.1: window 4096 of 32768), so `generate` refuses longer sequences.
        window = d.get("sliding_window")
        if window is not None:
            _check_positive("sliding_window", window, integer=True)
            config.max_position_embeddings = min(config.max_position_embeddings, window)
        return config


def _check_positive(name: str, value: Any, *, integer: bool) -> None:
    """Raise unless ``value`` is a positive int (``integer``) or a positive finite real number."""
    kind = "int" if integer else "finite number"
    if not (is_int(value) if integer else is_real(value)):
        raise TypeError(f"{name} must be a positive {kind}, got {value!r} ({type(value).__name__})")
    if not (value > 0 and (integer or math.isfinite(value))):
        raise ValueError(f"{name} must be a positive {kind}, got {value!r}")


# The numbers each supported rope_scaling type needs (`rope_inverse_frequencies` divides by each).
_ROPE_SCALING_KEYS = {"default": (), "linear": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _check_rope_scaling(scaling: Any) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")
    for key in _ROPE_SCALING_KEYS[rope_type]:
        if key not in scaling:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs {key!r}, got {scaling!r}")
        _check_positive(f"rope_scaling[{key!r}]", scaling[key], integer=False)
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling's high_freq_factor ({scaling['high_freq_factor']}) must exceed its "
                         f"low_freq_factor ({scaling['low_freq_factor']})")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # On the CPU, Hugging Face's values to the bit (the same ops inside), and faster than
            # those ops spelled out at a decoding step's few rows, where each op's dispatch
            # outweighs its work (`test_rms_norm` times both).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Hugging Face's LlamaRMSNorm op for op: normalized in fp32, cast back before the weight
        # (a fused op would round once, after the weight).
        x32 = as_float32(x)
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with linear or Llama-3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":  # smooth interpolation between low- and high-frequency bands
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, smoothed))
    return inv_freq.float()


@dataclass(eq=False)
class _Step:
    """What one forward pass computes once for all its layers: the rotary tables, the plans of
    the cache writes and of the attention (masks, length checks), and which tokens are real."""

    cos: torch.Tensor          # [B, T, 1, D] float32: cos of the angles, both halves
    sin: torch.Tensor          # [B, T, 1, D] float32: sin, first half negated (rotate-half sign)
    append: AppendPlan
    attention: RaggedAttentionPlan
    # [N] indices b * T + t of the real tokens when the per-token layers run on those only
    # (packed), None when they run on all B * T positions.
    packed: torch.Tensor | None = None

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [B, T, H, D] (half-split layout, as Hugging Face) in three ops:
        ``x cos + roll(x, D/2) sin``, where roll swaps the halves and ``sin`` carries the sign."""
        x32 = as_float32(x)
        rotated = torch.roll(x32, x.shape[-1] // 2, dims=-1)
        return torch.addcmul(x32 * self.cos, rotated, self.sin).to(x.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T): rows and query positions of the forward pass."""
        return self.attention.batch_size, self.attention.num_queries

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token values ([N, C] packed, or [B, T, C]) as [B, T, C], zeros at padding."""
        if self.packed is None:
            return x
        B, T = self.shape
        return x.new_zeros(B * T, x.shape[-1]).index_copy_(0, self.packed, x).view(B, T, -1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] as the per-token layers take it: [N, C] real tokens when packed."""
        return x if self.packed is None else x.reshape(-1, x.shape[-1]).index_select(0, self.packed)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads,
                                                        config.num_key_value_heads, config.head_dim)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wqkv = Linear(config.hidden_size, q_dim + 2 * kv_dim)  # q, k, v fused
        self.wo = Linear(q_dim, config.hidden_size)

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int, step: _Step) -> torch.Tensor:
        B, T = step.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = step.unpack(self.wqkv(x)).view(B, T, H + 2 * Hkv, D)
        qk = step.rope(qkv[:, :, : H + Hkv])          # q and k rotated together
        cache.append(layer, qk[:, :, H:], qkv[:, :, H + Hkv:], plan=step.append)
        plan = step.attention
        S = plan.max_len  # positions attention reads: the cache's capacity or a bound on the lengths
        out = ragged_attention(qk[:, :, :H], cache.k[layer][:, :S], cache.v[layer][:, :S], plan.cache_seqlens,
                               plan.q_seqlens, plan=plan)
        return self.wo(step.pack(out.reshape(B, T, H * D)))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w13 = Linear(config.hidden_size, 2 * config.intermediate_size)  # gate, up fused
        self.w2 = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int, step: _Step) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cache, layer, step)
        return x + self.feed_forward(self.ffn_norm(x))


class WeightsLock:
    """Shared by forward passes, exclusive for changes of the weights' layout (`Llama.pack_weights`).

    Forward passes in several threads run together. A layout change waits until the running ones
    have returned and holds new ones back meanwhile; when it is done, the forwards that waited for
    it go before the next change: neither a stream of forwards nor a stream of changes starves the
    other. A thread may take the lock again while it holds it (shared in shared, anything in
    exclusive); a layout change inside a forward of the same model is refused, as it could never
    get the lock. Copies and pickles of a model get a new lock (a model and its drafts copied
    together share theirs).
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._shared = 0                 # shared holds, by all threads
        self._owner: int | None = None   # the thread holding it exclusively
        self._exclusive = 0              # that thread's holds
        self._waiting_exclusive = 0      # threads waiting to hold it exclusively
        self._waiting_shared = 0         # threads waiting to hold it shared
        self._turn_of_shared = False     # set by an exclusive release: those waiting to share go first
        self._held = threading.local()   # .shared: this thread's shared holds

    def __reduce__(self):
        return (type(self), ())

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        held = self._held
        with self._condition:
            if not getattr(held, "shared", 0) and self._owner != threading.get_ident():
                self._waiting_shared += 1
                try:
                    while self._owner is not None or (self._waiting_exclusive and not self._turn_of_shared):
                        self._condition.wait()
                finally:  # (also when interrupted: a count left behind would block the others for good)
                    self._waiting_shared -= 1
                    if not self._waiting_shared:
                        self._turn_of_shared = False
                        self._condition.notify_all()
            held.shared = getattr(held, "shared", 0) + 1
            self._shared += 1
        try:
            yield
        finally:
            with self._condition:
                held.shared -= 1
                self._shared -= 1
                if not self._shared:
                    self._condition.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._condition:
            if self._owner != me:
                if getattr(self._held, "shared", 0):
                    raise RuntimeError("the weights' layout cannot change inside a forward pass of the same model")
                self._waiting_exclusive += 1
                try:
                    while self._owner is not None or self._shared or self._turn_of_shared:
                        self._condition.wait()
                finally:
                    self._waiting_exclusive -= 1
                    self._condition.notify_all()
                self._owner = me
            self._exclusive += 1
        try:
            yield
        finally:
            with self._condition:
                self._exclusive -= 1
                if not self._exclusive:
                    self._owner = None
                    self._turn_of_shared = self._waiting_shared > 0
                    self._condition.notify_all()


class Llama(nn.Module):
    """Llama-family causal LM following the package's model protocol (see the module docstring)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self._inv_freq: torch.Tensor | None = None  # fp32 whatever the weights' dtype; see rope_angles
        self.weights_lock = WeightsLock()  # see pack_weights

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "weights_lock" not in self.__dict__:  # pickled before models had one
            self.weights_lock = WeightsLock()

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, T, 1, D/2] (float32) of the rotary angles at ``positions`` [B, T].

        The inverse frequencies are kept in float32 outside the module's buffers, so casting the
        model to fp16 / bf16 never rounds them (0.4% relative error would shift angles by ~0.4 rad
        at position 2000)."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inverse_frequencies(self.config).to(positions.device)
        angles = positions[..., None, None].float() * self._inv_freq
        return angles.cos(), angles.sin()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """An empty KV cache for ``batch_size`` rows of up to ``max_len`` tokens each."""
        weight = self.output.weight
        return KVCache(len(self.layers), batch_size, max_len, self.config.num_key_value_heads,
                       self.config.head_dim, dtype=dtype or weight.dtype, device=device or weight.device)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, q_seqlens: torch.Tensor | None = None, *,
                last_only: bool = False, num_tokens: int | None = None, max_seqlen: int | None = None,
                min_seqlen: int | None = None) -> torch.Tensor:
        """Run ``input_ids`` [B, T] int64 through the model, appending to ``cache``.

        Args:
            input_ids: [B, T] token ids; row b's first ``q_seqlens[b]`` are real, the rest padding.
            cache: the KV cache (``cache.lengths`` [B] tokens already in it); it is advanced by
                ``q_seqlens``.
            q_seqlens: [B] int64 real new tokens per row (1..T); None means T for every row.
            last_only: return only the logits of each row's last real token, [B, 1, V].
            num_tokens: ``q_seqlens.sum()``, when the caller knows it on the host. The per-token
                layers (projections, MLP, norms, LM head) then skip the padding; without it they
                run on all B * T positions (finding the real ones would need a host sync).
            max_seqlen: an int >= every row's cache length after this pass (``cache.lengths +
                q_seqlens``), when the caller knows one on the host. Attention then reads only
                the first ``max_seqlen`` positions of each row instead of the cache's whole
                capacity (on the CPU its cost follows the positions read); a bound above the
                capacity means the capacity. A row longer than the bound is an error (checked
                on the device: a ValueError on CPU, a device assert on CUDA).
            min_seqlen: an int <= every row's cache length after this pass, when the caller
                knows one on the host (checked on the device likewise). The CPU attention path
                then multiplies V's positions below it in place (see `RaggedAttentionPlan`);
                when it equals the positions read (one row, ``max_seqlen`` exact), all of them.

        Returns:
            logits [B, T, V] (or [B, 1, V]) in the model's dtype; padded positions hold
            meaningless values.
        """
        with self.weights_lock.shared():
            return self._forward(input_ids, cache, q_seqlens, last_only, num_tokens, max_seqlen, min_seqlen)

    def _forward(self, input_ids: torch.Tensor, cache: KVCache, q_seqlens: torch.Tensor | None, last_only: bool,
                 num_tokens: int | None, max_seqlen: int | None, min_seqlen: int | None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if B != cache.batch_size:
            raise ValueError(f"input_ids has {B} rows but the cache has {cache.batch_size}")
        positions = cache.lengths[:, None] + torch.arange(T, device=input_ids.device)  # [B, T]
        cos, sin = self.rope_angles(positions)
        append = cache.plan_append(T, q_seqlens)  # validates q_seqlens
        q_seqlens = append.q_seqlens
        cache_seqlens = cache.lengths + (T if q_seqlens is None else q_seqlens)
        attention = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, min_seqlen=min_seqlen,
                                        max_len=self._positions_read(cache_seqlens, max_seqlen, T, cache.max_len))
        packed = self._real_tokens(q_seqlens, num_tokens, B, T)
        step = _Step(torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1), append, attention, packed)
        x = self.tok_embeddings(input_ids if packed is None else input_ids.flatten()[packed])
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, step)
        cache.advance(T if q_seqlens is None else q_seqlens)
        if last_only:  # each row's last real token
            if q_seqlens is None:
                x = x[:, -1:]
            elif packed is not None:
                x = x[q_seqlens.cumsum(0) - 1].view(B, 1, -1)
            else:
                x = x.gather(1, (q_seqlens - 1).view(B, 1, 1).expand(B, 1, x.shape[-1]))
            return self.output(self.norm(x)).contiguous()
        logits = step.unpack(self.output(self.norm(x)))
        return logits.contiguous()  # [B, T, V] rows, vocab contiguous

    @staticmethod
    def _positions_read(cache_seqlens: torch.Tensor, max_seqlen: int | None, T: int, capacity: int) -> int:
        """How many positions of each row attention reads: ``max_seqlen`` (checked) or the capacity."""
        if max_seqlen is None:
            return capacity
        if not is_int(max_seqlen) or max_seqlen < T:
            raise ValueError(f"max_seqlen must be an int >= T = {T} (the cache lengths after this pass "
                             f"include the new tokens), got {max_seqlen!r}")
        if max_seqlen >= capacity:  # the plan checks the lengths against the capacity
            return capacity
        device_check((cache_seqlens <= max_seqlen).all(),
                     f"max_seqlen={max_seqlen} is below a row's cache length after this pass")
        return int(max_seqlen)

    @staticmethod
    def _real_tokens(q_seqlens: torch.Tensor | None, num_tokens: int | None, B: int, T: int) -> torch.Tensor | None:
        """[N] indices b * T + t of the real tokens, or None to run on all B * T positions."""
        if num_tokens is None:
            return None
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 1 <= num_tokens <= B * T:
            raise ValueError(f"num_tokens must be an int in [1, B * T = {B * T}], got {num_tokens!r}")
        if q_seqlens is None:
            if num_tokens != B * T:
                raise ValueError(f"num_tokens={num_tokens} must be B * T = {B * T} when q_seqlens is None")
            return None
        device_check(q_seqlens.sum() == num_tokens, f"num_tokens={num_tokens} must equal q_seqlens.sum()")
        if num_tokens == B * T:
            return None
        rows = torch.repeat_interleave(torch.arange(B, device=q_seqlens.device), q_seqlens, output_size=num_tokens)
        starts = q_seqlens.cumsum(0) - q_seqlens
        return rows * T + torch.arange(num_tokens, device=q_seqlens.device) - starts[rows]

    def truncated(self, num_layers: int) -> Llama:
        """A draft made of this model's first ``num_layers`` layers plus its final norm and head
        (layer-skip self-speculation); shares every weight, costs no memory."""
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers must be in [1, {len(self.layers)}], got {num_layers}")
        config = LlamaConfig(**{**asdict(self.config), "num_hidden_layers": num_layers})
        draft = Llama.__new__(Llama)
        nn.Module.__init__(draft)
        draft.config = config
        draft.tok_embeddings, draft.norm, draft.output = self.tok_embeddings, self.norm, self.output
        draft.layers = nn.ModuleList(self.layers[:num_layers])
        draft._inv_freq = None
        draft.weights_lock = self.weights_lock  # the layers are shared, and so is their layout
        return draft

    def can_pack_weights(self) -> bool:
        """Whether `pack_weights` can prepare this model: every matmul weight is CPU float32."""
        try:
            for module in self.modules():
                if isinstance(module, Linear):
                    module.check_packable()
        except (ValueError, RuntimeError):
            return False
        return True

    def pack_weights(self, enable: bool = True, *, plan: MatmulPlan | None = None) -> Llama:
        """Prepare every matmul (projections and LM head) for CPU float32 inference in the form
        this machine runs fastest; ``enable=False`` undoes it. Returns the model.

        Without ``plan``, `measured_matmul_plan` times each form (``F.linear``, ``weight @ x^T``,
        MKL's packed GEMM and oneDNN's) and weight layout (row-major, input-major) on the first
        layers' weights and the LM head, at 1 to 64 rows (seconds, for SmolLM2-135M), and picks a
        layout and a form per row count: what won differs between machines
        (`specdec_kernels.matmul`). A plan measured while nothing else used the CPU is stored
        (`specdec_kernels.matmul.plans_file`) and reused by every later process on this machine,
        with these shapes and this number of torch threads; one measured under load serves this
        process only. Close calls may go either way between measurements, which changes the last
        bits of the logits. ``plan=`` applies a given `MatmulPlan` instead
        (`specdec_kernels.matmul.MKL_PACKED_PLAN`, for one), the same in every process.
        Measuring holds up to three more copies of the timed weights (256 MiB) for a few seconds.
        Every `Linear` then stores its weight in the plan's layout, in place (the parameters keep
        their shapes, values and ties; ``pack_weights(False)`` stores them row-major again), and,
        for each packed form the plan runs, a packed copy of it, which adds about one more copy of
        those weights to the resident memory (MKL reserves more address space than it touches);
        weights that shared storage with another model (a `from_pretrained` of a loaded module)
        no longer do, which adds another copy of those. MKL packs for the current number of torch threads (for its
        speed; results do not depend on it): call this method again after changing it.

        A tied input embedding stored input-major with the LM head makes its lookups strided
        gathers, many times slower than row reads (worst at a prefill's hundreds of tokens),
        against the LM head's gain at every one-row step: hence the margin the input-major
        layout must win by.

        Forwards on other devices or dtypes, or with autograd, run as without a plan (``.to()``,
        copies and pickles keep the layout). Input-major weights are not contiguous:
        ``save_pretrained`` stores them as usual, but a ``state_dict()`` given straight to
        safetensors' ``save_file`` needs ``.contiguous()``. A weight replaced or changed in
        place afterwards is packed again at its next use (a change made through ``.data``, or in
        place to a weight created under ``torch.inference_mode``, is not seen: call this method
        again); ``.to()`` drops the packed copies, which are made again at the next CPU float32
        use. Drafts made by `truncated` share the layers and so the plan and copies
        (``pack_weights(False)`` on a draft undoes it for the target too). Nothing is changed if
        any weight cannot follow the plan.

        Thread safety: a forward pass reads the weights in their layout throughout, so this method
        (a layout change) waits for the forward passes running in other threads, of this model and
        of the drafts that share its layers (`truncated`), and holds back new ones until it is
        done: a generation running meanwhile goes on with the new layout from its next forward
        pass, with the same logits up to the last bits (see above). Forward passes still run
        together. The lock is ``weights_lock`` (a `WeightsLock`); hold
        ``model.weights_lock.exclusive()`` to change weights in place while other threads generate.

        Raises:
            ValueError: a weight is not a CPU float32 tensor, ``plan`` is not a `MatmulPlan`, or a
                plan is given with ``enable=False``.
            RuntimeError: ``plan`` has a packed form this torch build lacks
                (`specdec_kernels.matmul.PACKED_FORMS`), or this method is called inside a forward
                pass of the same model (a hook's).
        """
        layers = {name: module for name, module in self.named_modules() if isinstance(module, Linear)}
        if plan is not None and not isinstance(plan, MatmulPlan):
            raise ValueError(f"plan must be a MatmulPlan or None, got {type(plan).__name__}")
        if not enable:
            if plan is not None:
                raise ValueError("plan must be None with enable=False (which stores the weights as loaded)")
            with self.weights_lock.exclusive():
                for layer in layers.values():
                    layer.unpack()
            return self
        for name, layer in layers.items():
            try:
                layer.check_packable(plan)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if plan is None:  # measured while forwards may run: it reads the weights, changes nothing
            plan = measured_matmul_plan(self._matmul_sample())
        with self.weights_lock.exclusive():
            for layer in layers.values():
                layer.pack(plan)
        return self

    def _matmul_sample(self, budget: int = 256 << 20) -> list[torch.Tensor]:
        """Weights to time the matmul forms on (`pack_weights`): the first layers' and the LM
        head's (its first rows when it holds more than half of ``budget``), in forward order,
        about ``budget`` bytes (more than a CPU's last-level cache, so that they stream from
        memory as in decoding), or all of them in a smaller model."""
        head = self.output.weight
        row_bytes = head.shape[1] * head.element_size()
        head = head[: max(1, min(head.shape[0], budget // 2 // row_bytes))]
        weights, size = [], head.shape[0] * row_bytes
        for layer in self.layers:
            layer_weights = [m.weight for m in layer.modules() if isinstance(m, Linear)]
            weights += layer_weights
            size += sum(w.numel() * w.element_size() for w in layer_weights)
            if size >= budget:
                break
        return [*weights, head]

    # ----------------------------------------------------------------- loading Hugging Face weights

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike | nn.Module, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> Llama:
        """Load Hugging Face Llama weights.

        The config's values are checked before anything is built (`LlamaConfig`), and every tensor
        of the source must belong to the model the config describes, exactly once, with the shape
        the config implies (`check_hf_state`): weights that contradict their config are an error,
        never a model that computes something else.

        Args:
            source: a folder with ``config.json`` and ``*.safetensors`` (Hugging Face layout), or a
                loaded ``transformers`` ``LlamaForCausalLM``.
            dtype: floating-point ``torch.dtype`` of the weights.
            device: where the weights go.

        Raises:
            TypeError: ``source`` is neither a folder path nor a module with a ``transformers``
                config, ``dtype`` is not a floating-point ``torch.dtype``, or a config value has
                the wrong type (the message names the key and ``config.json``'s path).
            ValueError: ``config.json`` is missing or not valid JSON, a config value is out of
                range, no ``*.safetensors`` file is there or one is not valid (empty, truncated,
                corrupt), or a tensor is missing, unused, in two files, or of the wrong shape or
                dtype (the message names the tensor and its file).
            OSError: a file cannot be read (the message names it).
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype such as torch.float16, got {dtype!r}")
        device = torch.device(device)
        if isinstance(source, nn.Module):
            if not hasattr(getattr(source, "config", None), "to_dict"):
                raise TypeError(f"source must be a transformers LlamaForCausalLM or a folder, got a "
                                f"{type(source).__name__} without a transformers config")
            config, state = LlamaConfig.from_hf(source.config), source.state_dict()
            origin = f"the {type(source).__name__}"
            files, config_where = dict.fromkeys(state, f"{origin}'s state_dict"), f"{origin}'s config"
        elif isinstance(source, (str, os.PathLike)):
            config, state, files = _read_hf_folder(Path(source))
            config_where = str(Path(source) / "config.json")
        else:
            raise TypeError("source must be a folder (a str or os.PathLike) with config.json and *.safetensors, "
                            f"or a loaded transformers LlamaForCausalLM, got {source!r}")
        state = check_hf_state(state, config, files, config_where)
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(hf_to_internal(state, config), assign=True, strict=True)
        if config.tie_word_embeddings:
            model.output.weight = model.tok_embeddings.weight
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the Hugging Face Llama layout."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {**asdict(self.config), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        state = internal_to_hf(self.state_dict(), self.config)
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def _read_hf_folder(folder: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, str]]:
    """The config and tensors of a Hugging Face folder, and the file each tensor came from. A file
    that cannot be read or parsed, and a tensor in two files, are errors naming the files."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"source must be a folder with config.json and *.safetensors, got {folder}")
    try:
        hf_config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise OSError(f"cannot read {path}: {e}") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e}): restore it or download it again") from e
    if not isinstance(hf_config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(hf_config).__name__}")
    try:
        config = LlamaConfig.from_hf(hf_config)
    except (TypeError, ValueError) as e:
        raise (TypeError if isinstance(e, TypeError) else ValueError)(f"{path}: {e}") from e
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state, files = {}, {}
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            tensors = load_file(shard)
        except SafetensorError as e:
            raise ValueError(f"{shard} is not a valid safetensors file ({e}): it is empty, truncated or "
                             "corrupt; download or convert it again") from e
        except OSError as e:
            raise OSError(f"cannot read {shard}: {e}") from e
        for name, tensor in tensors.items():
            if name in files:
                raise ValueError(f"{name} is in two files, {files[name]} and {shard}: a tensor may be in only "
                                 "one (is one of them a stale copy?)")
            state[name], files[name] = tensor, str(shard)
    if not state:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return config, state, files


# The tensors of each layer in a Hugging Face checkpoint, with their shapes in config fields.
_HF_LAYER_SHAPES = {
    "self_attn.q_proj.weight": ("num_attention_heads * head_dim", "hidden_size"),
    "self_attn.k_proj.weight": ("num_key_value_heads * head_dim", "hidden_size"),
    "self_attn.v_proj.weight": ("num_key_value_heads * head_dim", "hidden_size"),
    "self_attn.o_proj.weight": ("hidden_size", "num_attention_heads * head_dim"),
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
}
# Rotary frequencies that old transformers versions saved in each layer: ignored (they follow
# from rope_theta and head_dim), as transformers ignores them, but checked for their shape.
_HF_INV_FREQ = "self_attn.rotary_emb.inv_freq"


def hf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """Every tensor a Hugging Face checkpoint of ``config`` holds (named as in
    ``LlamaForCausalLM.state_dict()``), with its shape as products of config fields, e.g.
    ``("num_key_value_heads * head_dim", "hidden_size")``; ``lm_head.weight`` only when the
    embeddings are not tied."""
    shapes = {"model.embed_tokens.weight": ("vocab_size", "hidden_size"), "model.norm.weight": ("hidden_size",)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = ("vocab_size", "hidden_size")
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in _HF_LAYER_SHAPES.items()})
    return shapes


def _size(config: LlamaConfig, expression: str) -> int:
    """The size a shape expression of `hf_tensor_shapes` names: config fields joined by ``" * "``,
    optionally followed by ``" / 2"``."""
    product, _, divisor = expression.partition(" / ")
    return math.prod(getattr(config, name) for name in product.split(" * ")) // int(divisor or 1)


def _listed(names: list[str], files: dict[str, str] | None = None, most: int = 3) -> str:
    """``names`` for an error message: the first ``most``, and the files they are in when ``files`` is given."""
    listed = ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")
    return listed + (f" (in {', '.join(sorted({files[n] for n in names}))})" if files else "")


def _layers_hint(names: Any, config: LlamaConfig, config_where: str) -> str:
    """Where the layers the weights hold differ from ``num_hidden_layers``, a sentence that says so."""
    held = sorted({int(m[1]) for name in names if (m := re.match(r"model\.layers\.(\d+)\.", name))})
    if held == list(range(config.num_hidden_layers)):
        return ""
    span = f"0-{len(held) - 1}" if held == list(range(len(held))) else ", ".join(map(str, held))
    return (f"; the weights hold {len(held)} layers ({span}) and {config_where} says "
            f"num_hidden_layers={config.num_hidden_layers}")


def check_hf_state(state: dict[str, torch.Tensor], config: LlamaConfig, files: dict[str, str] | None = None,
                   config_where: str = "the config") -> dict[str, torch.Tensor]:
    """``state`` (a Hugging Face ``LlamaForCausalLM`` state dict) keyed by the names of
    `hf_tensor_shapes`, after checking that it holds every one of those tensors once, with the
    shape ``config`` implies and a floating-point dtype, and nothing else. Names without the
    ``model.`` prefix (a ``LlamaModel``'s) count as with it. With tied embeddings an
    ``lm_head.weight`` may be there if it equals ``model.embed_tokens.weight``.

    Args:
        files: where each tensor came from, for the error messages.
        config_where: where ``config`` came from (``config.json``'s path), for the messages.

    Raises:
        ValueError: a tensor is missing, unused, there under two names, or of the wrong shape or
            dtype; the message names the tensor and its file.
    """
    files = files or dict.fromkeys(state, "the state dict")
    named: dict[str, str] = {}  # name as in `hf_tensor_shapes` -> name in ``state``
    for name in state:
        key = name if name.startswith("model.") or name == "lm_head.weight" else f"model.{name}"
        if key in named:
            raise ValueError(f"{named[key]} (in {files[named[key]]}) and {name} (in {files[name]}) are the same "
                             "tensor under two names: a tensor may be there only once")
        named[key] = name
    expected = hf_tensor_shapes(config)
    optional = {f"model.layers.{i}.{_HF_INV_FREQ}": ("head_dim / 2",) for i in range(config.num_hidden_layers)}
    if config.tie_word_embeddings:
        optional["lm_head.weight"] = ("vocab_size", "hidden_size")
    hint = _layers_hint(named, config, config_where)
    missing = [key for key in expected if key not in named]
    if missing:
        if "lm_head.weight" in missing:
            hint += ("; if the LM head is the input embedding (tied), set tie_word_embeddings to true in "
                     f"{config_where}")
        raise ValueError(f"missing tensors: {_listed(missing)}; {config_where} implies them{hint}")
    unused = [named[key] for key in named if key not in expected and key not in optional]
    if unused:
        raise ValueError(f"unused tensors: {_listed(unused, files)}; every tensor must belong to the model "
                         f"{config_where} describes{hint}")
    for key, name in named.items():
        tensor, shape = state[name], {**expected, **optional}[key]
        sizes = tuple(_size(config, expression) for expression in shape)
        if tuple(tensor.shape) != sizes:
            raise ValueError(f"{name} (in {files[name]}) has shape {tuple(tensor.shape)}, but {config_where} "
                             f"implies {sizes} = ({', '.join(shape)})")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} (in {files[name]}) has dtype {tensor.dtype}; the built-in Llama loads "
                             "floating-point weights only")
    if "lm_head.weight" in named and config.tie_word_embeddings:
        name = named["lm_head.weight"]
        if not torch.equal(state[name], state[named["model.embed_tokens.weight"]]):
            raise ValueError(f"{name} (in {files[name]}) differs from the input embedding, but {config_where} "
                             "ties them (tie_word_embeddings=true): set it to false to use this LM head")
    return {key: state[name] for key, name in named.items()}


def hf_to_internal(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Map a Hugging Face ``LlamaForCausalLM`` state dict (checked by `check_hf_state`) onto
    `Llama`'s, fusing qkv and gate/up."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    head = state["embed_tokens.weight"] if config.tie_word_embeddings else state["lm_head.weight"]
    out = {"tok_embeddings.weight": state["embed_tokens.weight"], "norm.weight": state["norm.weight"],
           "output.weight": head}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        attn = [state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]
        mlp = [state[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")]
        out.update({
            f"{p}attention.wqkv.weight": torch.cat(attn),
            f"{p}attention.wo.weight": state[f"{p}self_attn.o_proj.weight"],
            f"{p}feed_forward.w13.weight": torch.cat(mlp),
            f"{p}feed_forward.w2.weight": state[f"{p}mlp.down_proj.weight"],
            f"{p}attention_norm.weight": state[f"{p}input_layernorm.weight"],
            f"{p}ffn_norm.weight": state[f"{p}post_attention_layernorm.weight"],
        })
    return out


def internal_to_hf(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_internal`."""
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(config.num_hidden_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[f"{p}attention.wqkv.weight"].split([q_dim, kv_dim, kv_dim])
        gate, up = state[f"{p}feed_forward.w13.weight"].chunk(2)
        out.update({
            f"{h}self_attn.q_proj.weight": q, f"{h}self_attn.k_proj.weight": k, f"{h}self_attn.v_proj.weight": v,
            f"{h}self_attn.o_proj.weight": state[f"{p}attention.wo.weight"],
            f"{h}mlp.gate_proj.weight": gate, f"{h}mlp.up_proj.weight": up,
            f"{h}mlp.down_proj.weight": state[f"{p}feed_forward.w2.weight"],
            f"{h}input_layernorm.weight": state[f"{p}attention_norm.weight"],
            f"{h}post_attention_layernorm.weight": state[f"{p}ffn_norm.weight"],
        })
    return out
