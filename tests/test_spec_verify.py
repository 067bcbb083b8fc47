"""Acceptance math: greedy rule, oracle / anti-oracle drafters, seeding, and losslessness by chi-square."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import outrider.speculative.verify as verify_mod
from outrider.sampler import RowSpec, Sampler, SamplingRows, TokenMasks
from outrider.params import SamplingParams
from outrider.speculative.verify import verify

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0)


def rows_for(params, seed, step, drafts):
    """The k+1 sampler rows of one request, as the runner lays them out."""
    return [RowSpec(params, seed, step + j) for j in range(len(drafts) + 1)]


def run(sampler, logits_per_row, params, drafts, seeds=None, probs=None):
    seeds = seeds or list(range(len(drafts)))
    rows = [r for d, s in zip(drafts, seeds) for r in rows_for(params, s, 0, d)]
    return verify(sampler, torch.cat(logits_per_row), sampler.prepare(rows), drafts, probs).settle()


def test_greedy_rule_accepts_while_draft_is_argmax():
    V, k = 16, 4
    sampler = Sampler(V, "cpu")
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(k + 1, V, generator=gen) for _ in range(6)]
    drafts = []
    for i, lg in enumerate(logits):  # row i matches the argmax for its first i drafts (capped at k)
        best = lg.argmax(-1).tolist()
        drafts.append([best[j] if j < i else (best[j] + 1) % V for j in range(k)])
    verdict = run(sampler, logits, GREEDY, drafts)
    for i, lg in enumerate(logits):
        m = min(i, k)
        assert verdict.num_accepted[i] == m
        assert verdict.tokens[i] == lg.argmax(-1).tolist()[: m + 1]


def test_oracle_drafter_accepts_everything():
    """Greedy oracle drafts at T=0, and q == p self-drafts at T>0, both reach k+1 tokens per round."""
    V, k = 16, 5
    sampler = Sampler(V, "cpu")
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(k + 1, V, generator=gen) for _ in range(8)]
    greedy = run(sampler, logits, GREEDY, [lg.argmax(-1).tolist()[:k] for lg in logits])
    assert greedy.num_accepted == [k] * 8
    # Self-draft: the drafter samples from exactly the target's processed distribution.
    q = [sampler.process(lg, sampler.prepare(rows_for(SAMPLED, 0, 0, [0] * k))).exp() for lg in logits]
    drafts = [torch.multinomial(qi[:k], 1, generator=gen)[:, 0].tolist() for qi in q]
    sampled = run(sampler, logits, SAMPLED, drafts, probs=q)
    assert sampled.num_accepted == [k] * 8
    for v, d in zip(sampled.tokens, drafts):
        assert v[:k] == d


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_anti_oracle_drafter_gets_acceptance_one(params):
    """A drafted token with target probability 0 is always rejected: one token per round, from the target."""
    V, k = 16, 4
    banned = V - 1
    sampler = Sampler(V, "cpu")
    params = SamplingParams(**{**params.__dict__, "logit_bias": ((banned, -math.inf),)})
    gen = torch.Generator().manual_seed(2)
    logits = [torch.randn(k + 1, V, generator=gen) for _ in range(8)]
    for lg in logits:
        lg[:, banned] = 50.0  # the raw favourite, banned by the bias
    verdict = run(sampler, logits, params, [[banned] * k] * 8)
    assert verdict.num_accepted == [0] * 8
    assert all(len(t) == 1 and t[0] != banned for t in verdict.tokens)


def test_rows_without_drafts_draw_what_plain_sampling_draws():
    V = 16
    sampler = Sampler(V, "cpu")
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    rows = [RowSpec(SAMPLED, seed=s, step=7) for s in range(6)]
    plain = sampler.sample(logits, sampler.prepare(rows)).token_ids.tolist()
    verdict = verify(sampler, logits, sampler.prepare(rows), [[]] * 6).settle()
    assert [t[0] for t in verdict.tokens] == plain


def test_seeded_verdict_independent_of_batch():
    V, k = 12, 3
    sampler = Sampler(V, "cpu")
    gen = torch.Generator().manual_seed(4)
    mine = torch.randn(k + 1, V, generator=gen)
    draft = torch.randint(0, V, (k,), generator=gen).tolist()
    alone = run(sampler, [mine], SAMPLED, [draft], seeds=[77])
    others = [torch.randn(n + 1, V, generator=gen) for n in (0, 5, 2)]
    other_drafts = [[], [1, 2, 3, 4, 5], [0, 0]]
    for pos in range(4):
        lg = others[:pos] + [mine] + others[pos:]
        dr = other_drafts[:pos] + [draft] + other_drafts[pos:]
        seeds = [1, 2, 3][:pos] + [77] + [1, 2, 3][pos:]
        together = run(sampler, lg, SAMPLED, dr, seeds=seeds)
        assert together.tokens[pos] == alone.tokens[0]


def test_logprobs_follow_committed_tokens():
    V, k = 12, 3
    sampler = Sampler(V, "cpu")
    params = SamplingParams(temperature=0.0, n_probs=3)
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(5))
    best = logits.argmax(-1).tolist()
    verdict = run(sampler, [logits], params, [best[:k]])
    raw = torch.log_softmax(logits, -1)
    out = verdict.output
    torch.testing.assert_close(out.chosen_logprob, raw.gather(1, torch.tensor(best)[:, None])[:, 0])
    assert torch.equal(out.top_ids, raw.topk(3, -1).indices)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_greedy_batches_get_the_general_paths_verdict(data):
    """An all-greedy batch of argmax drafts takes the greedy path (Sampler.greedy and a comparison on the host). Its
    verdict (accepted counts, committed tokens, emitted ids and log-probs) equals the rejection-sampling path's,
    which one-hot q forces, under logit biases, end-of-generation bans, penalties and grammar masks; drafts are
    the processed argmax or not, at random."""
    V = data.draw(st.integers(4, 40), label="V")
    ks = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=4).filter(any), label="ks")
    token = st.integers(0, V - 1)
    sampler = Sampler(V, "cpu")
    sampler.set_eog_ids([V - 1])
    specs = []
    for i, k in enumerate(ks):
        params = SamplingParams(
            temperature=0.0, n_probs=data.draw(st.integers(0, 3)), min_tokens=data.draw(st.integers(0, 3)),
            logit_bias=tuple(data.draw(st.lists(st.tuples(token, st.sampled_from([-math.inf, -2.0, 4.0])),
                                                max_size=3))),
            repeat_penalty=data.draw(st.sampled_from([1.0, 1.5])), presence_penalty=data.draw(st.sampled_from([0, 1.0])))
        history = data.draw(st.lists(token, max_size=6))
        specs += [RowSpec(params, seed=i, step=j, history=history) for j in range(k + 1)]
    rows = SamplingRows.of(specs)
    constrained = sorted(data.draw(st.sets(st.integers(0, len(specs) - 1)), label="constrained rows"))
    if constrained:
        allowed = np.zeros((len(constrained), -(-V // 32) * 32), dtype=bool)
        for r in range(len(constrained)):
            allowed[r, data.draw(st.lists(token, min_size=1, max_size=V))] = True
        bits = np.packbits(allowed, axis=1, bitorder="little").view("<i4")  # bit j % 32 of word j // 32
        rows.allowed = TokenMasks(np.array(constrained, dtype=np.int64), bits)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="logits seed"))
    logits = torch.randn(len(specs), V, generator=gen) * data.draw(st.sampled_from([0.1, 1.0, 5.0]))
    best = sampler.greedy(logits, sampler.prepare(rows)).token_ids.tolist()
    drafts, start = [], 0
    for k in ks:
        drafts.append([best[start + j] if data.draw(st.booleans()) else data.draw(token) for j in range(k)])
        start += k + 1
    one_hot = [torch.nn.functional.one_hot(torch.tensor(d, dtype=torch.int64), V).float() if d else None
               for d in drafts]
    processed = sampler.processed
    calls = []
    sampler.processed = lambda *args: calls.append(1) or processed(*args)
    fast = verify(sampler, logits, sampler.prepare(rows), drafts).settle()
    assert not calls  # the greedy path processes no distributions
    general = verify(sampler, logits, sampler.prepare(rows), drafts, one_hot).settle()
    assert calls
    assert (fast.num_accepted, fast.tokens, fast.starts) == (general.num_accepted, general.tokens, general.starts)
    # (counted on the device, as when the drafter drafts its next round from the verdict: the same)
    pending = verify(sampler, logits, sampler.prepare(rows), drafts, accepted_on_device=True)
    assert pending.accepted.tolist() == fast.num_accepted
    on_device = pending.settle()
    assert (on_device.num_accepted, on_device.tokens) == (fast.num_accepted, fast.tokens)
    assert torch.equal(fast.output.token_ids, general.output.token_ids)
    for name in ("top_ids", "top_logprobs", "chosen_logprob"):
        a, b = getattr(fast.output, name), getattr(general.output, name)
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# --- losslessness: speculative output has the plain joint distribution ---------------------------------

V_TOY, K_TOY, N_SEQ = 5, 3, 12_000


def toy_tables():
    gen = torch.Generator().manual_seed(6)
    target = torch.randn(V_TOY, V_TOY, generator=gen) * 1.5  # bigram logits: row = previous token
    draft = torch.randn(V_TOY, V_TOY, generator=gen) * 1.5
    return target, draft


def speculative_pairs(mode: str) -> np.ndarray:
    """Generate two tokens after token 0 for N_SEQ seeded sequences by speculative rounds; count the pairs."""
    target, draft_logits = toy_tables()
    sampler = Sampler(V_TOY, "cpu")
    gen = torch.Generator().manual_seed(7)
    q_table = torch.softmax(draft_logits, -1)
    outs: list[list[int]] = [[] for _ in range(N_SEQ)]
    while True:
        active = [i for i in range(N_SEQ) if len(outs[i]) < 2]
        if not active:
            break
        last = torch.tensor([outs[i][-1] if outs[i] else 0 for i in active])
        drafts = torch.empty(len(active), K_TOY, dtype=torch.int64)
        probs = torch.empty(len(active), K_TOY, V_TOY)
        prev = last
        for j in range(K_TOY):
            q = q_table[prev]
            if mode == "greedy_draft":
                nxt = q.argmax(-1)
            elif mode == "sampled_draft":
                nxt = torch.multinomial(q, 1, generator=gen)[:, 0]
            else:  # "self_draft": q = the target's own processed distribution
                q = sampler.process(target[prev], sampler.prepare([RowSpec(SAMPLED, 0, 0)] * len(active))).exp()
                nxt = torch.multinomial(q, 1, generator=gen)[:, 0]
            drafts[:, j], probs[:, j], prev = nxt, q, nxt
        feed = torch.cat([last[:, None], drafts], dim=1)  # [x_last, d1..dk] -> target rows
        logits = target[feed.flatten()]
        rows = [r for n, i in enumerate(active) for r in rows_for(SAMPLED, i, len(outs[i]), drafts[n].tolist())]
        given = None if mode == "greedy_draft" else list(probs)
        verdict = verify(sampler, logits, sampler.prepare(rows), drafts.tolist(), given).settle()
        for n, i in enumerate(active):
            outs[i].extend(verdict.tokens[n])
    counts = np.zeros((V_TOY, V_TOY))
    for o in outs:
        counts[o[0], o[1]] += 1
    return counts


def plain_pairs_distribution() -> np.ndarray:
    target, _ = toy_tables()
    sampler = Sampler(V_TOY, "cpu")
    p = sampler.process(target, sampler.prepare([RowSpec(SAMPLED, 0, 0)] * V_TOY)).exp().double().numpy()
    return p[0][:, None] * p  # P(x1 | 0) * P(x2 | x1)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.flatten() / probs.sum() * counts.sum()  # float32 probabilities sum to 1 +- 1e-7
    observed = counts.flatten()
    assert observed[expected == 0].sum() == 0, "emitted a token the target gives probability 0"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


@pytest.mark.parametrize("mode", ["greedy_draft", "sampled_draft", "self_draft"])
def test_speculative_distribution_equals_plain(mode):
    assert chi_square_pvalue(speculative_pairs(mode), plain_pairs_distribution()) > 1e-3


@pytest.mark.parametrize("broken", ["no_residual_correction", "accept_any_possible_token"])
def test_chi_square_catches_wrong_acceptance(broken, monkeypatch):
    """The same test must reject a verifier whose rejection path (drafts with their q) is wrong, so it can see a
    real bug."""
    if broken == "no_residual_correction":
        monkeypatch.setattr(verify_mod, "residual", lambda p, q: p)
    else:
        monkeypatch.setattr(verify_mod, "residual", lambda p, q: p * (q == 0))  # as if accepting all p > 0
        original = verify_mod.Sampler.uniform
        monkeypatch.setattr(verify_mod.Sampler, "uniform", lambda self, b, s: original(self, b, s) * 0)
    assert chi_square_pvalue(speculative_pairs("sampled_draft"), plain_pairs_distribution()) < 1e-6


def test_chi_square_catches_a_compared_draw_from_another_distribution(monkeypatch):
    """Argmax drafts are checked against the target's own draw: a verifier drawing that from anything but p
    (here p at temperature 2) is caught."""
    original = verify_mod.Sampler.gumbel_argmax
    monkeypatch.setattr(verify_mod.Sampler, "gumbel_argmax",
                        lambda self, logp, ids, b, s: original(self, logp / 2, ids, b, s))
    assert chi_square_pvalue(speculative_pairs("greedy_draft"), plain_pairs_distribution()) < 1e-6


def test_argmax_drafts_emit_the_plain_draw_at_every_position():
    """Sample and compare: every token a verify step emits is the token a plain step draws at that output index
    (same seed), accepted or not, so seeded output does not depend on the drafts."""
    target, draft_logits = toy_tables()
    sampler = Sampler(V_TOY, "cpu")
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        prev, k = int(torch.randint(V_TOY, (1,), generator=gen)), trial % 4
        drafts = torch.randint(V_TOY, (k,), generator=gen).tolist()
        feed = [prev, *drafts]
        rows = rows_for(SAMPLED, trial, 5, drafts)
        verdict = verify(sampler, target[feed], sampler.prepare(rows), [drafts]).settle()
        plain = sampler.sample(target[feed], sampler.prepare(rows)).token_ids.tolist()
        m = verdict.num_accepted[0]
        assert verdict.tokens[0] == plain[: m + 1]
        assert drafts[:m] == plain[:m] and (m == k or drafts[m] != plain[m])
