"""The built-in Llama matches transformers' LlamaForCausalLM on the same weights."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from specdec_kernels import KVCache
from specdec_kernels.matmul import (
    BFLOAT16_PLAN,
    MKL_PACKED_PLAN,
    PACKED_FORMS,
    Linear,
    MatmulPlan,
    bfloat16_matmuls_available,
    choose_matmul_plan,
    cpu_seconds_elsewhere,
    fastest_calls,
    linear,
    measure_matmul_plan,
    mkl_packing_available,
    onednn_packing_available,
    panels_available,
    weight_first,
)
from specdec_kernels.model import Llama, LlamaConfig, RMSNorm
from specdec_kernels.testing import assert_close

from tiny_models import tiny_config, tiny_llama

transformers = pytest.importorskip("transformers")


def hf_twin(model: Llama, **config_overrides):
    """A transformers LlamaForCausalLM with ``model``'s weights."""
    from specdec_kernels.model import internal_to_hf

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attn_implementation="eager", **config_overrides)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(internal_to_hf(model.state_dict(), c), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


ROPE_CASES = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kv_heads", [2, 4, 1], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("rope", list(ROPE_CASES))
def test_ragged_prefill_and_decode_match_transformers(tied, rope, kv_heads):
    model = tiny_llama(seed=1, kv_heads=kv_heads, tie_word_embeddings=tied, rope_scaling=ROPE_CASES[rope])
    hf = hf_twin(model)
    lengths = [5, 1, 9, 3]
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    B, T = len(prompts), max(lengths)
    input_ids = torch.zeros(B, T, dtype=torch.int64)
    for b, p in enumerate(prompts):
        input_ids[b, : len(p)] = p
    cache = model.new_cache(B, 32)
    with torch.no_grad():
        logits = model(input_ids, cache, torch.tensor(lengths))
        next_ids = torch.tensor([[7], [11], [13], [17]])
        step = model(next_ids, cache)
        for b, p in enumerate(prompts):
            full = torch.cat([p, next_ids[b]])
            expected = hf(full[None]).logits[0]
            assert_close(logits[b, : len(p)], expected[: len(p)], dtype=torch.float32, msg=f"row {b} prefill")
            assert_close(step[b, 0], expected[-1], dtype=torch.float32, msg=f"row {b} decode")
    assert cache.lengths.tolist() == [n + 1 for n in lengths]


def test_last_only_and_verification_shapes():
    model = tiny_llama(seed=2)
    ids = torch.randint(0, 97, (3, 6))
    q = torch.tensor([6, 2, 4])
    with torch.no_grad():
        full = model(ids, model.new_cache(3, 16), q)
        last = model(ids, model.new_cache(3, 16), q, last_only=True)
    assert last.shape == (3, 1, 97)
    for b in range(3):
        torch.testing.assert_close(last[b, 0], full[b, q[b] - 1])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "num_tokens"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_hidden_only_returns_the_hidden_states_of_return_hidden_and_fills_the_cache_alike(packed, tree):
    model = tiny_llama(seed=2)
    ids = torch.randint(0, 97, (3, 6))
    q = torch.tensor([6, 2, 4])
    kwargs = {"num_tokens": int(q.sum())} if packed else {}
    if tree:  # each token sees itself and a random subset of the earlier ones
        kwargs["tree_mask"] = torch.eye(6, dtype=torch.bool) | (torch.rand(3, 6, 6, generator=torch.Generator()
                                                                            .manual_seed(0)) < 0.5).tril()
    with torch.no_grad():
        with_logits, cache = model.new_cache(3, 16), model.new_cache(3, 16)
        _, expected = model(ids, with_logits, q, return_hidden=True, **kwargs)
        hidden = model(ids, cache, q, hidden_only=True, **kwargs)
    assert hidden.shape == (3, 6, model.config.hidden_size)
    assert cache.lengths.tolist() == with_logits.lengths.tolist() == [6, 2, 4]
    for b in range(3):  # padding positions hold meaningless values
        n = int(q[b])
        torch.testing.assert_close(hidden[b, :n], expected[b, :n], rtol=0, atol=0)
        for layer in range(model.config.num_hidden_layers):
            torch.testing.assert_close(cache.k[layer][b, :n], with_logits.k[layer][b, :n], rtol=0, atol=0)
            torch.testing.assert_close(cache.v[layer][b, :n], with_logits.v[layer][b, :n], rtol=0, atol=0)
    for conflicting in ({"last_only": True}, {"return_hidden": True}):
        with pytest.raises(ValueError, match="hidden_only"):
            model(ids, model.new_cache(3, 16), q, hidden_only=True, **conflicting)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_num_tokens_skips_padding_with_the_same_results(kv_heads):
    """Told ``num_tokens`` = q_seqlens.sum(), the per-token layers run on the real tokens only;
    logits at real positions, last-token logits and the cache written for later steps agree."""
    model = tiny_llama(seed=6, kv_heads=kv_heads)
    ids = torch.randint(0, 97, (4, 9), generator=torch.Generator().manual_seed(6))
    q = torch.tensor([9, 1, 4, 6])
    real = torch.arange(9) < q[:, None]
    caches = [model.new_cache(4, 24) for _ in range(4)]
    with torch.no_grad():
        full = model(ids, caches[0], q)
        packed = model(ids, caches[1], q, num_tokens=20)
        last = model(ids, caches[2], q, last_only=True, num_tokens=20)
        model(ids, caches[3], q, last_only=True)
        assert packed.shape == full.shape and last.shape == (4, 1, 97)
        assert_close(packed[real], full[real], dtype=torch.float32)
        assert_close(last[:, 0], full[torch.arange(4), q - 1], dtype=torch.float32)
        step = torch.randint(0, 97, (4, 3))
        reference = model(step, caches[0])
        for cache in caches[1:]:
            assert cache.lengths.tolist() == q.tolist()
            assert_close(model(step, cache), reference, dtype=torch.float32)


def test_max_seqlen_reads_fewer_positions_with_the_same_results(monkeypatch):
    """Told a bound on the lengths, attention reads that many positions of a larger cache; logits
    and lengths agree with reading the whole capacity."""
    import specdec_kernels.model as model_module

    positions_read = []
    attend = model_module.ragged_attention

    def spy(q, k_cache, *args, **kwargs):
        positions_read.append(k_cache.shape[1])
        return attend(q, k_cache, *args, **kwargs)

    monkeypatch.setattr(model_module, "ragged_attention", spy)
    model = tiny_llama(seed=7)
    gen = torch.Generator().manual_seed(7)
    prompt, q = torch.randint(0, 97, (3, 6), generator=gen), torch.tensor([6, 2, 4])
    bounded, full = model.new_cache(3, 64), model.new_cache(3, 64)
    with torch.no_grad():
        assert_close(model(prompt, bounded, q, max_seqlen=6), model(prompt, full, q), dtype=torch.float32)
        expected = [6, 64]
        for step in range(3):
            ids = torch.randint(0, 97, (3, 1), generator=gen)
            bound = int(bounded.lengths.max()) + 1 + step  # tight, then looser
            assert_close(model(ids, bounded, max_seqlen=bound), model(ids, full), dtype=torch.float32)
            expected += [bound, 64]
        model(ids, bounded, max_seqlen=10**6)  # a bound above the capacity means the capacity
    assert bounded.lengths.tolist() == [10, 6, 8]
    assert positions_read == [n for n in expected + [64] for _ in model.layers]


def test_max_seqlen_errors():
    model = tiny_llama()
    ids = torch.zeros(2, 3, dtype=torch.int64)
    for bad in (2, 0, 3.0, True, "4"):
        with pytest.raises(ValueError, match="max_seqlen must be an int >= T = 3"):
            model(ids, model.new_cache(2, 8), max_seqlen=bad)
    cache = model.new_cache(2, 8)
    cache.advance(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="max_seqlen=3 is below a row's cache length after this pass"):
        model(ids, cache, max_seqlen=3)
    model(ids, cache, max_seqlen=4)  # row 0 reaches exactly 4


def test_min_seqlen_errors_and_one_full_row_gives_the_same_logits():
    model = tiny_llama(seed=8)
    ids = torch.randint(0, 97, (1, 3), generator=torch.Generator().manual_seed(8))
    for bad in (0, 9, 3.0, True, "4"):
        with pytest.raises(ValueError, match="min_seqlen must be None or an int in 1..max_len=8"):
            model(ids, model.new_cache(1, 8), min_seqlen=bad)
    with pytest.raises(ValueError, match="min_seqlen must be None or an int in 1..max_len=3"):
        model(ids, model.new_cache(1, 8), max_seqlen=3, min_seqlen=4)
    cache = model.new_cache(2, 8)
    cache.advance(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="min_seqlen=4"):  # row 1 reaches only 3: checked on the device
        model(ids.expand(2, 3), cache, min_seqlen=4)
    hinted, plain = model.new_cache(1, 8), model.new_cache(1, 8)
    with torch.no_grad():
        model(ids, hinted), model(ids, plain)
        for T in (1, 2):  # one row, max_seqlen exact: every key visible, no length mask
            step = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(T))
            n = int(hinted.lengths) + T
            assert_close(model(step, hinted, max_seqlen=n, min_seqlen=n), model(step, plain, max_seqlen=n),
                         dtype=torch.float32)


