"""The compiled Triton kernels on CUDA tensors against the reference on the CPU.

The rest of the suite runs the kernels under the Triton interpreter on CPU tensors, on every
machine. These tests run instead when ``SPECDEC_CUDA_TESTS=1`` (interpreter off, see
``conftest.py``) on a machine with CUDA; ``.ci/run`` does that when torch sees a GPU::

    SPECDEC_CUDA_TESTS=1 python -m pytest tests/test_cuda.py
"""

import pytest
import torch
from test_attention import CASES as ATTENTION_CASES
from test_attention import make_inputs, reference_fp32
from test_lookahead import force_kinds, repetitive_prompts
from test_sampling import CASES as SAMPLER_CASES
from test_sampling import NO_TOKEN_OPS, _bad_row_inputs, _no_token_cases, make_case, noise_for

from specdec_kernels import (
    EarlyExitDraft,
    KVCache,
    PromptLookupDraft,
    first_rejection_index,
    generate,
    process_logits,
    ragged_attention,
    rejection_sample,
    rejection_sample_logits,
    speculative_generate,
    tree_rejection_sample,
)
from specdec_kernels._checks import DeviceCheckError
from specdec_kernels.sampling import make_rejection_noise
from specdec_kernels.testing import SyncCounter, assert_close

from tiny_models import V, greedy_divergence_allowed, ragged_prompts, tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# Top-p cases expect the reference's tokens exactly; the thresholds kernel sums top-p mass in another
# order (see `kernels/sampling.py`), which these seeded rows were checked against only under the
# interpreter. A failure there on a GPU: first check for a row within rounding of top_p.


def cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", ATTENTION_CASES)
@pytest.mark.parametrize("split", ["auto", "nosplit", "split"])
def test_attention_matches_reference(split, B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    args = cuda(q, k, v, cache_seqlens, q_seqlens)
    if split == "auto":
        out = ragged_attention(*args, backend="triton")
    else:  # one program per row, or many splits merged by log-sum-exp
        from specdec_kernels.kernels.attention import ragged_attention_triton

        kwargs = dict(max_splits=1) if split == "nosplit" else dict(max_splits=16, min_chunk=16)
        out = ragged_attention_triton(*args, D ** -0.5, **kwargs)
    assert out.is_cuda and out.dtype == dtype
    assert_close(out.cpu(), reference_fp32(q, k, v, cache_seqlens, q_seqlens), dtype)


@pytest.mark.parametrize("B,T,G,Hkv,D,Lmax,lengths,q_lens,dtype", ATTENTION_CASES)
def test_torch_attention_path_on_cuda_matches_reference(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype):
    # The CPU path is written for any device: its masks and zeroed-copy GEMMs on CUDA tensors, sync-free.
    q, k, v, cache_seqlens, q_seqlens = make_inputs(B, T, G, Hkv, D, Lmax, lengths, q_lens, dtype)
    args = cuda(q, k, v, cache_seqlens, q_seqlens)
    ragged_attention(*args, backend="torch")  # warm-up: first calls may synchronize to allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # CUDA's own detector, inside torch's ops too
    try:
        with SyncCounter() as syncs:
            out = ragged_attention(*args, backend="torch")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert syncs.count == 0, syncs.events
    assert out.is_cuda and out.dtype == dtype
    assert_close(out.cpu(), reference_fp32(q, k, v, cache_seqlens, q_seqlens), dtype)


def test_attention_and_cache_append_are_sync_free():
    B, T, Hkv, D = 3, 5, 2, 64
    cache = KVCache(1, B, 64, Hkv, D, dtype=torch.float16, device="cuda")
    cache.advance(torch.tensor([3, 10, 0], device="cuda"))
    k_new, v_new, q = (torch.randn(B, T, h, D, device="cuda", dtype=torch.float16) for h in (Hkv, Hkv, 3 * Hkv))
    q_seqlens = torch.tensor([5, 1, 3], device="cuda")
    with SyncCounter() as syncs:
        cache.append(0, k_new, v_new, q_seqlens)
        ragged_attention(q, cache.k[0], cache.v[0], cache.lengths + q_seqlens, q_seqlens)
    assert syncs.count == 0, syncs.events


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_append_matches_torch_path(dtype):
    B, T, Hkv, D, L = 4, 5, 3, 80, 40
    lengths = torch.tensor([0, 7, 35, 20])
    q_seqlens = torch.tensor([5, 1, 5, 0])
    k_new, v_new = (torch.randn(B, T, Hkv, D).to(dtype) for _ in range(2))
    caches = {}
    for device, backend in (("cpu", "torch"), ("cuda", "triton")):
        cache = KVCache(2, B, L, Hkv, D, dtype=dtype, device=device)
        cache.k[1].zero_()
        cache.v[1].zero_()
        cache.advance(lengths.to(device))
        cache.append(1, k_new.to(device), v_new.to(device), q_seqlens.to(device), backend=backend)
        caches[device] = cache
    assert torch.equal(caches["cuda"].k[1].cpu(), caches["cpu"].k[1])
    assert torch.equal(caches["cuda"].v[1].cpu(), caches["cpu"].v[1])


@pytest.mark.parametrize("B,K,V,dtype,draft,ragged,greedy", SAMPLER_CASES)
def test_rejection_sample_matches_reference(B, K, V, dtype, draft, ragged, greedy):
    p, q, ids, n, g, noise = make_case(B, K, V, dtype, draft=draft, ragged=ragged, greedy=greedy)
    noise = noise_for("triton", noise)
    expected = rejection_sample(p, q, ids, n, greedy=g, noise=noise, backend="reference")
    g_cuda = g.cuda() if isinstance(g, torch.Tensor) else g
    actual = rejection_sample(*cuda(p, q, ids, n), greedy=g_cuda, noise=type(noise)(*cuda(*noise)),
                              backend="triton")
    assert torch.equal(actual.num_accepted.cpu(), expected.num_accepted)
    assert torch.equal(actual.token_ids.cpu(), expected.token_ids)


@pytest.mark.parametrize("filters", [{}, {"top_k": 7}, {"top_p": 0.8}, {"top_k": 40, "top_p": 0.9}],
                         ids=["none", "topk", "topp", "topk-topp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rejection_sample_logits_matches_reference(dtype, filters):
    B, K, V = 6, 4, 333
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(B, K + 1, V, generator=gen) * 2
    target = (base + 0.5 * torch.randn(B, K + 1, V, generator=gen)).to(dtype)
    draft = (base[:, :K] + 0.5 * torch.randn(B, K, V, generator=gen)).to(dtype)
    n = torch.tensor([0, 4, 2, 4, 1, 3])
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.5])
    # Drafts drawn from the draft's own processed distribution (inside the filters), so that some
    # are accepted: uniform ids would fall outside top-k / top-p and all be rejected.
    probs = process_logits(draft, temperature, **filters)
    ids = torch.multinomial(probs.reshape(-1, V), 1, generator=gen).reshape(B, K)
    noise = make_rejection_noise(B, K, V, generator=torch.Generator().manual_seed(4))
    kwargs = dict(**filters, noise=noise)
    expected = rejection_sample_logits(target, draft, ids, n, temperature=temperature, backend="reference", **kwargs)
    assert expected.num_accepted.sum() > 0  # the case exercises acceptance, not only rejection
    kwargs["noise"] = type(noise)(*cuda(*noise))
    actual = rejection_sample_logits(*cuda(target, draft, ids, n), temperature=temperature.cuda(),
                                     backend="triton", **kwargs)
    assert torch.equal(actual.num_accepted.cpu(), expected.num_accepted)
    assert torch.equal(actual.token_ids.cpu(), expected.token_ids)


@pytest.mark.parametrize("drafts", ["sampled", "deterministic", "duplicates"])
@pytest.mark.parametrize("dtype,temperature,filters", [(torch.float32, 1.0, {}), (torch.float16, 0.7, {"top_k": 5}),
                                                       (torch.bfloat16, 0.8, {"top_p": 0.9})])
def test_tree_rejection_sample_matches_reference(drafts, dtype, temperature, filters):
    """The compiled tree kernel takes the reference's path and draws its token given the same noise."""
    from test_tree_sampling import random_case

    *args, greedy = random_case(24, 9, 2100, drafts, seed=5, dtype=dtype)
    noise = make_rejection_noise(24, 9, 2100, seed=3)
    expected = tree_rejection_sample(*args, greedy=greedy, temperature=temperature, noise=noise,
                                     backend="reference", **filters)
    actual = tree_rejection_sample(*cuda(*args), greedy=greedy.cuda(), temperature=temperature,
                                   noise=type(noise)(*cuda(*noise)), backend="triton", **filters)
    assert (expected.num_accepted > 0).any()
    for name in ("token_ids", "num_accepted", "path"):
        assert torch.equal(getattr(actual, name).cpu(), getattr(expected, name)), name


@pytest.mark.parametrize("kind,fault,which,setting,validate", _no_token_cases())
def test_values_without_a_token_raise_on_cuda(kind, fault, which, setting, validate, monkeypatch):
    """The compiled samplers' row flags (NaN, +inf, rows of only -inf) on CUDA flag the rows the
    interpreter does (`test_sampling.py`): a ValueError with validation, a DeviceCheckError without.
    On CUDA that check is a device-side assert, which would end the process's CUDA context, so here
    the flags are read on the host and checked as on the CPU."""
    import specdec_kernels.kernels.sampling as kernels

    refuse = kernels.refuse_rows_without_token
    monkeypatch.setattr(kernels, "refuse_rows_without_token", lambda bad, names: refuse(bad.cpu(), names))
    op, settings, validated, refused = NO_TOKEN_OPS[kind]
    target, draft, ids = cuda(*_bad_row_inputs(fault, which, kind))
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in settings[setting].items()}
    counts = kwargs.pop("counts", None)
    name = f"{which}_{kind}"
    error, match = (ValueError, f"{name} {validated}") if validate else (
        DeviceCheckError, rf"{name}: batch row\(s\) \[1\] {refused}")
    with pytest.raises(error, match=match):
        op(target, draft, ids, counts, seed=0, validate=validate, backend="triton", **kwargs)


