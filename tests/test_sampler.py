"""Sampler: filters against a slow llama.cpp-style reference, seeding, goodness of fit, penalties, log-probs."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from outrider.sampler import ParamTable, RowSpec, Sampler, SamplingRows
from outrider.params import SamplingParams

V = 32


def plain(**kw) -> SamplingParams:
    """Params with every filter off unless asked for."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    return SamplingParams(**{**base, **kw})


def reference_probs(logits, params: SamplingParams, history=()) -> np.ndarray:
    """A loop-by-loop transcription of llama.cpp's default chain for one row (float64)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for tok, b in params.logit_bias:
        x[tok] += b
    n = params.repeat_last_n if params.repeat_last_n >= 0 else len(history)
    window = list(history)[-n:] if n > 0 else []
    for tok in set(window):
        c = window.count(tok)
        x[tok] = x[tok] * params.repeat_penalty if x[tok] <= 0 else x[tok] / params.repeat_penalty
        x[tok] -= c * params.frequency_penalty + params.presence_penalty
    out = np.zeros_like(x)
    if params.temperature <= 0:
        out[int(np.argmax(x))] = 1.0
        return out
    cand = sorted(range(len(x)), key=lambda t: -x[t])
    if params.top_k > 0:
        cand = cand[: params.top_k]

    def softmax(ids):
        z = np.exp(x[ids] - x[ids].max())
        return z / z.sum()

    if params.typical_p < 1.0:
        p = softmax(cand)
        ent = -sum(pi * math.log(pi) for pi in p if pi > 0)
        order = sorted(range(len(cand)), key=lambda i: abs(-math.log(p[i]) - ent))
        cum, last = 0.0, len(cand)
        for j, i in enumerate(order):
            cum += p[i]
            if cum > params.typical_p:
                last = j + 1
                break
        cand = sorted([cand[i] for i in order[:last]], key=lambda t: -x[t])
    if params.top_p < 1.0:
        p = softmax(cand)
        cum, last = 0.0, len(cand)
        for i, pi in enumerate(p):
            cum += pi
            if cum >= params.top_p:
                last = i + 1
                break
        cand = cand[:last]
    if params.min_p > 0:
        floor = x[cand].max() + math.log(params.min_p)
        cand = [t for t in cand if x[t] >= floor]
    z = np.exp((x[cand] - x[cand].max()) / params.temperature)
    out[cand] = z / z.sum()
    return out


def run_process(params_list, logits, histories=None):
    sampler = Sampler(logits.shape[1], "cpu")
    histories = histories or [()] * len(params_list)
    batch = sampler.prepare([RowSpec(p, seed=1, step=0, history=h) for p, h in zip(params_list, histories)])
    return sampler.process(logits, batch).exp().numpy()


FILTER_CASES = [
    plain(),
    plain(temperature=0.7),
    plain(top_k=5),
    plain(top_p=0.8),
    plain(min_p=0.1),
    plain(typical_p=0.6),
    plain(temperature=1.3, top_k=10, top_p=0.9, min_p=0.02),
    plain(temperature=0.5, top_k=12, typical_p=0.8, top_p=0.95),
    SamplingParams(),  # llama-server defaults
]


@pytest.mark.parametrize("params", FILTER_CASES,
                         ids=lambda p: f"T{p.temperature}k{p.top_k}p{p.top_p}m{p.min_p}t{p.typical_p}")
def test_filters_match_reference(params):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 2
    got = run_process([params] * 6, logits)
    for i in range(6):
        np.testing.assert_allclose(got[i], reference_probs(logits[i], params), atol=1e-5)


def test_mixed_batch_matches_reference_per_row():
    """Rows with different filters (and a full-vocab row forcing full width) share one batch."""
    logits = torch.randn(len(FILTER_CASES), V, generator=torch.Generator().manual_seed(1)) * 2
    got = run_process(FILTER_CASES, logits)
    for i, p in enumerate(FILTER_CASES):
        np.testing.assert_allclose(got[i], reference_probs(logits[i], p), atol=1e-5)


def test_greedy_is_argmax_and_one_hot():
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(V, "cpu")
    batch = sampler.prepare([RowSpec(plain(temperature=0.0), seed=i, step=i) for i in range(16)])
    assert torch.equal(sampler.sample(logits, batch).token_ids, logits.argmax(-1))
    probs = sampler.process(logits, batch).exp()
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_a_temperature_that_rounds_to_zero_on_the_device_is_greedy():
    """1e-50 > 0, but the device holds temperatures as float32, where it is 0: such a row is greedy everywhere
    (no division by a zero temperature), alone and beside sampled rows."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(V, "cpu")
    for temps in ([1e-50] * 4, [1e-50, 1.0, 1e-50, 0.7]):
        batch = sampler.prepare([RowSpec(plain(temperature=t), seed=i, step=0) for i, t in enumerate(temps)])
        tokens = sampler.sample(logits, batch).token_ids
        probs = sampler.process(logits, batch).exp()
        for i, t in enumerate(temps):
            if t < 1e-40:
                assert tokens[i] == logits[i].argmax() and probs[i, logits[i].argmax()] == 1.0
        assert torch.isfinite(probs).all()


