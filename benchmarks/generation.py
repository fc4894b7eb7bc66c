"""Generation benchmarks on SmolLM2-135M-Instruct (fp32, CPU by default), shared by the pytest
benchmarks (`test_bench_generation.py`) and the table script (`python -m benchmarks.generation`;
``--device cuda --dtype bfloat16`` runs both sides on a GPU in that dtype).

Compared side by side in one run, greedy, same weights, same prompts:

- our `generate` vs Hugging Face ``model.generate`` (our model's matmuls in the forms
  `Llama.pack_weights` measures fastest on this machine; ``--no-pack`` leaves them as loaded);
- our `speculative_generate` (prompt-lookup draft; the target's first layers, `EarlyExitDraft`,
  drafting in the target's cache) vs our `generate` vs Hugging Face assisted generation with the
  same drafts (``prompt_lookup_num_tokens=``; ``assistant_model=`` a model of the same first
  layers, in its own cache), which supports one row at a time, so batch 8 loops over rows;
- efficiency: measured speedup / predicted speedup, predicted = (1 - a^(K+1)) / ((1 - a)(K c + v))
  with a = acceptance rate, c = draft time per drafted token / target step, v = target verify of
  K+1 tokens / target step, all from the phase timers of the same runs, prefill excluded (target
  step = our plain run's target time per decoding step; verify = the speculative run's). The
  measured speedup is that of the decoding phase too: tokens per second after the target's
  prefill, which both runs share and the formula does not model (the tokens/s columns include
  it; a draft model's prefill counts on the speculative side). What efficiency misses from 1 is
  time outside the model forwards (sampler, drafting bookkeeping, loop) and, in a batch, rows
  that need more steps than the mean acceptance predicts.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from specdec_kernels import EarlyExitDraft, PromptLookupDraft, generate, speculative_generate
from specdec_kernels.testing import OracleDraft

PROMPTS = (
    "Rewrite this Python function with type hints, keeping the body unchanged:\n\n"
    "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result",
    "Copy this shopping list and add a quantity after each item: apples, bread, milk, eggs, rice, "
    "tomatoes, onions, cheese, butter, coffee.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "List the days of the week, one per line, each followed by its number in the week.",
)
#: Prompts whose answers repeat little of them (the lookahead table's second set).
OPEN_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the benefits of regular exercise for older adults?",
    "Describe how a bicycle's gears make climbing a hill easier.",
)
DRAFT_LAYERS = 6  # the layer-skip draft: the target's first 6 of 30 layers


@dataclass
class Setup:
    model: object  # our Llama
    hf: object  # transformers LlamaForCausalLM, same weights
    hf_draft: object  # transformers model with the first DRAFT_LAYERS layers
    tokenizer: object
    cuda_graphs: bool | None = None  # our loops' cuda_graphs= (None: on for CUDA)
    hf_packed: tuple | None = None  # copies of hf and hf_draft with packed matmuls (`run_ours_on_hf`)


def load_setup(pack: bool = True, device: str = "cpu", dtype: torch.dtype = torch.float32,
               random_weights: str | None = None) -> Setup:
    """SmolLM2 as our model and as transformers models on the same converted weights, on ``device``
    in ``dtype``. ``pack``: our model's matmuls in the forms `Llama.pack_weights` measures fastest,
    where that applies (CPU float32). ``random_weights``: a folder holding SmolLM2's tokenizer
    (``tokenizer.save_pretrained``); the models then get random weights in SmolLM2's shapes
    (seeded), for machines without the model file: timings hold, acceptance says nothing of text."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdec_kernels.model import Llama
    from specdec_kernels.pretrained import load_smollm2, smollm2_folder

    if random_weights is None:
        model, tokenizer = load_smollm2(dtype=dtype, device=device)
        folder = smollm2_folder()
        hf = LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    else:
        from benchmarks.diagnostics.smollm2_shape import SMOLLM2_SHAPE

        tokenizer = AutoTokenizer.from_pretrained(random_weights)
        torch.manual_seed(0)
        hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(dtype)
        model = Llama.from_pretrained(hf, dtype=dtype, device=device)
    hf_draft = _layer_prefix(hf, DRAFT_LAYERS)
    if pack and model.can_pack_weights():
        model.pack_weights()
    hf, hf_draft = hf.to(device).eval(), hf_draft.to(device).eval()
    for m in (hf, hf_draft):  # run to max_new_tokens, like ours with eos_token_id=None
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = tokenizer.pad_token_id
    return Setup(model, hf, hf_draft, tokenizer)


def _layer_prefix(hf, layers: int):
    """A transformers model of ``hf``'s first ``layers`` layers with its embeddings, final norm and
    LM head, holding copies of ``hf``'s weights (loaded strictly: every tensor it has, none other)."""
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = layers
    draft = type(hf)(config).to(hf.dtype)
    wanted = draft.state_dict().keys()
    draft.load_state_dict({name: w for name, w in hf.state_dict().items() if name in wanted})
    return draft


def encode(setup: Setup, batch_size: int, prompts: tuple[str, ...] = PROMPTS):
    texts = [setup.tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                                 tokenize=False, add_generation_prompt=True)
             for i in range(batch_size)]
    setup.tokenizer.padding_side = "left"
    enc = setup.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    device = setup.model.output.weight.device
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def make_drafter(setup: Setup, draft: str, batch_size: int, max_new_tokens: int, k: int,
                 prompts: tuple[str, ...] = PROMPTS):
    """``"prompt_lookup"``, ``"layers"`` (the target's first DRAFT_LAYERS layers, in its cache) or ``"oracle"``
    (the target's own greedy continuation of ``prompts``, computed beforehand: every draft is accepted)."""
    if draft == "prompt_lookup":
        return PromptLookupDraft()
    if draft == "layers":
        return EarlyExitDraft(setup.model, DRAFT_LAYERS, cuda_graphs=setup.cuda_graphs)
    ids, mask = encode(setup, batch_size, prompts)
    truth = generate(setup.model, ids, mask, max_new_tokens=max_new_tokens + k, temperature=0)
    return OracleDraft(truth.tokens)


def run_ours(setup: Setup, batch_size: int, max_new_tokens: int, draft, k: int = 4, adaptive: bool = True,
             prompts: tuple[str, ...] = PROMPTS):
    """One greedy run of our generate (``draft`` None) or speculative_generate (``draft`` a name
    for `make_drafter`, or a drafter; adaptive draft lengths by default, as in the package) on
    the first ``batch_size`` of ``prompts`` (cycled)."""
    ids, mask = encode(setup, batch_size, prompts)
    if draft is None:
        return generate(setup.model, ids, mask, max_new_tokens=max_new_tokens, temperature=0,
                        cuda_graphs=setup.cuda_graphs)
    drafter = make_drafter(setup, draft, batch_size, max_new_tokens, k) if isinstance(draft, str) else draft
    return speculative_generate(setup.model, drafter, ids, mask, num_draft_tokens=k, adaptive=adaptive,
                                max_new_tokens=max_new_tokens, temperature=0, cuda_graphs=setup.cuda_graphs)


def run_each_prompt(setup: Setup, batch_size: int, max_new_tokens: int, draft, k: int = 4, adaptive: bool = True):
    """`run_ours`, at batch 1 on every prompt of `PROMPTS` in turn (`_one_at_a_time`); ``draft``
    may then be a list of drafters, one per prompt (oracles)."""
    if batch_size > 1:
        return run_ours(setup, batch_size, max_new_tokens, draft, k, adaptive)
    drafts = draft if isinstance(draft, list) else [draft] * len(PROMPTS)
    return _one_at_a_time([run_ours(setup, 1, max_new_tokens, d, k, adaptive, prompts=(p,))
                           for p, d in zip(PROMPTS, drafts, strict=True)])


