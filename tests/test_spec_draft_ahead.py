"""Drafting ahead: the drafter learns a verify step's committed rows and drafts the next round from the verdict while
it is still on the device (Speculator.draft_ahead), before the host reads and commits the round.

It must propose what drafting after the commit proposes (token for token, in float32, wherever both draft the same
length from the same sequence: the path of a request that trims its drafts), and keep greedy output equal to plain
decoding when rounds end early on a stop or a token limit."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from spec_helpers import SETUPS, write_attentive_families

AHEAD_KINDS = ["dflash", "mtp", "mimo", "eagle3"]
PROMPTS = [[5, 9, 100, 13, 7, 200, 11, 17, 19, 23], [42, 300, 8, 8, 9], list(range(60, 81)), [7, 100, 200, 300]]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_attentive_families(tmp_path_factory.mktemp("ahead"))


def spec_llm(families, kind: str, plain: bool = False, **kwargs) -> LLM:
    """The kind's setup, or with `plain` its target alone."""
    arch, served, engine_kwargs, _ = SETUPS[kind]
    extra = {"spec_type": "none"} if plain else engine_kwargs(families[arch])
    return LLM(families[arch][served], dtype="float32", max_num_seqs=8, overlap_schedule=True, spec_draft_n_max=3,
               spec_measured_costs=False, **extra, **kwargs)


def record_rounds(engine) -> dict:
    """Every verified round, keyed by (the request's tokens before it, its draft length) -> the drafts (read in the
    verdict's copy); and how many rounds were drafted ahead."""
    rounds, counts = {}, {"ahead": 0}
    collect, draft_ahead = engine.runner.collect, engine.speculation.speculator.draft_ahead

    def recorded_collect(step):
        before = {s.request.request_id: tuple(s.request.prompt_ids + s.request.output_ids) for s in step.plan.scheduled}
        out = collect(step)
        for s in step.plan.scheduled:
            if s.draft_tokens:
                rounds[(before[s.request.request_id], len(s.draft_tokens))] = list(s.draft_tokens)
        return out

    def counted(launched):
        counts["ahead"] += 1
        return draft_ahead(launched)

    engine.runner.collect, engine.speculation.speculator.draft_ahead = recorded_collect, counted
    return {"rounds": rounds, "counts": counts}


def generate(llm: LLM, prompts, max_tokens, **kwargs) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs) for n in max_tokens]
    return [c.token_ids for c in llm.generate(prompts, params)]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", AHEAD_KINDS)
def test_drafting_ahead_proposes_what_drafting_after_the_commit_proposes(families, kind, batch):
    """Greedy output equals plain decoding with rounds drafted ahead, and every round that both paths draft from the
    same tokens at the same length carries the same drafts (requests end at different steps, on their token limit,
    often inside a round). Drafting after the commit: requests with a confidence stop no draft falls below (it
    trims nothing, but reading the drafts keeps their rounds from being drafted ahead)."""
    prompts, max_tokens = PROMPTS[:batch], [41 - 7 * i for i in range(batch)]
    plain = generate(spec_llm(families, kind, plain=True), prompts, max_tokens)
    runs = {}
    for ahead, p_min in ((True, None), (False, 1e-30)):
        llm = spec_llm(families, kind)
        record = record_rounds(llm.engine)
        assert generate(llm, prompts, max_tokens, spec_p_min=p_min) == plain
        runs[ahead] = record
    ahead, after = runs[True], runs[False]
    assert ahead["counts"]["ahead"] >= 5 and after["counts"]["ahead"] == 0
    shared = ahead["rounds"].keys() & after["rounds"].keys()
    assert len(shared) >= len(ahead["rounds"]) // 2 and any(any(ahead["rounds"][key]) for key in shared)
    assert {key: ahead["rounds"][key] for key in shared} == {key: after["rounds"][key] for key in shared}


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_stop_inside_a_round_discards_the_round_drafted_ahead(families, kind):
    """Requests that stop on a token inside a round (a stop token id, past a min_tokens that differs per request)
    have the round drafted after it discarded: each output stops where plain decoding's does, and the requests
    beside them go on unchanged."""
    prompts, max_tokens = PROMPTS, [40] * 4
    plain = generate(spec_llm(families, kind, plain=True), prompts, max_tokens)
    stop = plain[0][0]
    firsts = [5 + 6 * i for i in range(4)]  # (a stop id counts past min_tokens outputs)
    want = [out[: next((j + 1 for j, t in enumerate(out) if t == stop and j >= n), len(out))]
            for out, n in zip(plain, firsts)]
    assert len({len(w) for w in want}) > 1
    llm = spec_llm(families, kind)
    record = record_rounds(llm.engine)
    params = [SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=[stop], min_tokens=n)
              for m, n in zip(max_tokens, firsts)]
    assert [c.token_ids for c in llm.generate(prompts, params)] == want
    counts = record["counts"]
    assert counts["ahead"] > 0
    assert llm.engine.pool.num_used == 0  # (the blocks reserved for the discarded rounds are free again)


def test_a_request_that_trims_its_drafts_is_verified_after_the_commit(families):
    """A confidence stop (p_min) reads the drafts' values before verifying them: no round is drafted ahead then."""
    llm = spec_llm(families, "dflash")
    record = record_rounds(llm.engine)
    out = generate(llm, PROMPTS[:2], [30, 30], spec_p_min=0.01)
    assert out == generate(spec_llm(families, "dflash", plain=True), PROMPTS[:2], [30, 30])
    assert record["counts"]["ahead"] == 0 and record["rounds"]