def test_num_tokens_errors():
    model = tiny_llama()
    ids, q = torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3, 1])
    for bad in (0, 7, 2.0, True):
        with pytest.raises(ValueError, match="num_tokens"):
            model(ids, model.new_cache(2, 8), q, num_tokens=bad)
    with pytest.raises(ValueError, match="num_tokens=5 must equal q_seqlens.sum"):
        model(ids, model.new_cache(2, 8), q, num_tokens=5)
    with pytest.raises(ValueError, match="num_tokens=4 must be B \\* T = 6 when q_seqlens is None"):
        model(ids, model.new_cache(2, 8), num_tokens=4)


def test_save_and_load_round_trip_through_transformers(tmp_path):
    model = tiny_llama(seed=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    reloaded = Llama.from_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        ours = reloaded(ids, reloaded.new_cache(2, 8))
        assert_close(ours, hf(ids).logits, dtype=torch.float32)
        assert_close(ours, model(ids, model.new_cache(2, 8)), dtype=torch.float32)
    loaded_from_hf = Llama.from_pretrained(hf)
    assert loaded_from_hf.output.weight is loaded_from_hf.tok_embeddings.weight


def test_truncated_draft_shares_weights():
    model = tiny_llama(seed=4, layers=3)
    draft = model.truncated(1)
    assert len(draft.layers) == 1 and draft.config.num_hidden_layers == 1
    assert draft.layers[0] is model.layers[0] and draft.output is model.output
    assert isinstance(draft.new_cache(2, 8), KVCache) and draft.new_cache(2, 8).num_layers == 1
    with pytest.raises(ValueError, match="num_layers"):
        model.truncated(4)


def test_bad_config_and_inputs():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        tiny_config(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig(10, 8, 8, 1, 2, 1, rope_scaling={"rope_type": "yarn"})
    model = tiny_llama()
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(4, dtype=torch.int64), model.new_cache(1, 8))
    with pytest.raises(ValueError, match="rows"):
        model(torch.zeros(2, 3, dtype=torch.int64), model.new_cache(1, 8))
    with pytest.raises(ValueError, match="config.json"):
        Llama.from_pretrained("/nonexistent")


@pytest.mark.parametrize("change,match", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_config_variants_the_model_does_not_compute_are_refused(change, match):
    """Hugging Face configs whose model differs from ours (biases, another activation) are refused
    rather than loaded into a model that computes something else."""
    hf_config = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, **change)
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(hf_config)
    with pytest.raises(ValueError, match=match):
        Llama.from_pretrained(transformers.LlamaForCausalLM(hf_config))
    unaffected = transformers.MistralConfig(vocab_size=97, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, sliding_window=None)
    assert LlamaConfig.from_hf(unaffected).vocab_size == 97


def test_rope_stays_float32_in_half_precision_models():
    model = tiny_llama(seed=5)
    positions = torch.tensor([[0, 7, 2000]])
    cos32, sin32 = model.rope_angles(positions)
    half = tiny_llama(seed=5).to(torch.bfloat16)
    draft = half.truncated(1)
    for m in (half, draft):
        cos, sin = m.rope_angles(positions)
        assert cos.dtype == torch.float32
        torch.testing.assert_close(cos, cos32)
        torch.testing.assert_close(sin, sin32)
    with torch.no_grad():
        logits = half(torch.tensor([[1, 2, 3]]), half.new_cache(1, 4))
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()


def test_sliding_window_attention_past_the_window():
    """A Mistral config with a 16-key window: the built-in model attends within it, past the
    window too (40 positions): logits equal transformers' forward, and greedy `generate` equals
    transformers' greedy `generate` over 30 new tokens."""
    from specdec_kernels import generate

    hf_config = transformers.MistralConfig(vocab_size=97, hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           sliding_window=16, max_position_embeddings=64)
    hf_config._attn_implementation = "eager"
    assert LlamaConfig.from_hf(hf_config).sliding_window == 16
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(hf_config).eval()
    hf.generation_config.eos_token_id = None  # both run all 30 tokens (the config's EOS id is 2)
    model = Llama.from_pretrained(hf)
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        assert_close(model(tokens, model.new_cache(2, 48)), hf(tokens).logits, dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 10))
    expected = hf.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)[:, 10:]
    assert torch.equal(generate(model, ids, max_new_tokens=30, temperature=0).tokens, expected)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 63, 64, 65])