def test_penalties_match_reference():
    history = [3, 3, 7, 1, 3, 9, 9, 30]
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3)) * 3
    cases = [
        plain(repeat_penalty=1.3),
        plain(presence_penalty=0.7, frequency_penalty=0.4),
        plain(repeat_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=4),
        plain(repeat_penalty=1.5, repeat_last_n=-1),
        plain(repeat_penalty=1.5, repeat_last_n=0),
    ]
    for p in cases:
        got = run_process([p], logits, [history])[0]
        np.testing.assert_allclose(got, reference_probs(logits[0], p, history), atol=1e-5)


def test_repeat_penalty_pushes_greedy_off_a_repeated_token():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    sampler = Sampler(V, "cpu")
    rows = [RowSpec(plain(temperature=0.0, repeat_penalty=1.5), seed=0, step=0, history=[5])]
    assert sampler.sample(logits, sampler.prepare(rows)).token_ids.item() == 6


def test_logit_bias_and_bans():
    logits = torch.zeros(64, V)
    logits[:, 4] = 10.0
    sampler = Sampler(V, "cpu")
    params = plain(logit_bias=((4, -math.inf), (9, 2.0), (11, -math.inf)))
    rows = [RowSpec(params, seed=7, step=i) for i in range(64)]
    batch = sampler.prepare(rows)
    toks = sampler.sample(logits, batch).token_ids
    assert not ((toks == 4) | (toks == 11)).any()
    probs = sampler.process(logits, batch).exp()[0]
    assert probs[4] == 0 and probs[11] == 0
    assert probs[9] == pytest.approx(math.e**2 / (math.e**2 + V - 3), rel=1e-5)
    greedy = sampler.prepare([RowSpec(plain(temperature=0.0, logit_bias=((4, -math.inf),)), 0, 0)])
    assert sampler.sample(logits[:1], greedy).token_ids.item() != 4


def running(params: list[SamplingParams]) -> list[SimpleNamespace]:
    """Stand-ins for running requests (what ParamTable.sync reads), slot i each."""
    return [SimpleNamespace(params=p, seed=i, id_slot=i) for i, p in enumerate(params)]


@pytest.mark.parametrize("steps", [[5, 1, 0], [5, 4, 3]], ids=["every row banned", "some rows banned"])
def test_eog_bans_by_rule_match_explicit_bans(steps):
    """The runner's rows ban EOG ids by rule (ignore_eos, or short of min_tokens) as a logit bias of -inf on them
    would."""
    eog = (7, 30)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(8))
    logits[:, 7] = 20.0
    params = [plain(ignore_eos=True, n_probs=3), plain(temperature=0.0, min_tokens=4), plain(min_tokens=1)]
    sampler, unaware = Sampler(V, "cpu"), Sampler(V, "cpu")  # the second knows no EOG ids
    table = ParamTable()
    table.sync(running(params))
    sampler.set_eog_ids(eog)
    by_rule = sampler.prepare(SamplingRows(table, np.arange(3), np.array(steps)))
    biased = [dataclasses.replace(p, logit_bias=tuple((tok, -math.inf) for tok in eog))
              if p.ignore_eos or step < p.min_tokens else p for p, step in zip(params, steps)]
    explicit = unaware.prepare([RowSpec(p, i, step) for i, (p, step) in enumerate(zip(biased, steps))])
    got, want = sampler.sample(logits, by_rule), unaware.sample(logits, explicit)
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.top_logprobs, want.top_logprobs)
    assert torch.equal(sampler.process(logits, by_rule), unaware.process(logits, explicit))
    assert (got.token_ids == 7).tolist() == [False, steps[1] >= 4, steps[2] >= 1]


