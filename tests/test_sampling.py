"""Rejection sampling: exact agreement with the reference, semantics on hand-built cases, bad input,
reproducibility, host syncs, and (under the Triton interpreter) bytes moved and launches.

Distribution (losslessness) tests live in ``test_sampling_distribution.py``.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels import (
    DeviceCheckError,
    RejectionNoise,
    first_rejection_index,
    make_rejection_noise,
    process_logits,
    rejection_sample,
    rejection_sample_logits,
    sample_logits,
    triton_available,
)
from specdec_kernels._backend import interpreter_enabled
from specdec_kernels._logits import logit_thresholds, temperature_rows
from specdec_kernels.testing import SyncCounter, TrafficMeter

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")
FAST = ["torch", pytest.param("triton", marks=needs_triton)]


# --------------------------------------------------------------------------- case builders


def make_case(
    B: int,
    K: int,
    V: int,
    dtype: torch.dtype,
    *,
    draft: bool,
    ragged: bool,
    greedy: str,
    seed: int = 0,
    device: str = "cpu",
):
    """Target / draft probabilities close enough that drafts are often accepted, drafts drawn from
    q (or from p_i's top token without draft probs), ragged counts including 0 and K."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, K + 1, V, generator=g) * 3
    p = torch.softmax(base + 0.7 * torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(base[:, :K] + 0.7 * torch.randn(B, K, V, generator=g), -1)
    if draft:
        ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K) if K else torch.zeros(B, 0)
    else:
        ids = p[:, :K].argmax(-1)
        flip = torch.rand(B, K, generator=g) < 0.3
        ids = torch.where(flip, torch.randint(0, V, (B, K), generator=g), ids)
    n = None
    if ragged:
        n = torch.randint(0, K + 1, (B,), generator=g)
        n[0], n[-1] = 0, K
    greedy_arg: bool | torch.Tensor = {"none": False, "all": True}.get(greedy)
    if greedy == "mixed":
        greedy_arg = torch.arange(B) % 3 == 1
        greedy_arg = greedy_arg.to(device)
    noise = make_rejection_noise(B, K, V, generator=torch.Generator().manual_seed(seed + 1))
    to = lambda t: None if t is None else t.to(device)
    return (
        p.to(dtype).to(device),
        q.to(dtype).to(device) if draft else None,
        ids.long().to(device),
        to(n),
        greedy_arg,
        RejectionNoise(*(to(t) for t in noise)),
    )


def noise_for(backend: str, noise: RejectionNoise) -> RejectionNoise:
    """The reference consumes whichever form the backend does: the race for triton, else the CDF."""
    return noise if backend == "triton" else noise._replace(exponential=None)


CASES = [
    pytest.param(
        6, 4, 1000, torch.float32, True, True, "mixed", id="B6-K4-V1000-fp32-draft-ragged-mixedgreedy"
    ),
    pytest.param(5, 16, 333, torch.float16, False, True, "none", id="B5-K16-V333-fp16-nodraft-ragged"),
    pytest.param(5, 3, 515, torch.bfloat16, True, False, "none", id="B5-K3-V515-bf16-draft"),
    pytest.param(3, 2, 2049, torch.float32, False, True, "mixed", id="B3-K2-V2049-fp32-nodraft-multitile"),
    pytest.param(4, 5, 97, torch.float16, True, True, "all", id="B4-K5-V97-fp16-draft-allgreedy"),
    pytest.param(3, 0, 64, torch.bfloat16, True, False, "none", id="B3-K0-V64-bf16-bonus-only"),
    pytest.param(4, 16, 300, torch.float32, True, True, "none", id="B4-K16-V300-fp32-draft-ragged"),
]


@pytest.mark.parametrize("fast_backend", FAST)
@pytest.mark.parametrize("B,K,V,dtype,draft,ragged,greedy", CASES)
def test_matches_reference_token_for_token(fast_backend, B, K, V, dtype, draft, ragged, greedy):
    p, q, ids, n, g, noise = make_case(B, K, V, dtype, draft=draft, ragged=ragged, greedy=greedy)
    noise = noise_for(fast_backend, noise)
    expected = rejection_sample(p, q, ids, n, greedy=g, noise=noise, backend="reference")
    actual = rejection_sample(p, q, ids, n, greedy=g, noise=noise, backend=fast_backend)
    assert actual.token_ids.dtype == actual.num_accepted.dtype == torch.int64
    assert torch.equal(actual.num_accepted, expected.num_accepted)
    assert torch.equal(actual.token_ids, expected.token_ids)


def test_exact_cases_exercise_rejection_and_full_acceptance():
    """The exact cases above are only meaningful if they contain both outcomes."""
    p, q, ids, n, g, noise = make_case(6, 4, 1000, torch.float32, draft=True, ragged=True, greedy="none")
    out = rejection_sample(p, q, ids, n, noise=noise._replace(exponential=None), backend="reference")
    assert (out.num_accepted < n).any() and (out.num_accepted == n).any() and (out.num_accepted > 0).any()


LOGIT_CASES = [
    pytest.param(dict(temperature=1.0), torch.float32, True, id="T1-fp32-draft"),
    pytest.param(dict(temperature="rows"), torch.float16, True, id="Trows-with-zeros-fp16-draft"),
    pytest.param(dict(temperature=0.7, top_k=7), torch.bfloat16, True, id="T0.7-topk7-bf16-draft"),
    pytest.param(dict(temperature=1.3, top_p=0.8), torch.float32, False, id="T1.3-topp0.8-fp32-nodraft"),
    pytest.param(
        dict(temperature="rows", top_k=40, top_p=0.9), torch.float32, True, id="Trows-topk40-topp0.9"
    ),
    pytest.param(dict(temperature=0.0), torch.float16, False, id="T0-greedy-fp16-nodraft"),
]


@pytest.mark.parametrize("fast_backend", FAST)
@pytest.mark.parametrize("params,dtype,draft", LOGIT_CASES)
def test_logits_matches_reference_token_for_token(fast_backend, params, dtype, draft):
    B, K, V = 6, 4, 333
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(B, K + 1, V, generator=gen) * 2
    target = (base + 0.5 * torch.randn(B, K + 1, V, generator=gen)).to(dtype)
    draft_logits = (base[:, :K] + 0.5 * torch.randn(B, K, V, generator=gen)).to(dtype) if draft else None
    params = dict(params)
    if params.get("temperature") == "rows":
        params["temperature"] = torch.tensor([0.0, 0.5, 1.0, 0.0, 2.0, 0.8])
    probs = process_logits(target[:, :K], **params)
    ids = torch.multinomial(probs.reshape(-1, V), 1, generator=gen).reshape(B, K)
    n = torch.tensor([0, 4, 2, 3, 4, 1])
    noise = noise_for(fast_backend, make_rejection_noise(B, K, V, generator=torch.Generator().manual_seed(4)))
    expected = rejection_sample_logits(
        target, draft_logits, ids, n, noise=noise, backend="reference", **params
    )
    actual = rejection_sample_logits(
        target, draft_logits, ids, n, noise=noise, backend=fast_backend, **params
    )
    assert torch.equal(actual.num_accepted, expected.num_accepted)
    assert torch.equal(actual.token_ids, expected.token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("flag", ["temperature=0", "greedy=True"])
@pytest.mark.parametrize("draft", [True, False], ids=["draft", "nodraft"])
def test_all_greedy_logits_skip_the_distributions(monkeypatch, dtype, flag, draft):
    """With every row greedy (known on the host) the torch path decides by an argmax alone: of the
    raw logits at temperature 0, of the target's probabilities above it; no draft distribution,
    no noise. Same tokens as the reference, with drafts that are sometimes the argmax and
    sometimes not, ties at the top (first maximum) and ragged counts."""
    import specdec_kernels._sampling_torch as torch_path

    B, K, V = 7, 3, 50
    gen = torch.Generator().manual_seed(11)
    target = (torch.randn(B, K + 1, V, generator=gen) * 2).round().to(dtype)  # rounded: many ties
    draft_logits = torch.randn(B, K, V, generator=gen).to(dtype) if draft else None
    top = target[:, :K].float().argmax(-1)
    ids = torch.where(torch.rand(B, K, generator=gen) < 0.7, top, torch.randint(0, V, (B, K), generator=gen))
    n = torch.tensor([3, 0, 1, 2, 3, 3, 2])
    params = dict(temperature=0.0) if flag == "temperature=0" else dict(temperature=0.8, greedy=True, top_k=5)
    expected = rejection_sample_logits(target, draft_logits, ids, n, seed=0, backend="reference", **params)
    processed = []  # the fast path processes the target's logits above temperature 0 only
    process = torch_path.process_logits
    monkeypatch.setattr(torch_path, "process_logits", lambda *a, **kw: processed.append(a[0]) or process(*a, **kw))
    monkeypatch.setattr(torch_path, "make_rejection_noise", None)  # and draws no noise
    actual = rejection_sample_logits(target, draft_logits, ids, n, seed=0, backend="torch", **params)
    assert [t is target for t in processed] == ([] if flag == "temperature=0" else [True])
    assert torch.equal(actual.num_accepted, expected.num_accepted)
    assert torch.equal(actual.token_ids, expected.token_ids)
    assert (expected.num_accepted < n).any() and (expected.num_accepted == n).any()
    if flag == "greedy=True":  # above temperature 0 the probabilities decide: softmax ties 0 and 1e-8
        monkeypatch.undo()
        near_tie = torch.tensor([[[0.0, 1e-8], [0.0, 0.0]]])
        for backend in ("reference", "torch"):
            out = rejection_sample_logits(near_tie, None, torch.tensor([[0]]), temperature=1.0, greedy=True,
                                          backend=backend)
            assert out.token_ids.tolist() == [[0, 0]] and out.num_accepted.tolist() == [1]


def test_int_temperature_past_int64_is_taken():
    """A Python int temperature beyond int64 (finite as a float) validates and samples like the float."""
    logits, ids = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(5)), torch.tensor([[1, 2], [3, 4]])
    as_int = rejection_sample_logits(logits, None, ids, temperature=2**70, seed=0)
    as_float = rejection_sample_logits(logits, None, ids, temperature=float(2**70), seed=0)
    assert torch.equal(as_int.token_ids, as_float.token_ids)


# --------------------------------------------------------------------------- top-k / top-p thresholds (triton)


def threshold_case(B: int, K: int, V: int, dtype: torch.dtype, seed: int = 0):
    """Target ``[B, K+1, V]`` and draft ``[B, K, V]`` logits with ties at the top and at the
    top-k / top-p boundary, -inf entries, a row of coarse (heavily tied) values and a row of -inf
    only; per-row temperatures include 0 (greedy rows keep divisor 1)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, K + 1, V, generator=g) * 3
    draft = torch.randn(B, K, V, generator=g) * 3
    target[0, 0, : (V + 1) // 2] = target[0, 0].max()  # half the row tied at the maximum
    target[0, -1] = (target[0, -1] * 2).round() / 2  # many ties everywhere
    if B > 1:
        target[1, :, ::3] = float("-inf")
        draft[1, :, 1::4] = float("-inf")
        target[1, -1] = float("-inf")  # no finite entry at all
    if K > 0:
        draft[0, 0, : max(V // 8, 1)] = draft[0, 0, 0]  # a block of ties
    temperature = torch.tensor([0.7, 0.0, 1.3, 1.0, 0.45])[:B]
    return target.to(dtype), draft.to(dtype), temperature


#: (top_k, top_p) pairs; "V" / "V+1" stand for the vocabulary size (top-k off), top_p 1.0 is off.
ALL_FILTERS = [(1, None), (5, None), ("V", None), ("V+1", 0.9), (None, 0.1), (None, 0.9), (None, 1.0),
               (5, 0.9), (1, 0.1), (5, 1.0)]
FEW_FILTERS = [(5, None), (None, 0.9), (1, 0.1), (5, 0.9)]
THRESHOLD_CASES = [
    pytest.param(3, 4, 1000, torch.float32, True, "rows", ALL_FILTERS, id="B3-K4-V1000-fp32-draft-Trows"),
    pytest.param(2, 1, 4099, torch.bfloat16, True, "rows", ALL_FILTERS, id="B2-K1-V4099-bf16-draft-Trows"),
    pytest.param(2, 4, 4099, torch.float16, False, 0.7, FEW_FILTERS, id="B2-K4-V4099-fp16-nodraft-T0.7"),
    pytest.param(2, 16, 7, torch.float16, True, "rows", [(5, 0.9), (None, 0.1)], id="B2-K16-V7-fp16-draft-Trows"),
    pytest.param(3, 0, 7, torch.bfloat16, True, "rows", ALL_FILTERS, id="B3-K0-V7-bf16-bonus-only-Trows"),
    pytest.param(3, 1, 1, torch.float32, True, 1.0, ALL_FILTERS, id="B3-K1-V1-fp32-draft-T1"),
]


@needs_triton
@pytest.mark.parametrize("B,K,V,dtype,draft,temperature,filters", THRESHOLD_CASES)
def test_triton_thresholds_match_logit_thresholds(B, K, V, dtype, draft, temperature, filters):
    """One launch computes every target and draft row's threshold; top-k is exact by construction,
    top-p sums in another order than torch's cumsum and may differ only within rounding of top_p
    (these seeded cases have no such row)."""
    from specdec_kernels.kernels.sampling import logit_thresholds_triton

    target, draft_logits, row_temperature = threshold_case(B, K, V, dtype)
    draft_logits = draft_logits if draft else None
    temperature = row_temperature if temperature == "rows" else temperature
    divisor = temperature_rows(temperature, B, target.device)[0][:, None, None]
    for top_k, top_p in filters:
        top_k = {"V": V, "V+1": V + 1}.get(top_k, top_k)
        thr_t, thr_d = logit_thresholds_triton(target, draft_logits, temperature, top_k, top_p)
        case = f"top_k={top_k} top_p={top_p}"
        assert thr_t.dtype == torch.float32 and thr_t.shape == (B, K + 1), case
        assert torch.equal(thr_t, logit_thresholds(target.float() / divisor, top_k, top_p)), case
        if draft:
            assert thr_d.dtype == torch.float32 and thr_d.shape == (B, K), case
            assert torch.equal(thr_d, logit_thresholds(draft_logits.float() / divisor, top_k, top_p)), case
        else:
            assert thr_d is None


@needs_triton
def test_triton_thresholds_on_hand_built_rows():
    """Ties with the k-th value are kept, -0.0 equals 0.0, -inf entries count for top-k."""
    from specdec_kernels.kernels.sampling import logit_thresholds_triton

    inf = float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0, -inf, 3.0], [0.0, -0.0, 0.0, -1.0, -0.0, -inf],
                         [-inf, -inf, 5.0, -inf, -inf, -inf]])[:, None]
    thr = lambda top_k, top_p: logit_thresholds_triton(rows, None, 1.0, top_k, top_p)[0][:, 0].tolist()
    assert thr(2, None) == [3.0, 0.0, -inf]
    assert thr(4, None) == [2.0, 0.0, -inf]
    assert thr(5, None) == [1.0, -1.0, -inf]
    assert thr(1, 0.5) == [3.0, 0.0, 5.0]
    # softmax of row 0: three tied 3s hold 0.84 of the mass; the 2 follows at mass_before 0.84
    assert thr(None, 0.5) == [3.0, 0.0, 5.0]
    assert thr(None, 0.9) == [2.0, 0.0, 5.0]  # row 1: the four zeros already hold 0.92
    for top_k, top_p in [(2, None), (4, None), (5, None), (1, 0.5), (None, 0.5), (None, 0.9), (3, 0.95)]:
        assert torch.equal(logit_thresholds_triton(rows, None, 1.0, top_k, top_p)[0],
                           logit_thresholds(rows, top_k, top_p))


# --------------------------------------------------------------------------- semantics on known outcomes


def one_hot(V: int, *tokens: int) -> torch.Tensor:
    t = torch.zeros(len(tokens), V)
    t[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return t


def test_known_outcomes(backend):
    """One-hot targets make every outcome deterministic, whatever the random draws."""
    V = 10
    p = torch.stack(
        [
            one_hot(V, 3, 5, 7),  # row 0: drafts 3, 5 match p exactly -> accept both, bonus 7
            one_hot(V, 2, 5, 7),  # row 1: draft 4 has p = 0 -> rejected at 0, residual mass only at 2
            one_hot(V, 3, 5, 7),  # row 2: n = 0 -> bonus from p_0
            one_hot(V, 3, 6, 7),  # row 3: greedy: draft 3 == argmax, draft 5 != 6 -> emit 6
            one_hot(V, 1, 5, 7),  # row 4: q(draft) == 0 rejects although p(draft) = 1
        ]
    )
    q = torch.full((5, 2, V), 1.0 / V)
    q[4, 0] = torch.tensor([0.0] + [1.0 / 9] * 9)
    ids = torch.tensor([[3, 5], [4, 5], [3, 5], [3, 5], [0, 5]])
    n = torch.tensor([2, 2, 0, 2, 2])
    greedy = torch.tensor([False, False, False, True, False])
    out = rejection_sample(p, q, ids, n, greedy=greedy, seed=11, backend=backend)
    assert out.num_accepted.tolist() == [2, 0, 0, 1, 0]
    assert out.token_ids.tolist() == [[3, 5, 7], [2, -1, -1], [3, -1, -1], [3, 6, -1], [1, -1, -1]]


def test_known_outcomes_without_draft_probs(backend):
    V = 6
    p = torch.stack([one_hot(V, 1, 2, 3), one_hot(V, 1, 2, 3)])
    p[1, 0] = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])  # draft 1 rejected w.p. 1/2; residual only at 4
    ids = torch.tensor([[1, 2], [1, 2]])
    outs = [rejection_sample(p, None, ids, seed=s, backend=backend) for s in range(8)]
    assert all(o.token_ids[0].tolist() == [1, 2, 3] for o in outs)
    row1 = {tuple(o.token_ids[1].tolist()) for o in outs}
    assert row1 <= {(1, 2, 3), (4, -1, -1)} and len(row1) == 2


@pytest.mark.parametrize("validate", [False, True], ids=["no-validation", "validate"])
def test_zero_residual_mass_falls_back_to_target(backend, validate):
    """p_0 == q_0 (one-hot at 2) and the draft 4 has q = 0, so it is rejected with a residual
    max(p - q, 0) that is zero everywhere: the corrected token comes from p_0, i.e. 2. Finite
    inputs keep this fallback on every path, from probabilities and from logits (-inf entries
    are finite inputs: tokens filtered out)."""
    V = 5
    p = one_hot(V, 2, 0)[None]
    q = one_hot(V, 2)[None]
    ids = torch.tensor([[4]])  # q(4) = 0 -> rejected; residual max(p - q, 0) = 0 everywhere
    logits = torch.full((1, 2, V), float("-inf"))
    logits[0, :, 2] = 1.5  # softmax: one-hot at 2 in both rows
    for out in (rejection_sample(p, q, ids, seed=0, validate=validate, backend=backend),
                rejection_sample_logits(logits, logits[:, :1].clone(), ids, seed=0, validate=validate,
                                        backend=backend)):
        assert out.token_ids.tolist() == [[2, -1]] and out.num_accepted.tolist() == [0]


@pytest.mark.parametrize("backend_", ["reference", "torch", pytest.param("triton", marks=needs_triton)])
def test_first_rejection_index(backend_):
    accepted = torch.tensor(
        [
            [True, True, False, True],
            [True, True, True, True],
            [False, True, True, True],
            [True, False, True, True],
            [True, True, True, False],
        ]
    )
    n = torch.tensor([4, 3, 2, 1, 0])
    assert first_rejection_index(accepted, n, backend=backend_).tolist() == [2, 3, 0, 1, 0]
    assert first_rejection_index(accepted, backend=backend_).tolist() == [2, 4, 0, 1, 3]
    big = torch.rand(7, 37, generator=torch.Generator().manual_seed(0)) < 0.95
    nb = torch.tensor([0, 37, 5, 20, 36, 1, 30])
    assert torch.equal(
        first_rejection_index(big, nb, backend=backend_), first_rejection_index(big, nb, backend="reference")
    )
    for bad in ([-2, 1, 1, 1, 1], [4, 5, 1, 1, 1]):  # outside [0, K]: an error, never a clamp
        with pytest.raises(ValueError, match="num_draft_tokens"):
            first_rejection_index(accepted, torch.tensor(bad), backend=backend_)
    strided = torch.tensor([[4, 9], [3, 9], [2, 9], [1, 9], [0, 9]])[:, 0]  # a column: stride 2
    assert first_rejection_index(accepted, strided, backend=backend_).tolist() == [2, 3, 0, 1, 0]


def _column(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B] as a strided view: column 0 of a [B, 2] tensor (what ``x[:, 0]`` hands a function)."""
    return torch.stack((t, torch.zeros_like(t)), 1)[:, 0]


@pytest.mark.parametrize("fast_backend", FAST)
def test_strided_row_inputs_are_read_by_value(fast_backend):
    """Counts, greedy flags and per-row seeds given as strided [B] views give the same tokens as
    contiguous ones (kernels index [B] inputs as contiguous, so launchers must copy views)."""
    p, q, ids, n, greedy, noise = make_case(6, 4, 300, torch.float32, draft=True, ragged=True, greedy="mixed")
    noise = noise_for(fast_backend, noise)
    expected = rejection_sample(p, q, ids, n, greedy=greedy, noise=noise, backend=fast_backend)
    got = rejection_sample(p, q, ids, _column(n), greedy=_column(greedy), noise=noise, backend=fast_backend)
    assert torch.equal(got.token_ids, expected.token_ids) and torch.equal(got.num_accepted, expected.num_accepted)
    seeds = torch.arange(6) * 7 + 1
    by_seed = rejection_sample(p, q, ids, n, seed=seeds, backend=fast_backend)
    assert torch.equal(rejection_sample(p, q, ids, n, seed=_column(seeds), backend=fast_backend).token_ids,
                       by_seed.token_ids)


# --------------------------------------------------------------------------- logits helpers


def test_process_logits_definition():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0], [0.5, 0.5, 4.0, 1.0, 0.0]])
    torch.testing.assert_close(process_logits(logits, 2.0), torch.softmax(logits / 2, -1))
    top2 = process_logits(logits, 1.0, top_k=2)
    assert (top2 > 0).sum(-1).tolist() == [2, 2]
    torch.testing.assert_close(top2[0, [1, 2]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    # top_p = 0.5 keeps only the first token of row 1 (mass 0.88 >= 0.5) and two of row 0.
    top_p = process_logits(logits, 1.0, top_p=0.7)
    assert (top_p > 0).sum(-1).tolist() == [2, 1]
    greedy = process_logits(logits, torch.tensor([0.0, 1.0]))
    assert greedy[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(greedy[1], torch.softmax(logits[1], -1))
    assert process_logits(logits.half(), 1.0).dtype == torch.float32


def test_sample_logits_greedy_rows_and_support():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    temperature = (torch.arange(64) % 2).float()  # even rows greedy
    tok = sample_logits(logits, temperature, top_k=3, generator=torch.Generator().manual_seed(1))
    assert tok.dtype == torch.int64 and tok.shape == (64,)
    assert torch.equal(tok[::2], logits[::2].argmax(-1))
    top3 = logits.topk(3, -1).indices
    assert (top3 == tok[:, None]).any(-1).all()
    with SyncCounter() as syncs:
        sample_logits(logits, temperature, top_p=0.9)
    assert syncs.count == 0, syncs.events


# --------------------------------------------------------------------------- reproducibility


@pytest.mark.parametrize("backend_", ["torch", pytest.param("triton", marks=needs_triton)])
def test_same_seed_same_tokens_and_rows_independent(backend_):
    B, K, V = 12, 3, 50
    p = torch.softmax(torch.randn(1, K + 1, V, generator=torch.Generator().manual_seed(0)), -1).expand(
        B, -1, -1
    )
    q = torch.softmax(torch.randn(1, K, V, generator=torch.Generator().manual_seed(1)), -1).expand(B, -1, -1)
    ids = torch.randint(0, V, (1, K), generator=torch.Generator().manual_seed(2)).expand(B, -1)
    seeds = torch.arange(B, dtype=torch.int64) * 7919 + 3
    a = rejection_sample(p, q, ids, seed=seeds, backend=backend_)
    b = rejection_sample(p, q, ids, seed=seeds, backend=backend_)
    assert torch.equal(a.token_ids, b.token_ids)
    # A row depends on its own seed only: permuting the seeds permutes the rows.
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    c = rejection_sample(p, q, ids, seed=seeds[perm], backend=backend_)
    assert torch.equal(c.token_ids, a.token_ids[perm])
    # Different seeds give different draws (12 identical rows would be astronomically unlikely).
    assert len({tuple(r) for r in a.token_ids.tolist()}) > 1
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(
        rejection_sample(p, q, ids, generator=g1, backend=backend_).token_ids,
        rejection_sample(p, q, ids, generator=g2, backend=backend_).token_ids,
    )


# --------------------------------------------------------------------------- bad input


def _good():
    B, K, V = 2, 3, 10
    return dict(
        target_probs=torch.full((B, K + 1, V), 0.1),
        draft_probs=torch.full((B, K, V), 0.1),
        draft_token_ids=torch.zeros(B, K, dtype=torch.int64),
        num_draft_tokens=None,
    )


BAD_INPUTS = [
    pytest.param(dict(target_probs=torch.full((4, 10), 0.1)), ValueError, "target_probs", id="target-rank"),
    pytest.param(
        dict(target_probs=torch.ones(2, 4, 10, dtype=torch.int64)), TypeError, "target_probs", id="target-int"
    ),
    pytest.param(dict(draft_probs=torch.full((2, 2, 10), 0.1)), ValueError, "draft_probs", id="draft-K"),
    pytest.param(dict(draft_probs=torch.full((3, 3, 10), 0.1)), ValueError, "draft_probs", id="draft-B"),
    pytest.param(dict(draft_probs=torch.full((2, 3, 11), 0.1)), ValueError, "draft_probs", id="draft-V"),
    pytest.param(
        dict(draft_probs=torch.full((2, 3, 10), 0.1, dtype=torch.float16)),
        TypeError,
        "draft_probs",
        id="draft-dtype",
    ),
    pytest.param(
        dict(draft_token_ids=torch.zeros(2, 4, dtype=torch.int64)),
        ValueError,
        "draft_token_ids",
        id="ids-shape",
    ),
    pytest.param(dict(draft_token_ids=torch.zeros(2, 3)), TypeError, "draft_token_ids", id="ids-float"),
    pytest.param(dict(draft_token_ids=torch.full((2, 3), 10)), ValueError, "draft_token_ids", id="ids-range"),
    pytest.param(
        dict(draft_token_ids=torch.full((2, 3), -1)), ValueError, "draft_token_ids", id="ids-negative"
    ),
    pytest.param(dict(num_draft_tokens=torch.tensor([0, 4])), ValueError, "num_draft_tokens", id="n-above-K"),
    pytest.param(
        dict(num_draft_tokens=torch.tensor([-1, 2])), ValueError, "num_draft_tokens", id="n-negative"
    ),
    pytest.param(
        dict(num_draft_tokens=torch.tensor([1, 2, 3])), ValueError, "num_draft_tokens", id="n-shape"
    ),
    pytest.param(
        dict(num_draft_tokens=torch.tensor([1.0, 2.0])), TypeError, "num_draft_tokens", id="n-float"
    ),
    pytest.param(
        dict(target_probs=torch.full((2, 4, 10), float("nan"))), ValueError, "target_probs", id="nan"
    ),
    pytest.param(dict(draft_probs=torch.full((2, 3, 10), float("inf"))), ValueError, "draft_probs", id="inf"),
    pytest.param(dict(target_probs=torch.full((2, 4, 10), -0.1)), ValueError, "target_probs", id="negative"),
    pytest.param(dict(target_probs=torch.full((2, 4, 10), 0.2)), ValueError, "target_probs rows must sum to 1",
                 id="target-not-normalized"),
    pytest.param(dict(draft_probs=torch.zeros(2, 3, 10)), ValueError, "draft_probs rows must sum to 1",
                 id="draft-zero-rows"),
    pytest.param(dict(noise=RejectionNoise(torch.full((2, 3), 0.5)), backend="torch"), ValueError,
                 "noise.uniform", id="noise-without-uniform"),
    pytest.param(dict(greedy=torch.tensor([1, 0])), ValueError, "greedy", id="greedy-int"),
    pytest.param(dict(seed=1.5), TypeError, "seed", id="seed-float"),
    pytest.param(dict(seed=torch.tensor([1, 2, 3])), ValueError, "seed", id="seed-shape"),
    pytest.param(dict(generator=torch.Generator(), seed=1), ValueError, "generator", id="generator-and-seed"),
    pytest.param(dict(backend="cuda"), ValueError, "backend", id="backend-name"),
]


@pytest.mark.parametrize("change,error,name", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument(change, error, name):
    kwargs = {**_good(), **change}
    with pytest.raises(error, match=name):
        rejection_sample(**kwargs)


def test_row_sums_are_checked_where_the_sampler_reads_them(backend):
    """validate=True sums the rows the sampler draws a token from (p_j, and q_j at a rejection),
    not the rows it reads one entry of, nor positions past a row's draft count."""
    B, K, V = 2, 3, 50
    p = torch.softmax(torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(0)), -1)
    q = p[:, :K].clone()  # q == p with u = 1: every draft is accepted, j = n_b
    ids, counts = torch.zeros(B, K, dtype=torch.int64), torch.tensor([3, 1])
    noise = RejectionNoise(torch.ones(B, K), torch.full((B, 2), 0.5), torch.ones(B, V))
    q[1, 1:], p[1, 2:] = float("nan"), float("nan")  # past row 1's count: never read
    p[0, 1, 1:] *= 2.0  # only p_1(x_1) is read of this row (x_1 = 0): not summed
    q[0, 1, 1:] *= 2.0
    out = rejection_sample(p, q, ids, counts, noise=noise, backend=backend)
    assert out.num_accepted.tolist() == [3, 1]
    bonus_off = p.clone()
    bonus_off[0, 3] *= 1.01  # the bonus row of row 0
    with pytest.raises(ValueError, match="target_probs rows must sum to 1"):
        rejection_sample(bonus_off, q, ids, counts, noise=noise, backend=backend)
    rejected = q.clone()  # q_0(x_0) = 1 > p_0(x_0): row 0 rejects draft 0 and reads q_0 in full
    rejected[0, 0] = torch.nn.functional.one_hot(torch.tensor(0), V)
    assert rejection_sample(p, rejected, ids, counts, noise=noise, backend=backend).num_accepted.tolist() == [0, 1]
    rejected[0, 0, 1] = 0.5
    with pytest.raises(ValueError, match="draft_probs rows must sum to 1"):
        rejection_sample(p, rejected, ids, counts, noise=noise, backend=backend)


def test_fp16_rows_sum_to_one_within_subnormal_rounding():
    """A uniform fp16 row over 256000 entries (sum off by 7e-3 from subnormal rounding) passes."""
    wide = torch.softmax(torch.zeros(1, 2, 256000), -1).half()
    rejection_sample(wide, None, torch.zeros(1, 1, dtype=torch.int64), seed=0)


VALUE_ERRORS = [param for param in BAD_INPUTS if param.id in (
    "ids-range", "n-above-K", "nan", "inf", "negative", "target-not-normalized", "draft-zero-rows")]


@pytest.mark.parametrize("change,error,name", VALUE_ERRORS)
def test_every_backend_checks_the_values_it_reads(backend, change, error, name):
    """The torch path checks sums it computes anyway; the reference and the kernel have the same
    values gathered again after the call: the same errors either way."""
    with pytest.raises(error, match=name):
        rejection_sample(**{**_good(), **change, "backend": backend})


@pytest.mark.parametrize("backend_", ["reference", "torch"])
def test_greedy_rows_check_the_largest_entries_they_read(backend_):
    """Greedy rows read only argmaxes: their rows' largest entries must be finite and in (0, 1]
    (logits passed as probabilities are caught); rows past the accepted ones are not read."""
    p = torch.softmax(torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(0)), -1)
    ids = p[:, :2].argmax(-1)
    ids[:, 1] = (ids[:, 1] + 1) % 10  # draft 1 is not the argmax: rows read positions 0 and 1
    p[:, 2] = float("nan")
    rejection_sample(p, None, ids, greedy=True, backend=backend_)
    for bad, message in ((float("nan"), "NaN or inf"), (-1.0, "without a positive probability"),
                         (3.0, "above 1")):
        q = p.clone()
        q[1, 1] = bad
        with pytest.raises(ValueError, match=f"target_probs .*{message}"):
            rejection_sample(q, None, ids, greedy=True, backend=backend_)


def test_validation_reads_the_host_once():
    """Every value check of a call is decided by one host read (none when validate=False)."""
    p, q, ids, n, g, _ = make_case(8, 4, 300, torch.float32, draft=True, ragged=True, greedy="mixed")
    for call in (lambda **kw: rejection_sample(p, q, ids, n, greedy=g, seed=0, **kw),
                 lambda **kw: rejection_sample(p, None, ids, n, greedy=True, **kw),
                 lambda **kw: rejection_sample_logits(p.log(), q.log(), ids, n, temperature=0.7, top_k=20,
                                                      seed=torch.arange(8), **kw)):
        with SyncCounter() as syncs:
            call()
        assert syncs.count == 1, syncs.events
        with SyncCounter() as syncs:
            call(validate=False)
        assert syncs.count == 0, syncs.events


def test_generator_for_another_device_raises():
    kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _good().items()}
    with pytest.raises(ValueError, match="generator"):
        rejection_sample(**kwargs, generator=torch.Generator(), backend="torch")
    with pytest.raises(ValueError, match="generator"):
        sample_logits(torch.zeros(2, 10, device="meta"), generator=torch.Generator())
    with pytest.raises(ValueError, match="generator"):
        make_rejection_noise(2, 3, device="meta", generator=torch.Generator())


def test_tensors_on_different_devices_raise():
    kwargs = _good()
    kwargs["draft_probs"] = kwargs["draft_probs"].to("meta")
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(**kwargs, backend="torch")


@pytest.mark.parametrize(
    "change,error,name",
    [
        pytest.param(dict(temperature=-1.0), ValueError, "temperature", id="T-negative"),
        pytest.param(dict(temperature=10**400), ValueError, "temperature", id="T-int-past-float-range"),
        pytest.param(dict(temperature=torch.ones(3)), ValueError, "temperature", id="T-shape"),
        pytest.param(dict(temperature=torch.tensor([1.0, -1.0])), ValueError, "temperature", id="T-row-negative"),
        pytest.param(dict(temperature=torch.tensor([float("nan"), 1.0])), ValueError, "temperature", id="T-row-nan"),
        pytest.param(dict(top_k=0), ValueError, "top_k", id="topk-0"),
        pytest.param(dict(top_p=1.5), ValueError, "top_p", id="topp-range"),
        pytest.param(
            dict(target_logits=torch.full((2, 4, 10), float("nan"))), ValueError, "target_logits", id="nan"
        ),
        pytest.param(dict(target_logits=torch.zeros(2, 4, 10).index_fill_(2, torch.tensor([3]), float("inf"))),
                     ValueError, "target_logits", id="plus-inf"),
        pytest.param(dict(draft_logits=torch.full((2, 3, 10), float("-inf"))), ValueError, "draft_logits",
                     id="all-minus-inf"),
        pytest.param(dict(target_logits=torch.randn(2, 4, 10) * 50, temperature=1e-37), ValueError, "overflows",
                     id="temperature-overflow"),
    ],
)
def test_bad_logits_input(change, error, name):
    kwargs = dict(
        target_logits=torch.zeros(2, 4, 10),
        draft_logits=torch.zeros(2, 3, 10),
        draft_token_ids=torch.zeros(2, 3, dtype=torch.int64),
    )
    with pytest.raises(error, match=name):
        rejection_sample_logits(**{**kwargs, **change})


def test_logit_rows_the_sampler_never_reads_are_not_checked():
    """validate=True looks only at the positions each row's count uses: an all -inf row past it
    (padding) is accepted, the same row inside it is refused."""
    target, draft = torch.randn(2, 4, 10), torch.randn(2, 3, 10)
    target[0, 2:], draft[0, 1:] = float("-inf"), float("-inf")
    ids = torch.zeros(2, 3, dtype=torch.int64)
    rejection_sample_logits(target, draft, ids, torch.tensor([1, 3]), seed=0, validate=True)
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample_logits(target, draft, ids, torch.tensor([2, 3]), seed=0, validate=True)


@pytest.mark.parametrize("field,values", [("accept", [[0.0, 0.5]]), ("accept", [[1.5, 0.5]]),
                                          ("uniform", [[1.0, 0.5]]), ("uniform", [[float("nan"), 0.5]]),
                                          ("exponential", [[0.0] + [1.0] * 9])])
def test_explicit_noise_out_of_range_is_refused(field, values):
    """Explicit noise is range-checked when validating (it silently picked zero-probability tokens)."""
    probs = torch.softmax(torch.randn(1, 3, 10), -1)
    noise = dict(accept=torch.full((1, 2), 0.5), uniform=torch.full((1, 2), 0.5), exponential=torch.ones(1, 10))
    noise[field] = torch.tensor(values)
    with pytest.raises(ValueError, match=f"noise.{field}"):
        rejection_sample(probs, probs[:, :2], torch.zeros(1, 2, dtype=torch.int64), noise=RejectionNoise(**noise))


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(batch=2, num_draft=3, seed=torch.tensor([5])), ValueError, "seed"),
    (dict(batch=2, num_draft=3, seed=1.5), TypeError, "seed"),
    (dict(batch=2, num_draft=-1), ValueError, "num_draft"),
    (dict(batch=True, num_draft=3), ValueError, "batch"),
    (dict(batch=2, num_draft=3, vocab=0), ValueError, "vocab"),
    (dict(batch=2, num_draft=3, generator=0), TypeError, "generator"),
], ids=["seed-shape", "seed-float", "num-draft-negative", "batch-bool", "vocab-zero", "generator-type"])
def test_make_rejection_noise_bad_input(kwargs, error, name):
    with pytest.raises(error, match=name):
        make_rejection_noise(**kwargs)