def test_linear_and_weight_first_match_f_linear_at_every_row_count(rows):
    # `linear` switches between x @ W^T and (W @ x^T)^T by row count; both are the same product,
    # from a weight stored either way and an input that need not be contiguous.
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 24, generator=gen)
    x = torch.randn(rows, 1, 24, generator=gen)
    strided = torch.randn(rows, 1, 48, generator=gen)[..., ::2]
    for w in (weight, weight.t().contiguous().t()):
        for fn in (linear, weight_first):
            for inputs in (x, strided):
                out = fn(inputs, w)
                assert out.shape == (rows, 1, 40)
                torch.testing.assert_close(out, F.linear(inputs, weight), rtol=1e-5, atol=1e-5)


needs_mkl = pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL")
needs_onednn = pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
needs_panels = pytest.mark.skipif(not panels_available(), reason="the panels form is not built here")


def mkl_linear_calls(fn) -> int:
    """How many MKL packed GEMMs ``fn()`` runs; none of them may fall back to an unpacked matmul
    (torch's op does so inside when not told the input's row count)."""
    with torch.profiler.profile() as prof:
        fn()
    counts = {e.key: e.count for e in prof.key_averages()}
    packed = counts.get("mkl::_mkl_linear", 0)
    if packed:
        assert not counts.get("aten::linear") and not counts.get("aten::mm"), counts
    return packed


@needs_mkl
@pytest.mark.parametrize("features", [(24, 40), (97, 33)], ids=["24x40", "97x33"])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 8, 40, 63, 64, 65, 130])
def test_packed_linear_matches_f_linear_at_every_row_count(rows, features):
    # Packed for 64 rows (`_PACK_ROWS`), MKL's buffer serves any row count.
    gen = torch.Generator().manual_seed(rows)
    n_in, n_out = features
    layer = Linear(n_in, n_out).requires_grad_(False)
    layer.weight.copy_(torch.randn(n_out, n_in, generator=gen))
    weight = layer.weight.detach().clone()
    layer.pack()
    assert layer.weight.t().is_contiguous() and torch.equal(layer.weight, weight)  # stored input-major
    x = torch.randn(rows, 1, n_in, generator=gen)
    assert mkl_linear_calls(lambda: layer(x)) == (1 if rows >= 2 else 0)
    out = layer(x)
    assert out.shape == (rows, 1, n_out)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)  # the row-major weight
    strided = torch.randn(rows, 2 * n_in, generator=gen)[:, ::2]  # not contiguous
    torch.testing.assert_close(layer(strided), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("input_major", [False, True], ids=["row-major", "input-major"])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 8, 40, 65, 130])
def test_onednn_packed_linear_matches_f_linear_at_every_row_count(rows, input_major):
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(97, 33).requires_grad_(False)
    layer.weight.copy_(torch.randn(33, 97, generator=gen))
    weight = layer.weight.detach().clone()
    layer.pack(MatmulPlan(input_major=input_major, forms=((1, "onednn_packed"),)))
    x = torch.randn(rows, 1, 97, generator=gen)
    with torch.profiler.profile() as prof:
        out = layer(x)
    assert {e.key: e.count for e in prof.key_averages()}.get("mkldnn::_linear_pointwise") == 1
    assert out.shape == (rows, 1, 33)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 2 * 97, generator=gen)[:, ::2]  # not contiguous
    torch.testing.assert_close(layer(strided), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


def panels_calls(monkeypatch) -> list[int]:
    """The row counts of the ``panels`` form's calls from now on (in the test)."""
    import dataclasses

    from specdec_kernels import matmul

    calls, form = [], matmul.PACKED_FORMS["panels"]

    def run(x, packed, weight):
        calls.append(x.numel() // x.shape[-1])
        return form.run(x, packed, weight)

    monkeypatch.setitem(matmul.PACKED_FORMS, "panels", dataclasses.replace(form, run=run))
    return calls


@needs_panels
@pytest.mark.parametrize("input_major", [False, True], ids=["row-major", "input-major"])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 12, 13, 25, 65, 130])
@pytest.mark.parametrize("features", [(97, 33), (64, 48), (576, 960), (1, 17)], ids=str)
def test_panels_linear_matches_f_linear_at_every_row_count(monkeypatch, rows, input_major, features):
    """The package's own kernel: any row count (past its register tile of 12 rows on AVX-512,
    3 on AVX2), output counts that fill no panel pair (33: 2 panels and a part; 17: one and a
    part) or do, either weight layout, inputs of any strides."""
    gen = torch.Generator().manual_seed(rows)
    n_in, n_out = features
    layer = Linear(n_in, n_out).requires_grad_(False)
    layer.weight.copy_(torch.randn(n_out, n_in, generator=gen))
    weight = layer.weight.detach().clone()
    layer.pack(MatmulPlan(input_major=input_major, forms=((1, "panels"),)))
    calls = panels_calls(monkeypatch)
    x = torch.randn(rows, 1, n_in, generator=gen)
    out = layer(x)
    assert calls == [rows] and out.shape == (rows, 1, n_out)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    strided = torch.randn(rows, 2 * n_in, generator=gen)[:, ::2]  # not contiguous
    torch.testing.assert_close(layer(strided), F.linear(strided, weight), rtol=1e-5, atol=1e-4)
    assert torch.equal(layer.weight, weight)


