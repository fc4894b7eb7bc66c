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

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import as_float32
from ._checks import check_float_dtype, device_check, is_int
from ._weights_lock import WeightsLock
from .attention import RaggedAttentionPlan, ragged_attention
from .cache import AppendPlan, KVCache
from .checkpoint import check_hf_state, hf_to_internal, internal_to_hf, read_hf_folder
from .config import LlamaConfig
from .matmul import FORMS, Linear, MatmulPlan, matmul_sample, measured_matmul_plan


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


def positions_read(cache_seqlens: torch.Tensor, max_seqlen: int | None, T: int, capacity: int) -> int:
    """How many positions of each row attention reads in a forward of T new tokens per row:
    ``max_seqlen`` (a host bound on ``cache_seqlens``, checked on the device) or the capacity."""
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


def tree_depths(tree_mask: torch.Tensor | None, q_seqlens: torch.Tensor | None, T: int, device: torch.device
                ) -> torch.Tensor:
    """Each new token's offset from its row's cache length: ``0 .. T-1`` for a chain (``tree_mask``
    None, [1, T]); in a tree, its depth: the real new tokens it sees, minus one ([B, T]). The
    attention plan checks the mask's shape and diagonal."""
    if tree_mask is None:
        return torch.arange(T, device=device)[None, :]
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool or tree_mask.shape[1:] != (T, T):
        raise ValueError(f"tree_mask must be a [B, T={T}, T] bool tensor or None, got "
                         f"{getattr(tree_mask, 'dtype', type(tree_mask).__name__)} "
                         f"{list(getattr(tree_mask, 'shape', []))}")
    seen = tree_mask if q_seqlens is None else tree_mask & (torch.arange(T, device=device) < q_seqlens.view(-1, 1, 1))
    return (seen.sum(-1) - 1).clamp(min=0)  # a padding query (outputs never read) may see none


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
                               plan.q_seqlens, sliding_window=plan.sliding_window, tree_mask=plan.tree_mask,
                               plan=plan)
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


