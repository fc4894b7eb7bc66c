"""Where a decode step of the built-in model spends its time, on SmolLM2-135M's shapes.

- ``test_matmuls``: one pass over the weights of every layer plus the LM head (what a forward's
  matmuls read), for ``rows`` = B * T activation rows, in each form `Llama.pack_weights` chooses
  from (`specdec_kernels.matmul`): ``weight_first`` (``weight @ x^T`` from row-major weights, one
  row duplicated to two; also what `specdec_kernels.matmul.linear` runs for 4 to 63 rows without
  a plan), ``F.linear`` from row-major weights (what that runs for 1 to 3 rows and for 64 or more:
  102 and 816 rows are the generation benchmark's batch-1 and batch-8 prompts, padded) and from
  input-major ones (``F.linear_input_major``), and MKL's and oneDNN's matmuls from weights packed
  once (``mkl_packed``, ``onednn_packed``).
- ``test_rms_norm``: ``F.rms_norm`` (what `RMSNorm` runs in fp32; a composite of about ten ops
  on the CPU) against Hugging Face's LlamaRMSNorm ops spelled out (``pow``, ``mean``, ``add``,
  ``rsqrt``, two ``mul``), at 1 and 8 rows (decoding) and 816 (a batch-8 prefill of 102 tokens).
- ``test_decode_step``: one decode step (B = 1 or 8, T = 1, 80 tokens cached) of a random-weight
  model with SmolLM2-135M's config, in a cache of 160 or 2048 positions, the latter also with
  ``max_seqlen`` (what the generation loops pass: attention then reads 81 positions, not 2048),
  with the weights as loaded and prepared (``Llama.pack_weights``, its plan in ``extra_info``);
  ``extra_info["aten_ops"]`` counts the ATen ops it dispatches (``torch.profiler``).

Random weights: the shapes, not the values, set the cost, and nothing needs downloading.

    SPECDEC_BENCH_THREADS=2 python -m pytest benchmarks/test_bench_model.py --benchmark-group-by=group
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.timing import bench
from specdec_kernels import Llama, LlamaConfig
from specdec_kernels.matmul import PACKED_FORMS, weight_first

pytestmark = pytest.mark.usefixtures("pinned_torch_threads")
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True)


def smollm2_weights() -> list[torch.Tensor]:
    """[out, in] weights of every matmul of one SmolLM2-135M forward: fused qkv, o, fused gate/up,
    down per layer, then the LM head."""
    c, gen = SMOLLM2, torch.Generator().manual_seed(0)
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    shapes = [(qkv, c.hidden_size), (c.hidden_size, c.num_attention_heads * c.head_dim),
              (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    weights = [torch.randn(shape, generator=gen) for _ in range(c.num_hidden_layers) for shape in shapes]
    return weights + [torch.randn(c.vocab_size, c.hidden_size, generator=gen)]


@pytest.fixture(scope="module")
def weights():
    return smollm2_weights()


# impl is the top decorator, so it varies fastest: the forms of one row count run one after
# another (the shared machine's load drifts over minutes).
@pytest.mark.parametrize("impl", ["weight_first", "F.linear", "F.linear_input_major", "mkl_packed", "onednn_packed",
                                  "panels"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 40, 64, 102, 816])
def test_matmuls(benchmark, weights, impl, rows):
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    # Same product, summed in another order (entries are sums of 576 unit-variance terms, ~24).
    torch.testing.assert_close(weight_first(inputs[576], weights[0]), F.linear(inputs[576], weights[0]),
                               rtol=1e-5, atol=1e-4)
    if impl in PACKED_FORMS:  # packed here, under the benchmark's thread count, as `Linear.pack` does
        form = PACKED_FORMS[impl]
        if not form.available():
            pytest.skip(f"this torch build has no {impl}")
        packed = [form.pack(w) for w in weights]
        torch.testing.assert_close(form.run(inputs[576], packed[0], weights[0]), F.linear(inputs[576], weights[0]),
                                   rtol=1e-5, atol=1e-4)

        def one_pass():
            for w, p in zip(weights, packed, strict=True):
                form.run(inputs[w.shape[1]], p, w)
    else:
        matmul = weight_first if impl == "weight_first" else F.linear
        if impl == "F.linear_input_major":
            weights = [w.t().contiguous().t() for w in weights]

        def one_pass():
            for w in weights:
                matmul(inputs[w.shape[1]], w)

    benchmark.group = f"matmuls rows={rows}"
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    bench(benchmark, one_pass, rounds=5)


@pytest.mark.parametrize("rows", [1, 8, 816])
@pytest.mark.parametrize("impl", ["F.rms_norm", "hf_ops"])
@torch.inference_mode()
def test_rms_norm(benchmark, impl, rows):
    gen = torch.Generator().manual_seed(0)
    weight, eps = torch.randn(SMOLLM2.hidden_size, generator=gen), SMOLLM2.rms_norm_eps
    x = torch.randn(rows, 1, SMOLLM2.hidden_size, generator=gen)
    fused = lambda: F.rms_norm(x, weight.shape, weight, eps)
    hf_ops = lambda: weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    assert torch.equal(fused(), hf_ops())
    benchmark.group = f"rms_norm rows={rows}"
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    bench(benchmark, fused if impl == "F.rms_norm" else hf_ops, rounds=200)


@pytest.mark.parametrize("weights", ["unpacked", "packed"])
@pytest.mark.parametrize("capacity, bounded", [(160, False), (2048, False), (2048, True)],
                         ids=["capacity160", "capacity2048", "capacity2048-max_seqlen"])
@pytest.mark.parametrize("batch", [1, 8])
@torch.inference_mode()
def test_decode_step(benchmark, batch, capacity, bounded, weights):
    torch.manual_seed(0)
    model = Llama(SMOLLM2).eval()
    if weights == "packed":
        model.pack_weights()  # the plan for the benchmark's thread count: stored, or measured now
    cache = model.new_cache(batch, capacity)
    max_seqlen = 81 if bounded else None
    model(torch.randint(0, SMOLLM2.vocab_size, (batch, 80)), cache, max_seqlen=max_seqlen and 80)
    token, base = torch.full((batch, 1), 7), cache.lengths.clone()

    def step():
        cache.crop(base)
        model(token, cache, last_only=True, max_seqlen=max_seqlen)

    step()
    with torch.profiler.profile() as prof:
        step()
    benchmark.group = f"decode step B={batch} {capacity}{' max_seqlen' if bounded else ''}"
    if model.output.plan is not None:
        benchmark.extra_info["matmul_plan"] = model.output.plan.describe()
    benchmark.extra_info["aten_ops"] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    bench(benchmark, step, rounds=10)