@needs_panels
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 13, 65])
def test_the_panels_bfloat16_form_is_float32_arithmetic_on_the_rounded_weight(monkeypatch, rows):
    """``"panels_bfloat16"`` rounds the weight alone: its product is float32's with the weight
    rounded to bfloat16 (the input is not rounded, unlike ``"onednn_bfloat16"``)."""
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(97, 33).requires_grad_(False)
    layer.weight.copy_(torch.randn(33, 97, generator=gen))
    weight = layer.weight.detach().clone()
    layer.pack(MatmulPlan(input_major=False, forms=((1, "panels_bfloat16"),)))
    assert torch.equal(layer.weight, weight) and layer.weight.dtype == torch.float32
    x = torch.randn(rows, 1, 97, generator=gen)
    out = layer(x)
    assert out.shape == (rows, 1, 33) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight.bfloat16().float()), rtol=1e-5, atol=1e-4)
    if rows:
        assert not torch.allclose(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    strided = torch.randn(rows, 2 * 97, generator=gen)[:, ::2]  # not contiguous
    torch.testing.assert_close(layer(strided), F.linear(strided, weight.bfloat16().float()), rtol=1e-5, atol=1e-4)


def test_bfloat16_plan_takes_the_forms_this_machine_runs(monkeypatch):
    from specdec_kernels import matmul

    for panels, onednn, expected in ((True, True, matmul.PANELS_BFLOAT16_PLAN),
                                     (True, False, MatmulPlan(False, ((1, "panels_bfloat16"),))),
                                     (False, True, BFLOAT16_PLAN), (False, False, None)):
        monkeypatch.setattr(matmul, "panels_available", lambda panels=panels: panels)
        monkeypatch.setattr(matmul, "bfloat16_matmuls_available", lambda onednn=onednn: onednn)
        assert matmul.bfloat16_plan() == expected
    assert matmul.PANELS_BFLOAT16_PLAN.rounded and matmul.PANELS_BFLOAT16_PLAN.form(9) == "panels_bfloat16"


@needs_panels
def test_the_panels_forms_refuse_what_their_kernel_would_misread():
    from specdec_kernels import matmul

    weight = torch.randn(33, 97)
    packed, rounded = matmul.panels_pack(weight), matmul.panels_bfloat16_pack(weight)
    for pack in (matmul.panels_pack, matmul.panels_bfloat16_pack):
        for bad in (weight.double(), weight[0], weight.to("meta")):
            with pytest.raises(ValueError, match="weight must be a CPU float32 \\[out, in\\] tensor"):
                pack(bad)
    for run, good, other in ((matmul.panels_linear, packed, rounded), (matmul.panels_bfloat16_linear, rounded, packed)):
        for x, copy in ((torch.randn(2, 96), good), (torch.randn(2, 97).double(), good), (torch.randn(2, 97), other),
                        (torch.randn(2, 97), matmul.panels_pack(torch.randn(17, 97)))):
            with pytest.raises(ValueError, match="x must be CPU float32 \\[..., 97\\] and packed"):
                run(x, copy, weight)


def test_the_panels_form_is_built_where_it_can_be():
    """On x86-64 Linux with a C compiler the kernel must build (else the form would vanish
    from every plan unnoticed); elsewhere the form says why it is missing."""
    import platform
    import shutil

    from specdec_kernels import _native

    buildable = (platform.system() == "Linux" and platform.machine() == "x86_64"
                 and shutil.which(os.environ.get("CC") or "cc") and not os.environ.get(_native.DISABLE_VARIABLE))
    if buildable:
        assert panels_available(), _native.unavailable_reason()
    else:
        assert not panels_available() and _native.unavailable_reason()


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """The native library built anew into ``tmp_path`` (and reloaded as before afterwards)."""
    from specdec_kernels import _native

    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path))
    _native.library.cache_clear()
    yield tmp_path / "native"
    monkeypatch.undo()
    _native.library.cache_clear()
    _native.library()


@needs_panels
def test_the_panels_library_says_why_it_is_missing(monkeypatch, fresh_native):
    from specdec_kernels import _native

    monkeypatch.setenv("CC", "no-such-compiler")
    assert _native.library() is None and "no C compiler: no-such-compiler" in _native.unavailable_reason()
    _native.library.cache_clear()
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert _native.library() is None and "compiling panels.c and attention.c with" in _native.unavailable_reason()
    _native.library.cache_clear()
    monkeypatch.delenv("CC")
    monkeypatch.setenv(_native.DISABLE_VARIABLE, "1")
    assert _native.library() is None and _native.DISABLE_VARIABLE in _native.unavailable_reason()


@needs_panels
def test_a_corrupt_cached_panels_library_is_built_again(fresh_native):
    from specdec_kernels import _native

    path, _ = _native.library_path()
    assert path.parent == fresh_native
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")  # as a write cut short might leave it
    assert _native.library() is not None, _native.unavailable_reason()
    assert path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.skipif(not bfloat16_matmuls_available(), reason="no native bfloat16 matmul here")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 65, 130])
def test_the_bfloat16_form_is_the_product_of_the_rounded_operands(rows):
    """`BFLOAT16_PLAN` computes with a bfloat16 copy of the weight: the product of the operands
    rounded to bfloat16 (float64 here), rounded once more, and returned in float32; not float32's
    product. The float32 weight itself is kept."""
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(97, 33).requires_grad_(False)
    layer.weight.copy_(torch.randn(33, 97, generator=gen))
    weight = layer.weight.detach().clone()
    layer.pack(BFLOAT16_PLAN)
    assert torch.equal(layer.weight, weight) and layer.weight.dtype == torch.float32
    x = torch.randn(rows, 1, 97, generator=gen)
    out = layer(x)
    assert out.shape == (rows, 1, 33) and out.dtype == torch.float32
    rounded = x.bfloat16().double() @ weight.bfloat16().double().T
    torch.testing.assert_close(out.double(), rounded.bfloat16().double(), rtol=2 ** -7, atol=1e-6)
    if rows:
        assert not torch.allclose(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 2 * 97, generator=gen)[:, ::2]  # not contiguous
    torch.testing.assert_close(layer(strided), F.linear(strided.bfloat16(), weight.bfloat16()).float())


