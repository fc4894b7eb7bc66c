"""Loading checks: `Llama.from_pretrained` accounts for every tensor exactly once, checks each
shape and the config's values, and names the file and the tensor or key in every error; the
converted SmolLM2 cache is verified at every use, converted again when broken, and readable by
other users."""

import json
import math
import stat
import tracemalloc
from pathlib import Path

import pytest
import test_packaging
import torch
from safetensors.torch import load_file, save_file

from specdec_kernels.model import Llama, LlamaConfig

from tiny_models import tiny_llama

stub_conversion = test_packaging.stub_conversion  # the SmolLM2 conversion with its slow parts stubbed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A saved two-layer model (hidden 64, 4 heads, 2 KV heads, head_dim 16, vocabulary 97)."""
    folder = tmp_path_factory.mktemp("checkpoint")
    tiny_llama(seed=1).save_pretrained(folder)
    return folder


@pytest.fixture
def folder(checkpoint, tmp_path) -> Path:
    """A copy of `checkpoint` to break."""
    for path in checkpoint.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    return tmp_path


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def edit_weights(folder: Path, change) -> None:
    """Rewrite model.safetensors with ``change(tensors)`` applied (a dict of name -> tensor)."""
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


# ---------------------------------------------------------------- config values, checked before building

CONFIG_CASES = {
    # change, exception, what the message says (after config.json's path)
    "one-layer-of-two": (dict(num_hidden_layers=1), ValueError,
                         r"unused tensors: model\.layers\.1\..*model\.safetensors.*hold 2 layers \(0-1\).*"
                         r"num_hidden_layers=1"),
    "three-layers-of-two": (dict(num_hidden_layers=3), ValueError,
                            r"missing tensors: model\.layers\.2\.self_attn\.q_proj\.weight.*num_hidden_layers=3"),
    "eps-negative": (dict(rms_norm_eps=-1), ValueError, "rms_norm_eps must be a positive finite number, got -1"),
    "eps-nan": (dict(rms_norm_eps=math.nan), ValueError, "rms_norm_eps must be a positive finite number, got nan"),
    "eps-past-float32": (dict(rms_norm_eps=1e300), ValueError,  # inf in the norms' float32: zero logits
                         "rms_norm_eps must be at most float32's largest value"),
    "theta-negative": (dict(rope_theta=-5), ValueError, "rope_theta must be a positive finite number, got -5"),
    "theta-inf": (dict(rope_theta=math.inf), ValueError, "rope_theta must be a positive finite number, got inf"),
    "kv-heads-0": (dict(num_key_value_heads=0), ValueError, "num_key_value_heads must be a positive int, got 0"),
    "kv-heads-3-of-4": (dict(num_key_value_heads=3), ValueError,
                        r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    "vocab-str": (dict(vocab_size="97"), TypeError, r"vocab_size must be a positive int, got '97' \(str\)"),
    "layers-float": (dict(num_hidden_layers=2.0), TypeError, r"num_hidden_layers must be a positive int, got 2\.0"),
    "intermediate-0": (dict(intermediate_size=0), ValueError, "intermediate_size must be a positive int, got 0"),
    "hidden-not-heads-multiple": (dict(hidden_size=66, head_dim=None), ValueError,
                                  r"hidden_size \(66\) must be a multiple of num_attention_heads \(4\)"),
    "head-dim-odd": (dict(head_dim=15), ValueError, "head_dim must be even, got 15"),
    "tie-str": (dict(tie_word_embeddings="yes"), TypeError, "tie_word_embeddings must be a bool"),
    "rope-scaling-str": (dict(rope_scaling="linear"), TypeError, "rope_scaling must be a dict or null"),
    "llama3-without-factor": (dict(rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 64}),
                              ValueError, "rope_scaling of type 'llama3' needs 'factor'"),
    "window-str": (dict(model_type="mistral", sliding_window="16"), TypeError, "sliding_window must be a positive int"),
}


@pytest.mark.parametrize("change,error,match", list(CONFIG_CASES.values()), ids=list(CONFIG_CASES))
def test_a_config_that_contradicts_the_weights_or_itself_is_refused_naming_the_key_and_file(
        folder, change, error, match):
    edit_config(folder, **change)
    with pytest.raises(error, match=str(folder / "config.json")) as raised:
        Llama.from_pretrained(folder)
    assert raised.match(match)