class Llama(nn.Module):
    """Llama-family causal LM following the package's model protocol (see the module docstring)."""

    #: Its decoding forwards can be replayed as CUDA graphs (no host synchronization): the loops
    #: do so by default on CUDA.
    capturable = True

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
                min_seqlen: int | None = None, return_hidden: bool = False, tree_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, hidden_only: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
            return_hidden: also return the last layer's hidden states, before the final norm, at
                every position, ``last_only`` or not (what EAGLE-style draft heads read, the
                prompt's included; see `specdec_kernels.Drafter`).
            tree_mask: [B, T, T] bool, or None (a chain): the new tokens form a tree, each
                attending to the cache and to the new tokens its row of the mask gives (its
                ancestors and itself; `ragged_attention`). A token's position (for the rotary
                embedding) is then the row's cache length plus its depth: the number of new
                tokens it sees, minus one. With a sliding window, a ValueError once the window
                hides keys of the positions the pass reads (a tree token's distance to them is
                its depth, which the mask does not give).
            inputs_embeds: [B, T, H] in the model's dtype: the first layer's input instead of the
                token embeddings of ``input_ids`` (which then give only the shape); a draft head
                (`FeatureHeadDraft`) feeds its own mix of features and embeddings.
            hidden_only: return the last layer's hidden states alone, [B, T, H], without the final
                norm and the LM head (a draft head growing a tree reads its nodes' features, not
                their logits); ``last_only`` and ``return_hidden`` must then be False.

        Returns:
            logits [B, T, V] (or [B, 1, V]) in the model's dtype; padded positions hold
            meaningless values. With ``return_hidden``: (logits, hidden states [B, T, H]). With
            ``hidden_only``: the hidden states [B, T, H] alone.
        """
        if hidden_only and (last_only or return_hidden):
            raise ValueError("hidden_only=True returns the hidden states alone: last_only and return_hidden "
                             "must be False")
        with self.weights_lock.shared():
            return self._forward(input_ids, cache, q_seqlens, last_only, num_tokens, max_seqlen, min_seqlen,
                                 return_hidden, tree_mask, inputs_embeds, hidden_only)

    def _forward(self, input_ids: torch.Tensor, cache: KVCache, q_seqlens: torch.Tensor | None, last_only: bool,
                 num_tokens: int | None, max_seqlen: int | None, min_seqlen: int | None, return_hidden: bool,
                 tree_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                 hidden_only: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if B != cache.batch_size:
            raise ValueError(f"input_ids has {B} rows but the cache has {cache.batch_size}")
        positions = cache.lengths[:, None] + tree_depths(tree_mask, q_seqlens, T, input_ids.device)  # [B, T]
        cos, sin = self.rope_angles(positions)
        append = cache.plan_append(T, q_seqlens)  # validates q_seqlens
        q_seqlens = append.q_seqlens
        cache_seqlens = cache.lengths + (T if q_seqlens is None else q_seqlens)
        attention = RaggedAttentionPlan(cache_seqlens, q_seqlens, num_queries=T, min_seqlen=min_seqlen,
                                        max_len=positions_read(cache_seqlens, max_seqlen, T, cache.max_len),
                                        sliding_window=self.config.sliding_window, tree_mask=tree_mask)
        packed = self._real_tokens(q_seqlens, num_tokens, B, T)
        step = _Step(torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1), append, attention, packed)
        if inputs_embeds is None:
            x = self.tok_embeddings(input_ids if packed is None else input_ids.flatten()[packed])
        else:
            if inputs_embeds.shape != (B, T, self.config.hidden_size):
                raise ValueError(f"inputs_embeds must be [B, T, H] = {[B, T, self.config.hidden_size]}, got "
                                 f"{list(inputs_embeds.shape)}")
            x = step.pack(inputs_embeds)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, step)
        cache.advance(T if q_seqlens is None else q_seqlens)
        if hidden_only:
            return step.unpack(x)
        hidden = step.unpack(x) if return_hidden else None
        if last_only:  # each row's last real token
            if q_seqlens is None:
                x = x[:, -1:]
            elif packed is not None:
                x = x[q_seqlens.cumsum(0) - 1].view(B, 1, -1)
            else:
                x = x.gather(1, (q_seqlens - 1).view(B, 1, 1).expand(B, 1, x.shape[-1]))
            logits = self.output(self.norm(x)).contiguous()
            return (logits, hidden) if return_hidden else logits
        logits = step.unpack(self.output(self.norm(x))).contiguous()  # [B, T, V] rows, vocab contiguous
        return (logits, hidden) if return_hidden else logits

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
        if not is_int(num_layers):
            raise TypeError(f"num_layers must be an int, got {num_layers!r}")
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
        This covers eager forwards (CPU, and CUDA without graphs): a CUDA-graph replay does not go
        through ``forward`` and takes no lock, so do not change weights while graphed loops run.

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
        if plan is not None and plan.rounded:
            raise ValueError(f"plan must run forms of {FORMS} only (the same logits to the last bits), got "
                             f"{plan.describe()}; a rounded form is for a draft's own Linears (`Linear.pack`)")
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
        if plan is None:  # shared: forwards may run meanwhile, another layout change may not
            with self.weights_lock.shared():
                plan = measured_matmul_plan(self._matmul_sample())
        with self.weights_lock.exclusive():
            for layer in layers.values():
                layer.pack(plan)
        return self

    def _matmul_sample(self) -> list[torch.Tensor]:
        """Weights to time the matmul forms on (`pack_weights`): the first layers' and the LM head's
        (`specdec_kernels.matmul.matmul_sample`)."""
        layers = [[m.weight for m in layer.modules() if isinstance(m, Linear)] for layer in self.layers]
        return matmul_sample(layers, self.output.weight)

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
        check_float_dtype(dtype)
        device = torch.device(device)
        if isinstance(source, nn.Module):
            if not hasattr(getattr(source, "config", None), "to_dict"):
                raise TypeError(f"source must be a transformers LlamaForCausalLM or a folder, got a "
                                f"{type(source).__name__} without a transformers config")
            config, state = LlamaConfig.from_hf(source.config), source.state_dict()
            origin = f"the {type(source).__name__}"
            files, config_where = dict.fromkeys(state, f"{origin}'s state_dict"), f"{origin}'s config"
        elif isinstance(source, (str, os.PathLike)):
            config, state, files = read_hf_folder(Path(source))
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
        """Write ``config.json`` and ``model.safetensors`` in the Hugging Face Llama layout (as a
        Mistral config when the model has a sliding window)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # A window is Mistral's (transformers' Llama would ignore it and attend to every position).
        model_type, architecture = (("mistral", "MistralForCausalLM") if self.config.sliding_window is not None
                                    else ("llama", "LlamaForCausalLM"))
        config = {**asdict(self.config), "model_type": model_type, "architectures": [architecture]}
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        state = internal_to_hf(self.state_dict(), self.config)
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