def run_ours_on_hf(setup: Setup, batch_size: int, max_new_tokens: int, draft: str | None, k: int = 4,
                   packed: bool = True):
    """Our loops driving the transformers models themselves (`specdec_kernels.HFCausalLM`): greedy
    `generate` (``draft`` None) or `speculative_generate` with prompt lookup or the transformers
    layer draft (``"layers"``), adaptive lengths as in the package. ``packed``: on copies of the
    models whose matmuls `HFCausalLM.pack_weights` prepared (made at the first call; CPU float32
    only), as the built-in model's are; else on the models as loaded (which transformers' own runs use)."""
    ids, mask = encode(setup, batch_size)
    if packed and setup.hf_packed is None:
        from specdec_kernels import HFCausalLM

        setup.hf_packed = tuple(HFCausalLM(copy.deepcopy(m)).pack_weights().hf for m in (setup.hf, setup.hf_draft))
    target, layer_draft = setup.hf_packed if packed else (setup.hf, setup.hf_draft)
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=0, cuda_graphs=setup.cuda_graphs)
    if draft is None:
        return generate(target, ids, mask, **kwargs)
    drafter = PromptLookupDraft() if draft == "prompt_lookup" else layer_draft
    return speculative_generate(target, drafter, ids, mask, num_draft_tokens=k, **kwargs)


def run_hf(setup: Setup, batch_size: int, max_new_tokens: int, draft: str | None, k: int = 4) -> int:
    """Greedy Hugging Face generation; returns tokens generated. Assisted generation handles one
    row per call, so batched assisted runs loop over rows."""
    ids, mask = encode(setup, batch_size)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    with torch.inference_mode():
        if draft is None:
            out = setup.hf.generate(ids, attention_mask=mask, **kwargs)
            return int((out.shape[1] - ids.shape[1]) * batch_size)
        extra = (dict(prompt_lookup_num_tokens=k) if draft == "prompt_lookup"
                 else dict(assistant_model=setup.hf_draft))
        total = 0
        for row in range(batch_size):
            real = mask[row].bool()
            out = setup.hf.generate(ids[row][real][None], **kwargs, **extra)
            total += out.shape[1] - int(real.sum())
        return total


def decode_tokens_per_second(stats) -> float:
    """Tokens per second of the decoding phase: all generated tokens over the time after the
    target's prefill (the prefill's sampled token included: both runs make it alike). A draft
    model's prefill stays in: it is a cost of speculating that c and v do not cover."""
    target_prefill = stats.time_prefill_s - stats.time_draft_prefill_s
    return float(stats.num_generated.sum()) / (stats.time_total_s - target_prefill)


def predicted_speedup(a: float, k: int, c: float, v: float) -> float:
    """Expected speedup of speculative decoding (Leviathan et al. 2022, eq. for walltime)."""
    if a >= 1.0:
        return (k + 1) / (k * c + v)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + v))


def _markdown(caption: str, header: str, rows: list[str]) -> str:
    """A table as the benchmarks print it: the caption line, the machine line, then the markdown
    ``header`` and ``rows``."""
    from benchmarks.timing import machine_line

    return f"{caption}\nmachine: {machine_line()}\n\n{header}\n" + "\n".join(rows)


