"""Training data for draft heads: prompts built from text on this machine and a list of everyday
topics, answered by the target.

A draft head learns to predict what the *target* says, not what a corpus says (self-distillation):
so the data is the target's own answers (greedy and sampled) to prompts built from text every
Debian-like machine with Python carries and from a built-in topic list, and the target's features
and top logits at every position.
No model hub and no download.

Prompts (`build_prompts`) are of two kinds. The *documents* kind is tasks over
- the Python standard library: explain a function from its docstring; add type hints or a
  docstring to a short function, keeping its body (copy-heavy, as code editing is);
- the installed Debian packages (``/var/lib/dpkg/status``): explain, introduce, list uses;
- documentation text (``/usr/share/doc``): summarize, rewrite, list key points;
- lists (module and package names): copy, number, sort, annotate.

The *open* kind is requests of the kinds users write to a chat model (explain, tell a story,
write a poem or an email, give tips) over a list of everyday topics (`OPEN_TOPICS`).

A stable hash puts one prompt in twenty in the held-out set, which training never reads.

Shards (`write_shards`): each shard answers ``shard_size`` prompts and stores, for every sequence
(chat-formatted prompt, then answer): its tokens, the target's last-layer hidden states before the
final norm (float16; what a feature head reads), and the target's top ``top_k`` logits (the
distillation target). A shard is written to a temporary file and renamed, so an interrupted run
leaves whole shards only; a later run skips the shards already on disk. Shard i always holds the
same prompts: the data does not depend on how often the run was interrupted.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import itertools
import json
import os
import pkgutil
import random
import re
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

HELD_OUT_ONE_IN = 20
DPKG_STATUS = Path("/var/lib/dpkg/status")
DOC_ROOT = Path("/usr/share/doc")


# --------------------------------------------------------------------------- prompts

def _stdlib_modules() -> Iterator[object]:
    """Importable pure-Python standard library modules (no tests, no GUI, no side effects)."""
    skip = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "lib2to3", "ensurepip", "pydoc_data",
            "__main__", "__phello__", "_", "xxsubtype", "venv", "webbrowser", "msilib", "turtledemo")
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name not in sys.stdlib_module_names or info.name.startswith(skip):
            continue
        try:
            with warnings.catch_warnings():  # deprecated modules say so on import
                warnings.simplefilter("ignore")
                module = __import__(info.name)
        except Exception:  # platform-specific modules
            continue
        if getattr(module, "__file__", "") and module.__file__.endswith(".py"):
            yield module


def _stdlib_functions() -> Iterator[tuple[str, str, str]]:
    """(qualified name, first docstring paragraph, source) of public standard library functions."""
    for module in _stdlib_modules():
        try:
            tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
            source = Path(module.__file__).read_text(encoding="utf-8").splitlines()
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                body = "\n".join(source[node.lineno - 1: node.end_lineno])
                yield f"{module.__name__}.{node.name}", doc.split("\n\n")[0].strip(), textwrap.dedent(body)


def _debian_packages() -> Iterator[tuple[str, str, str]]:
    """(name, one-line summary, long description) of the installed Debian packages."""
    try:
        text = DPKG_STATUS.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    for stanza in text.split("\n\n"):
        name = re.search(r"^Package: (.+)$", stanza, re.M)
        desc = re.search(r"^Description: (.+)\n((?: .*\n?)*)", stanza, re.M)
        if name and desc:
            long = " ".join(line.strip() for line in desc.group(2).splitlines() if line.strip() != ".")
            yield name.group(1), desc.group(1).strip(), long.strip()


def _doc_paragraphs(limit_files: int = 400) -> Iterator[str]:
    """Prose paragraphs (200-900 characters) from the text files under /usr/share/doc."""
    if not DOC_ROOT.is_dir():
        return
    files = sorted(p for p in DOC_ROOT.rglob("*") if p.is_file() and not p.is_symlink()
                   and re.search(r"(README|NEWS|\.txt|\.md|\.rst)(\.gz)?$", p.name) and "changelog" not in p.name)
    for path in files[:limit_files]:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            letters = sum(c.isalpha() for c in para)
            if 200 <= len(para) <= 900 and letters > 0.7 * len(para):
                yield para


def _function_tasks(rng: random.Random) -> list[str]:
    tasks = []
    for name, doc, source in _stdlib_functions():
        lines = source.count("\n") + 1
        if doc and 40 <= len(doc) <= 600:
            tasks.append(rng.choice((
                f"Explain what the Python function {name} does, then show a short example of calling it.\n\n{doc}",
                f"In two or three sentences, describe when you would use {name}. Its documentation says:\n\n{doc}",
            )))
        if 4 <= lines <= 24 and '"""' not in source and "'''" not in source:
            tasks.append(rng.choice((
                f"Rewrite this Python function with type hints, keeping the body unchanged:\n\n{source}",
                f"Add a docstring to this Python function and return the whole function:\n\n{source}",
                f"Explain this Python code line by line:\n\n{source}",
                f"Rename the variables of this function to clearer names and return the new code:\n\n{source}",
            )))
    return tasks