def test_param_table_rewrites_a_slot_only_for_another_request():
    table = ParamTable()
    a, b = running([plain(temperature=0.5), plain(temperature=0.7)])
    table.sync([a, b])
    a.params = plain(temperature=0.9)  # (never happens to a running request: shows the slot is not rewritten)
    table.sync([b, a])
    assert table.floats[0, :2].tolist() == pytest.approx([0.5, 0.7])
    c = SimpleNamespace(params=plain(temperature=0.3), seed=1, id_slot=0)  # a's slot, reused
    table.sync([c])
    assert table.floats[0, 0] == pytest.approx(0.3)


def test_unused_filters_do_not_change_draws():
    """A batch skips the filters no row uses; every row draws what it draws beside rows that use them all."""
    gen = torch.Generator().manual_seed(9)
    sampler = Sampler(V, "cpu")
    rows = [RowSpec(plain(temperature=0.7), 3, s) for s in range(8)]
    busy = [RowSpec(plain(top_k=5, top_p=0.5, min_p=0.1, typical_p=0.5), 3, 0), RowSpec(plain(temperature=0.0), 3, 0)]
    logits = torch.randn(10, V, generator=gen)
    alone = sampler.sample(logits[:8], sampler.prepare(rows, sample_only=True)).token_ids
    beside = sampler.sample(logits, sampler.prepare(rows + busy)).token_ids
    assert torch.equal(alone, beside[:8])


def test_seed_invariant_to_batch_composition():
    """A seeded row draws the same tokens alone, among other rows, at any index, with any batch width."""
    gen = torch.Generator().manual_seed(4)
    target = plain(temperature=0.9, top_k=20, top_p=0.95)
    sampler = Sampler(V, "cpu")
    for step in range(20):
        row_logits = torch.randn(1, V, generator=gen)
        alone = sampler.sample(row_logits, sampler.prepare([RowSpec(target, 1234, step)])).token_ids.item()
        others = [RowSpec(plain(top_k=0), 99, step), RowSpec(plain(temperature=0.0), 5, 3),
                  RowSpec(plain(top_k=3), 1234, step + 1)]
        for pos in range(len(others) + 1):
            rows = others[:pos] + [RowSpec(target, 1234, step)] + others[pos:]
            logits = torch.randn(len(rows), V, generator=gen)
            logits[pos] = row_logits[0]
            toks = sampler.sample(logits, sampler.prepare(rows)).token_ids
            assert toks[pos].item() == alone


def test_different_seeds_and_steps_differ():
    sampler = Sampler(V, "cpu")
    logits = torch.zeros(200, V)
    rows = [RowSpec(plain(), seed=s, step=0) for s in range(100)] + [RowSpec(plain(), 0, st) for st in range(100)]
    toks = sampler.sample(logits, sampler.prepare(rows)).token_ids
    assert len(set(toks[:100].tolist())) > 20 and len(set(toks[100:].tolist())) > 20


@pytest.mark.parametrize("params", [plain(temperature=0.8, top_p=0.9), SamplingParams(),
                                    plain(temperature=1.5, typical_p=0.7)])
def test_chi_square_against_processed_distribution(params):
    n, vocab = 40_000, 10
    sampler = Sampler(vocab, "cpu")
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    batch = sampler.prepare([RowSpec(params, seed=42, step=i) for i in range(n)])
    toks = sampler.sample(row.expand(n, vocab), batch).token_ids
    probs = sampler.process(row, sampler.prepare([RowSpec(params, 42, 0)])).exp()[0].double().numpy()
    counts = np.bincount(toks.numpy(), minlength=vocab)
    support = probs > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], probs[support] / probs[support].sum() * n).pvalue > 1e-3


def test_top_n_logprobs():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    sampler = Sampler(V, "cpu")
    rows = [RowSpec(plain(n_probs=4, repeat_penalty=1.5), 3, 0, history=[0, 1]),
            RowSpec(plain(temperature=0.0, n_probs=2), 3, 0), RowSpec(plain(), 3, 0)]
    batch = sampler.prepare(rows)
    out = sampler.sample(logits, batch)
    expected = torch.log_softmax(sampler.adjusted_logits(logits, batch), -1)
    vals, ids = expected.topk(4, dim=-1)
    assert out.top_ids.shape == (3, 4)
    assert torch.equal(out.top_ids, ids)
    torch.testing.assert_close(out.top_logprobs, vals)
    torch.testing.assert_close(out.chosen_logprob, expected.gather(1, out.token_ids[:, None])[:, 0])
    assert sampler.sample(logits, sampler.prepare([RowSpec(plain(), 0, 0)] * 3)).top_ids is None