@pytest.mark.parametrize("temperature", [torch.tensor([1.0, -1.0]), torch.tensor([float("inf"), 1.0])],
                         ids=["negative", "inf"])
def test_bad_temperature_rows_raise(temperature):
    """A [B] temperature is checked row by row (sync-free), like a float one."""
    logits = torch.randn(2, 10)
    for fn in (process_logits, sample_logits):
        with pytest.raises(ValueError, match="temperature"):
            fn(logits, temperature)


# --------------------------------------------------------------------------- values no token comes from

#: Faults that leave a row without a token, applied to one row of V = 11 entries (entry 2 is the
#: drafted token of the row they hit, so entries 5 and 7 are not the one the acceptance test reads).
NO_TOKEN = {
    "nan-row": lambda row: row.fill_(float("nan")),
    "one-nan": lambda row: row[5:6].fill_(float("nan")),
    "plus-inf": lambda row: row[7:8].fill_(float("inf")),
    "minus-inf-row": lambda row: row.fill_(float("-inf")),
}
#: Sampler settings that force each branch: greedy, sampled (also with top-k / top-p, which adds the
#: thresholds kernel), per-row greedy flags, and a bonus-only row (count 0: position 0 is the bonus).
LOGIT_SETTINGS = {
    "greedy": dict(temperature=0.0),
    "T0.8": dict(temperature=0.8),
    "T0.8-topk-topp": dict(temperature=0.8, top_k=5, top_p=0.9),
    "row1-greedy": dict(temperature=torch.tensor([0.8, 0.0, 0.8])),
    "row1-bonus": dict(temperature=0.8, counts=torch.tensor([3, 0, 3])),
}
PROB_SETTINGS = {
    "sampled": dict(),
    "greedy": dict(greedy=True),
    "row1-greedy": dict(greedy=torch.tensor([False, True, False])),
    "row1-bonus": dict(counts=torch.tensor([3, 0, 3])),
}
#: Draft rows a greedy or bonus-only row never reads: nothing to refuse without validation.
_DRAFT_UNREAD = ("greedy", "row1-greedy", "row1-bonus")
#: Per input kind: the op, its settings, and how the validation and the refusal word the fault.
NO_TOKEN_OPS = {
    "logits": (rejection_sample_logits, LOGIT_SETTINGS, "has a row with NaN", r"hold NaN, \+inf or only -inf"),
    "probs": (rejection_sample, PROB_SETTINGS, "contains NaN or inf", "hold NaN or inf"),
}