def test_first_rejection_index_matches_reference():
    gen = torch.Generator().manual_seed(5)
    accepted = torch.rand(7, 16, generator=gen) < 0.8
    n = torch.randint(0, 17, (7,), generator=gen)
    expected = first_rejection_index(accepted, n, backend="reference")
    assert torch.equal(first_rejection_index(accepted.cuda(), n.cuda(), backend="triton").cpu(), expected)


# ---- the decoding path on CUDA: the built-in model, generate and speculative_generate ----


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float().cpu() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_model_forward_on_cuda_matches_cpu(dtype, tolerance):
    """A ragged prefill, then a ragged verification step, on CUDA (the Triton attention and cache
    scatter) against the fp32 model on the CPU (the torch paths). Rows past q_seqlens are not compared."""
    model = tiny_llama(seed=0, layers=3)
    gpu = tiny_llama(seed=0, layers=3).to("cuda", dtype)
    ids, mask = ragged_prompts(B=5, P=11, seed=1, left=False)
    prompt_lens = mask.sum(1)
    step = torch.randint(0, V, (5, 4), generator=torch.Generator().manual_seed(2))
    step_lens = torch.tensor([4, 1, 3, 4, 2])
    cpu_cache, gpu_cache = model.new_cache(5, 16), gpu.new_cache(5, 16)
    with torch.no_grad():
        for tokens, lengths in ((ids, prompt_lens), (step, step_lens)):
            expected = model(tokens, cpu_cache, lengths)
            actual = gpu(tokens.cuda(), gpu_cache, lengths.cuda())
            assert actual.is_cuda and actual.dtype == dtype
            valid = torch.arange(tokens.shape[1]) < lengths[:, None]
            assert relative_error(actual.cpu()[valid], expected[valid]) < tolerance
    assert torch.equal(gpu_cache.lengths.cpu(), prompt_lens + step_lens)


@pytest.mark.parametrize("draft_kind", ["truncated", "prompt-lookup"])
def test_greedy_speculative_equals_greedy_generate_on_cuda(draft_kind):
    """Token for token on CUDA, and equal to the CPU's tokens (fp32; the same top-2 gap allowance as
    the CPU test in `test_generation.py`)."""
    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    draft = model.truncated(1) if draft_kind == "truncated" else PromptLookupDraft()
    input_ids, mask = ragged_prompts(seed=4)
    plain_cpu = generate(cpu_model, input_ids, mask, max_new_tokens=24, temperature=0)
    ids, m = input_ids.cuda(), mask.cuda()
    plain = generate(model, ids, m, max_new_tokens=24, temperature=0)
    # Fixed K: every step drafts (adaptive lengths may choose plain steps, see the test below).
    spec = speculative_generate(model, draft, ids, m, num_draft_tokens=4, max_new_tokens=24, temperature=0,
                                adaptive=False)
    assert plain.tokens.is_cuda and spec.tokens.is_cuda
    allowances = 0
    for tokens in (plain.tokens.cpu(), spec.tokens.cpu()):
        for row in range(input_ids.shape[0]):
            differ = (plain_cpu.tokens[row] != tokens[row]).nonzero()
            if len(differ):
                assert greedy_divergence_allowed(cpu_model, input_ids, mask, plain_cpu.tokens, row, int(differ[0]))
                allowances += 1
    assert allowances <= 1
    assert spec.stats.num_generated.tolist() == [24] * input_ids.shape[0]
    assert spec.stats.num_accepted.sum() > 0