def _package_tasks(rng: random.Random) -> list[str]:
    tasks = []
    for name, summary, long in _debian_packages():
        tasks.append(rng.choice((
            f"What is the Debian package {name} for? It is described as: {summary}.",
            f"Write a short paragraph introducing {name} ({summary}) to a new Linux user.",
            f"List three situations where someone would install {name}. Description: {long or summary}",
            f"Summarize this package description in one sentence: {long or summary}",
        )))
    return tasks


def _doc_tasks(rng: random.Random) -> list[str]:
    return [rng.choice(("Summarize this text in two sentences:\n\n", "Rewrite this text in plain words:\n\n",
                        "Turn this text into a bulleted list of its key points:\n\n",
                        "What is the main point of this text?\n\n")) + para for para in _doc_paragraphs()]


def _list_tasks(rng: random.Random, names: list[str], count: int) -> list[str]:
    tasks = []
    for _ in range(count):
        items = ", ".join(rng.sample(names, rng.randint(5, 12)))
        tasks.append(rng.choice((f"Copy this list and number each item: {items}.",
                                 f"Sort this list alphabetically, one item per line: {items}.",
                                 f"Write each of these names on its own line followed by a short note: {items}.",
                                 f"Repeat this list in reverse order: {items}.")))
    return tasks


# Open requests, the kinds users write to a chat model: questions, stories, advice, letters. A
# topic list is the one text here that is not read from the machine (none of its topics is one of
# the benchmark's open prompts). Every template takes every topic.
OPEN_TOPICS = (
    "volcanoes", "honeybees", "the moon", "saving money", "learning to cook", "growing tomatoes", "public libraries",
    "chess", "rainforests", "getting enough sleep", "time management", "the printing press", "recycling",
    "learning a second language", "coffee", "ocean tides", "friendship", "job interviews", "camping in the mountains",
    "electric cars", "ancient Rome", "baking bread", "photography", "volunteering", "owning a cat", "dinosaurs",
    "solar energy", "the human heart", "practising a musical instrument", "public speaking", "travelling on a budget",
    "winter storms", "board games", "first aid", "the water cycle", "city parks", "trains", "writing a resume",
    "meditation", "gardening on a balcony", "earthquakes", "penguins", "the internet", "mechanical clocks",
    "vaccines", "chocolate", "museums", "rivers", "moving to a new city", "birthday parties", "healthy breakfasts",
    "the pyramids of Egypt", "black holes", "teamwork", "rainbows", "the history of writing", "walking to work",
    "starting a small business", "houseplants", "the Olympic Games", "robots", "climate change", "forests in autumn",
    "a rainy afternoon", "dogs as pets", "the invention of the telephone", "kindness to strangers", "deserts",
    "learning to swim", "the night sky", "pizza", "keeping a diary", "an old map", "a lost key", "a village market",
)
OPEN_TEMPLATES = (
    "Explain {} to a ten-year-old.", "What should everyone know about {}?", "Write a short story about {}.",
    "Write a short poem about {}.", "Give me five practical tips about {}.", "What are the pros and cons of {}?",
    "Describe {} in a few sentences.", "Why does {} matter?", "Write a friendly email to a colleague about {}.",
    "I'm curious about {}. Where should I start?", "Tell me three interesting facts about {}.",
    "Write a short dialogue between two friends talking about {}.",
    "What mistakes do people often make when it comes to {}?", "Summarize what people have learned about {} over time.",
)