def _no_token_cases():
    cases = []
    for kind, (_, settings, _, _) in NO_TOKEN_OPS.items():
        for fault in NO_TOKEN:
            for which in ("target", "draft"):
                for setting in settings:
                    for validate in (False, True):
                        # Validating logits checks the draft rows of greedy rows too (not those past a
                        # row's count); validating probabilities checks only what the sampler reads.
                        checked = validate and kind == "logits" and setting != "row1-bonus"
                        if which == "draft" and setting in _DRAFT_UNREAD and not checked:
                            continue
                        name = f"{kind}-{fault}-{which}-{setting}-" + ("validate" if validate else "no-validation")
                        cases.append(pytest.param(kind, fault, which, setting, validate, id=name))
    return cases


def _bad_row_inputs(fault: str, which: str, kind: str):
    """B=3, K=3, V=11 target / draft rows (logits, or their softmax) with ``fault`` in batch row 1,
    position 0, which every row reads; row 1's draft token 2 has target probability 0, so sampling
    rejects it and reads the full target and draft rows at position 0."""
    g = torch.Generator().manual_seed(3)
    target, draft = torch.randn(3, 4, 11, generator=g), torch.randn(3, 3, 11, generator=g)
    ids = torch.randint(0, 11, (3, 3), generator=g)
    ids[1, 0] = 2
    target[1, 0, 2] = float("-inf")
    if kind == "probs":
        target, draft = torch.softmax(target, -1), torch.softmax(draft, -1)
    NO_TOKEN[fault]((target if which == "target" else draft)[1, 0])
    return target, draft, ids