def test_sampled_speculative_decoding_on_cuda_is_seeded_and_in_vocabulary():
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, mask = (t.cuda() for t in ragged_prompts(seed=6))
    runs = [speculative_generate(model, model.truncated(1), ids, mask, num_draft_tokens=3, max_new_tokens=16,
                                 temperature=0.8, top_k=20, top_p=0.9, seed=11, adaptive=False) for _ in range(2)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    generated = torch.cat([torch.tensor(runs[0].row_tokens(r)) for r in range(ids.shape[0])])
    assert len(generated) == 16 * ids.shape[0] and generated.min() >= 0 and generated.max() < V


def test_model_forward_is_sync_free_on_cuda():
    """CUDA's own sync detector (not only `SyncCounter`'s op list): one verification forward,
    the cache append, the attention plan and the sampler after it, with synchronizing calls made errors."""
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    cache = model.new_cache(4, 32)
    ids, mask = ragged_prompts(B=4, seed=7, left=False)
    with torch.no_grad():
        model(ids.cuda(), cache, mask.sum(1).cuda())
        step = torch.randint(0, V, (4, 5), device="cuda")
        q_seqlens = torch.tensor([5, 2, 5, 1], device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = model(step, cache, q_seqlens)
            out = rejection_sample_logits(logits[:, :5], logits[:, :4] * 0.9, step[:, 1:], q_seqlens - 1,
                                          temperature=1.0, backend="triton")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.is_cuda and out.num_accepted.shape == (4,)


@pytest.mark.parametrize("draft_kind", [None, "truncated", "early-exit", "prompt-lookup"])
def test_cuda_graphs_give_the_eager_tokens(draft_kind, monkeypatch):
    """Decoding steps replayed from CUDA graphs (the default for the built-in model on CUDA)
    against the eager loop: greedy tokens equal (the top-2 gap allowance: graphs read the whole
    cache capacity), rows ending at different steps (new graphs for the smaller batches)."""
    from specdec_kernels import cuda_graphs

    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    input_ids, mask = ragged_prompts(seed=9)
    ids, m = input_ids.cuda(), mask.cuda()
    drafts = {"truncated": lambda: model.truncated(1), "prompt-lookup": PromptLookupDraft,
              "early-exit": lambda: EarlyExitDraft(model, 1)}

    def run(**kwargs):
        if draft_kind is None:
            return generate(model, ids, m, max_new_tokens=20, temperature=0, **kwargs)
        return speculative_generate(model, drafts[draft_kind](), ids, m, num_draft_tokens=3, max_new_tokens=20,
                                    temperature=0, **kwargs)

    eos = int(run(cuda_graphs=False).tokens[1, 4])
    eager = run(eos_token_id=eos, cuda_graphs=False)
    captures = []
    capture = cuda_graphs.GraphedForward._capture
    monkeypatch.setattr(cuda_graphs.GraphedForward, "_capture",
                        lambda self, x, q: captures.append(tuple(x.shape)) or capture(self, x, q))
    graphed = run(eos_token_id=eos)
    assert len(set(captures)) > 1, captures
    assert eager.stats.num_generated.min() < 20
    tokens = graphed.tokens.cpu()
    for row in range(input_ids.shape[0]):
        differ = (eager.tokens[row].cpu() != tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(model, ids, m, eager.tokens, row, int(differ[0]))
    assert (eager.tokens.cpu() != tokens).any(1).sum() <= 1


# ---- drafters, adaptive draft lengths and streaming on CUDA ----


class _Recorder:
    """A streamer keeping what each row was handed."""

    def __init__(self, batch_size: int) -> None:
        self.rows: list[list[int]] = [[] for _ in range(batch_size)]
        self.ended = False

    def put(self, token_ids) -> None:
        parts = [token_ids[0]] if isinstance(token_ids, torch.Tensor) else token_ids
        for row, part in enumerate(parts):
            assert part.device.type == "cpu" and part.dtype == torch.int64
            self.rows[row] += part.tolist()

    def end(self) -> None:
        self.ended = True


class _HiddenStatesDraft(PromptLookupDraft):
    """Prompt lookup that asks for the target's hidden states and checks what it is given."""

    needs_target_hidden = True

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size, self.commits = hidden_size, 0

    def prefill(self, input_ids, q_seqlens, max_len, *, hidden_states) -> None:
        assert hidden_states.is_cuda and hidden_states.shape == (*input_ids.shape, self.hidden_size)
        super().prefill(input_ids, q_seqlens, max_len)

    def commit(self, token_ids, num_tokens, *, hidden_states) -> None:
        assert hidden_states.is_cuda and hidden_states.shape[:2] == token_ids.shape
        assert hidden_states.shape[2] == self.hidden_size
        self.commits += 1
        super().commit(token_ids, num_tokens)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("draft_kind", ["model", "early-exit", "prompt-lookup", "oracle", "hidden-states"])
def test_drafters_on_cuda_give_generate_tokens_and_stream_them(draft_kind, adaptive):
    """Every kind of drafter on CUDA (graphs by default: one per batch size and verify width;
    none for the target of a drafter reading its hidden states), with fixed and adaptive draft
    lengths: greedy tokens equal eager `generate`'s (the top-2 gap allowance), and the streamer
    is handed exactly the returned tokens, row by row."""
    from specdec_kernels import ModelDraft
    from specdec_kernels.testing import OracleDraft

    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    input_ids, mask = ragged_prompts(seed=5)
    ids, m = input_ids.cuda(), mask.cuda()
    B, K, N = input_ids.shape[0], 4, 24
    plain = generate(model, ids, m, max_new_tokens=N, temperature=0, cuda_graphs=False)
    drafts = {"model": lambda: ModelDraft(model.truncated(1)), "prompt-lookup": PromptLookupDraft,
              "early-exit": lambda: EarlyExitDraft(model, 1),
              "oracle": lambda: OracleDraft(generate(model, ids, m, max_new_tokens=N + K, temperature=0,
                                                     cuda_graphs=False).tokens),
              "hidden-states": lambda: _HiddenStatesDraft(model.config.hidden_size)}
    draft, streamer = drafts[draft_kind](), _Recorder(B)
    spec = speculative_generate(model, draft, ids, m, num_draft_tokens=K, max_new_tokens=N, temperature=0,
                                adaptive=adaptive, streamer=streamer)
    assert spec.tokens.is_cuda and streamer.ended
    tokens = spec.tokens.cpu()
    for row in range(B):
        assert streamer.rows[row] == spec.row_tokens(row)
        differ = (plain.tokens[row].cpu() != tokens[row]).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(model, ids, m, plain.tokens, row, int(differ[0]))
    assert (plain.tokens.cpu() != tokens).any(1).sum() <= 1
    assert spec.stats.num_generated.tolist() == [N] * B
    assert int(spec.stats.draft_lengths.sum()) == int(spec.stats.num_steps.sum())
    if draft_kind == "oracle":
        assert spec.stats.acceptance_rate > 0.9
    if draft_kind == "hidden-states":
        assert draft.commits == int(spec.stats.num_steps.max()) + 1


@pytest.mark.parametrize("draft_kind, adaptive", [(None, False), ("model", False), ("model", True),
                                                   ("early-exit", True), ("prompt-lookup", False),
                                                   ("prompt-lookup", True)],
                         ids=["generate", "model-fixed", "model-adaptive", "early-exit-adaptive",
                              "prompt-lookup-fixed", "prompt-lookup-adaptive"])
def test_decoding_steps_synchronize_once_on_cuda(draft_kind, adaptive):
    """CUDA's own sync detector over whole eager runs: a longer run costs exactly one more
    synchronization per extra step (the step's one transfer); draft lengths, streaming and row
    drops add none."""
    import collections
    import warnings

    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, m = (t.cuda() for t in ragged_prompts(seed=8))

    def syncs_and_steps(max_new_tokens: int) -> tuple[collections.Counter, int]:
        """The synchronizations CUDA reports, counted per place in the source, and the steps."""
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=0, cuda_graphs=False, streamer=_Recorder(len(ids)))
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if draft_kind is None:
                    out = generate(model, ids, m, **kwargs)
                else:
                    draft = {"model": lambda: model.truncated(1), "early-exit": lambda: EarlyExitDraft(model, 1),
                             "prompt-lookup": PromptLookupDraft}[draft_kind]()
                    out = speculative_generate(model, draft, ids, m, num_draft_tokens=3, adaptive=adaptive, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        places = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message))
        return places, int(out.stats.num_steps.max())

    syncs_and_steps(8)  # Triton compilation and lazy initialization out of the way
    (short, short_steps), (long, long_steps) = syncs_and_steps(8), syncs_and_steps(32)
    assert long_steps > short_steps
    extra = long - short
    transfer = [place for place in extra if "generation.py" in place]
    assert len(transfer) == 1 and set(extra) == set(transfer), (short, long)  # only the transfer adds syncs
    assert extra[transfer[0]] % (long_steps - short_steps) == 0, (short, long)  # the same number every step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("window", [1, 7, 100, 5000], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T,q_lens", [(1, None), (5, [5, 1, 3, 2])], ids=["decode", "verify"])
def test_sliding_window_attention_on_cuda(window, T, q_lens, dtype):
    """The compiled kernel with a sliding window (each row's splits start at its first query's
    window) against the CPU reference: short windows, windows inside long rows, and one longer
    than the cache; NaN beyond every length."""
    from test_attention import dense_oracle

    q, k, v, cache_seqlens, q_seqlens = make_inputs(4, T, 3, 2, 64, 3000, [3000, 1200, 9, 700], q_lens, dtype)
    out = ragged_attention(*cuda(q, k, v, cache_seqlens, q_seqlens), sliding_window=window, backend="triton")
    assert_close(out, dense_oracle(q, k, v, cache_seqlens, q_seqlens, window=window), dtype)


# ---- transformers models on CUDA ----


def _hf_family_cases():
    transformers_available = __import__("importlib").util.find_spec("transformers") is not None
    if not transformers_available:
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="needs transformers"))]
    from test_hf_models import FAMILIES

    return FAMILIES