def _open_tasks() -> list[str]:
    return [template.format(topic) for topic in OPEN_TOPICS for template in OPEN_TEMPLATES]


def is_held_out(prompt: str) -> bool:
    """Whether ``prompt`` belongs to the held-out set (a stable hash: one prompt in twenty)."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little") % HELD_OUT_ONE_IN == 0


PROMPT_KINDS = ("documents", "open")


def build_prompts(seed: int = 0, kinds: tuple[str, ...] = PROMPT_KINDS) -> tuple[list[str], list[str]]:
    """The training and held-out prompts, built from text on this machine and `OPEN_TOPICS`, in a
    fixed shuffled order.

    Two kinds: ``"documents"``, tasks over the standard library, the installed packages, the
    documentation and lists (copy-heavy: summarize, rewrite, explain, annotate), and ``"open"``,
    requests of the kinds users write (questions, stories, advice, letters over `OPEN_TOPICS`).
    With both, the lists alternate one prompt of each kind while both last (the open kind has
    1,050), so that a prefix (``train-draft --prompts N``) holds as many of each.

    The same machine, seed and kinds give the same lists; the held-out prompts are those
    `is_held_out` picks, so a prompt is never in both.

    Args:
        seed: shuffles each kind's list (and picks each documents task's wording).
        kinds: a non-empty subset of `PROMPT_KINDS`, in any order (documents first in the lists).

    Returns:
        ``(train, held_out)``: lists of user messages (not chat-formatted).

    Example::

        train, held_out = build_prompts()
        print(len(train), held_out[0])
    """
    if not kinds or not set(kinds) <= set(PROMPT_KINDS) or len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds must be a non-empty subset of {PROMPT_KINDS} without repeats, got {kinds!r}")
    lists = []
    if "documents" in kinds:
        rng = random.Random(seed)
        tasks = _function_tasks(rng) + _package_tasks(rng) + _doc_tasks(rng)
        names = sorted({m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names}
                       | {name for name, _, _ in _debian_packages()})
        tasks += _list_tasks(rng, names, len(tasks) // 8)
        tasks = sorted(set(tasks))  # a task listed twice (same docstring twice) once, then shuffled
        rng.shuffle(tasks)
        lists.append(tasks)
    if "open" in kinds:
        tasks = _open_tasks()
        random.Random(seed + 1).shuffle(tasks)
        lists.append(tasks)
    # One of each kind in turn while both last (the documents list's own order is the one an
    # earlier version of the recipe used alone).
    tasks = [t for group in itertools.zip_longest(*lists) for t in group if t is not None]
    held_out = [t for t in tasks if is_held_out(t)]
    return [t for t in tasks if not is_held_out(t)], held_out


def save_prompts(path: str | os.PathLike, train: list[str], held_out: list[str]) -> None:
    """Write prompt lists (`build_prompts`) to ``path`` (JSON, gzip-compressed when the name ends
    in ``.gz``), atomically, so that another machine, which lacks the local documentation and
    packages `build_prompts` reads (a GPU machine, say), answers and trains on the same prompts
    (`load_prompts`)."""
    path = Path(path)
    data = json.dumps({"format": "specdec_kernels prompts 1", "train": train, "held_out": held_out}).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    os.replace(tmp, path)


def load_prompts(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """The ``(train, held_out)`` lists `save_prompts` wrote. A ValueError names a file that is
    not one, or whose split is not `is_held_out`'s (a held-out prompt must never be trained on)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompts file at {path}")
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
        if data.get("format") != "specdec_kernels prompts 1":
            raise ValueError(f"format {data.get('format')!r}")
        train, held_out = data["train"], data["held_out"]
        if not (isinstance(train, list) and isinstance(held_out, list)
                and all(isinstance(p, str) for p in train + held_out)):
            raise ValueError("train and held_out must be lists of strings")
    except Exception as e:
        raise ValueError(f"{path} is not a prompts file ({type(e).__name__}: {e}); write it with "
                         "train-draft --stage prompts") from e
    if any(is_held_out(p) for p in train) or not all(is_held_out(p) for p in held_out):
        raise ValueError(f"{path}: its train/held-out split is not is_held_out's: a held-out prompt would be "
                         "trained on, or a training prompt held out")
    return train, held_out