@pytest.mark.parametrize("kind,fault,which,setting,validate", _no_token_cases())
def test_values_without_a_token_raise_on_every_backend(backend, kind, fault, which, setting, validate):
    """NaN anywhere in a row, +inf, or a row of only -inf, in target or draft logits or
    probabilities the sampler reads (the rows it samples from, the drafted tokens' entries, a greedy
    row's maximum): every backend raises, with validation (ValueError) and without
    (DeviceCheckError, checked on the device), instead of emitting an id chosen by an index guard."""
    op, settings, validated, refused = NO_TOKEN_OPS[kind]
    target, draft, ids = _bad_row_inputs(fault, which, kind)
    kwargs = dict(settings[setting])
    counts = kwargs.pop("counts", None)
    name = f"{which}_{kind}"
    error, match = (ValueError, f"{name} {validated}") if validate else (
        DeviceCheckError, rf"{name}: batch row\(s\) \[1\] {refused}")
    with pytest.raises(error, match=match):
        op(target, draft, ids, counts, seed=0, validate=validate, backend=backend, **kwargs)


@pytest.mark.parametrize("fault", NO_TOKEN)
def test_draft_rows_a_greedy_row_never_reads_are_ignored_without_validation(backend, fault):
    """Greedy verification reads target rows only: draft logits it never reads change nothing."""
    _, clean_draft, _ = _bad_row_inputs("nan-row", "target", "logits")  # the same draft rows, no fault
    target, draft, ids = _bad_row_inputs(fault, "draft", "logits")
    expected = rejection_sample_logits(target, clean_draft, ids, temperature=0.0, validate=False, backend=backend)
    out = rejection_sample_logits(target, draft, ids, temperature=0.0, validate=False, backend=backend)
    assert torch.equal(out.token_ids, expected.token_ids) and torch.equal(out.num_accepted, expected.num_accepted)