@pytest.mark.parametrize("family, overrides", _hf_family_cases())
def test_transformers_models_on_cuda_decode_as_transformers_does(family, overrides, monkeypatch):
    """Every supported transformers family on CUDA through the package's cache and kernels, its
    decoding forwards replayed as CUDA graphs (the default): greedy `generate`, and
    `speculative_generate` with a smaller same-family draft (adaptive lengths, the draft graphed
    too) and with prompt lookup (fixed K), equal transformers' own greedy ``generate`` on the CPU
    row by row, rows of different lengths and sliding windows included (a first difference only
    where the CPU logits' top-2 gap is within rounding of CUDA's)."""
    from test_hf_models import greedy_case

    from specdec_kernels import HFCausalLM, cuda_graphs

    captures = []
    capture = cuda_graphs.GraphedForward._capture
    monkeypatch.setattr(cuda_graphs.GraphedForward, "_capture",
                        lambda self, x, q: captures.append(tuple(x.shape)) or capture(self, x, q))
    hf, draft, input_ids, mask, expected = greedy_case(family, overrides)
    on_cpu = HFCausalLM(hf)
    hf.cuda(), draft.cuda()
    ids, m = input_ids.cuda(), mask.cuda()
    runs = {
        "generate": generate(hf, ids, m, max_new_tokens=16, temperature=0),
        "model draft": speculative_generate(hf, draft, ids, m, num_draft_tokens=3, max_new_tokens=16,
                                            temperature=0, adaptive=True),
        "prompt lookup": speculative_generate(hf, PromptLookupDraft(), ids, m, num_draft_tokens=3,
                                              max_new_tokens=16, temperature=0, adaptive=False),
    }
    hf.cpu()
    assert captures, "no decoding forward was recorded as a CUDA graph"
    for name, out in runs.items():
        assert out.tokens.is_cuda, name
        tokens = out.tokens.cpu()
        for row in range(4):
            differ = (tokens[row] != expected[row]).nonzero()
            if len(differ):
                assert greedy_divergence_allowed(on_cpu, input_ids, mask, expected, row, int(differ[0]), gap=1e-3), \
                    f"{family}, {name}, row {row}"
    assert runs["model draft"].stats.num_proposed.sum() > 0