def test_uniform_is_uniform_reproducible_and_stream_separated():
    sampler = Sampler(V, "cpu")
    batch = sampler.prepare([RowSpec(plain(), seed=9, step=i) for i in range(20_000)])
    u1, u2 = sampler.uniform(batch, 1), sampler.uniform(batch, 2)
    assert ((u1 > 0) & (u1 < 1)).all()
    assert stats.kstest(u1.numpy(), "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(u1.numpy(), u2.numpy())[0, 1]) < 0.03
    assert torch.equal(u1, sampler.uniform(batch, 1))


def stream_keys(rows: list[RowSpec]) -> np.ndarray:
    """The host keys of these rows, every stream."""
    from outrider.sampler import NUM_STREAMS, _seed_key, _stream_keys

    return _stream_keys(np.array([_seed_key(r.seed) for r in rows], dtype=np.int64),
                        np.array([r.step for r in rows], dtype=np.int64), NUM_STREAMS)


def test_stream_keys_agree_on_ints_and_arrays():
    """The host hash runs on Python ints for small batches and numpy arrays for large ones: same keys."""
    rng = np.random.default_rng(0)
    rows = [RowSpec(plain(), int(seed), int(step)) for seed, step in
            zip(rng.integers(0, 2**63 - 1, 40, dtype=np.int64), rng.integers(0, 2**32 + 5, 40))]
    many = stream_keys(rows)
    few = np.concatenate([stream_keys(rows[i : i + 4]) for i in range(0, len(rows), 4)], axis=1)
    assert many.dtype == few.dtype == np.int64 and np.array_equal(many, few)


def test_stream_keys_are_pinned_and_match_the_device_hash():
    """Seeded draws must not change across versions: host keys (either path) equal known values, and the hash
    computed on torch int64 tensors (the device's arithmetic) gives the same keys."""
    from outrider.sampler import _M32, _SALT, NUM_STREAMS, _absorb

    seeds_steps = [(0, 0), (1, 7), (2**63 - 1, 2**32 + 5), (123456789012345, 99)]
    rows = [RowSpec(plain(), seed, step) for seed, step in seeds_steps]
    pinned = [[1459986880, 663870494, 1618100533, 253648000], [2537935315, 2951709447, 1652868867, 3033719192],
              [2823541456, 631515596, 2387145058, 2891760805], [4077386885, 1114654818, 1901374852, 3355370414]]
    assert stream_keys(rows).tolist() == pinned  # Python ints (a few rows)
    assert stream_keys(rows * 3).tolist() == [r * 3 for r in pinned]  # numpy (many rows)
    col = lambda f: torch.tensor([f(r) & _M32 for r in rows], dtype=torch.int64)  # noqa: E731
    row = _absorb(_absorb(_absorb(_SALT, col(lambda r: r.seed)), col(lambda r: r.seed >> 32)), col(lambda r: r.step))
    assert _absorb(row[None, :], torch.arange(NUM_STREAMS)[:, None]).tolist() == pinned


def test_compiled_noise_never_recompiles_for_a_lone_row_or_one_candidate():
    """torch.compile specialises sizes 0 and 1; the sampler pads such calls, so the variant compiled at warm-up
    serves every batch (a recompile costs seconds inside a request). Draws are the same as the eager hash's."""
    import torch._dynamo

    from outrider.sampler import _gumbel_noise

    torch._dynamo.reset()
    calls = []

    def counting_backend(gm, example_inputs):
        calls.append(1)
        return gm.forward

    sampler = Sampler(64, "cpu")
    sampler._noise = torch.compile(_gumbel_noise, dynamic=True, backend=counting_backend)
    eager = Sampler(64, "cpu")
    for rows, top_k in ((3, 5), (1, 5), (4, 1), (1, 1), (6, 9)):
        params = SamplingParams(temperature=0.8, top_k=top_k, top_p=1.0, min_p=0.0)
        specs = [RowSpec(params, seed=i, step=2) for i in range(rows)]
        logits = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        got = sampler.sample(logits, sampler.prepare(specs, sample_only=True)).token_ids
        want = eager.sample(logits, eager.prepare(specs, sample_only=True)).token_ids
        assert torch.equal(got, want), (rows, top_k)
    assert len(calls) == 1
    torch._dynamo.reset()