def test_shapes_are_checked_against_the_config_naming_the_tensor_expected_and_actual_shape(folder):
    """One KV head of 16 where the weights have two: k_proj is [32, 64], the config implies [16, 64]."""
    edit_config(folder, num_key_value_heads=1)
    with pytest.raises(ValueError) as raised:
        Llama.from_pretrained(folder)
    assert str(raised.value) == (
        f"model.layers.0.self_attn.k_proj.weight (in {folder / 'model.safetensors'}) has shape (32, 64), but "
        f"{folder / 'config.json'} implies (16, 64) = (num_key_value_heads * head_dim, hidden_size)")


def test_a_config_naming_absurdly_many_layers_is_refused_without_listing_them(folder):
    """Every expected tensor was listed before comparing, so num_hidden_layers=2**62 took all the
    memory there was. The missing ones are counted now, and only the first are listed."""
    edit_config(folder, num_hidden_layers=10**6)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.self_attn\.q_proj\.weight, .*"
                                             r"\(8999982 in all\).*hold 2 layers \(0-1\).*num_hidden_layers=1000000"):
            Llama.from_pretrained(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    edit_config(folder, num_hidden_layers=2**62)
    with pytest.raises(ValueError, match=rf"\({9 * 2**62 - 18} in all\)"):
        Llama.from_pretrained(folder)


def test_a_config_without_a_size_names_it_and_one_without_kv_heads_has_one_per_head(folder):
    """A missing size raised Python's own "__init__() missing 1 required positional argument"."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=rf"{folder / 'config.json'}: hidden_size missing: a Llama config gives"):
        Llama.from_pretrained(folder)
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4)
    for kv_heads in ({}, {"num_key_value_heads": None}):  # transformers' default: multi-head attention
        assert LlamaConfig.from_hf({**sizes, **kv_heads}).num_key_value_heads == 4


def test_config_values_are_checked_when_a_config_is_built():
    with pytest.raises(ValueError, match="rms_norm_eps must be a positive finite number"):
        LlamaConfig(97, 64, 144, 2, 4, 2, rms_norm_eps=0.0)
    with pytest.raises(TypeError, match="hidden_size must be a positive int"):
        LlamaConfig(97, True, 144, 2, 4, 2)
    with pytest.raises(ValueError, match="high_freq_factor"):
        LlamaConfig(97, 64, 144, 2, 4, 2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})


# ---------------------------------------------------------------- every tensor exactly once


def test_a_tensor_in_two_shards_names_both_files(folder):
    """An extra shard holding the embedding silently overrode the real one."""
    (folder / "model.safetensors").rename(folder / "a.safetensors")
    save_file({"model.embed_tokens.weight": torch.zeros(97, 64)}, str(folder / "stale.safetensors"))
    with pytest.raises(ValueError, match=rf"model\.embed_tokens\.weight is in two files, "
                                         rf"{folder / 'a.safetensors'} and {folder / 'stale.safetensors'}"):
        Llama.from_pretrained(folder)


def test_an_unused_tensor_is_refused_naming_its_file(folder):
    edit_weights(folder, lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    weights = folder / "model.safetensors"
    with pytest.raises(ValueError, match=rf"unused tensors: model\.extra\.weight \(in {weights}\)"):
        Llama.from_pretrained(folder)


def test_files_beside_the_weights_are_not_read(folder, checkpoint):
    """Mistral folders ship consolidated.safetensors in Mistral's own names beside model.safetensors."""
    save_file({"tok_embeddings.weight": torch.zeros(3)}, str(folder / "consolidated.safetensors"))
    reference = Llama.from_pretrained(checkpoint)
    assert torch.equal(Llama.from_pretrained(folder).output.weight, reference.output.weight)


def test_an_index_selects_the_shards_and_their_tensors(folder, checkpoint):
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, str(folder / "w-1.safetensors"))
    save_file({n: tensors[n] for n in names[5:]}, str(folder / "w-2.safetensors"))
    weight_map = {n: "w-1.safetensors" if i < 5 else "w-2.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"stale.weight": torch.zeros(3)}, str(folder / "stale.safetensors"))  # not listed: not read
    reference = Llama.from_pretrained(checkpoint)
    assert torch.equal(Llama.from_pretrained(folder).output.weight, reference.output.weight)
    weight_map[names[0]] = "w-2.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"{names[0]} is in .*w-1\.safetensors, but .* lists it in w-2"):
        Llama.from_pretrained(folder)


def test_a_tensor_under_two_names_is_refused(folder):
    edit_weights(folder, lambda t: t.update({"norm.weight": t["model.norm.weight"].clone()}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight .* and norm\.weight .* the same tensor under two names"):
        Llama.from_pretrained(folder)


def test_a_missing_tensor_is_named(folder):
    edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight; "):
        Llama.from_pretrained(folder)


def test_an_untied_config_without_lm_head_says_to_tie(folder):
    """Without lm_head.weight an untied config used the embedding as the LM head without a word."""
    edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: lm_head\.weight;.*set tie_word_embeddings to true"):
        Llama.from_pretrained(folder)


def test_integer_weights_are_refused(folder):
    edit_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight .* has dtype torch\.int8"):
        Llama.from_pretrained(folder)


def test_tied_embeddings_load_with_or_without_an_equal_lm_head_and_refuse_a_different_one(tmp_path):
    model = tiny_llama(seed=2, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    ids = torch.randint(0, 97, (2, 5))
    expected = model(ids, model.new_cache(2, 5))
    for lm_head in ("absent", "equal"):
        if lm_head == "equal":
            edit_weights(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
        loaded = Llama.from_pretrained(tmp_path)
        assert loaded.output.weight is loaded.tok_embeddings.weight
        torch.testing.assert_close(loaded(ids, loaded.new_cache(2, 5)), expected, rtol=0, atol=0)
    edit_weights(tmp_path, lambda t: t["lm_head.weight"].mul_(2))
    with pytest.raises(ValueError, match=r"lm_head\.weight .* differs from the input embedding.*tie_word_embeddings"):
        Llama.from_pretrained(tmp_path)


def test_names_without_the_model_prefix_and_old_rotary_frequencies_load(folder):
    """A LlamaModel's names (no ``model.``) and the ``rotary_emb.inv_freq`` buffers old transformers
    versions saved load as before."""
    def rename(tensors):
        for name in [n for n in tensors if n.startswith("model.")]:
            tensors[name.removeprefix("model.")] = tensors.pop(name)
        tensors["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    reference = Llama.from_pretrained(folder)
    edit_weights(folder, rename)
    loaded = Llama.from_pretrained(folder)
    for (name, expected), (_, actual) in zip(reference.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(actual, expected), name
    edit_weights(folder, lambda t: t.update({"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(9)}))
    with pytest.raises(ValueError, match=r"inv_freq .* has shape \(9,\), but .* implies \(8,\) = \(head_dim / 2\)"):
        Llama.from_pretrained(folder)


# ---------------------------------------------------------------- broken files and bad arguments

BROKEN_FILES = {
    "weights-empty": ("model.safetensors", lambda b: b""),
    "weights-truncated": ("model.safetensors", lambda b: b[: len(b) // 2]),
    "weights-garbage": ("model.safetensors", lambda b: b"\x07" * 64),
    "config-not-json": ("config.json", lambda b: b"{\"vocab_size\": 97,"),
    "config-not-utf8": ("config.json", lambda b: b"\xff\xfe{}"),
    "config-a-list": ("config.json", lambda b: b"[]"),
}


@pytest.mark.parametrize("name,corrupt", list(BROKEN_FILES.values()), ids=list(BROKEN_FILES))
def test_a_broken_file_is_named_with_what_is_wrong(folder, name, corrupt):
    path = folder / name
    path.write_bytes(corrupt(path.read_bytes()))
    what = "is not a valid safetensors file" if name == "model.safetensors" else "(is not valid JSON|must hold a JSON)"
    with pytest.raises(ValueError, match=f"{path} {what}"):
        Llama.from_pretrained(folder)


@pytest.mark.parametrize("source,kwargs,match", [
    (None, {}, "source must be a folder .* or a loaded transformers LlamaForCausalLM, got None"),
    (5, {}, "source must be a folder .*, got 5"),
    (torch.nn.Linear(2, 2), {}, "source must be a transformers LlamaForCausalLM or a folder, got a Linear"),
    ("checkpoint", dict(dtype="float16"), "dtype must be a floating-point torch.dtype .*, got 'float16'"),
    ("checkpoint", dict(dtype=torch.int8), "dtype must be a floating-point torch.dtype .*, got torch.int8"),
], ids=["source-none", "source-int", "source-module-without-config", "dtype-str", "dtype-int"])
def test_bad_arguments_raise_type_errors(checkpoint, source, kwargs, match):
    with pytest.raises(TypeError, match=match):
        Llama.from_pretrained(checkpoint if source == "checkpoint" else source, **kwargs)


# ---------------------------------------------------------------- the converted SmolLM2 cache


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "truncated-without-manifest", "tokenizer-missing"])
def test_a_broken_converted_folder_is_converted_again(stub_conversion, monkeypatch, tmp_path, damage):
    """Checking only that the files existed kept a truncated or overwritten model forever."""
    from specdec_kernels.pretrained import smollm2_folder

    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path / "cache"))
    folder = smollm2_folder()
    weights = folder / "model.safetensors"
    intact = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(intact[:-100])
    elif damage == "overwritten":  # same size
        weights.write_bytes(intact[:-100] + bytes(100))
    elif damage == "truncated-without-manifest":  # an unfinished conversion by an older version
        next(p for p in folder.iterdir() if "manifest" in p.name).unlink()
        weights.write_bytes(intact[:-100])
    else:
        (folder / "tokenizer.json").unlink()
    assert smollm2_folder() == folder and len(stub_conversion) == 2
    assert len(weights.read_bytes()) == len(intact) and Llama.from_pretrained(folder).config.vocab_size == 32
    assert smollm2_folder() == folder and len(stub_conversion) == 2  # intact again: not converted a third time


def test_a_whole_folder_converted_before_manifests_is_kept(stub_conversion, monkeypatch, tmp_path):
    """Caches converted by earlier versions have no manifest: whole ones are kept and recorded."""
    from specdec_kernels.pretrained import MANIFEST, smollm2_folder

    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path / "cache"))
    folder = smollm2_folder()
    (folder / MANIFEST).unlink()
    assert smollm2_folder() == folder and len(stub_conversion) == 1 and (folder / MANIFEST).is_file()


def test_the_converted_folder_is_readable_by_other_users(stub_conversion, monkeypatch, tmp_path):
    """tempfile.mkdtemp made the folder 0700, so another user of a shared cache got PermissionError."""
    from specdec_kernels.pretrained import smollm2_folder

    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path / "cache"))
    folder = smollm2_folder()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == dict.fromkeys(
        [p.name for p in folder.iterdir()], 0o644)


def test_a_broken_folder_in_a_cache_this_user_cannot_write_says_why_it_needs_writing(stub_conversion, monkeypatch,
                                                                                    tmp_path):
    """Another user's shared cache, damaged since its conversion: "cannot write the converted model"
    alone did not say that the model there was broken."""
    from specdec_kernels import pretrained

    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path / "cache"))
    folder = pretrained.smollm2_folder()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])

    def read_only(*args, **kwargs):  # (the tests may run as root, whom file modes do not stop)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pretrained.tempfile, "TemporaryFile", read_only)
    with pytest.raises(pretrained.ModelNotInstalledError,
                       match=rf"{folder} is not a complete conversion .* {folder.parent} cannot be written to convert "
                             r"it again .*ask its owner to delete it, or set SPECDEC_KERNELS_CACHE"):
        pretrained.smollm2_folder()
    assert len(stub_conversion) == 1


def test_the_digest_of_a_large_file_covers_its_header_and_samples_of_its_data(tmp_path):
    """Weights above the whole-file limit are hashed in part; damage to the header or to a large
    region (a never-written tail) still changes the digest, as does a different size."""
    from specdec_kernels.pretrained import _HASHED_WHOLE, _digest

    path = tmp_path / "big.safetensors"
    header = b'{"__metadata__":{}}'
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (_HASHED_WHOLE + 12345,), dtype=torch.uint8, generator=generator)
    intact = len(header).to_bytes(8, "little") + header + data.numpy().tobytes()
    path.write_bytes(intact)
    digest = _digest(path)
    for damaged in (intact[:10] + b"X" + intact[11:],                                  # the header
                    intact[: len(intact) // 2] + bytes(len(intact) - len(intact) // 2),  # the second half zeroed
                    intact[:-1] + bytes([intact[-1] ^ 1])):                             # the last byte
        path.write_bytes(damaged)
        assert _digest(path) != digest