def test_transformers_model_decoding_synchronizes_once_per_step_on_cuda():
    """A transformers model on CUDA (eager, CUDA's own sync detector): a longer run of
    `generate` and of adaptive prompt lookup costs exactly the extra steps' transfers."""
    import collections
    import warnings

    from test_hf_models import tiny_hf

    hf = tiny_hf("qwen2", scale=3.0).cuda()
    ids, m = (t.cuda() for t in ragged_prompts(B=4, P=9, seed=8))

    def syncs_and_steps(draft, max_new_tokens: int) -> tuple[collections.Counter, int]:
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=0, cuda_graphs=False)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = (generate(hf, ids, m, **kwargs) if draft is None else
                       speculative_generate(hf, draft, ids, m, num_draft_tokens=3, adaptive=True, **kwargs))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        places = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message))
        return places, int(out.stats.num_steps.max())

    for draft in (None, PromptLookupDraft()):
        syncs_and_steps(draft, 8)  # compilation and lazy initialization out of the way
        (short, short_steps), (long, long_steps) = syncs_and_steps(draft, 8), syncs_and_steps(draft, 32)
        assert long_steps > short_steps
        extra = long - short
        transfer = [place for place in extra if "generation.py" in place]
        assert len(transfer) == 1 and set(extra) == set(transfer), (draft, short, long)
        assert extra[transfer[0]] % (long_steps - short_steps) == 0, (draft, short, long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", ["nosplit", "split"])
@pytest.mark.parametrize("G,T", [(1, 8), (3, 16), (8, 40)])
def test_tree_attention_matches_the_masked_oracle(G, T, split, dtype):
    """The compiled tree kernel (its own specializations) against the dense masked oracle."""
    from specdec_kernels.kernels.attention import ragged_attention_triton
    from test_attention import dense_oracle
    from test_tree_attention import random_tree_masks

    q, k, v, cache_seqlens, q_seqlens = make_inputs(3, T, G, 2, 64, 300, [300, T + 20, T], [T, T - 3, T], dtype)
    tree = random_tree_masks(3, T, seed=G)
    kwargs = dict(max_splits=1) if split == "nosplit" else dict(max_splits=16, min_chunk=32)
    out = ragged_attention_triton(*cuda(q, k, v, cache_seqlens, q_seqlens), 64 ** -0.5, tree_mask=tree.cuda(),
                                  **kwargs)
    assert_close(out.cpu(), dense_oracle(q, k, v, cache_seqlens, q_seqlens, tree_mask=tree), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_compact_matches_torch_path(dtype):
    from test_cache_compact import filled_cache

    keep = torch.tensor([[0, 2, 5, 0, 0, 0], [1, 3, 4, 5, 0, 0], [0, 1, 2, 3, 0, 0]])
    num_keep = torch.tensor([3, 4, 2])
    cpu, _ = filled_cache(dtype=dtype)
    gpu = KVCache(cpu.num_layers, cpu.batch_size, cpu.max_len, cpu.num_kv_heads, cpu.head_dim, dtype=dtype,
                  device="cuda")
    for layer in range(cpu.num_layers):
        gpu.k[layer].copy_(cpu.k[layer])
        gpu.v[layer].copy_(cpu.v[layer])
    gpu.advance(cpu.lengths.cuda())
    cpu.compact(keep, num_keep, backend="torch")
    gpu.compact(keep.cuda(), num_keep.cuda(), backend="triton")
    assert torch.equal(gpu.lengths.cpu(), cpu.lengths)
    for layer in range(cpu.num_layers):
        assert torch.equal(gpu.k[layer].cpu(), cpu.k[layer]) and torch.equal(gpu.v[layer].cpu(), cpu.v[layer])


def test_tree_speculative_decoding_on_cuda_equals_generate():
    """Prompt-lookup trees verified on CUDA (eager tree forwards beside graphed plain steps): the
    CPU's greedy tokens, with `test_greedy_speculative_equals_greedy_generate_on_cuda`'s top-2
    gap allowance."""
    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, mask = repetitive_prompts(B=4, seed=1)
    plain_cpu = generate(cpu_model, ids, mask, max_new_tokens=24, temperature=0)
    spec = speculative_generate(model, PromptLookupDraft(branches=3), ids.cuda(), mask.cuda(), num_draft_tokens=7,
                                max_new_tokens=24, temperature=0)
    assert_cpu_greedy_tokens(cpu_model, ids, mask, plain_cpu.tokens, spec.tokens)


def assert_cpu_greedy_tokens(cpu_model, ids, mask, expected: torch.Tensor, got: torch.Tensor) -> None:
    """``got`` (from CUDA) equals the CPU's greedy ``expected`` but in at most one row, where it
    may differ only at a top-2 logit gap too small for fp32 rounding to decide."""
    allowances = 0
    for row in range(ids.shape[0]):
        differ = (expected[row] != got[row].cpu()).nonzero()
        if len(differ):
            assert greedy_divergence_allowed(cpu_model, ids, mask, expected, row, int(differ[0]))
            allowances += 1
    assert allowances <= 1


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_jacobi_on_cuda_equals_generate(cuda_graphs):
    """Jacobi decoding on CUDA (eager and with its forwards replayed as CUDA graphs): the CPU's
    greedy tokens, with the same top-2 gap allowance as the speculative test above."""
    from specdec_kernels import jacobi_generate

    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, mask = ragged_prompts(B=4, seed=2)
    plain_cpu = generate(cpu_model, ids, mask, max_new_tokens=24, temperature=0)
    out = jacobi_generate(model, ids.cuda(), mask.cuda(), window=5, max_new_tokens=24, cuda_graphs=cuda_graphs)
    assert_cpu_greedy_tokens(cpu_model, ids, mask, plain_cpu.tokens, out.tokens)
    assert out.stats.num_generated.tolist() == [24] * ids.shape[0]


@pytest.mark.parametrize("adaptive", [False, True])
def test_lookahead_on_cuda_equals_generate(adaptive):
    """Lookahead decoding on CUDA (tree-masked eager lookahead steps, graphed plain steps where
    the switch takes them): the CPU's greedy tokens, as above."""
    from specdec_kernels import lookahead_generate

    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, mask = repetitive_prompts(B=4, seed=1)
    plain_cpu = generate(cpu_model, ids, mask, max_new_tokens=24, temperature=0)
    out = lookahead_generate(model, ids.cuda(), mask.cuda(), window=3, ngram=3, guesses=3, max_new_tokens=24,
                             adaptive=adaptive)
    assert_cpu_greedy_tokens(cpu_model, ids, mask, plain_cpu.tokens, out.tokens)
    assert out.stats.num_generated.tolist() == [24] * ids.shape[0]
    if not adaptive:
        assert out.stats.num_accepted.sum() > 0  # candidates were verified and kept


def test_lookahead_verify_steps_on_cuda_equal_generate(monkeypatch):
    """Verify steps on CUDA (eager, tree-masked, between graphed plain steps and lookahead
    steps; the switch's choices forced in turn): the CPU's greedy tokens, as above."""
    from specdec_kernels import lookahead_generate
    from specdec_kernels.lookahead import LOOKAHEAD, PLAIN, VERIFY

    force_kinds(monkeypatch, [VERIFY, PLAIN, LOOKAHEAD, VERIFY])
    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, mask = repetitive_prompts(B=4, seed=1)
    plain_cpu = generate(cpu_model, ids, mask, max_new_tokens=24, temperature=0)
    out = lookahead_generate(model, ids.cuda(), mask.cuda(), window=3, ngram=3, guesses=3, max_new_tokens=24)
    assert_cpu_greedy_tokens(cpu_model, ids, mask, plain_cpu.tokens, out.tokens)
    assert out.stats.num_generated.tolist() == [24] * ids.shape[0]
    assert out.stats.num_accepted.sum() > 0


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_feature_head_on_cuda_keeps_greedy_tokens(adaptive, branches):
    """A feature draft head (`FeatureHeadDraft`, chains and trees, over the first ids of its
    vocabulary) on CUDA: the target's hidden states flow to the head's own cache each step, and
    the CPU's greedy tokens come out, as above."""
    from specdec_kernels import FeatureHeadDraft
    from specdec_kernels.draft_training import new_head

    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, mask = repetitive_prompts(B=4, seed=2)
    plain_cpu = generate(cpu_model, ids, mask, max_new_tokens=24, temperature=0)
    head = new_head(model, torch.arange(64), seed=0)
    drafter = FeatureHeadDraft(model, head, branches=branches, draft_vocab_size=48)
    out = speculative_generate(model, drafter, ids.cuda(), mask.cuda(), num_draft_tokens=5, max_new_tokens=24,
                               temperature=0, adaptive=adaptive)
    assert_cpu_greedy_tokens(cpu_model, ids, mask, plain_cpu.tokens, out.tokens)
    assert out.stats.num_generated.tolist() == [24] * ids.shape[0]


@pytest.mark.parametrize("adaptive", [False, True])
def test_an_exit_head_on_cuda_keeps_greedy_tokens(adaptive):
    """An early-exit head (`ExitHeadDraft`) on CUDA, its one-token forwards replayed as CUDA
    graphs in the target's cache: the CPU's greedy tokens, and drafts accepted."""
    from specdec_kernels import ExitHeadDraft
    from specdec_kernels.draft_training import new_head

    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    ids, mask = repetitive_prompts(B=4, seed=2)
    plain_cpu = generate(cpu_model, ids, mask, max_new_tokens=24, temperature=0)
    head = new_head(model, torch.arange(64), seed=0, kind="early-exit", exit_layer=2)
    out = speculative_generate(model, ExitHeadDraft(model, head), ids.cuda(), mask.cuda(), num_draft_tokens=3,
                               max_new_tokens=24, temperature=0, adaptive=adaptive)
    assert_cpu_greedy_tokens(cpu_model, ids, mask, plain_cpu.tokens, out.tokens)
    assert out.stats.num_generated.tolist() == [24] * ids.shape[0]
    if not adaptive:
        assert out.stats.num_accepted.sum() > 0


def test_draft_shards_written_on_cuda_hold_the_cpu_features_and_train_there(tmp_path):
    """`write_shards` with the target on CUDA writes host tensors (a shard written on a GPU loads
    anywhere) holding what the CPU target computes; `train_head` trains there."""
    from test_demo import _CharTokenizer

    from specdec_kernels import FeatureHead
    from specdec_kernels.draft_data import Shard, write_shards
    from specdec_kernels.draft_training import TrainSettings, load_sequences, train_head

    cpu_model = tiny_llama(seed=0, scale=3.0, layers=3)
    model = tiny_llama(seed=0, scale=3.0, layers=3).cuda()
    prompts = ["abc", "hello there", "list: a, b, c", "copy this"]
    paths = write_shards(model, _CharTokenizer(), prompts, tmp_path, shard_size=2, max_new_tokens=6, batch_size=2,
                         top_k=4)
    shard = Shard.load(paths[0])
    assert all(t.device.type == "cpu" for t in (shard.token_ids, shard.hidden, shard.top_ids, shard.top_logits))
    first = shard.token_ids[: int(shard.lengths[0])]
    with torch.no_grad():
        logits, hidden = cpu_model(first[None], cpu_model.new_cache(1, len(first)), return_hidden=True)
    assert relative_error(shard.hidden[: len(first)].float(), hidden[0]) < 1e-2
    torch.testing.assert_close(shard.top_logits[: len(first), 0], logits[0].max(-1).values, rtol=1e-3, atol=1e-3)
    settings = TrainSettings(steps=3, tokens_per_batch=32, warmup=1, unroll=2, draft_vocab_size=40,
                             checkpoint_every=2)
    head = train_head(model, load_sequences(paths), tmp_path / "run", settings, log=lambda _: None)
    assert head.fc.weight.device.type == "cuda"
    head.save(tmp_path / "head.pt")
    assert FeatureHead.load(tmp_path / "head.pt").fc.weight.device.type == "cpu"