@pytest.mark.parametrize("temperature", [0.0, 1e-39, 0.8, "per-row"])
@pytest.mark.parametrize("fault", NO_TOKEN)
def test_sample_logits_refuses_a_row_without_a_distribution(fault, temperature):
    """A row with NaN, +inf or only -inf has no token to sample, greedy or not: an error, not a
    made-up id."""
    logits = torch.randn(3, 11)
    NO_TOKEN[fault](logits[1])
    t = torch.tensor([0.8, 0.0, 0.8]) if temperature == "per-row" else temperature
    with pytest.raises(DeviceCheckError, match="logits"):
        sample_logits(logits, t, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("poison", ["zeros", "negative", "ids", "counts"])
def test_invalid_values_without_validation_stay_in_range(backend, poison):
    """Finite invalid inputs (rows without mass, negative probabilities, ids and counts out of
    range) are not refused without validation: index guards keep every emitted id in [0, V)."""
    B, K, V = 4, 3, 37
    p, q, ids, n, _, _ = make_case(B, K, V, torch.float32, draft=True, ragged=True, greedy="none")
    greedy = torch.tensor([False, True, False, True])
    if poison == "zeros":
        p[:, :, : V // 2] = 0.0
        p[2] = 0.0
        q[1] = 0.0
    elif poison == "negative":
        p = -p
        q[0] = -q[0]
    elif poison == "ids":
        ids = torch.tensor([[-5, 40, 3], [37, 1, 2], [0, 100, 0], [-1, -1, -1]])
    else:
        n = torch.tensor([-3, 9, 2, 100])
    out = rejection_sample(p, q, ids, n, greedy=greedy, seed=0, validate=False, backend=backend)
    emitted = out.token_ids.gather(1, out.num_accepted[:, None])
    assert ((emitted >= 0) & (emitted < V)).all()
    assert ((out.num_accepted >= 0) & (out.num_accepted <= K)).all()


# --------------------------------------------------------------------------- host syncs


def test_torch_path_is_sync_free():
    p, q, ids, n, g, _ = make_case(8, 4, 300, torch.float16, draft=True, ragged=True, greedy="mixed")
    with SyncCounter() as syncs:
        rejection_sample(p, q, ids, n, greedy=g, seed=torch.arange(8), validate=False, backend="torch")
        rejection_sample(
            p, None, ids, n, generator=torch.Generator().manual_seed(0), validate=False, backend="torch"
        )
        rejection_sample_logits(
            p.float().log(),
            q.float().log(),
            ids,
            n,
            temperature=torch.rand(8),
            top_k=20,
            top_p=0.9,
            greedy=g,
            validate=False,
            backend="torch",
        )
        first_rejection_index(torch.rand(8, 4) < 0.5, n, backend="torch")
    assert syncs.count == 0, syncs.events


@needs_triton
def test_triton_launcher_is_sync_free():
    """The launchers do no host sync (events inside the Triton interpreter itself are not the op's)."""
    p, q, ids, n, g, _ = make_case(3, 2, 64, torch.float32, draft=True, ragged=True, greedy="mixed")
    with SyncCounter() as syncs:
        rejection_sample(p, q, ids, n, greedy=g, validate=False, backend="triton")
        rejection_sample_logits(
            p.log(), q.log(), ids, n, temperature=torch.rand(3), top_k=5, validate=False, backend="triton"
        )
        rejection_sample_logits(p.log(), None, ids, n, temperature=0.8, top_k=5, top_p=0.9, validate=False,
                                backend="triton")
    own = [e for e in syncs.events if "/triton/" not in e.where.replace("\\", "/")]
    assert not own, own


# --------------------------------------------------------------------------- bytes and launches

needs_interpreter = pytest.mark.skipif(
    not (triton_available() and interpreter_enabled()),
    reason="the traffic meter needs the Triton interpreter",
)


def minimum_bytes_probs(p, q, n, out, greedy) -> int:
    """Analytic minimum of the probability sampler: per row the ids and the gathers p_i(x_i),
    q_i(x_i) up to the first rejection, one full row of p (and q at a rejection), the outputs
    (tokens, count, the flags of rows without a token), plus the row's scalars (count, greedy
    flag, seed). Greedy rows read p rows 0..j in full."""
    B, K1, V = p.shape
    es = p.element_size()
    total = 0
    for b in range(B):
        nb, j = int(n[b]), int(out.num_accepted[b])
        total += 8 + 1 + 8 + K1 * 8 + 8 + 2  # count, greedy, seed; outputs and the two flags
        if greedy[b]:
            total += (j + 1) * V * es + min(j + 1, nb) * 8
            continue
        gathers = min(j + 1, nb)
        total += gathers * (8 + es * (2 if q is not None else 1))
        total += V * es * (2 if (q is not None and j < nb) else 1)
    return total


@needs_interpreter
@pytest.mark.parametrize(
    "dtype,draft", [(torch.float32, True), (torch.float16, False), (torch.bfloat16, True)]
)
def test_triton_bytes_within_115_percent_of_minimum(dtype, draft):
    B, K, V = 4, 4, 4096
    p, q, ids, n, _, _ = make_case(B, K, V, dtype, draft=draft, ragged=True, greedy="none", seed=7)
    greedy = torch.tensor([False, False, True, False])
    with TrafficMeter() as meter:
        out = rejection_sample(p, q, ids, n, greedy=greedy, seed=1, validate=False, backend="triton")
    assert meter.num_launches <= 2
    minimum = minimum_bytes_probs(p, q, n, out, greedy)
    assert meter.bytes_moved <= 1.15 * minimum, (meter, minimum)
    # Reading every position's residual row would cost K times more: make sure the test can tell.
    assert minimum < 0.5 * (B * (K + 1) * V * p.element_size())


@needs_interpreter
def test_triton_logits_bytes_within_115_percent_of_minimum():
    B, K, V = 4, 3, 4096
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(B, K + 1, V, generator=gen) * 3
    target = base + 0.3 * torch.randn(B, K + 1, V, generator=gen)
    draft = base[:, :K] + 0.3 * torch.randn(B, K, V, generator=gen)
    ids = torch.multinomial(torch.softmax(draft, -1).reshape(-1, V), 1, generator=gen).reshape(B, K)
    n = torch.tensor([3, 0, 2, 3])
    with TrafficMeter() as meter:
        out = rejection_sample_logits(
            target, draft, ids, n, temperature=0.9, seed=2, validate=False, backend="triton"
        )
    assert meter.num_launches <= 2
    row = V * 4
    minimum = 0
    for b in range(B):
        nb, j = int(n[b]), int(out.num_accepted[b])
        minimum += 8 + 1 + 4 + 8 + (K + 1) * 8 + 8 + 2  # row inputs; outputs and the two flags
        scanned = min(j + 1, nb)
        minimum += scanned * (2 * row + 8 + 2 * 4)  # normalizer passes of target and draft rows, gathers
        minimum += 2 * row if j < nb else row  # residual row (target and draft) or the bonus row
    assert meter.bytes_moved <= 1.15 * minimum, (meter, minimum)


@needs_interpreter
@pytest.mark.parametrize("draft", [True, False], ids=["draft", "nodraft"])
def test_triton_filtered_logits_is_two_launches(draft):
    """top-k and top-p: the thresholds kernel, then the sampler; filters that keep everything
    launch nothing extra. Thresholds are [B, K+1] + [B, K] floats, never a [B, K+1, V] tensor."""
    B, K, V = 3, 2, 300
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(B, K + 1, V, generator=gen) * 2
    draft_logits = target[:, :K] + 0.3 * torch.randn(B, K, V, generator=gen) if draft else None
    ids = torch.randint(0, V, (B, K), generator=gen)
    temperature = torch.tensor([0.9, 0.0, 1.2])
    noise = make_rejection_noise(B, K, V, generator=torch.Generator().manual_seed(6))
    kwargs = dict(temperature=temperature, top_k=20, top_p=0.9, noise=noise, validate=False)
    with TrafficMeter() as meter:
        out = rejection_sample_logits(target, draft_logits, ids, backend="triton", **kwargs)
    assert meter.num_launches <= 2
    assert [launch.kernel for launch in meter.launches] == [
        "_logit_thresholds_kernel",
        "_rejection_sample_logits_kernel",
    ]
    assert meter.launches[0].grid[:2] == (B, K + 1 + (K if draft else 0))
    assert meter.launches[0].bytes_stored == B * (K + 1 + (K if draft else 0)) * 4
    expected = rejection_sample_logits(target, draft_logits, ids, backend="reference", **kwargs)
    assert torch.equal(out.token_ids, expected.token_ids)
    with TrafficMeter() as meter:
        rejection_sample_logits(target, draft_logits, ids, backend="triton", **{**kwargs, "top_k": V, "top_p": 1.0})
    assert meter.num_launches == 1


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.3, top_k=5),
                                    dict(temperature=0.9, top_p=0.6), dict(temperature=0.8, top_k=9, top_p=0.75),
                                    dict(temperature=torch.tensor([0.0, 1.0, 0.5]), top_k=4)],
                         ids=["T", "T-topk", "T-topp", "T-topk-topp", "per-row-T-with-greedy"])