def logits_after_prefill(models, ids: torch.Tensor, prefill: int, q_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Each model's logits for ``ids[:, prefill:]`` (ragged ``q_seqlens``) after a prefill of
    the first ``prefill`` tokens, in a cache of its own."""
    logits = []
    with torch.inference_mode():
        for m in models:
            cache = m.new_cache(*ids.shape)
            m(ids[:, :prefill], cache)
            logits.append(m(ids[:, prefill:], cache, q_seqlens))
    return logits


@needs_mkl
@pytest.mark.parametrize("B, T", [(1, 1), (1, 3), (2, 2), (3, 5), (8, 1), (4, 17)])
def test_packed_weights_give_the_unpacked_results(B, T):
    model = tiny_llama(seed=1)
    packed = tiny_llama(seed=1).pack_weights(plan=MKL_PACKED_PLAN)
    ids = torch.randint(0, 97, (B, 6 + T), generator=torch.Generator().manual_seed(B * T))
    q_seqlens = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(T))
    logits = logits_after_prefill((model, packed), ids, 6, q_seqlens)
    with torch.inference_mode():
        # Every matmul (2 layers x 4, plus the head) is packed from 2 rows on; one row runs F.linear.
        assert mkl_linear_calls(lambda: packed(ids[:, :T], packed.new_cache(B, T))) == (9 if B * T >= 2 else 0)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packing_stores_weights_input_major_and_unpacking_row_major():
    model, unpacked = tiny_llama(seed=5, tie_word_embeddings=True), tiny_llama(seed=5, tie_word_embeddings=True)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    model.pack_weights(plan=MKL_PACKED_PLAN)
    assert all(m.weight.t().is_contiguous() for m in layers)
    assert model.output.weight is model.tok_embeddings.weight  # still tied: one parameter, stored anew
    state, unpacked_state = model.state_dict(), unpacked.state_dict()
    assert all(torch.equal(state[name], unpacked_state[name]) for name in unpacked_state)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        logits = []
        for m in (model, unpacked):
            cache = m.new_cache(1, 7)
            m(ids[:, :6], cache)
            logits.append(m(ids[:, 6:], cache))  # one row: F.linear on the input-major weights
        assert mkl_linear_calls(lambda: model(ids[:, :1], model.new_cache(1, 1))) == 0
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    model.pack_weights(False)
    assert all(m.weight.is_contiguous() for m in layers)
    assert model.output.weight is model.tok_embeddings.weight


@needs_mkl
def test_packed_weights_follow_weight_changes_and_stay_out_of_the_state_dict():
    model = tiny_llama(seed=2)
    keys = set(model.state_dict())
    draft = model.pack_weights(plan=MKL_PACKED_PLAN).truncated(1)
    assert set(model.state_dict()) == keys
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    layer = model.layers[0].attention.wqkv
    with torch.inference_mode():
        assert mkl_linear_calls(lambda: draft.layers[0].attention.wqkv(x)) == 1  # the draft shares the copies
        with torch.no_grad():
            layer.weight.mul_(2)  # in place: a stale copy would give half the product
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        model.load_state_dict(tiny_llama(seed=3).state_dict())
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))  # replaced
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        model.pack_weights(False)
        assert mkl_linear_calls(lambda: layer(x)) == 0


@needs_mkl
def test_packed_linear_refuses_a_wrong_input_width_and_drops_its_copy_when_moved():
    layer = Linear(24, 40).requires_grad_(False)
    layer.pack()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # as F.linear says it
        layer(torch.randn(4, 20))  # MKL's op itself would read past the input
    layer.to(torch.float64)
    assert layer.packing and not layer._packed  # the float32 copy is not kept alive
    layer.float()
    x = torch.randn(5, 24)
    assert mkl_linear_calls(lambda: layer(x)) == 1  # packed anew at its first use
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_copies_of_a_packed_model_pack_their_own_weights():
    import copy
    import io

    model = tiny_llama(seed=4).pack_weights(plan=MKL_PACKED_PLAN)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # MKL's buffer itself cannot be pickled or copied
    buffer.seek(0)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(ids, model.new_cache(2, 5))
        for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            assert twin.output.packing
            assert mkl_linear_calls(lambda twin=twin: twin(ids, twin.new_cache(2, 5))) == 9
            assert torch.equal(twin(ids, twin.new_cache(2, 5)), expected)


@needs_mkl
def test_a_packed_model_unpickled_without_mkl_runs_unpacked(monkeypatch):
    import io

    buffers = [io.BytesIO(), io.BytesIO()]
    torch.save(tiny_llama().pack_weights(plan=MKL_PACKED_PLAN), buffers[0])
    torch.save(tiny_llama().pack_weights(plan=WEIGHT_FIRST_PLAN), buffers[1])
    without_packed_forms(monkeypatch)
    model, other = (torch.load(io.BytesIO(b.getvalue()), weights_only=False) for b in buffers)
    assert not model.output.packing and model.output.weight.is_contiguous()  # row-major again
    assert other.output.plan == WEIGHT_FIRST_PLAN  # needs no MKL
    ids = torch.randint(0, 97, (2, 5))
    with torch.inference_mode():
        assert mkl_linear_calls(lambda: model(ids, model.new_cache(2, 5))) == 0


@needs_mkl
def test_packed_weights_keep_autograd_and_other_dtypes_on_the_plain_path():
    layer = Linear(64, 32)
    layer.pack()
    x = torch.randn(6, 64, requires_grad=True)
    out = layer(x)  # grad mode: the packed GEMM has no backward, so it is not used
    out.sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(6, 64))
    assert layer.weight.grad is not None
    layer.requires_grad_(False)  # nothing needs a gradient: packed even in grad mode
    assert mkl_linear_calls(lambda: layer(x.detach())) == 1
    layer.requires_grad_(True)
    with torch.inference_mode():
        made_here = Linear(64, 32)  # an inference tensor has no version counter
        made_here.pack()
        torch.testing.assert_close(made_here(x), F.linear(x, made_here.weight), rtol=1e-5, atol=1e-5)
        half = Linear(64, 32).to(torch.bfloat16)
        with pytest.raises(ValueError, match="CPU float32 weight"):
            half.pack()
        with pytest.raises(ValueError, match="CPU float32 weight"):
            tiny_llama().to(torch.float16).pack_weights()
        model = tiny_llama()
        model.output.to(torch.float16)
        with pytest.raises(ValueError, match="output: packing needs a CPU float32 weight"):
            model.pack_weights()
        assert not any(isinstance(m, Linear) and m.packing for m in model.modules())  # all or nothing
        layer = layer.to(torch.float64)  # a packed layer cast afterwards runs unpacked
        assert mkl_linear_calls(lambda: layer(x.detach().double())) == 0


def without_packed_forms(monkeypatch) -> None:
    """Make this torch build look as if it had neither MKL's nor oneDNN's packed matmuls."""
    import dataclasses

    from specdec_kernels import matmul

    for name, form in matmul.PACKED_FORMS.items():
        monkeypatch.setitem(matmul.PACKED_FORMS, name, dataclasses.replace(form, available=lambda: False))


def test_can_pack_weights_says_whether_pack_weights_would_pack(monkeypatch):
    model = tiny_llama()
    assert model.can_pack_weights()
    model.output.to(torch.float16)  # one weight that cannot be prepared
    assert not model.can_pack_weights()
    without_packed_forms(monkeypatch)
    assert tiny_llama().can_pack_weights()  # a measured plan then leaves the packed forms out
    with pytest.raises(RuntimeError, match="the 'mkl_packed' form is not available on this machine"):
        tiny_llama().pack_weights(plan=MKL_PACKED_PLAN)
    assert not measure_matmul_plan([torch.randn(8, 4)], row_counts=(1, 2), repeats=1).packed_forms


def test_pack_weights_in_another_thread_while_generate_runs_leaves_the_tokens_unchanged():
    """A layout change re-stores each weight in place: a forward running meanwhile in another
    thread read weights half re-stored (logits off by up to 1e36). Forwards and layout changes
    now take turns (`WeightsLock`), so the tokens are those of either layout alone."""
    import threading

    from specdec_kernels import generate

    model = tiny_llama(seed=2, scale=4.0, hidden=256)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    input_major = MatmulPlan(input_major=True, forms=((1, "linear"),))  # a layout change on every build
    expected = generate(model, ids, max_new_tokens=32, temperature=0).tokens
    assert torch.equal(generate(model.pack_weights(plan=input_major), ids, max_new_tokens=32, temperature=0).tokens,
                       expected)
    stop, errors, changes = threading.Event(), [], []

    def change_layouts():
        try:
            while not stop.is_set():
                model.pack_weights(False).pack_weights(plan=input_major)
                changes.append(2)
        except Exception as e:  # raised in the main thread below
            errors.append(e)

    thread = threading.Thread(target=change_layouts)
    thread.start()
    try:
        outputs = [generate(model, ids, max_new_tokens=32, temperature=0).tokens for _ in range(3)]
    finally:
        stop.set()
        thread.join()
    assert not errors and changes
    for tokens in outputs:
        assert torch.equal(tokens, expected)


def test_weights_lock_is_shared_by_forwards_and_exclusive_for_layout_changes():
    import threading

    from specdec_kernels.model import WeightsLock

    lock, entered, release = WeightsLock(), [], threading.Event()

    def hold(kind):
        with getattr(lock, kind)():
            entered.append(kind)
            release.wait(10)

    first = threading.Thread(target=hold, args=("shared",))
    first.start()
    while not entered:
        threading.Event().wait(0.001)
    with lock.shared():  # a second forward does not wait for the first
        pass
    change = threading.Thread(target=hold, args=("exclusive",))
    change.start()
    change.join(0.2)
    assert entered == ["shared"]  # the layout change waits for the running forward
    release.set()
    change.join(10)
    first.join(10)
    assert entered == ["shared", "exclusive"]
    with lock.exclusive(), lock.exclusive(), lock.shared():  # the thread that holds it may take it again
        pass
    with lock.shared(), pytest.raises(RuntimeError, match="cannot change inside a forward pass"):
        with lock.exclusive():
            pass


def test_copies_get_their_own_weights_lock_and_drafts_share_their_models():
    import copy
    import io

    model = tiny_llama()
    draft = model.truncated(1)
    assert draft.weights_lock is model.weights_lock  # the draft's layers are the model's
    model_copy, draft_copy = copy.deepcopy((model, draft))
    assert model_copy.weights_lock is draft_copy.weights_lock and model_copy.weights_lock is not model.weights_lock
    del model.__dict__["weights_lock"]  # as pickled before models had one
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ids = torch.tensor([[1, 2, 3]])
    assert loaded.weights_lock is not model_copy.weights_lock
    torch.testing.assert_close(loaded(ids, loaded.new_cache(1, 3)), model_copy(ids, model_copy.new_cache(1, 3)))


WEIGHT_FIRST_PLAN = MatmulPlan(input_major=False, forms=((1, "weight_first"), (65, "linear")))
ONEDNN_PLAN = MatmulPlan(input_major=False, forms=((1, "weight_first"), (4, "onednn_packed")))
PLANS = [pytest.param(MKL_PACKED_PLAN, id="mkl-packed", marks=needs_mkl),
         pytest.param(ONEDNN_PLAN, id="onednn-packed", marks=needs_onednn),
         pytest.param(MatmulPlan(input_major=True, forms=((1, "mkl_packed"), (3, "onednn_packed"))),
                      id="both-packed-input-major", marks=[needs_mkl, needs_onednn]),
         pytest.param(MatmulPlan(input_major=False, forms=((1, "panels"), (16, "mkl_packed"))), id="panels",
                      marks=[needs_panels, needs_mkl]),
         pytest.param(WEIGHT_FIRST_PLAN, id="weight-first"),
         pytest.param(MatmulPlan(input_major=True, forms=((1, "linear"), (3, "weight_first"))), id="input-major-mixed"),
         pytest.param(None, id="measured")]


# The op each form runs, as torch.profiler names it.
FORM_OPS = {"linear": "aten::linear", "weight_first": "aten::mm", "mkl_packed": "mkl::_mkl_linear",
            "onednn_packed": "mkldnn::_linear_pointwise", "panels": "panels"}


@pytest.fixture
def plans_in_tmp_path(monkeypatch, tmp_path):
    """Measured plans kept in ``tmp_path`` (not the user's cache folder), and none yet in this process."""
    from specdec_kernels import matmul

    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul, "_MEASURED", {})
    return tmp_path / "matmul_plans.json"


@pytest.mark.usefixtures("plans_in_tmp_path")
@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_gives_the_unprepared_logits(plan, monkeypatch):
    """Whatever plan `pack_weights` applies (or measures), a ragged batch's logits are those of
    the model as loaded, at one row, a few and more than 64, each matmul (2 layers x 4, and the
    head) runs the plan's form for its row count, and the weights keep their values."""
    model, prepared = tiny_llama(seed=6), tiny_llama(seed=6).pack_weights(plan=plan)
    plan = prepared.output.plan
    assert isinstance(plan, MatmulPlan) and all(m.plan is plan for m in prepared.modules() if isinstance(m, Linear))
    state = prepared.state_dict()
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    gen = torch.Generator().manual_seed(6)
    panels = panels_calls(monkeypatch) if panels_available() else []
    for B, T in ((1, 1), (3, 2), (9, 8)):
        ids = torch.randint(0, 97, (B, 4 + T), generator=gen)
        q_seqlens = torch.randint(1, T + 1, (B,), generator=gen)
        logits = logits_after_prefill((model, prepared), ids, 4, q_seqlens)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        panels.clear()
        with torch.inference_mode(), torch.profiler.profile() as prof:
            prepared(ids[:, :T], prepared.new_cache(B, T))  # B * T rows through every matmul
        counts = {e.key: e.count for e in prof.key_averages()}
        counts["panels"] = len(panels)  # our own kernel: no op the profiler sees
        form = plan.form(B * T)
        assert counts.get(FORM_OPS[form]) == 9, (form, counts)
        assert not any(counts.get(FORM_OPS[other]) for other in PACKED_FORMS if other != form), counts


def test_matmul_plan_forms_and_validation():
    plan = MatmulPlan(input_major=False, forms=((1, "weight_first"), (4, "onednn_packed"), (65, "linear"),
                                                (100, "mkl_packed"), (200, "onednn_packed")))
    assert [plan.form(rows) for rows in (0, 1, 3, 4, 64, 65, 99, 100, 1000)] == [
        "weight_first", "weight_first", "weight_first", "onednn_packed", "onednn_packed", "linear", "linear",
        "mkl_packed", "onednn_packed"]
    assert plan.packed_forms == ("onednn_packed", "mkl_packed") and not WEIGHT_FIRST_PLAN.packed_forms
    assert BFLOAT16_PLAN.packed_forms == ("onednn_bfloat16",)  # a rounded form: valid in a plan, never measured
    with pytest.raises(ValueError, match="plan must run forms of"):  # nor applied to a whole model
        tiny_llama().pack_weights(plan=BFLOAT16_PLAN)
    with pytest.raises(ValueError, match=r"seconds\[1\] must time forms of"):
        choose_matmul_plan({1: {(False, "linear"): 1.0, (True, "linear"): 1.0, (None, "onednn_bfloat16"): 0.5}})
    assert plan.describe() == ("row-major weights; 1-3 rows: weight_first, 4-64 rows: onednn_packed, 65-99 rows: "
                               "linear, 100-199 rows: mkl_packed, 200+ rows: onednn_packed")
    assert MKL_PACKED_PLAN.describe() == "input-major weights; 1 row: linear, 2+ rows: mkl_packed"
    assert MatmulPlan(input_major=False, forms=[[1, "linear"]]) == MatmulPlan(False, ((1, "linear"),))  # tuples
    for forms in ((), ((2, "linear"),), ((1, "linear"), (1, "mkl_packed")), ((1, "linear"), (3, "gemv")),
                  ((1, "linear"), (5, "mkl_packed"), (3, "linear")), ((1.0, "linear"),), (("1", "linear"),),
                  (1, 2)):
        with pytest.raises(ValueError, match="forms|form must be one of"):
            MatmulPlan(input_major=False, forms=forms)
    with pytest.raises(ValueError, match="input_major must be a bool"):
        MatmulPlan(input_major=1, forms=((1, "linear"),))
    with pytest.raises(ValueError, match="plan must be a MatmulPlan or None"):
        tiny_llama().pack_weights(plan="weight_first")
    with pytest.raises(ValueError, match="plan must be None with enable=False"):
        tiny_llama().pack_weights(False, plan=WEIGHT_FIRST_PLAN)


def test_choose_matmul_plan_follows_the_measured_times():
    """The measurements of two machines (ms, SmolLM2's weights): one where MKL's packed GEMM wins
    from 2 rows and one row is fastest from input-major weights, one where ``weight @ x^T`` from
    row-major weights wins everywhere."""
    def times(rows_linear, rows_weight_first, inputs_linear, mkl, onednn):
        return {(False, "linear"): rows_linear, (False, "weight_first"): rows_weight_first,
                (True, "linear"): inputs_linear, (None, "mkl_packed"): mkl, (None, "onednn_packed"): onednn}

    mkl_machine = {1: times(33.5, 45.0, 27.7, 33.0, 40.0), 2: times(34.0, 50.0, 60.0, 33.0, 40.0),
                   8: times(60.0, 52.0, 70.0, 40.0, 45.0), 64: times(150.0, 140.0, 160.0, 100.0, 120.0)}
    assert choose_matmul_plan(mkl_machine) == MKL_PACKED_PLAN
    amd_machine = {1: times(45.9, 21.7, 31.9, 33.2, 24.0), 2: times(76.5, 20.7, 48.8, 55.0, 27.4),
                   8: times(61.1, 41.8, 67.9, 71.0, 23.5), 64: times(141.9, 122.3, 151.1, 151.8, 88.7)}
    assert choose_matmul_plan(amd_machine) == MatmulPlan(input_major=False,
                                                         forms=((1, "weight_first"), (8, "onednn_packed")))
    unpacked = {rows: {k: v for k, v in t.items() if k[0] is not None} for rows, t in mkl_machine.items()}
    assert choose_matmul_plan(unpacked) == MatmulPlan(input_major=False, forms=((1, "linear"), (8, "weight_first")))
    # Input-major by less than the margin: the weights stay as loaded.
    close = {1: times(30.0, 45.0, 29.0, 40.0, 40.0), 8: times(50.0, 52.0, 70.0, 40.0, 45.0)}
    assert choose_matmul_plan(close) == MatmulPlan(input_major=False, forms=((1, "linear"), (8, "mkl_packed")))
    for bad in ({}, {2: times(1, 1, 1, 1, 1)}, {1.0: times(1, 1, 1, 1, 1)}, {1: {(False, "linear"): 1.0}},
                {1: times(0.0, 1, 1, 1, 1)}):
        with pytest.raises(ValueError, match="seconds"):
            choose_matmul_plan(bad)


def test_measure_matmul_plan_checks_its_arguments():
    for bad in ([], [torch.randn(4, 4, dtype=torch.float64)], [torch.randn(4)]):
        with pytest.raises(ValueError, match="weights must"):
            measure_matmul_plan(bad)
    for counts in ((), (2, 4), (1, 4, 2), (1, 1)):
        with pytest.raises(ValueError, match="row_counts must"):
            measure_matmul_plan([torch.randn(4, 4)], row_counts=counts)
    with pytest.raises(ValueError, match="repeats must"):
        measure_matmul_plan([torch.randn(4, 4)], repeats=0)
    with pytest.raises(ValueError, match=r"weights\[1\]: torch.float32 \(4, 4\) on meta"):
        measure_matmul_plan([torch.randn(4, 4), torch.randn(4, 4, device="meta")])


def test_measure_matmul_plan_times_every_candidate_at_every_row_count(monkeypatch):
    from specdec_kernels import matmul

    measured = []
    monkeypatch.setattr(matmul, "choose_matmul_plan", lambda seconds: measured.append(seconds) or WEIGHT_FIRST_PLAN)
    plan = measure_matmul_plan([torch.randn(8, 4), torch.randn(4, 8)], row_counts=(1, 3), repeats=1)
    assert plan is WEIGHT_FIRST_PLAN
    (seconds,) = measured
    packed = {(None, name) for name, form in PACKED_FORMS.items() if form.available()}
    assert list(seconds) == [1, 3]
    for times in seconds.values():
        assert set(times) == {(False, "linear"), (False, "weight_first"), (True, "linear")} | packed
        assert all(t > 0 for t in times.values())


def test_a_linear_pickled_before_plans_loads_with_the_mkl_plan():
    layer = Linear(8, 4)
    state = {k: v for k, v in layer.__getstate__().items() if k != "plan"}
    for packing, plan in ((True, MKL_PACKED_PLAN), (False, None)):
        old = Linear.__new__(Linear)
        old.__setstate__({**state, "packing": packing, "_packed": None})
        assert old.plan == plan and old._packed == {} and "packing" not in old.__dict__


@pytest.mark.parametrize("dim", [96, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_hugging_face_arithmetic(dtype, dim):
    # Hugging Face's LlamaRMSNorm: normalize in fp32, cast to the input dtype, then scale.
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(dim, eps=1e-5).to(dtype)
    for _ in range(20):
        norm.weight.data = torch.randn(dim, generator=gen).to(dtype)
        x = (torch.randn(3, 2, dim, generator=gen) * 4).to(dtype)
        x32 = x.float()
        expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        out = norm(x)
        assert out.dtype == dtype
        # The same ops in the same order (F.rms_norm runs them inside on the CPU in fp32): equal
        # to the bit. Rounding once after the weight, as a fused op does, changes about a
        # quarter of the half-precision entries.
        assert torch.equal(out, expected)


def test_a_call_slowed_in_some_passes_does_not_decide_the_plan():
    """Each call counts at its fastest pass. ``weight_first`` is the quiet machine's fastest at one
    row, but a load slowed one of its three calls in every pass (a different one each time); the
    minimum over whole passes would pick ``F.linear``, which ran undisturbed at twice the time."""
    disturbed = [[5.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 5.0]]  # ms per call, one list per pass
    passes = {1: {(False, "linear"): [[2.0, 2.0, 2.0]] * 3, (False, "weight_first"): disturbed,
                  (True, "linear"): [[3.0, 3.0, 3.0]] * 3}}
    whole_passes = {1: {key: min(map(sum, timed)) for key, timed in passes[1].items()}}
    fastest = {1: {key: fastest_calls(timed) for key, timed in passes[1].items()}}
    assert choose_matmul_plan(whole_passes) == MatmulPlan(input_major=False, forms=((1, "linear"),))
    assert fastest[1][(False, "weight_first")] == 3.0
    assert choose_matmul_plan(fastest) == MatmulPlan(input_major=False, forms=((1, "weight_first"),))
    assert fastest_calls([[2.0, 7.0]]) == 9.0
    for bad in ([], [[1.0, 2.0], [1.0]]):
        with pytest.raises(ValueError, match="passes must"):
            fastest_calls(bad)


def stub_measurement(monkeypatch, plan: MatmulPlan, elsewhere: list[float | None]) -> list:
    """`measure_matmul_plan` returns ``plan`` (and logs its weights' shapes); `cpu_seconds_elsewhere`
    returns the values of ``elsewhere`` in turn: a measurement is quiet when its two readings are equal."""
    from specdec_kernels import matmul

    measured, readings = [], iter(elsewhere)
    monkeypatch.setattr(matmul, "measure_matmul_plan", lambda ws: measured.append([w.shape for w in ws]) or plan)
    monkeypatch.setattr(matmul, "cpu_seconds_elsewhere", lambda: next(readings))
    return measured


def test_a_plan_measured_on_a_quiet_machine_is_stored_for_later_processes(monkeypatch, plans_in_tmp_path):
    from specdec_kernels import matmul

    weights = [torch.randn(8, 4), torch.randn(4, 8)]
    measured = stub_measurement(monkeypatch, ONEDNN_PLAN, [5.0, 5.0])
    assert matmul.plans_file() == plans_in_tmp_path
    assert matmul.measured_matmul_plan(weights) == ONEDNN_PLAN and len(measured) == 1
    assert matmul.measured_matmul_plan(weights) == ONEDNN_PLAN and len(measured) == 1  # once per process
    monkeypatch.setattr(matmul, "_MEASURED", {})  # a later process, with a machine as loaded as may be
    measured = stub_measurement(monkeypatch, WEIGHT_FIRST_PLAN, [0.0, 1e6])
    assert matmul.measured_matmul_plan(weights) == ONEDNN_PLAN and not measured
    model = tiny_llama(seed=2)
    stub_measurement(monkeypatch, ONEDNN_PLAN, [5.0, 5.0])
    model.pack_weights()
    monkeypatch.setattr(matmul, "_MEASURED", {})
    measured = stub_measurement(monkeypatch, WEIGHT_FIRST_PLAN, [0.0, 1e6])
    assert tiny_llama(seed=2).pack_weights().output.plan == ONEDNN_PLAN and not measured
    # Other shapes, or another number of threads: measured anew.
    stub_measurement(monkeypatch, WEIGHT_FIRST_PLAN, [5.0, 5.0])
    assert matmul.measured_matmul_plan(weights[:1]) == WEIGHT_FIRST_PLAN
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        stub_measurement(monkeypatch, MKL_PACKED_PLAN, [5.0, 5.0])
        assert matmul.measured_matmul_plan(weights) == MKL_PACKED_PLAN
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("elsewhere", [[0.0, 10.0], [None, None], [0.0, None]],
                         ids=["loaded", "unknown", "unknown-after"])
def test_a_plan_measured_under_load_serves_only_its_process(monkeypatch, plans_in_tmp_path, elsewhere):
    """Another process used the CPU while the plan was measured (10 CPU seconds within a
    measurement of a few milliseconds), or that cannot be told: the plan is not stored."""
    from specdec_kernels import matmul

    weights = [torch.randn(8, 4)]
    measured = stub_measurement(monkeypatch, WEIGHT_FIRST_PLAN, elsewhere)
    assert matmul.measured_matmul_plan(weights) == WEIGHT_FIRST_PLAN and len(measured) == 1
    assert not plans_in_tmp_path.exists()
    monkeypatch.setattr(matmul, "_MEASURED", {})  # a later process measures again, and stores on a quiet machine
    measured = stub_measurement(monkeypatch, ONEDNN_PLAN, [1.0, 1.0])
    assert matmul.measured_matmul_plan(weights) == ONEDNN_PLAN and len(measured) == 1
    assert plans_in_tmp_path.exists()


@pytest.mark.parametrize("content", ["not json", "[1, 2]", "{KEY: 3}",
                                     '{KEY: {"input_major": false, "forms": [[2, "linear"]]}}',
                                     '{KEY: {"input_major": false, "forms": [[1, "onednn_bfloat16"]]}}'],
                         ids=["not-json", "not-a-dict", "not-a-plan", "bad-forms", "rounded-form"])
def test_an_unreadable_plans_file_is_measured_over(monkeypatch, plans_in_tmp_path, content):
    import json

    from specdec_kernels import matmul

    weights = [torch.randn(8, 4)]
    plans_in_tmp_path.write_text(content.replace("KEY", json.dumps(matmul._plan_key(weights))))
    measured = stub_measurement(monkeypatch, ONEDNN_PLAN, [1.0, 1.0])
    assert matmul.measured_matmul_plan(weights) == ONEDNN_PLAN and len(measured) == 1
    monkeypatch.setattr(matmul, "_MEASURED", {})
    stub_measurement(monkeypatch, WEIGHT_FIRST_PLAN, [1.0, 1.0])
    assert matmul.measured_matmul_plan(weights) == ONEDNN_PLAN  # stored over the bad content


def test_a_plans_folder_that_cannot_be_written_leaves_the_plan_to_its_process(monkeypatch, tmp_path):
    from specdec_kernels import matmul

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(blocker / "cache"))  # below a file: cannot be made
    monkeypatch.setattr(matmul, "_MEASURED", {})
    stub_measurement(monkeypatch, ONEDNN_PLAN, [1.0, 1.0])
    assert matmul.measured_matmul_plan([torch.randn(8, 4)]) == ONEDNN_PLAN
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(cpu_seconds_elsewhere() is None, reason="needs /proc/stat (Linux)")
def test_cpu_seconds_elsewhere_counts_other_processes(monkeypatch):
    import resource
    import subprocess
    import sys

    from specdec_kernels import matmul

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = cpu_seconds_elsewhere()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                    "while time.process_time() < end: pass"], check=True)
    after = cpu_seconds_elsewhere()
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = now.ru_utime + now.ru_stime - children.ru_utime - children.ru_stime
    assert child >= 0.5 and after - before >= child - 0.05  # clock ticks: 10 ms apart
    monkeypatch.setattr(matmul, "open", lambda *args: open("/nonexistent/stat"), raising=False)
    assert cpu_seconds_elsewhere() is None


def test_a_windowed_model_saves_as_mistral(tmp_path):
    """A model with a sliding window saves as a Mistral config (transformers' Llama would attend to
    every position) and loads back with its window; a Llama config's stray sliding_window field
    is ignored, as transformers' Llama ignores it."""
    config = tiny_llama(seed=0, sliding_window=8).config
    Llama(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "mistral" and saved["architectures"] == ["MistralForCausalLM"]
    assert Llama.from_pretrained(tmp_path).config.sliding_window == 8
    assert transformers.AutoConfig.from_pretrained(tmp_path).sliding_window == 8
    assert LlamaConfig.from_hf({**saved, "model_type": "llama"}).sliding_window is None