def table(max_new_tokens: int = 48, batch_sizes=(1, 8), k: int = 4, repeats: int = 3, pack: bool = True,
          device: str = "cpu", dtype: torch.dtype = torch.float32, cuda_graphs: bool = True,
          random_weights: str | None = None) -> str:
    """Run every comparison ``repeats`` times (interleaved, so load changes hit every method alike)
    and return a markdown table of medians plus the machine line."""
    torch.manual_seed(0)
    setup = load_setup(pack, device, dtype, random_weights)
    cuda = torch.device(device).type == "cuda"
    setup.cuda_graphs = None if cuda_graphs else False
    plan = setup.model.output.plan
    rows = []
    for B in batch_sizes:
        methods = (("ours generate", run_ours, None), ("HF generate", run_hf, None),
                   ("ours spec, prompt lookup", run_ours, "prompt_lookup"),
                   ("HF assisted, prompt lookup", run_hf, "prompt_lookup"),
                   (f"ours spec, {DRAFT_LAYERS}-layer draft", run_ours, "layers"),
                   (f"HF assisted, {DRAFT_LAYERS}-layer draft", run_hf, "layers"))
        runs = {name: [] for name, _, _ in methods}
        for _, fn, draft in methods:
            fn(setup, B, 4, draft, k)  # warm-up
        for _ in range(repeats):
            for name, fn, draft in methods:
                t0 = time.perf_counter()
                out = fn(setup, B, max_new_tokens, draft, k)
                if cuda:  # the host may be ahead of the GPU
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - t0
                tokens = out if isinstance(out, int) else int(out.stats.num_generated.sum())
                runs[name].append((tokens / seconds, out))
        timed = {name: sorted(r, key=lambda x: x[0])[len(r) // 2] for name, r in runs.items()}  # median run
        plain = timed["ours generate"][1]
        target_step = plain.stats.time_target_s / (plain.stats.target_forwards - 1)  # prefill excluded
        plain_decode_tps = decode_tokens_per_second(plain.stats)
        base, hf_base = timed["ours generate"][0], timed["HF generate"][0]
        for name, (tps, out) in timed.items():
            accept = eff = quantities = ""
            if not isinstance(out, int) and out.stats.num_proposed.sum() > 0:
                st = out.stats
                a = st.acceptance_rate
                v = st.time_target_s / (st.target_forwards - 1) / target_step
                c = st.time_draft_s / (_run_total(st, st.num_steps) * k) / target_step
                decode_speedup = decode_tokens_per_second(st) / plain_decode_tps
                eff = f"{decode_speedup / predicted_speedup(a, k, c, v):.2f}"
                accept = f"{a:.1%}"
                quantities = f"c={c:.3f}, v={v:.2f}, {decode_speedup:.2f}x"
            rows.append(f"| {B} | {name} | {tps:.1f} | {tps / base:.2f}x | {tps / hf_base:.2f}x | {accept} | "
                        f"{quantities} | {eff} |")
    header = ("| batch | method | tokens/s | vs ours generate | vs HF generate | acceptance | "
              "measured c, v, decoding-phase speedup | efficiency |\n|---|---|---|---|---|---|---|---|")
    caption = (f"{_setting(random_weights, dtype, device)}, greedy, "
               f"{max_new_tokens} new tokens per row, K = {k}, "
               f"median of {repeats} interleaved runs, our matmuls: {plan.describe() if plan else 'as loaded'}"
               f"{', our decoding steps replayed as CUDA graphs' if cuda and cuda_graphs else ''}")
    return _markdown(caption, header, rows)


def leviathan(st, k: int, plain) -> tuple[float, float]:
    """(predicted speedup, efficiency) of a fixed-K run with stats ``st``, against the plain run's
    stats ``plain``, from their phase timers (see the module docstring)."""
    target_step = plain.time_target_s / (plain.target_forwards - 1)
    v = st.time_target_s / (st.target_forwards - 1) / target_step
    c = st.time_draft_s / (_run_total(st, st.num_steps) * k) / target_step
    predicted = predicted_speedup(st.acceptance_rate, k, c, v)
    return predicted, decode_tokens_per_second(st) / decode_tokens_per_second(plain) / predicted


def _setting(random_weights: str | None, dtype: torch.dtype, device: str) -> str:
    """How a table's caption opens: the weights it ran, their dtype and the device."""
    weights = "random weights in SmolLM2-135M's shapes" if random_weights else "SmolLM2-135M-Instruct"
    return f"{weights} {str(dtype).removeprefix('torch.')} on {device}"


BASELINE_EVERY = 3  # `_interleaved_medians`: other methods between two runs of the baseline


def _interleaved_medians(setup: Setup, methods: dict, batch_size: int, max_new_tokens: int, repeats: int,
                         baseline: str | None = None, speedups: dict | None = None) -> dict:
    """``methods`` maps a name to ``(fn, *args)``, run as ``fn(setup, batch_size, tokens, *args)``:
    each once untimed (4 tokens: one-time costs out of the way), then ``repeats`` rounds of every
    method in turn, in reverse order every other round (a slow spell of the machine falls on all
    alike, and a drift on none more than another); the median run of each,
    ``{name: (seconds, output)}``.

    With a ``baseline`` (one of the names), it also runs at each round's start, after every
    `BASELINE_EVERY` other methods and at the round's end, and ``speedups`` is filled with each
    other method's median over rounds of its speedup over the baseline's time at its place in
    the round (interpolated between the baseline runs around it): this machine's slow spells
    last from seconds to minutes, so a ratio of two runs made close together moves less than one
    of medians taken minutes apart."""
    if speedups is not None and baseline is None:
        raise ValueError("speedups are measured against a baseline: name one of the methods")
    if baseline is not None and baseline not in methods:
        raise ValueError(f"baseline {baseline!r} is not one of the methods {list(methods)}")
    for fn, *args in methods.values():
        fn(setup, batch_size, 4, *args)
    runs = {name: [] for name in methods}
    others = [name for name in methods if name != baseline]
    ratios = {name: [] for name in others}

    def run(name) -> float:
        fn, *args = methods[name]
        runs[name].append(_timed(setup, fn, batch_size, max_new_tokens, *args))
        return runs[name][-1][0]

    for round_ in range(repeats):
        names = others if round_ % 2 == 0 else others[::-1]
        base_at, timed = [], []  # (place, seconds) of the baseline runs; (place, name, seconds) of the others
        for place, name in enumerate(names):
            if baseline is not None and place % BASELINE_EVERY == 0:
                base_at.append((place - 0.5, run(baseline)))
            timed.append((place, name, run(name)))
        if baseline is None:
            continue
        base_at.append((len(names) - 0.5, run(baseline)))
        for place, name, seconds in timed:
            (p0, s0), (p1, s1) = next((a, b) for a, b in zip(base_at, base_at[1:], strict=False) if b[0] > place)
            ratios[name].append((s0 + (s1 - s0) * (place - p0) / (p1 - p0)) / seconds)
    if speedups is not None:
        speedups.update({name: statistics.median(r) for name, r in ratios.items()})
    return {name: sorted(r, key=lambda x: x[0])[len(r) // 2] for name, r in runs.items()}


def _timed(setup: Setup, fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(setup, *args)
    if setup.model.output.weight.is_cuda:  # the host may be ahead of the GPU
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def speculation_table(max_new_tokens: int = 48, batch_sizes=(1, 8), ks=(2, 4, 8), repeats: int = 3,
                      pack: bool = True, device: str = "cpu", dtype: torch.dtype = torch.float32,
                      random_weights: str | None = None) -> str:
    """Fixed vs adaptive draft lengths against our plain generate, per draft, batch size and K,
    and the oracle drafter (every draft accepted) at K = 4, all interleaved in one run (batch 1
    answers every prompt in turn, `run_each_prompt`); returns a markdown table plus the machine
    line.

    Columns: speedups over plain generate (`_interleaved_medians` with plain as the baseline:
    medians of ratios to the plain runs made around each run); the share of the fixed K's gain
    (speedup - 1) that adaptive keeps where the fixed K gains; the fixed run's acceptance, Leviathan-predicted
    speedup and efficiency (measured decoding-phase speedup / predicted, as in `table`); the mean
    draft length adaptive chose. Oracle: tokens per target forward, speedup, and the prediction
    with a = 1, ``(K + 1) / (K c + v)``.
    """
    torch.manual_seed(0)
    setup = load_setup(pack, device, dtype, random_weights)
    lines = []
    for B in batch_sizes:
        oracle = (make_drafter(setup, "oracle", B, max_new_tokens, 4) if B > 1 else
                  [make_drafter(setup, "oracle", 1, max_new_tokens, 4, (prompt,)) for prompt in PROMPTS])
        methods = {"plain": (run_each_prompt, None, 4, True)}
        for draft in ("prompt_lookup", "layers"):
            for k in ks:
                methods[draft, k, "fixed"] = (run_each_prompt, draft, k, False)
                methods[draft, k, "adaptive"] = (run_each_prompt, draft, k, True)
        methods["oracle"] = (run_each_prompt, oracle, 4, False)
        speedup = {}
        median = _interleaved_medians(setup, methods, B, max_new_tokens, repeats, "plain", speedup)
        plain = median["plain"][1]
        for draft in ("prompt_lookup", "layers"):
            best_fixed = max(speedup[draft, k, "fixed"] for k in ks)
            for k in ks:
                fixed, adaptive = median[draft, k, "fixed"][1], median[draft, k, "adaptive"][1]
                fx, ax = speedup[draft, k, "fixed"], speedup[draft, k, "adaptive"]
                keeps = f"{(ax - 1) / (fx - 1):.0%}" if fx > 1 else "-"
                keeps_best = f"{(ax - 1) / (best_fixed - 1):.0%}" if best_fixed > 1 else "-"
                predicted, efficiency = leviathan(fixed.stats, k, plain.stats)
                lines.append(f"| {B} | {draft} | {k} | {fx:.2f}x | {ax:.2f}x | {keeps} | {keeps_best} | "
                             f"{fixed.stats.acceptance_rate:.1%} | {predicted:.2f}x | {efficiency:.2f} | "
                             f"{adaptive.stats.mean_draft_length:.2f} |")
        oracle = median["oracle"][1]
        predicted, efficiency = leviathan(oracle.stats, 4, plain.stats)
        lines.append(f"| {B} | oracle | 4 | {speedup['oracle']:.2f}x | | | | {oracle.stats.acceptance_rate:.0%} | "
                     f"{predicted:.2f}x (a = 1) | {efficiency:.2f} | "
                     f"{oracle.stats.tokens_per_target_forward:.2f} tokens per target forward |")
    header = ("| batch | draft | K | fixed K vs plain | adaptive vs plain | adaptive keeps of fixed K's gain | "
              "of best fixed K's gain | acceptance (fixed) | predicted (fixed) | efficiency (fixed) | "
              "adaptive mean draft length |\n|---|---|---|---|---|---|---|---|---|---|---|")
    caption = (f"{_setting(random_weights, dtype, device)}, greedy, {max_new_tokens} "
               f"new tokens per row (batch 1: each of the {len(PROMPTS)} prompts in turn), speedups: median over "
               f"{repeats} interleaved rounds of the ratio to plain runs made around each run, layer draft: "
               f"the first {DRAFT_LAYERS} of 30 layers")
    return _markdown(caption, header, lines)


def per_prompt_table(max_new_tokens: int = 48, batch_sizes=(1, 8), ks=(2, 4, 8), repeats: int = 10,
                     pack: bool = True, device: str = "cpu", dtype: torch.dtype = torch.float32,
                     random_weights: str | None = None) -> str:
    """Fixed vs adaptive draft lengths against our plain generate, as `speculation_table` but
    timed prompt by prompt: at batch 1 every method answers each prompt of `PROMPTS` ``repeats``
    times (at batch b, one batch of the first b prompts, cycled), the methods interleaved on each
    prompt in turn, in reverse order every other round. A method's time is the sum over prompts
    of its minimum run, and of its median run; its speedup is plain's time over it. A slow spell
    of a shared machine lengthens a run and never shortens one, so the minima move least; the
    medians are the robust middle. Each drafter is made once per prompt and reused by every
    round, as a server reuses one: costs carry from call to call as the package carries them.
    Every method's tokens are checked against plain's once (untimed, before the rounds).
    Returns a markdown table plus the machine line."""
    torch.manual_seed(0)
    setup = load_setup(pack, device, dtype, random_weights)
    lines = [line for B in batch_sizes for line in _per_prompt_rows(setup, B, max_new_tokens, ks, repeats)]
    header = ("| batch | draft | K | fixed K vs plain (minima; medians) | adaptive vs plain (minima; medians) | "
              "adaptive keeps of best fixed K's gain (minima; medians) |\n|---|---|---|---|---|---|")
    caption = (f"{_setting(random_weights, dtype, device)}, greedy, {max_new_tokens} new tokens per "
               f"row, batch 1: each of the {len(PROMPTS)} prompts; speedups: sums over prompts of the minimum and of "
               f"the median of {repeats} interleaved runs, plain's over the method's; layer draft: the first "
               f"{DRAFT_LAYERS} of 30 layers")
    return _markdown(caption, header, lines)


def _per_prompt_rows(setup: Setup, B: int, max_new_tokens: int, ks, repeats: int) -> list[str]:
    """`per_prompt_table`'s rows at batch size ``B``."""
    groups = [(prompt,) for prompt in PROMPTS] if B == 1 else [PROMPTS]
    methods = [(draft, k, adaptive) for draft in ("prompt_lookup", "layers") for k in ks for adaptive in (False, True)]
    drafters = {(m, i): make_drafter(setup, m[0], B, max_new_tokens, m[1], group)
                for m in methods for i, group in enumerate(groups)}

    def run(m, i):
        draft, k, adaptive = (None, 4, True) if m is None else (drafters[m, i], m[1], m[2])
        return _timed(setup, run_ours, B, max_new_tokens, draft, k, adaptive, groups[i])

    speedup = _per_prompt_speedups(methods, len(groups), run, repeats)
    lines = []
    for draft in ("prompt_lookup", "layers"):
        best = [max(speedup[draft, k, False][0][j] for k in ks) for j in (0, 1)]
        for k in ks:
            (fixed, _), (adaptive, _) = speedup[draft, k, False], speedup[draft, k, True]
            keeps = "; ".join(f"{(a - 1) / (b - 1):.0%}" if b > 1 else "-" for a, b in zip(adaptive, best, strict=True))
            lines.append(f"| {B} | {draft} | {k} | {fixed[0]:.3f}x; {fixed[1]:.3f}x | {adaptive[0]:.3f}x; "
                         f"{adaptive[1]:.3f}x | {keeps} |")
    return lines


def _per_prompt_speedups(methods: list, groups: int, run, repeats: int) -> dict:
    """Each method's speedups over plain generate, timed prompt group by prompt group.

    ``run(m, i)`` runs method ``m`` (None: plain generate, the baseline) on prompt group ``i``
    and returns ``(seconds, output)``. Every method runs once per group untimed, where its tokens
    must equal the baseline's exactly (float32: in reduced precision a near-tie may flip a token,
    which raises here); then ``repeats`` rounds, each running every method (the baseline
    first) on each group in turn, in reverse order every other round. Returns ``{m: ((minima,
    medians), outputs)}``: plain's time over the method's, a time being the sum over groups of the
    method's minimum run, and of its median run (a slow spell of a shared machine lengthens a run
    and never shortens one, so the minima move least; the medians are the robust middle), and the
    untimed outputs, one per group."""
    order = [None, *methods]
    outputs = {}
    for i in range(groups):
        plain = run(None, i)[1].tokens
        for m in methods:
            outputs.setdefault(m, []).append(run(m, i)[1])
            if not torch.equal(outputs[m][-1].tokens, plain):
                raise AssertionError(f"{m} gave other tokens than plain generate on prompt group {i}")
    times = {(m, i): [] for m in order for i in range(groups)}
    for round_ in range(repeats):
        for i in range(groups):
            for m in order if round_ % 2 == 0 else order[::-1]:
                times[m, i].append(run(m, i)[0])
    return {m: (tuple(sum(agg(times[None, i]) for i in range(groups)) / sum(agg(times[m, i]) for i in range(groups))
                      for agg in (min, statistics.median)), outputs[m]) for m in methods}


HEAD_TREES = ((4, 4), (4, 7))  # the trees table's (branches, depth) of the head's trees


def trees_table(max_new_tokens: int = 48, batch_sizes=(1, 8), widths=(8, 16), branches=(2, 4),
                head_trees=HEAD_TREES, repeats: int = 3, pack: bool = True, device: str = "cpu",
                dtype: torch.dtype = torch.float32, random_weights: str | None = None) -> str:
    """Token trees against chains at equal verify width, on held-out prompts (`held_out_prompts`;
    batch 1 answers each in turn, a batch of b rows the first b): prompt lookup as a chain
    (`PromptLookupDraft`) and as trees of its earlier occurrences' continuations (``branches=``);
    the shipped trained head (`load_smollm2_draft`; not with random weights) as a chain and as
    dynamic trees of ``(branches, depth)`` in ``head_trees``; ``width - 1`` drafts each (fixed
    lengths), and our plain generate; every method ``repeats`` times, interleaved; a markdown
    table of medians plus the machine line. Columns: tokens per target forward (tree / chain of
    the same source), wall-clock speedups over plain and over the chain. Each run's tokens are
    checked against plain's (`_greedy_rows_note`)."""
    from specdec_kernels import load_smollm2_draft

    torch.manual_seed(0)
    setup = load_setup(pack, device, dtype, random_weights)
    prompts = held_out_prompts()
    sources = {"prompt lookup": {"chain": PromptLookupDraft(),
                                 **{f"tree, {b} branches": PromptLookupDraft(branches=b) for b in branches}}}
    if random_weights is None:
        sources["trained head"] = {"chain": load_smollm2_draft(setup.model),
                                   **{f"tree, {b} branches, depth {d}": load_smollm2_draft(setup.model, branches=b,
                                                                                         depth=d)
                                      for b, d in head_trees}}
    lines = []
    for B in batch_sizes:
        methods = {"plain": (run_head, None, 4, False, prompts)}
        for width in widths:
            for source, drafters in sources.items():
                for name, drafter in drafters.items():
                    methods[width, source, name] = (run_head, drafter, width - 1, False, prompts)
        median = _interleaved_medians(setup, methods, B, max_new_tokens, repeats)
        plain_s, plain = median["plain"]
        for width in widths:
            for source, drafters in sources.items():
                chain_s, chain = median[width, source, "chain"]
                chain_tpf = chain.stats.tokens_per_target_forward
                for name in drafters:
                    seconds, out = median[width, source, name]
                    note = _greedy_rows_note(setup, B if B > 1 else len(prompts), prompts, out, plain, dtype,
                                             f"{source} {name}")
                    tpf = out.stats.tokens_per_target_forward
                    versus = ("", "") if name == "chain" else (f"{tpf / chain_tpf:.2f}x", f"{chain_s / seconds:.2f}x")
                    lines.append(f"| {B} | {width} | {source} | {name} | {tpf:.2f} | {versus[0]} | "
                                 f"{plain_s / seconds:.2f}x{note} | {versus[1]} |")
    header = ("| batch | verify width | source | draft | tokens per target forward | tree / chain | vs plain | "
              "vs chain |\n|---|---|---|---|---|---|---|---|")
    caption = (f"{_setting(random_weights, dtype, device)}, greedy, "
               f"{max_new_tokens} new tokens per row, {len(prompts)} held-out prompts (batch 1: one at a time), "
               f"fixed draft lengths, median of {repeats} interleaved runs")
    return _markdown(caption, header, lines)


NEAR_TIE = 2 ** -5  # reduced precision: a top-2 logit gap below this share of the top logit may flip


def _greedy_rows_note(setup: Setup, batch_size: int, prompts, out, plain, dtype: torch.dtype, name: str) -> str:
    """Checks ``out`` against plain greedy decoding's tokens. In float32 every row must match (a
    divergence is a bug). In float16 / bfloat16 a wider forward rounds differently, so a row may
    leave plain's tokens where plain's own top-2 logits are within `NEAR_TIE` of each other (the
    model run again on plain's prefix); such rows are reported (a note for the table's last
    column), any other divergence raises."""
    differ = [b for b in range(len(plain.tokens)) if not torch.equal(out.tokens[b], plain.tokens[b])]
    if not differ:
        return ""
    if dtype == torch.float32:
        raise AssertionError(f"{name} gave other tokens than greedy generate")
    ids, mask = encode(setup, batch_size, prompts)
    for b in differ:
        at = int((out.tokens[b] != plain.tokens[b]).nonzero()[0])
        prefix = torch.cat([ids[b][mask[b].bool()], plain.tokens[b, :at]])[None]
        with torch.no_grad():
            top2 = setup.model(prefix, setup.model.new_cache(1, prefix.shape[1]))[0, -1].float().topk(2).values
        if top2[0] - top2[1] > NEAR_TIE * top2[0].abs():
            raise AssertionError(f"{name} left greedy generate's tokens in row {b} at token {at}, where plain's "
                                 f"top-2 logits differ by {float(top2[0] - top2[1]):.3g}: not a near-tie")
    return f" ({len(plain.tokens) - len(differ)}/{len(plain.tokens)} rows as plain, the rest left it at near-ties)"


def run_jacobi(setup: Setup, batch_size: int, max_new_tokens: int, window: int):
    """One greedy run of our plain generate (``window`` 0) or `jacobi_generate`."""
    from specdec_kernels import jacobi_generate

    ids, mask = encode(setup, batch_size)
    if not window:
        return generate(setup.model, ids, mask, max_new_tokens=max_new_tokens, temperature=0)
    return jacobi_generate(setup.model, ids, mask, window=window, max_new_tokens=max_new_tokens)


def jacobi_table(max_new_tokens: int = 48, batch_sizes=(1, 8), windows=(4, 8), repeats: int = 3, pack: bool = True,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, random_weights: str | None = None) -> str:
    """`jacobi_generate` against our plain generate (greedy, same prompts, every method
    ``repeats`` times, interleaved): tokens per target forward and wall-clock speedup, medians;
    a markdown table plus the machine line. Each run's tokens are checked against plain's
    (`_greedy_rows_note`)."""
    setup = load_setup(pack, device, dtype, random_weights)
    lines = []
    for B in batch_sizes:
        median = _interleaved_medians(setup, {w: (run_jacobi, w) for w in (0, *windows)}, B, max_new_tokens, repeats)
        plain_s, plain = median[0]
        for w in windows:
            seconds, out = median[w]
            note = _greedy_rows_note(setup, B, PROMPTS, out, plain, dtype, f"jacobi_generate(window={w})")
            lines.append(f"| {B} | {w} | {out.stats.tokens_per_target_forward:.3f} | {plain_s / seconds:.2f}x{note} |")
    header = "| batch | window | tokens per target forward | vs plain |\n|---|---|---|---|"
    caption = (f"{_setting(random_weights, dtype, device)}, greedy, "
               f"{max_new_tokens} new tokens per row, median of {repeats} interleaved runs")
    return _markdown(caption, header, lines)


def run_lookahead(setup: Setup, batch_size: int, max_new_tokens: int, config: tuple | None, prompts=PROMPTS):
    """One greedy run of our plain generate (``config`` None) or `lookahead_generate` with
    ``config = (window, ngram, guesses, adaptive)``: at batch 1 on every prompt in turn
    (`_one_at_a_time`), else one batch of the first ``batch_size`` prompts."""
    from specdec_kernels import lookahead_generate

    def run(ids, mask):
        if config is None:
            return generate(setup.model, ids, mask, max_new_tokens=max_new_tokens, temperature=0)
        window, ngram, guesses, adaptive = config
        return lookahead_generate(setup.model, ids, mask, window=window, ngram=ngram, guesses=guesses,
                                  adaptive=adaptive, max_new_tokens=max_new_tokens)

    if batch_size == 1:
        return _one_at_a_time([run(*encode(setup, 1, (prompt,))) for prompt in prompts])
    return run(*encode(setup, batch_size, prompts))


LOOKAHEAD_CONFIGS = ((1, 4, 4), (2, 3, 4), (4, 4, 4))


def lookahead_table(max_new_tokens: int = 48, batch_sizes=(1, 8), configs=LOOKAHEAD_CONFIGS, repeats: int = 3,
                    pack: bool = True, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    random_weights: str | None = None) -> str:
    """`lookahead_generate` (each (window, ngram, guesses), fixed and adaptive) against our plain
    generate on the demo prompts (copy-heavy: code to rewrite, a list to copy, a sentence to
    repeat) and on open questions (`OPEN_PROMPTS`), batch 1 answering each prompt in turn;
    greedy, every method ``repeats`` times, interleaved; tokens per target forward and
    wall-clock speedup (`_interleaved_medians` with plain as the baseline); each run's tokens
    are checked against plain's (`_greedy_rows_note`). A markdown table plus the machine line."""
    setup = load_setup(pack, device, dtype, random_weights)
    lines = []
    for B in batch_sizes:
        for name, prompts in (("copy-heavy", PROMPTS), ("open", OPEN_PROMPTS)):
            methods = [(*c, a) for c in configs for a in (False, True)]
            speedup = {}
            median = _interleaved_medians(setup, {"plain": (run_lookahead, None, prompts),
                                                  **{m: (run_lookahead, m, prompts) for m in methods}},
                                          B, max_new_tokens, repeats, "plain", speedup)
            plain = median["plain"][1]
            for m in methods:
                out = median[m][1]
                note = _greedy_rows_note(setup, B if B > 1 else len(prompts), prompts, out, plain, dtype,
                                         f"lookahead_generate{m}")
                w, n, g, adaptive = m
                verified = out.stats.num_proposed.sum() / out.stats.num_steps.sum()
                lines.append(f"| {B} | {name} | {w}, {n}, {g} | {'adaptive' if adaptive else 'fixed'} | "
                             f"{out.stats.tokens_per_target_forward:.2f} | {verified:.1f} | "
                             f"{speedup[m]:.2f}x{note} |")
    header = ("| batch | prompts | W, N, G | steps | tokens per target forward | candidate tokens verified per step | "
              "vs plain |\n|---|---|---|---|---|---|---|")
    caption = (f"{_setting(random_weights, dtype, device)}, greedy, "
               f"{max_new_tokens} new tokens per row, speedups: median over {repeats} interleaved rounds of the "
               f"ratio to plain runs made around each run")
    return _markdown(caption, header, lines)


def lookahead_per_prompt_table(max_new_tokens: int = 48, batch_sizes=(1, 8), configs=((2, 3, 4),),
                               repeats: int = 10, pack: bool = True, device: str = "cpu",
                               dtype: torch.dtype = torch.float32, random_weights: str | None = None) -> str:
    """`lookahead_generate` (each (window, ngram, guesses), fixed and adaptive) against our plain
    generate, as `lookahead_table` but timed prompt by prompt (`_per_prompt_speedups`): at batch 1
    each prompt of a set is a group of its own, at batch b one batch of the set's prompts, cycled.
    Tokens per target forward are those of the untimed run, summed over the groups. A markdown
    table plus the machine line."""
    torch.manual_seed(0)
    setup = load_setup(pack, device, dtype, random_weights)
    lines = []
    for B in batch_sizes:
        for name, prompts in (("copy-heavy", PROMPTS), ("open", OPEN_PROMPTS)):
            groups = [(prompt,) for prompt in prompts] if B == 1 else [prompts]
            methods = [(*c, a) for c in configs for a in (False, True)]

            def run(m, i, B=B, groups=groups):
                return _timed(setup, run_lookahead, B, max_new_tokens, m, groups[i])

            speedup = _per_prompt_speedups(methods, len(groups), run, repeats)
            for c in configs:
                (fixed, fixed_out), (adaptive, adaptive_out) = speedup[(*c, False)], speedup[(*c, True)]
                per_forward = " / ".join(f"{_tokens_per_forward(outs):.2f}" for outs in (fixed_out, adaptive_out))
                lines.append(f"| {B} | {name} | {', '.join(map(str, c))} | {fixed[0]:.3f}x; {fixed[1]:.3f}x | "
                             f"{adaptive[0]:.3f}x; {adaptive[1]:.3f}x | {per_forward} |")
    header = ("| batch | prompts | W, N, G | fixed vs plain (minima; medians) | adaptive vs plain (minima; medians) | "
              "tokens per target forward (fixed / adaptive) |\n|---|---|---|---|---|---|")
    caption = (f"{_setting(random_weights, dtype, device)}, greedy, "
               f"{max_new_tokens} new tokens per row, batch 1: each prompt of a set; speedups: sums over prompts of "
               f"the minimum and of the median of {repeats} interleaved runs, plain's over the method's")
    return _markdown(caption, header, lines)


def _tokens_per_forward(outputs: list) -> float:
    """`tokens_per_target_forward` over runs (one per prompt group): generated tokens but each
    row's first (the prefill's) per decoding step, all rows of all runs together."""
    stats = [out.stats for out in outputs]
    return (sum(int(st.num_generated.sum()) - len(st.num_generated) for st in stats)
            / sum(int(st.num_steps.sum()) for st in stats))


def held_out_prompts(count: int = 8) -> tuple[str, ...]:
    """Prompts the draft-head recipe never trains on: its documents kind's held-out set
    (`build_prompts`), past the ones the documents-only recipe's evaluation shards answer. They
    ask to summarize, rewrite or explain text they quote: answers copy from their prompts."""
    from specdec_kernels.draft_data import build_prompts
    from specdec_kernels.draft_training import HELD_OUT_SHARDS

    held_out = build_prompts(kinds=("documents",))[1]
    return tuple(held_out[64 * HELD_OUT_SHARDS:][:count])


def run_head(setup: Setup, batch_size: int, max_new_tokens: int, draft, k: int, adaptive: bool,
             prompts: tuple[str, ...], temperature: float = 0.0):
    """Plain generate (``draft`` None) or speculative_generate with ``draft`` (a drafter), greedy
    or sampled (seeded): at batch 1 on every prompt in turn (`_one_at_a_time`), else one batch of
    the first ``batch_size`` prompts."""
    def run(ids, mask):
        if draft is None:
            return generate(setup.model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, seed=0)
        return speculative_generate(setup.model, draft, ids, mask, num_draft_tokens=k, adaptive=adaptive, seed=0,
                                    max_new_tokens=max_new_tokens, temperature=temperature)

    if batch_size == 1:
        return _one_at_a_time([run(*encode(setup, 1, (prompt,))) for prompt in prompts])
    return run(*encode(setup, batch_size, prompts))


def _one_at_a_time(outputs: list) -> SimpleNamespace:
    """Batch-1 runs as one output: ``tokens`` stacked (as one row each), per-row stats
    concatenated, counts and times summed, ``target_forwards`` counting one prefill as a batched
    run does, and ``one_at_a_time`` set (the rows ran one after another: `_run_total`)."""
    stats = [out.stats for out in outputs]
    merged = copy.copy(stats[0])
    for name in ("num_generated", "num_steps", "num_proposed", "num_accepted", "draft_lengths"):
        setattr(merged, name, torch.cat([getattr(st, name) for st in stats]))
    for name in ("draft_calls", "time_prefill_s", "time_draft_prefill_s", "time_target_s", "time_draft_s",
                 "time_sampler_s", "time_total_s"):
        setattr(merged, name, sum(getattr(st, name) for st in stats))
    merged.target_forwards = sum(st.target_forwards for st in stats) - (len(stats) - 1)
    merged.one_at_a_time = True
    width = max(out.tokens.shape[1] for out in outputs)
    tokens = torch.cat([torch.nn.functional.pad(out.tokens, (0, width - out.tokens.shape[1]), value=-1)
                        for out in outputs])
    return SimpleNamespace(tokens=tokens, stats=merged)


def _run_total(stats, per_row: torch.Tensor) -> int:
    """What the run did of a per-row count (steps, drafted tokens): a batch does its rows' together
    (the longest row's count); runs one at a time (`_one_at_a_time`) add theirs."""
    return int(per_row.sum() if getattr(stats, "one_at_a_time", False) else per_row.max())


# `heads_table`'s lookup-first draft: the loop's K. Lookup tokens cost nothing to propose, and at
# batch 1 a CPU verify forward's cost grows little from 5 to 8 tokens; the head stays at the table's K.
LOOKUP_FIRST_K = 7


def heads_table(max_new_tokens: int = 96, batch_sizes=(1, 8), k: int = 4, repeats: int = 3, pack: bool = True,
                head: str | None = None, exit_head: str | None = None, open_prompts: bool = False,
                matmul_dtypes: tuple[torch.dtype | None, ...] = (None,), head_tree: tuple[int, int] | None = None,
                draft_vocab_sizes: tuple[int | None, ...] | None = None) -> str:
    """The trained draft head (`load_smollm2_draft`, or the `FeatureHead` file ``head``), the
    head behind prompt lookup (`LookupFirstDraft`: K = `LOOKUP_FIRST_K`, the head asked for at
    most ``k``), an `ExitHead` file ``exit_head`` if given, and prompt lookup against our plain
    generate on held-out prompts (`held_out_prompts`, or with ``open_prompts`` `OPEN_PROMPTS`,
    which ask for new text rather than work on a text they quote; batch 1 answers each in turn,
    a batch of b rows the first b, cycled), greedy at each batch size and sampled (temperature
    0.7) at batch 1; fixed K and adaptive; every method ``repeats`` times, interleaved, with plain runs around each
    (`_interleaved_medians`). Columns: speedup (median over rounds of the ratio to the plain runs
    around it), acceptance per drafted token, tokens per target forward, the measured c and v,
    Leviathan's prediction and the efficiency (as in `table`, for fixed K), the mean draft
    length. ``matmul_dtypes``: the feature heads' (`FeatureHeadDraft`'s ``matmul_dtype``; None:
    its default), each with its own rows where more than one is given; the exit head keeps its
    default. ``head_tree``: (branches, depth) of the head's dynamic trees, also timed, at K =
    `LOOKUP_FIRST_K` (verify width 8; no prediction for trees), with the head's default matmul
    dtype only. ``draft_vocab_sizes``: the feature heads' ``draft_vocab_size`` (an entry None: the
    whole vocabulary), each with its own rows and named in them; trees take the first; None: the
    drafter's default only. A markdown table plus the machine line."""
    from specdec_kernels import (
        ExitHead,
        ExitHeadDraft,
        FeatureHead,
        FeatureHeadDraft,
        LookupFirstDraft,
        load_smollm2_draft,
    )

    torch.manual_seed(0)
    setup = load_setup(pack)
    for name, values in (("matmul_dtypes", matmul_dtypes), ("draft_vocab_sizes", draft_vocab_sizes or ())):
        if len(set(values)) != len(values):
            raise ValueError(f"{name} must be distinct, got {values}")
    default = draft_vocab_sizes is None  # the drafter's default size, unnamed in the rows
    vocab = lambda size: {} if default else {"draft_vocab_size": size}
    vocab_label = lambda size: [] if default else [f"{size or 'all'} draft ids"]
    feature_head = ((lambda **options: load_smollm2_draft(setup.model, **options)) if head is None
                    else (lambda **options: FeatureHeadDraft(setup.model, FeatureHead.load(head), **options)))
    heads = {}  # row-name suffix -> drafter
    for dtype, size in itertools.product(matmul_dtypes, (None,) if default else draft_vocab_sizes):
        dtype_name = "default" if dtype is None else str(dtype).removeprefix("torch.")
        named = [] if len(matmul_dtypes) == 1 else [f"{dtype_name} matmuls"]
        named += vocab_label(size)
        suffix = f" ({', '.join(named)})" if named else ""
        heads[suffix] = feature_head(matmul_dtype=dtype, **vocab(size))
    drafters = {f"trained head{suffix}": (drafter, k) for suffix, drafter in heads.items()}
    drafters["prompt lookup"] = (PromptLookupDraft(), k)
    drafters.update({f"trained head, lookup first{suffix}": (LookupFirstDraft(drafter, draft_tokens=k), LOOKUP_FIRST_K)
                     for suffix, drafter in heads.items()})
    if head_tree is not None:
        branches, depth = head_tree
        size = None if default else draft_vocab_sizes[0]
        tree = feature_head(branches=branches, depth=depth, **vocab(size))
        named = "".join(f" ({label})" for label in vocab_label(size))
        drafters[f"trained head, tree of {branches} branches, depth {depth}{named}"] = (tree, LOOKUP_FIRST_K)
    if exit_head is not None:
        drafters["early-exit head"] = (ExitHeadDraft(setup.model, ExitHead.load(exit_head)), k)
    prompts = OPEN_PROMPTS if open_prompts else held_out_prompts()
    lines = []
    for B, temperature in [*((b, 0.0) for b in batch_sizes), (1, 0.7)]:
        methods = {"plain": (run_head, None, k, False, prompts, temperature)}
        for name, (draft, draft_k) in drafters.items():
            for adaptive in (False, True):
                methods[name, adaptive] = (run_head, draft, draft_k, adaptive, prompts, temperature)
        speedups = {}
        median = _interleaved_medians(setup, methods, B, max_new_tokens, repeats, "plain", speedups)
        plain = median["plain"][1]
        for (name, adaptive), (_, out) in ((m, v) for m, v in median.items() if m != "plain"):
            if temperature == 0 and not torch.equal(out.tokens, plain.tokens):
                raise AssertionError(f"{name} gave other greedy tokens than plain generate")
            st, (draft, draft_k) = out.stats, drafters[name]
            target_step = plain.stats.time_target_s / (plain.stats.target_forwards - 1)
            v = st.time_target_s / (st.target_forwards - 1) / target_step
            c = st.time_draft_s / max(1, _run_total(st, st.num_proposed)) / target_step
            # (Leviathan's i.i.d. prediction describes chains of one draft: not a mix of two, nor trees.)
            chain = not isinstance(draft, LookupFirstDraft) and getattr(draft, "branches", 1) == 1
            predicted, efficiency = leviathan(st, draft_k, plain.stats) if chain and not adaptive else (None, None)
            kind = f"{'adaptive' if adaptive else 'fixed'}{f' (K = {draft_k})' if draft_k != k else ''}"
            lines.append(f"| {B} | {temperature:g} | {name} | {kind} | "
                         f"{speedups[name, adaptive]:.2f}x | {st.acceptance_rate:.1%} | "
                         f"{st.tokens_per_target_forward:.2f} | "
                         f"{c:.3f} | {v:.2f} | {'' if predicted is None else f'{predicted:.2f}x'} | "
                         f"{'' if efficiency is None else f'{efficiency:.2f}'} | {st.mean_draft_length:.2f} |")
    header = ("| batch | temperature | draft | K | vs plain | acceptance | tokens per target forward | c | v | "
              "predicted (fixed K) | efficiency (fixed K) | mean draft length |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")
    caption = (f"SmolLM2-135M-Instruct float32 on cpu, {max_new_tokens} new tokens per row, K = {k} unless noted, "
               f"{len(prompts)} {'open' if open_prompts else 'held-out'} prompts (batch 1: one at a time), "
               f"speedups: median over {repeats} interleaved rounds of the ratio to plain runs made around each run")
    return _markdown(caption, header, lines)


def hf_models_table(max_new_tokens: int = 48, batch_sizes=(1, 8), k: int = 4, repeats: int = 3,
                    device: str = "cpu", dtype: torch.dtype = torch.float32,
                    cuda_graphs: bool = True, random_weights: str | None = None) -> str:
    """Our loops driving transformers' own SmolLM2 (``LlamaForCausalLM``; on CPU float32 with
    matmuls prepared by `HFCausalLM.pack_weights`, and once as loaded) against transformers'
    generation with the same model and draft, the built-in `Llama` beside them; every method
    ``repeats`` times, interleaved; a markdown table of medians plus the machine line.
    ``cuda_graphs``: our loops replay their decoding forwards as CUDA graphs (on CUDA)."""
    torch.manual_seed(0)
    setup = load_setup(True, device, dtype, random_weights)
    setup.cuda_graphs = None if cuda_graphs else False
    packs = device == "cpu" and dtype == torch.float32  # what HFCausalLM.pack_weights takes
    ours_on_hf = functools.partial(run_ours_on_hf, packed=packs)
    unpacked = functools.partial(run_ours_on_hf, packed=False)
    rows = []
    for B in batch_sizes:
        methods = {"HF generate": (run_hf, None), "ours generate, HF model": (ours_on_hf, None),
                   **({"ours generate, HF model as loaded (no pack_weights)": (unpacked, None)} if packs else {}),
                   "ours generate, built-in Llama": (run_ours, None),
                   "HF assisted, prompt lookup": (run_hf, "prompt_lookup"),
                   "ours spec, HF model, prompt lookup": (ours_on_hf, "prompt_lookup"),
                   f"HF assisted, HF {DRAFT_LAYERS}-layer draft": (run_hf, "layers"),
                   f"ours spec, HF model, HF {DRAFT_LAYERS}-layer draft": (ours_on_hf, "layers")}
        for fn, draft in methods.values():
            fn(setup, B, 4, draft, k)  # warm-up
        runs = {name: [] for name in methods}
        for _ in range(repeats):
            for name, (fn, draft) in methods.items():
                seconds, out = _timed(setup, fn, B, max_new_tokens, draft, k)
                tokens = out if isinstance(out, int) else int(out.stats.num_generated.sum())
                runs[name].append(tokens / seconds)
        tps = {name: sorted(r)[len(r) // 2] for name, r in runs.items()}
        baseline = {"generate": tps["HF generate"], "prompt lookup": tps["HF assisted, prompt lookup"],
                    "layer": tps[f"HF assisted, HF {DRAFT_LAYERS}-layer draft"]}
        for name, value in tps.items():
            against = next(base for key, base in baseline.items() if key in name)
            rows.append(f"| {B} | {name} | {value:.1f} | {value / against:.2f}x |")
    header = "| batch | method | tokens/s | vs transformers, same model and draft |\n|---|---|---|---|"
    prepared = "after HFCausalLM.pack_weights() unless noted" if packs else "as loaded"
    graphs = (", CUDA graphs" if cuda_graphs else ", eager") if device != "cpu" else ""
    caption = (f"{_setting(random_weights, dtype, device)} as transformers' LlamaForCausalLM "
               f"(ours: {prepared}{graphs}), greedy, {max_new_tokens} new tokens per row, "
               f"K = {k} (ours: adaptive lengths), median of {repeats} interleaved runs; transformers' assisted "
               f"generation takes one row per call (batch 8 loops over rows)")
    return _markdown(caption, header, rows)


def _draft_vocab_size(text: str) -> int | None:
    """``--head-vocab``'s values: a positive int, or ``all`` (None: the head's whole vocabulary)."""
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'all', got {text!r}")
    return int(text)


def _branches_and_depth(text: str) -> tuple[int, int]:
    """A tree option's "B,D": two positive ints, branches and depth."""
    try:
        branches, depth = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,D (branches, depth: two ints), got {text!r}") from None
    if branches < 1 or depth < 1:
        raise argparse.ArgumentTypeError(f"branches and depth must be >= 1, got {text!r}")
    return branches, depth


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-pack", action="store_true", help="leave our model's matmuls as loaded (no pack_weights)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-cuda-graphs", action="store_true", help="our loops decode eagerly on CUDA too")
    parser.add_argument("--speculation", action="store_true",
                        help="fixed vs adaptive draft lengths for K in --ks, and the oracle drafter (no HF runs)")
    parser.add_argument("--per-prompt", action="store_true",
                        help="with --speculation or --lookahead: minima and medians of many runs per prompt "
                             "(--repeats rounds; --lookahead: W, N, G = 2, 3, 4 unless --lookahead-configs)")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--random-weights", metavar="TOKENIZER_DIR",
                        help="random weights in SmolLM2's shapes and the tokenizer saved in TOKENIZER_DIR, "
                             "for machines without the model (timings only)")
    parser.add_argument("--hf-models", action="store_true",
                        help="our loops driving transformers' own model and draft against transformers' generation")
    parser.add_argument("--trees", action="store_true",
                        help="prompt-lookup and trained-head trees against chains at equal verify width (no HF runs)")
    parser.add_argument("--head-trees", nargs="+", type=_branches_and_depth, default=None, metavar="B,D",
                        help="--trees: the head's trees as (branches, depth) (default: "
                             + " ".join(",".join(map(str, c)) for c in HEAD_TREES) + ")")
    parser.add_argument("--jacobi", action="store_true", help="jacobi_generate against our plain generate")
    parser.add_argument("--lookahead", action="store_true",
                        help="lookahead_generate (fixed and adaptive) against our plain generate, copy-heavy and "
                             "open prompts")
    parser.add_argument("--lookahead-configs", nargs="+", default=None, metavar="W,N,G",
                        help="the lookahead table's (window, ngram, guesses) (default: "
                             + " ".join(",".join(map(str, c)) for c in LOOKAHEAD_CONFIGS) + ")")
    parser.add_argument("--heads", action="store_true",
                        help="the trained draft head and prompt lookup against plain generate on held-out prompts")
    parser.add_argument("--head", default=None, metavar="PATH",
                        help="--heads: a FeatureHead file instead of the shipped head")
    parser.add_argument("--exit-head", default=None, metavar="PATH",
                        help="--heads: an ExitHead file (train-draft --head early-exit) to compare too")
    parser.add_argument("--head-matmul-dtypes", nargs="+", default=None, choices=["float32", "bfloat16"],
                        help="--heads: the head's matmul dtypes to compare, each with its own rows (default: "
                             "the head's default only)")
    parser.add_argument("--head-tree", type=_branches_and_depth, default=None, metavar="B,D",
                        help=f"--heads: also the head's trees of B branches and depth D, at K = {LOOKUP_FIRST_K}")
    parser.add_argument("--head-vocab", nargs="+", type=_draft_vocab_size, default=None, metavar="N",
                        help="--heads: the feature head's draft vocabulary sizes to compare ('all': the whole), "
                             "each with its own rows (default: the drafter's default)")
    parser.add_argument("--open-prompts", action="store_true",
                        help="--heads: the open prompts (new text, little to copy) instead of the held-out ones")
    args = parser.parse_args()
    if args.per_prompt and not (args.speculation or args.lookahead):
        parser.error("--per-prompt times the --speculation or the --lookahead table: give one of them")
    if args.head_trees is not None and not args.trees:
        parser.error("--head-trees sets the --trees table's head trees: give both")
    if args.head_trees is not None and len(set(args.head_trees)) != len(args.head_trees):
        parser.error("--head-trees: each B,D once")
    for flag, value in (("--head-tree", args.head_tree), ("--head-vocab", args.head_vocab)):
        if value is not None and not args.heads:
            parser.error(f"{flag} is an option of the --heads table: give both")
    if args.heads:
        print(heads_table(args.max_new_tokens, tuple(args.batch_sizes), args.k, args.repeats, pack=not args.no_pack,
                          head=args.head, exit_head=args.exit_head, open_prompts=args.open_prompts,
                          matmul_dtypes=(None,) if args.head_matmul_dtypes is None
                          else tuple(getattr(torch, d) for d in args.head_matmul_dtypes),
                          head_tree=args.head_tree,
                          draft_vocab_sizes=None if args.head_vocab is None else tuple(args.head_vocab)))
        raise SystemExit(0)
    if args.lookahead:
        configs = ({} if args.lookahead_configs is None else  # None: each table's own default
                   {"configs": tuple(tuple(int(x) for x in c.split(",")) for c in args.lookahead_configs)})
        table_fn = lookahead_per_prompt_table if args.per_prompt else lookahead_table
        print(table_fn(args.max_new_tokens, tuple(args.batch_sizes), **configs, repeats=args.repeats,
                       pack=not args.no_pack, device=args.device, dtype=getattr(torch, args.dtype),
                       random_weights=args.random_weights))
        raise SystemExit(0)
    if args.jacobi:
        print(jacobi_table(args.max_new_tokens, tuple(args.batch_sizes), repeats=args.repeats, pack=not args.no_pack,
                           device=args.device, dtype=getattr(torch, args.dtype), random_weights=args.random_weights))
        raise SystemExit(0)
    if args.trees:
        head_trees = HEAD_TREES if args.head_trees is None else tuple(args.head_trees)
        print(trees_table(args.max_new_tokens, tuple(args.batch_sizes), head_trees=head_trees, repeats=args.repeats,
                          pack=not args.no_pack, device=args.device, dtype=getattr(torch, args.dtype),
                          random_weights=args.random_weights))
        raise SystemExit(0)
    if args.hf_models:
        print(hf_models_table(args.max_new_tokens, tuple(args.batch_sizes), args.k, args.repeats, device=args.device,
                              dtype=getattr(torch, args.dtype), cuda_graphs=not args.no_cuda_graphs,
                              random_weights=args.random_weights))
        raise SystemExit(0)
    if args.speculation and args.per_prompt:
        print(per_prompt_table(args.max_new_tokens, tuple(args.batch_sizes), tuple(args.ks), args.repeats,
                               pack=not args.no_pack, device=args.device, dtype=getattr(torch, args.dtype),
                               random_weights=args.random_weights))
        raise SystemExit(0)
    if args.speculation:
        print(speculation_table(args.max_new_tokens, tuple(args.batch_sizes), tuple(args.ks), args.repeats,
                                pack=not args.no_pack, device=args.device, dtype=getattr(torch, args.dtype),
                                random_weights=args.random_weights))
        raise SystemExit(0)
    print(table(args.max_new_tokens, tuple(args.batch_sizes), args.k, args.repeats, pack=not args.no_pack,
                device=args.device, dtype=getattr(torch, args.dtype), cuda_graphs=not args.no_cuda_graphs,
                random_weights=args.random_weights))