def test_process_logits_matches_the_reference_definition(params):
    from specdec_kernels.reference.sampling import process_logits as reference

    logits = torch.randn(3, 4, 57, generator=torch.Generator().manual_seed(3)) * 3
    logits[0, 0, :6] = 1.5  # ties at the top-k / top-p boundary
    torch.testing.assert_close(process_logits(logits, **params), reference(logits, **params))


def test_top_p_one_keeps_every_token_in_the_reference_too():
    """top_p = 1.0 is off on every path: summing the mass of the larger entries can round up to
    1.0 for the smallest ones, which the reference then dropped (the fast path did not)."""
    from specdec_kernels.reference.sampling import process_logits as reference

    logits = torch.randn(4, 2, 300, generator=torch.Generator().manual_seed(0)) * 4
    unfiltered = reference(logits, 0.7)
    assert torch.equal(reference(logits, 0.7, top_p=1.0), unfiltered)
    assert torch.equal(process_logits(logits, 0.7, top_p=1.0) > 0, unfiltered > 0)


def test_empty_vocabulary_and_reference_noise_without_uniforms_are_clear_errors():
    with pytest.raises(ValueError, match="V >= 1"):
        sample_logits(torch.randn(2, 0), 1.0)
    with pytest.raises(ValueError, match="V >= 1"):
        process_logits(torch.randn(2, 0))
    probs = torch.softmax(torch.randn(1, 2, 5), -1)
    noise = RejectionNoise(torch.full((1, 1), 0.5))  # accept only: the reference needs a draw as well
    ids = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="reference backend consumes noise.uniform"):
        rejection_sample(probs, None, ids, noise=noise, backend="reference")
    with pytest.raises(ValueError, match="reference backend consumes noise.uniform"):
        rejection_sample_logits(probs.log(), None, ids, noise=noise, backend="reference")
