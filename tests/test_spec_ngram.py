"""N-gram (prompt lookup) drafting on its own: what it proposes, when it says it may, and a per-round host cost
that does not grow with the context (counted in tokens read and grams hashed, not timed)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.config import NgramConfig
from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.speculative.drafter import Commit
from outrider.speculative.kinds import load_drafter
from outrider.speculative.ngram import NgramDrafter, NgramIndex


class NoScanRequest(Request):
    """A request whose whole-sequence copy (O(length)) is off limits: the drafter must read slices only."""

    @property
    def all_ids(self):
        raise AssertionError("the n-gram drafter read the whole sequence")


def request(tokens: list[int], prompt_len: int | None = None) -> NoScanRequest:
    n = len(tokens) if prompt_len is None else prompt_len
    req = NoScanRequest(list(tokens[:n]), SamplingParams())
    req.output_ids.extend(tokens[n:])
    return req


def drafter(n: int = 3, m: int = 8, min_hits: int = 1, max_draft: int = 8) -> NgramDrafter:
    return NgramDrafter(NgramConfig(size_n=n, size_m=m, min_hits=min_hits), max_draft)


def commit(d: NgramDrafter, req: Request, new: list[int]) -> None:
    """Append committed tokens and tell the drafter, as the engine does after a step."""
    start = req.num_prompt + len(req.output_ids) - 1  # the last known token had no target row yet
    req.output_ids.extend(new)
    d.on_commit([Commit(req, start, len(new))], None, None)


def test_drafts_what_followed_the_newest_earlier_occurrence():
    d = drafter(n=2, m=8)
    req = request([1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 8, 0, 1, 2])
    assert d.may_propose(req)
    assert d.propose([req], [4]).tokens == [[5, 6, 7, 8]]  # after the newer "1 2", not the first
    assert d.propose([req], [2]).tokens == [[5, 6]]  # k caps it
    assert d.propose([request([1, 2, 3, 4, 5, 6])], [4]).tokens == [[]]  # "5 6" never occurred before


def test_a_continuation_that_reaches_the_present_repeats_its_period():
    d = drafter(n=2, m=8)
    assert d.propose([request([7, 1, 2, 1, 2])], [5]).tokens == [[1, 2, 1, 2, 1]]
    assert d.propose([request([3, 3, 3])], [4]).tokens == [[3, 3, 3, 3]]


def test_min_hits_counts_earlier_occurrences_of_the_n_gram():
    tokens = [1, 2, 5, 9, 1, 2, 6, 9, 1, 2]
    assert drafter(n=2, min_hits=2).propose([request(tokens)], [3]).tokens == [[6, 9, 1]]
    assert drafter(n=2, min_hits=3).propose([request(tokens)], [3]).tokens == [[]]
    assert not drafter(n=2, min_hits=3).may_propose(request(tokens))


def test_size_m_and_the_servers_draft_length_cap_drafts():
    assert drafter(n=1, m=2, max_draft=8).max_draft == 2
    assert drafter(n=1, m=48, max_draft=4).max_draft == 4
    d = drafter(n=1, m=2, max_draft=8)
    assert d.propose([request([1, 2, 3, 4, 1])], [8]).tokens == [[2, 3]]


def test_proposals_are_one_hot_and_need_no_pool():
    d = load_drafter("ngram", target=None, target_cfg=None, target_path="", draft_path=None, block_size=16,
                     dtype=None, device="cpu", max_draft=4, ngram=NgramConfig(size_n=2))
    props = d.propose([request([1, 2, 3, 1, 2])], [3])
    assert props.probs is None and props.confidence == [[1.0, 1.0, 1.0]]  # q one-hot: lossless at T > 0
    assert d.kv_shape[0] == 0 and d.lookahead(4) == 0 and d.aux_layer_ids == ()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 3),
       st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_incremental_index_matches_a_scan(tokens, n, min_hits, chunks):
    """Fed in arbitrary commit chunks (prefill chunks, rounds), the index drafts exactly what a scan of the whole
    sequence finds; and before the last token is known, may_propose is never False where a draft then exists."""
    d = drafter(n=n, m=6, min_hits=min_hits)
    req = request(tokens[:1])
    rest = tokens[1:]
    while rest:
        size = chunks[len(rest) % len(chunks)]
        piece, rest = rest[:size], rest[size:]
        req.num_pending = 1  # the step's last token is still on the device
        may = d.may_propose(req)
        req.num_pending = 0
        commit(d, req, piece)
        got = d.propose([req], [6]).tokens[0]
        assert got == scan_draft(tokens[: len(tokens) - len(rest)], n, 6, min_hits)
        if len(piece) == 1:
            assert may or not got
        assert d.may_propose(req) == bool(got)


def scan_draft(seq: list[int], n: int, k: int, min_hits: int) -> list[int]:
    """The reference: scan backwards for earlier occurrences of the last n tokens."""
    if len(seq) < n + 1:
        return []
    tail = seq[-n:]
    ends = [e for e in range(n, len(seq)) if seq[e - n : e] == tail]
    if len(ends) < min_hits:
        return []
    out = list(seq[ends[-1]:])
    while len(out) < k:
        out.append(out[len(out) - (len(seq) - ends[-1])])
    return out[:k]


@pytest.mark.parametrize("n", [1, 4, 12])
def test_a_rounds_host_work_does_not_grow_with_the_context(n):
    """The same edit session after a 1 K and after a 64 K token context: every round (may_propose, propose,
    learning the committed tokens) reads and hashes exactly as much, and nothing reads the whole sequence."""
    rng = random.Random(n)
    session = [rng.randrange(10**6) for _ in range(100)]
    per_context = []
    for length in (1_000, 64_000):
        prefix = [10**6 + rng.randrange(10**9) for _ in range(length)]  # never repeats the session's tokens
        d = drafter(n=n, m=8)
        req = request(prefix + session + session[:20])  # the session, then the start of its re-emission
        d.on_commit([Commit(req, 0, req.num_prompt - 1)], None, None)  # the prefill
        work = []
        for i in range(20, 95, 5):  # every round hits
            before = d.index_of(req).ops
            assert d.may_propose(req)
            assert d.propose([req], [4]).tokens[0] == session[i : i + 4]
            commit(d, req, session[i : i + 5])
            work.append(d.index_of(req).ops - before)
        per_context.append(work)
    assert per_context[0] == per_context[1]
    assert max(per_context[0]) <= 4 * n + 40  # O(n + k + tokens committed)


def test_lookup_misses_leave_the_step_plain_before_its_token_is_known():
    """The engine decides draft lengths while the step in flight still holds each request's last token; a request
    whose lookup cannot hit gets no length, so the step is not completed early and stays overlapped."""
    from outrider.engine.kv_cache import BlockPool
    from outrider.speculative.drafter import DraftPolicy
    from outrider.speculative.speculator import SpeculationLimits, Speculator

    def no_rows(spans):
        raise AssertionError("n-gram lookup reads no hidden states")

    spec = Speculator(drafter(n=2), DraftPolicy(), BlockPool(16, 16, False), no_rows, 2048, time.perf_counter,
                      lambda: None, SpeculationLimits())
    repeats, novel = request([1, 2, 3, 9, 1, 2]), request([1, 2, 3, 4, 5, 6])
    for req in (repeats, novel):
        req.num_pending = 1  # sampled on the device, not yet on the host
        req.num_computed = req.num_tokens - 1
    # "2 x" may follow "1 2 3 9 1 2" (2 came after 1 before); nothing can complete "... 5 6 x".
    assert set(spec.draft_lengths([repeats, novel])) == {repeats.request_id}
    assert spec.draft_lengths([novel]) == {}


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_indexing_a_token_at_a_time_equals_indexing_in_bulk(n):
    """A decode step indexes one new gram (its own short path); the index it builds is the one indexing the same
    tokens in one catch-up builds."""
    rng = random.Random(n)
    tokens = [rng.randrange(6) for _ in range(80)]  # a small alphabet: grams repeat
    bulk, stepwise = NgramIndex(n), NgramIndex(n)
    req = request(tokens)
    bulk.catch_up(req, len(tokens))
    stepwise.catch_up(req, 7)
    for known in range(8, len(tokens) + 1):
        stepwise.catch_up(req, known)
    assert (stepwise.last, stepwise.hits, stepwise.prefix_hits) == (bulk.last, bulk.hits, bulk.prefix_hits)
    assert stepwise.indexed == bulk.indexed == len(tokens)
