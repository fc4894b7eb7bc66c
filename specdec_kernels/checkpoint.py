"""Hugging Face Llama checkpoints: reading a folder, checking its tensors against the config, and
mapping names between the Hugging Face layout and the built-in `Llama`'s.

Loading accounts for every tensor exactly once: a missing, unused, duplicated or misshapen
tensor, and a file that cannot be read, are errors naming the tensor and the file.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .config import LlamaConfig


def read_hf_folder(folder: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, str]]:
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
    shards, index = _weight_files(folder)
    for shard in shards:
        try:
            tensors = load_file(shard)
        except SafetensorError as e:
            raise ValueError(f"{shard} is not a valid safetensors file ({e}): it is empty, truncated or "
                             "corrupt; download or convert it again") from e
        except OSError as e:
            raise OSError(f"cannot read {shard}: {e}") from e
        for name, tensor in tensors.items():
            if index is not None and index.get(name, shard.name) != shard.name:
                raise ValueError(f"{name} is in {shard}, but {folder / _INDEX} lists it in {index[name]}")
            if name in files:
                raise ValueError(f"{name} is in two files, {files[name]} and {shard}: a tensor may be in only "
                                 "one (is one of them a stale copy?)")
            state[name], files[name] = tensor, str(shard)
    if not state:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return config, state, files


_INDEX = "model.safetensors.index.json"


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The weight files of a Hugging Face folder, chosen as transformers chooses them, and the
    index's tensor -> file map when there is one: ``model.safetensors`` if present, else the
    shards ``model.safetensors.index.json`` lists, else every ``*.safetensors`` file. Other files
    beside them (Mistral's ``consolidated.safetensors`` in its own names) are not the model's."""
    single, index_path = folder / "model.safetensors", folder / _INDEX
    if single.is_file():
        return [single], None
    if not index_path.is_file():
        return sorted(folder.glob("*.safetensors")), None
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path} is not a valid safetensors index ({e!r}): restore it or download it "
                         "again") from e
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map must map tensor names to file names")
    missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
    if missing:
        raise ValueError(f"{index_path} lists {', '.join(missing)}, which {folder} does not have")
    return [folder / f for f in sorted(set(weight_map.values()))], weight_map


# The tensors of a Hugging Face checkpoint outside its layers, and of each layer, with their
# shapes in config fields.
_HF_SHAPES = {
    "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
    "model.norm.weight": ("hidden_size",),
    "lm_head.weight": ("vocab_size", "hidden_size"),
}
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
_HF_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)")


def hf_tensor(config: LlamaConfig, name: str) -> tuple[tuple[str, ...], bool] | None:
    """The shape of tensor ``name`` (as in ``LlamaForCausalLM.state_dict()``) in a Hugging Face
    checkpoint of ``config``, as products of config fields (e.g. ``("num_key_value_heads *
    head_dim", "hidden_size")``), and whether the checkpoint must hold it (``lm_head.weight`` only
    when the embeddings are not tied; old rotary frequencies never); None for a name that is none
    of its tensors. Read from the name alone: a config may name more layers than could be listed."""
    layer = _HF_LAYER.fullmatch(name)
    if layer is None:
        shape = _HF_SHAPES.get(name)
        return None if shape is None else (shape, name != "lm_head.weight" or not config.tie_word_embeddings)
    if int(layer[1]) >= config.num_hidden_layers:
        return None
    if layer[2] == _HF_INV_FREQ:
        return ("head_dim / 2",), False
    shape = _HF_LAYER_SHAPES.get(layer[2])
    return None if shape is None else (shape, True)


def hf_required_tensors(config: LlamaConfig) -> Iterator[str]:
    """The names of the tensors a Hugging Face checkpoint of ``config`` must hold, in
    ``state_dict()`` order; a generator, as `hf_tensor` reads names."""
    yield from (name for name in _HF_SHAPES if hf_tensor(config, name)[1])
    for i in range(config.num_hidden_layers):
        yield from (f"model.layers.{i}.{name}" for name in _HF_LAYER_SHAPES)


def _size(config: LlamaConfig, expression: str) -> int:
    """The size a shape expression of `hf_tensor` names: config fields joined by ``" * "``,
    optionally followed by ``" / 2"``."""
    product, _, divisor = expression.partition(" / ")
    return math.prod(getattr(config, name) for name in product.split(" * ")) // int(divisor or 1)


def _listed(names: list[str], files: dict[str, str] | None = None, most: int = 3, total: int | None = None) -> str:
    """``names`` (of ``total`` in all, by default as many as given) for an error message: the first
    ``most``, and the files they are in when ``files`` is given."""
    total = len(names) if total is None else total
    listed = ", ".join(names[:most]) + (f", ... ({total} in all)" if total > most else "")
    return listed + (f" (in {', '.join(sorted({files[n] for n in names}))})" if files else "")


def _layers_hint(names: Any, config: LlamaConfig, config_where: str) -> str:
    """Where the layers the weights hold differ from ``num_hidden_layers``, a sentence that says so."""
    held = sorted({int(m[1]) for name in names if (m := re.match(r"model\.layers\.(\d+)\.", name))})
    if len(held) == config.num_hidden_layers and held == list(range(len(held))):
        return ""
    span = f"0-{len(held) - 1}" if held == list(range(len(held))) else ", ".join(map(str, held))
    return (f"; the weights hold {len(held)} layers ({span}) and {config_where} says "
            f"num_hidden_layers={config.num_hidden_layers}")


def check_hf_state(state: dict[str, torch.Tensor], config: LlamaConfig, files: dict[str, str] | None = None,
                   config_where: str = "the config") -> dict[str, torch.Tensor]:
    """``state`` (a Hugging Face ``LlamaForCausalLM`` state dict) keyed by the names of
    ``LlamaForCausalLM.state_dict()``, after checking that it holds every tensor a checkpoint of
    ``config`` must hold (`hf_required_tensors`) once, with the shape ``config`` implies
    (`hf_tensor`) and a floating-point dtype, and nothing else. Names without the
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
    named: dict[str, str] = {}  # name as in ``LlamaForCausalLM.state_dict()`` -> name in ``state``
    for name in state:
        key = name if name.startswith("model.") or name == "lm_head.weight" else f"model.{name}"
        if key in named:
            raise ValueError(f"{named[key]} (in {files[named[key]]}) and {name} (in {files[name]}) are the same "
                             "tensor under two names: a tensor may be there only once")
        named[key] = name
    tensors = {key: hf_tensor(config, key) for key in named}
    hint = _layers_hint(named, config, config_where)
    # Counted rather than listed: a config may name more layers than could be listed.
    required = (sum(hf_tensor(config, name)[1] for name in _HF_SHAPES)
                + len(_HF_LAYER_SHAPES) * config.num_hidden_layers)
    present = sum(1 for tensor in tensors.values() if tensor is not None and tensor[1])
    if present < required:
        missing = list(itertools.islice((key for key in hf_required_tensors(config) if key not in named), 3))
        if "lm_head.weight" not in named and not config.tie_word_embeddings:
            hint += ("; if the LM head is the input embedding (tied), set tie_word_embeddings to true in "
                     f"{config_where}")
        raise ValueError(f"missing tensors: {_listed(missing, total=required - present)}; {config_where} implies "
                         f"them{hint}")
    unused = [named[key] for key, tensor in tensors.items() if tensor is None]
    if unused:
        raise ValueError(f"unused tensors: {_listed(unused, files)}; every tensor must belong to the model "
                         f"{config_where} describes{hint}")
    for key, name in named.items():
        tensor, shape = state[name], tensors[key][0]
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
