"""`LlamaConfig`: the shapes and constants of a Llama-family decoder, checked when made.

Every field is validated before anything is built from it, so a mistyped or contradictory config
is an error naming the field, never a silently different model.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any

from ._checks import is_int, is_real


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
    sliding_window: int | None = None  # each query sees at most this many keys, itself included (Mistral)

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
        if self.sliding_window is not None:
            _check_positive("sliding_window", self.sliding_window, integer=True)
        for name in ("rms_norm_eps", "rope_theta"):
            _check_positive(name, getattr(self, name), integer=False)
            setattr(self, name, float(getattr(self, name)))
        if self.rms_norm_eps > _FLOAT32_MAX:
            raise ValueError(f"rms_norm_eps must be at most float32's largest value ({_FLOAT32_MAX:.4g}), got "
                             f"{self.rms_norm_eps!r}: the norms compute in float32, where it would be infinite "
                             "and every norm's output 0")
        if not isinstance(self.tie_word_embeddings, bool):
            raise TypeError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        _check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config: Any) -> LlamaConfig:
        """From a ``transformers`` LlamaConfig (or its ``to_dict()``), old and new rope layouts alike.

        A missing or null ``num_key_value_heads`` means one per query head, as in transformers
        (configs written before grouped-query attention lack it).

        Raises:
            TypeError, ValueError: a value `LlamaConfig` refuses, a size missing, or a variant this
                decoder does not compute (another model type, biases, another activation).
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
        if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
            d = {**d, "num_key_value_heads": d["num_attention_heads"]}
        if d.get("model_type", "llama") != "mistral":  # transformers' Llama has no window, whatever the field says
            d = {k: v for k, v in d.items() if k != "sliding_window"}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]
        if missing:
            raise ValueError(f"{', '.join(missing)} missing: a Llama config gives the model's sizes (vocab_size, "
                             "hidden_size, intermediate_size, num_hidden_layers, num_attention_heads)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise TypeError(f"rope_scaling must be a dict or null, got {rope!r}")
        rope = dict(rope)
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        known = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        return cls(**{k: v for k, v in d.items() if k in known}, rope_theta=theta, rope_scaling=rope or None)


_FLOAT32_MAX = 3.4028234663852886e38


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