# --------------------------------------------------------------------------- shards

@dataclass
class Shard:
    """One shard of distillation data: S sequences of prompt then answer, packed end to end.

    Attributes:
        token_ids: [N] int64, the sequences' tokens, one after another (N tokens in all).
        lengths: [S] int64, each sequence's token count (prompt and answer).
        prompt_lengths: [S] int64, the tokens of each sequence's prompt.
        hidden: [N, H] float16, the target's last-layer hidden state (before the final norm) at
            each position: what predicts the next token.
        top_ids: [N, top_k] int64 and top_logits: [N, top_k] float32, the target's largest
            logits at each position, in descending order.
    """

    token_ids: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    hidden: torch.Tensor
    top_ids: torch.Tensor
    top_logits: torch.Tensor

    @staticmethod
    def load(path: str | os.PathLike) -> Shard:
        """Read a shard `write_shards` wrote; a ValueError names a file that is not one."""
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            shard = Shard(**{k: data[k] for k in Shard.__dataclass_fields__})
        except Exception as e:
            raise ValueError(f"{path} is not a draft-data shard ({type(e).__name__}: {e}); delete it and run the "
                             "data step again to rewrite it") from e
        N = int(shard.lengths.sum())
        if (shard.token_ids.shape != (N,) or shard.hidden.shape[0] != N or shard.top_ids.shape[0] != N
                or shard.top_logits.shape != shard.top_ids.shape or shard.prompt_lengths.shape != shard.lengths.shape
                or not ((shard.prompt_lengths >= 1) & (shard.prompt_lengths < shard.lengths)).all()):
            raise ValueError(f"{path}: inconsistent shapes (lengths sum to {N}, token_ids "
                             f"{tuple(shard.token_ids.shape)}, hidden {tuple(shard.hidden.shape)}): delete it and "
                             "run the data step again")
        return shard


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.pt"


def _chat(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


@torch.inference_mode()
def _features(model, sequences: list[torch.Tensor], top_k: int, max_tokens_per_pass: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's hidden states [N, H] (float16) and top-k logits ([N, k] ids, values) over the
    packed ``sequences``, in passes of similar lengths (little padding), on the host whatever the
    target's device (the inputs go to the target's device)."""
    device = model.output.weight.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    hidden, ids, values = [None] * len(sequences), [None] * len(sequences), [None] * len(sequences)
    start = 0
    while start < len(order):
        width, stop = len(sequences[order[start]]), start
        while stop < len(order) and len(sequences[order[stop]]) * (stop - start + 1) <= max(
                max_tokens_per_pass, len(sequences[order[stop]])):
            width, stop = len(sequences[order[stop]]), stop + 1
        batch = [sequences[i] for i in order[start:stop]]
        lengths = torch.tensor([len(s) for s in batch])
        ids_in = torch.zeros(len(batch), width, dtype=torch.int64)
        for b, s in enumerate(batch):
            ids_in[b, :len(s)] = s
        cache = model.new_cache(len(batch), width)
        logits, states = model(ids_in.to(device), cache, lengths.to(device), return_hidden=True)
        top = logits.float().topk(top_k, dim=-1)
        # Shards live on the host: one copy per pass, and a shard written on a GPU loads anywhere.
        states, top_ids, top_values = states.half().cpu(), top.indices.cpu(), top.values.cpu()
        for b, i in enumerate(order[start:stop]):
            n = len(batch[b])
            hidden[i], ids[i], values[i] = states[b, :n], top_ids[b, :n], top_values[b, :n]
        start = stop
    return torch.cat(hidden), torch.cat(ids), torch.cat(values)


def _check_manifest(folder: Path, settings: dict) -> None:
    """Record the settings shards are written with (``data.json``); refuse to add shards written
    with other settings (other prompts, another seed) to the same folder."""
    path = folder / "data.json"
    if path.exists():
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is unreadable ({e}); delete the folder to start the data again") from e
        if recorded != settings:
            diff = {k: (recorded.get(k), v) for k, v in settings.items() if recorded.get(k) != v}
            raise ValueError(f"{folder} holds shards written with other settings (recorded, now): {diff}; use "
                             "another folder or the recorded settings")
        return
    path.write_text(json.dumps(settings, indent=1))


def write_shards(model, tokenizer, prompts: list[str], folder: str | os.PathLike, *, shard_size: int = 64,
                 max_new_tokens: int = 256, batch_size: int = 32, top_k: int = 32, sampled_temperature: float = 0.7,
                 seed: int = 0, max_shards: int | None = None, max_seconds: float | None = None,
                 progress: Callable[[int, int, float], None] | None = None) -> list[Path]:
    """Answer ``prompts`` with ``model`` and write the distillation shards into ``folder``.

    Shard i holds prompts ``i * shard_size`` .. ``(i + 1) * shard_size - 1``; shards already on
    disk are kept (a resumed run writes only the missing ones). Half the shards are answered
    greedily, half sampled at ``sampled_temperature`` (seeded by ``seed`` and the shard index), so
    the head sees both kinds of text it will draft for.

    Args:
        model: the target (the built-in `Llama`; its forward must take ``return_hidden``).
        tokenizer: its tokenizer, with a chat template and an EOS token.
        prompts: user messages (`build_prompts`).
        folder: where the shards go (created if missing).
        max_shards: write only the first ``max_shards`` shards (None: all).
        max_seconds: stop after the shard that passes this wall time (the rest is written by a
            later run); None: write them all.
        progress: called as ``progress(done_shards, total_shards, seconds_per_shard)``.

    Returns:
        The paths of every shard now on disk for these prompts, in order.
    """
    from .generation import generate

    for name, value in (("shard_size", shard_size), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size),
                        ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _check_manifest(folder, {"prompts_sha256": hashlib.sha256("\0".join(prompts).encode()).hexdigest(),
                             "num_prompts": len(prompts), "shard_size": shard_size, "max_new_tokens": max_new_tokens,
                             "batch_size": batch_size, "top_k": top_k, "sampled_temperature": sampled_temperature,
                             "seed": seed})
    total = (len(prompts) + shard_size - 1) // shard_size
    if max_shards is not None:
        total = min(total, max_shards)
    t_start, written, device = time.perf_counter(), 0, model.output.weight.device
    for index in range(total):
        path = shard_path(folder, index)
        if path.exists():
            continue
        chats = [_chat(tokenizer, p) for p in prompts[index * shard_size:(index + 1) * shard_size]]
        temperature = 0.0 if index % 2 == 0 else sampled_temperature
        sequences, prompt_lengths = [], []
        for start in range(0, len(chats), batch_size):
            enc = tokenizer(chats[start:start + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False)
            out = generate(model, enc.input_ids.to(device), enc.attention_mask.to(device),
                           max_new_tokens=max_new_tokens, temperature=temperature,
                           eos_token_id=tokenizer.eos_token_id, seed=seed * 100_003 + index)
            for b in range(len(out.sequences)):
                prompt = enc.input_ids[b][enc.attention_mask[b].bool()]
                sequences.append(torch.cat([prompt, torch.tensor(out.row_tokens(b), dtype=torch.int64)]))
                prompt_lengths.append(len(prompt))
        hidden, top_ids, top_logits = _features(model, sequences, top_k, max_tokens_per_pass=4096)
        shard = {"token_ids": torch.cat(sequences), "lengths": torch.tensor([len(s) for s in sequences]),
                 "prompt_lengths": torch.tensor(prompt_lengths), "hidden": hidden, "top_ids": top_ids,
                 "top_logits": top_logits}
        tmp = path.with_suffix(".tmp")
        torch.save(shard, tmp)
        os.replace(tmp, path)
        written += 1
        if progress is not None:
            done = sum(shard_path(folder, i).exists() for i in range(total))
            progress(done, total, (time.perf_counter() - t_start) / written)
        if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
            break
    return [shard_path(folder, i) for i in range(total) if shard_path(folder, i).exists()]

