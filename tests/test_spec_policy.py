"""Draft-length policy: request and batch caps, the acceptance-aware rule, confidence and minimum-length trims."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.speculative.drafter import (PENDING, QUIET_DECISIONS, QUIET_DECISIONS_ASLEEP, DraftPolicy,
                                         PendingDrafts, Proposals, StepCosts, _Acceptance, batch_bucket,
                                         expected_tokens, stage_drafts)

DRAFTER = SimpleNamespace(max_draft=8, step_cost=0.1)
NGRAM_LIKE = SimpleNamespace(max_draft=8, step_cost=0.01)  # drafts cost next to nothing to make
EAGLE_LIKE = SimpleNamespace(max_draft=4, step_cost=0.05)


def req(prompt=(1, 2, 3), max_model_len=50, **params) -> Request:
    r = Request(list(prompt), SamplingParams(**{"max_tokens": 100, **params}))
    r.limit_outputs(max_model_len)  # (as the engine does when it takes the request)
    return r


def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_caps():
    policy = DraftPolicy(n_max=4, prior_alpha=0.99)  # requests in a 50-token context (req)
    assert policy.draft_lengths([req()], DRAFTER) == [4]
    assert policy.draft_lengths([req(spec_n_max=6)], DRAFTER) == [6]
    assert policy.draft_lengths([req(spec_n_max=20)], DRAFTER) == [8]  # the drafter's own limit
    assert policy.draft_lengths([req(max_tokens=3)], DRAFTER) == [2]  # the bonus token is free
    # (drafting ahead of a verdict: the round in flight may still commit its drafts and a bonus token)
    assert policy.draft_lengths([req(max_tokens=6), req(max_tokens=6)], DRAFTER, in_flight=[3, 0]) == [2, 4]
    long = req(range(47), max_tokens=-1)
    assert policy.draft_lengths([long], DRAFTER) == [2]  # context: 3 tokens left
    assert DraftPolicy(n_max=4, max_verify_tokens=12).draft_lengths([req()] * 4, DRAFTER) == [2] * 4
    assert DraftPolicy(max_batch=2).draft_lengths([req()] * 3, DRAFTER) == [0] * 3


def test_low_acceptance_turns_drafting_off_then_probes_ever_less_often():
    policy = DraftPolicy(n_max=4, probe_every=5)
    r = req()
    assert policy.draft_lengths([r], DRAFTER) == [4]
    for _ in range(20):
        policy.record(r.request_id, proposed=4, accepted=0)
    ks = [policy.draft_lengths([r], DRAFTER)[0] for _ in range(5 + 10 + 20)]
    probes = [i for i, k in enumerate(ks) if k]
    assert probes == [4, 14, 34] and set(ks) == {0, 1}  # after 5, 10, then 20 decisions; one draft each
    for _ in range(20):
        policy.record(r.request_id, proposed=1, accepted=1)
    assert policy.draft_lengths([r], DRAFTER) == [4]


def test_new_requests_whose_first_rounds_accept_nothing_leave_the_probe_backoff_doubling():
    """Nothing is accepted (alpha = 0). Each new request first drafts a few rounds on its prior's strength, which
    fail; that does not restart the probes' backoff, so the later requests see no probe in their 32 decisions."""
    policy = DraftPolicy(n_max=4, probe_every=4)
    after_prior = []
    for _ in range(6):
        r = req(max_tokens=200, max_model_len=300)
        ks = []
        for _ in range(32):
            ks.append(policy.draft_lengths([r], DRAFTER)[0])
            if ks[-1]:
                policy.record(r.request_id, proposed=ks[-1], accepted=0)
        after_prior.append(ks[ks.index(0):])
        policy.release(r.request_id)
    assert any(after_prior[0]) and not any(k for ks in after_prior[3:] for k in ks)


def test_probes_wait_longer_the_more_a_round_costs():
    """An exploratory round of one draft that costs three plain steps costs two plain steps' time beyond one: probes
    wait twice the doubling interval, so exploring costs the same share of time as with a round near a plain step."""
    policy = DraftPolicy(n_max=4, probe_every=5, measured=True)
    r = req()
    for _ in range(20):
        policy.record(r.request_id, proposed=4, accepted=0)
    for k in range(5):
        policy.observe_step(1, k, 1e-3 if k == 0 else 3e-3)  # (4 drafts all accepted would pay: 5 tokens in 3 ms)
    ks = [policy.draft_lengths([r], DRAFTER)[0] for _ in range(10 + 20 + 40)]
    assert [i for i, k in enumerate(ks) if k] == [9, 29, 69]


def test_no_probe_where_no_round_could_pay_even_with_every_draft_accepted():
    """The 8B shape at batch 32: a plain step 5.6 ms, rounds 22-43 ms. Even k + 1 tokens a round lose to plain steps,
    so an exploratory round could change the measured costs but not the decision: once a round's cost is confirmed
    by a second measurement (one probe), none until probe_max decisions. Nor does a round come back once the
    rounds' costs go stale (only plain steps are measured meanwhile): they give way to rounds measured later, not
    to the drafter's own estimate, by which a round would look cheap."""
    policy = DraftPolicy(n_max=4, probe_every=5, probe_max=2048, measured=True)
    batch = [req() for _ in range(32)]
    cost = [5.6e-3] + [(22 + 5 * k) * 1e-3 for k in range(1, 5)]
    for k in range(5):
        policy.observe_step(32, k, cost[k])
    decisions = []
    for _ in range(3 * policy.costs.stale_after):
        decisions.append(policy.draft_lengths(batch, EAGLE_LIKE)[0])
        policy.observe_step(32, decisions[-1], cost[decisions[-1]])
    assert [(i, k) for i, k in enumerate(decisions) if k] == [(18, 1)]  # 5 x (27 / 5.6 - 1) decisions: one probe
    assert policy.round_seconds(32, 1, EAGLE_LIKE.step_cost) == pytest.approx(27e-3)


def test_one_stalled_first_round_does_not_hold_plain_steps_until_probe_max():
    """The 0.6B draft model at 8B, batch 1: plain steps of 4.3 ms, rounds of four drafts 8.3 ms, but the first one
    measured 52.8 ms (within first_factor plain steps). Priced by that one measurement no round would pay even with
    every draft accepted; it is probed again at the usual interval, not after probe_max decisions, and drafting
    resumes on the probe's cost."""
    policy = DraftPolicy(n_max=4, probe_every=32, probe_max=2048, measured=True)
    r = req(max_tokens=2000, max_model_len=4000)
    for _ in range(20):
        policy.record(r.request_id, proposed=4, accepted=4)
    policy.observe_step(1, 0, 4.3e-3)
    policy.observe_step(1, 4, 52.8e-3)
    cost = {0: 4.3e-3, 1: 5.9e-3, 2: 6.6e-3, 3: 7.4e-3, 4: 8.3e-3}
    decisions = []
    for _ in range(1000):
        decisions.append(policy.draft_lengths([r], DRAFTER)[0])
        policy.observe_step(1, decisions[-1], cost[decisions[-1]])
        if decisions[-1]:
            policy.record(r.request_id, proposed=decisions[-1], accepted=decisions[-1])
    first = next(i for i, k in enumerate(decisions) if k)
    assert first < 32 * 12 and decisions[first:].count(0) <= 3  # (a plain step now and then re-measures its cost)


def test_a_priced_out_batch_size_stands_and_explores_no_round_when_asked_not_to():
    """k = 0 chosen from the costs stands at that batch size (priced_out) until a decision there drafts; with
    explore=False no exploratory round is ever returned (a sleeping drafter would have to catch up for it)."""
    policy = DraftPolicy(n_max=4, probe_every=2)
    r = req()
    for _ in range(20):
        policy.record(r.request_id, proposed=4, accepted=0)
    assert not policy.priced_out(1)  # (nothing decided yet)
    assert [policy.draft_lengths([r], DRAFTER, explore=False)[0] for _ in range(40)] == [0] * 40
    assert policy.priced_out(1) and not policy.priced_out(8)
    # Past its probe interval too, k = 0 stands quietly: a full decision once per QUIET_DECISIONS_ASLEEP.
    full, decide = [], policy._batch_length
    policy._batch_length = lambda *args: full.append(1) or decide(*args)
    n = 4 * QUIET_DECISIONS_ASLEEP
    assert [policy.draft_lengths([r], DRAFTER, explore=False)[0] for _ in range(n)] == [0] * n
    assert len(full) == 4
    del policy._batch_length
    assert policy.draft_lengths([r], DRAFTER) == [1]  # exploring again: a probe at once (its interval passed)
    assert not policy.priced_out(1)  # (until a decision chooses k = 0 again)


def test_decisions_taken_without_reading_the_requests_count_toward_the_next_probe():
    """stands (the Speculator's dormant path: the requests of the last decision, unchanged and not read) takes k = 0
    as draft_lengths's quiet decisions do, and counts it: with it deciding wherever it may, probes come after the
    same decisions as with draft_lengths alone; it gives way where one is due or the quiet run ends."""
    r = req()
    ks, stood = {}, []
    for dormant in (False, True):
        policy = DraftPolicy(n_max=4, probe_every=5)
        for _ in range(20):
            policy.record(r.request_id, proposed=4, accepted=0)
        policy._stats[r.request_id] = _Acceptance.worth_two_rounds(policy._pooled.alpha)  # (no drift lifts it)
        ks[dormant] = []
        for _ in range(70):
            stood.append(dormant and policy.stands(1))
            ks[dormant].append(0 if stood[-1] else policy.draft_lengths([r], DRAFTER)[0])
        assert not policy.stands(2)  # (no decision at that batch size)
    probes = [i for i, k in enumerate(ks[False]) if k]
    assert probes == [i for i, k in enumerate(ks[True]) if k] and len(probes) >= 3
    assert sum(stood) >= 50 and max(len(list(run)) for quiet, run in itertools.groupby(stood) if quiet) == \
        QUIET_DECISIONS - 1  # (then a decision reads the requests, applying the drift of the quiet ones)
    policy._stats[r.request_id] = _Acceptance(0.0, 2.0)  # below the pooled estimate: the drift lifts it
    for _ in range(QUIET_DECISIONS):  # (a full decision among them reads it)
        policy.draft_lengths([r], DRAFTER)
    assert not policy.stands(1)  # (every decision reads it now)


def test_a_standing_plain_decision_is_revisited_when_the_batch_changes():
    """k = 0 stands for a batch of two poorly accepted requests (the grid is not recomputed for it every step); when
    one of them leaves and a well accepted request takes its place, the policy decides again and drafts."""
    policy = DraftPolicy(n_max=4)
    poor, good = [req(), req()], req()
    for r in poor:
        for _ in range(30):
            policy.record(r.request_id, proposed=4, accepted=0)
    for _ in range(30):
        policy.record(good.request_id, proposed=4, accepted=4)
    assert policy.draft_lengths(poor, DRAFTER) == [0, 0]
    assert policy.draft_lengths(poor, DRAFTER) == [0, 0]
    assert min(policy.draft_lengths([poor[0], good], DRAFTER)) > 0


def test_a_new_request_starts_halfway_between_the_prior_and_the_acceptance_of_those_before_it():
    dear = SimpleNamespace(max_draft=4, step_cost=0.3)  # (drafts that pay only at a good acceptance)
    ks = {}
    for accepted in (0, 4):
        policy = DraftPolicy(n_max=4)
        assert policy.draft_lengths([req()], dear) == [2]  # the prior (0.7)
        for _ in range(3):
            earlier = req()
            for _ in range(40):
                policy.record(earlier.request_id, proposed=4, accepted=accepted)
            policy.release(earlier.request_id)
        ks[accepted] = policy.draft_lengths([req()], dear)[0]
    assert ks == {0: 1, 4: 4}  # nothing accepted before: a probing round of one draft (alpha 0.35)


def test_a_few_unlucky_rounds_do_not_keep_a_well_accepted_request_off_until_the_next_probe():
    """A run of misses turns a request's own estimate down (k = 0); plain steps measure no acceptance, so its
    estimate drifts back toward the one pooled over all rounds (0.8 here), and it drafts again long before the
    first probe (probe_every decisions)."""
    policy = DraftPolicy(n_max=4, probe_every=1000)
    rng = random.Random(0)

    def round_of(k):  # each draft kept with probability 0.8 until the first miss
        return next((j for j in range(k) if rng.random() >= 0.8), k)

    earlier = req()
    for _ in range(200):
        policy.record(earlier.request_id, proposed=4, accepted=round_of(4))
    r = req()
    for _ in range(8):
        policy.record(r.request_id, proposed=4, accepted=0)
    ks = []
    dear = SimpleNamespace(max_draft=4, step_cost=0.3)  # (drafts that pay only at a good acceptance)
    for _ in range(40):
        k = policy.draft_lengths([r], dear)[0]
        ks.append(k)
        if k:
            policy.record(r.request_id, proposed=k, accepted=round_of(k))
    assert ks[0] == 0
    assert 4 in ks[:30]


def smollm2_priced(policy: DraftPolicy) -> DraftPolicy:
    """SmolLM2's DFlash costs at batch 1 as measured on an H100: 0.965 ms plain, 1.77-1.92 ms a round of 1-7."""
    policy.observe_step(1, 0, 0.965e-3)
    for k in range(1, 8):
        policy.observe_step(1, k, (1.74 + 0.026 * k) * 1e-3)
    return policy


SMOLLM2_DFLASH = SimpleNamespace(max_draft=7, step_cost=0.02)


def test_a_request_missing_a_few_rounds_keeps_the_drafter_awake_while_the_pooled_acceptance_pays():
    """A run of misses turns one request's estimate down until k = 0 stands, but the acceptance pooled over all
    rounds still pays: the drafter stays awake (its estimate drifts back, and a drafter woken then would pay a
    catch-up over every row slept through). Once the pooled acceptance no longer pays either, it may sleep."""
    policy = smollm2_priced(DraftPolicy(n_max=7, measured=True))
    earlier = req()
    for _ in range(20):
        policy.record(earlier.request_id, proposed=7, accepted=4)
    r = req()
    for _ in range(6):
        policy.record(r.request_id, proposed=7, accepted=0)
    assert policy.draft_lengths([r], SMOLLM2_DFLASH) == [0]
    assert policy.priced_out(1) and not policy.lets_sleep(1)
    for _ in range(100):
        policy.record(r.request_id, proposed=7, accepted=0)
    assert policy.draft_lengths([r], SMOLLM2_DFLASH) == [0]
    assert policy.lets_sleep(1)


def test_a_request_joining_after_quiet_decisions_starts_from_its_own_fresh_estimate():
    """Decisions taken without reading the requests (QUIET_DECISIONS) drift the estimates of the requests they stood
    for, not those of a request that joined since: its first decision rests on its fresh estimate, which here pays
    (halfway between the prior 0.7 and a pooled 0.35), where the quiet run's drift would have turned it down."""
    policy = smollm2_priced(DraftPolicy(n_max=7, measured=True))
    old = req()
    for _ in range(100):  # (one draft accepted every other round: an acceptance of about 1/3, its own and pooled)
        for accepted in (0, 1):
            policy.record(old.request_id, proposed=7, accepted=accepted)
    for _ in range(QUIET_DECISIONS - 1):
        assert policy.draft_lengths([old], SMOLLM2_DFLASH) == [0]
    assert policy.probes[1].quiet == QUIET_DECISIONS - 2
    assert policy.draft_lengths([req()], SMOLLM2_DFLASH)[0] > 0


def test_expensive_drafts_need_high_acceptance():
    policy = DraftPolicy(n_max=8, prior_alpha=0.5)
    costly = SimpleNamespace(max_draft=8, step_cost=1.0)  # e.g. verify on a CPU: every token costs a step
    assert policy.draft_lengths([req()], costly) == [0]
    assert 0 < policy.draft_lengths([req()], DRAFTER)[0] < 8


def test_trim_applies_p_min_and_n_min():
    policy = DraftPolicy(p_min=0.5, n_min=2)
    q = torch.full((4, 10), 0.1)
    props = Proposals([[1, 2, 3, 4], [5, 6, 7], [8, 9]],
                      [[0.9, 0.8, 0.4, 0.9], [0.9, 0.3, 0.9], [0.9, 0.9]], [q, None, q[:2]])
    out = policy.trim([req(), req(), req(spec_p_min=0.95, spec_n_min=0)], props)
    assert out.tokens == [[1, 2], [], []]
    assert out.probs[0].shape == (2, 10) and out.probs[1] is None and out.probs[2] is None
    assert DraftPolicy(p_min=0.0).trim([req()], Proposals([[1]], [[0.01]])).tokens == [[1]]


def test_measured_costs_decide_whether_a_round_pays():
    """With measured step costs, k maximises expected tokens per second: a round that costs six plain steps does
    not pay at alpha 0.8, one that costs 1.5 does; unmeasured lengths are priced from the plain step."""
    r = req()
    slow, fast = DraftPolicy(n_max=4, measured=True), DraftPolicy(n_max=4, measured=True)
    for policy, round_s in ((slow, 6e-3), (fast, 1.5e-3)):
        for _ in range(30):
            policy.record(r.request_id, proposed=4, accepted=3)  # alpha -> 0.75
        policy.observe_step(1, 0, 1e-3)
        for k in range(1, 5):
            policy.observe_step(1, k, round_s)
    assert slow.draft_lengths([r], DRAFTER) == [0]
    assert fast.draft_lengths([r], DRAFTER) == [4]
    fresh = DraftPolicy(n_max=4, measured=True, prior_alpha=0.99)
    assert fresh.draft_lengths([r], DRAFTER) == [0]  # a plain step is measured first
    fresh.observe_step(1, 0, 1e-3)
    assert fresh.round_seconds(1, 3, step_cost=0.1) == pytest.approx(1.3e-3)  # the drafter's estimate
    assert fresh.draft_lengths([r], DRAFTER) == [4]
    fresh.observe_step(1, 4, 5e-3)  # a measured round: shorter ones keep its fixed part, less 0.1 plain per draft
    assert fresh.round_seconds(1, 2, step_cost=0.1) == pytest.approx(4.8e-3)
    fresh.observe_step(1, 8, 6e-3)  # between two measured rounds: on the line between them
    assert fresh.round_seconds(1, 6, step_cost=0.1) == pytest.approx(5.5e-3)


def test_a_short_probe_round_does_not_price_longer_rounds_out_of_reach():
    """A round's fixed part (synchronous drafting, verify, host work) is not a cost per draft. After a plain step
    (0.74 ms) and a probe round of one draft (1.3 ms), on a launch-bound target where 8 drafts cost about what 1
    does, the policy tries the long round, and keeps it once measured."""
    r = req()
    policy = DraftPolicy(n_max=8, measured=True)
    for _ in range(30):
        policy.record(r.request_id, proposed=8, accepted=8)  # alpha -> ~0.96
    policy.observe_step(1, 0, 0.74e-3)
    policy.observe_step(1, 1, 1.3e-3)
    assert policy.round_seconds(1, 8, step_cost=0.01) == pytest.approx(1.3e-3 + 7 * 0.0074e-3)
    assert policy.draft_lengths([r], NGRAM_LIKE) == [8]
    policy.observe_step(1, 8, 1.45e-3)
    assert policy.draft_lengths([r], NGRAM_LIKE) == [8]


def serve(policy: DraftPolicy, r: Request, true_seconds: dict[int, float]) -> list[int]:
    """The policy's k for r at batch 1, each step then measured at its true cost, for twice stale_after steps."""
    decisions = []
    for _ in range(2 * policy.costs.stale_after):
        k = policy.draft_lengths([r], EAGLE_LIKE)[0]
        decisions.append(k)
        policy.observe_step(1, k, true_seconds[k])
    return decisions


def test_one_slow_early_round_does_not_rule_its_draft_length_out_for_good():
    """The EAGLE-3 shape at 8B: a plain step 4.3 ms, rounds of one draft 6.8 ms. The first 4-draft round ran slow
    (20 ms: a warm-up, a busy host), so the policy settles on k = 1, which it keeps measuring. Once the 4-draft
    cost has gone stale it is priced from its neighbours again, tried, and kept at its true 7.7 ms."""
    r = req()
    policy = DraftPolicy(n_max=4, measured=True)
    for _ in range(30):
        policy.record(r.request_id, proposed=1, accepted=1)
        policy.record(r.request_id, proposed=4, accepted=3)  # alpha ~0.8
    policy.observe_step(1, 0, 4.3e-3)
    policy.observe_step(1, 4, 20e-3)
    policy.observe_step(1, 1, 6.8e-3)
    decisions = serve(policy, r, {0: 4.3e-3, 1: 6.8e-3, 2: 7.1e-3, 3: 7.4e-3, 4: 7.7e-3})
    assert decisions[0] == 1 and decisions[-1] == 4
    assert policy.costs.get(1, 4) == pytest.approx(7.7e-3)  # measured afresh, not averaged with the slow round


def test_a_stalled_first_round_does_not_price_speculation_out_until_it_goes_stale():
    """A probe round that stalled (200 ms against a 1 ms plain step: a kernel compiled on first use, as seen on the
    H200 at batch 8) counts as at most first_factor plain steps, and the true cost (3 ms) takes over within a few
    rounds; a later stall moves the average by a bounded step only."""
    r = req()
    policy = DraftPolicy(n_max=4, measured=True)
    for _ in range(30):
        policy.record(r.request_id, proposed=4, accepted=4)  # alpha ~0.97: a 3 ms round of 4 drafts pays
    policy.observe_step(1, 0, 1e-3)
    policy.observe_step(1, 4, 200e-3)
    assert policy.costs.get(1, 4) == pytest.approx(policy.costs.first_factor * 1e-3)
    for _ in range(12):
        policy.observe_step(1, 4, 3e-3)
    assert policy.costs.get(1, 4) < 3.5e-3 and policy.draft_lengths([r], DRAFTER) == [4]
    policy.observe_step(1, 4, 500e-3)
    assert policy.costs.get(1, 4) < 2 * 3.5e-3


def test_the_draft_length_stays_put_while_another_is_only_noisily_better():
    """Measured costs jitter by 1 %, which alone flips the argmax between neighbouring draft lengths (a device round
    restarts on each change): the chosen k stays while another is less than KEEP_MARGIN better, and moves once
    one is clearly better."""
    r = req()
    policy = DraftPolicy(n_max=4, measured=True)
    for _ in range(30):
        policy.record(r.request_id, proposed=4, accepted=3)
    # (alpha ~0.75: 4 drafts earn 3.05 tokens, 3 drafts 2.73: at these costs their rates lie within 0.5 %)
    true = {0: 4.3e-3, 1: 5.0e-3, 2: 5.6e-3, 3: 6.1e-3, 4: 6.8e-3}
    rng = random.Random(0)
    for k, s in true.items():
        policy.observe_step(1, k, s)
    decisions = []
    for _ in range(200):
        k = policy.draft_lengths([r], EAGLE_LIKE)[0]
        decisions.append(k)
        policy.observe_step(1, k, true[k] * (1 + rng.uniform(-0.01, 0.01)))
        for j in (3, 4):
            if j != k:  # (the neighbour's cost jitters as well, as if measured by other requests' rounds)
                policy.observe_step(1, j, true[j] * (1 + rng.uniform(-0.01, 0.01)))
    drafted = {k for k in decisions if k}  # (and a plain step now and then: its cost goes stale, unmeasured)
    assert len(drafted) == 1 and drafted <= {3, 4} and decisions.count(0) < 5
    (kept,) = drafted
    policy.observe_step(1, 0, true[0])
    policy.observe_step(1, 7 - kept, 0.5 * true[3])
    assert policy.draft_lengths([r], EAGLE_LIKE)[0] == 7 - kept


def test_nothing_accepted_brings_plain_steps_back_even_after_a_slow_plain_measurement():
    """At alpha = 0 a round yields one token, as a plain step does, for more time. A plain step measured slow once
    (10 ms against its true 4.3) makes one-draft rounds (6.8 ms) look better, and rounds do not measure plain
    steps; once the plain cost goes stale, a plain step is measured again and wins."""
    r = req()
    policy = DraftPolicy(n_max=1, measured=True)
    for _ in range(30):
        policy.record(r.request_id, proposed=1, accepted=0)
    policy.observe_step(1, 0, 10e-3)
    policy.observe_step(1, 1, 6.8e-3)
    decisions = serve(policy, r, {0: 4.3e-3, 1: 6.8e-3})
    assert decisions[0] == 1 and decisions[-10:] == [0] * 10


def test_a_standing_plain_decision_reads_no_request_until_its_next_full_decision(monkeypatch):
    """Where rounds do not pay (here nothing is accepted), k = 0 stands: of every QUIET_DECISIONS decisions for the
    same requests, one reads them (caps, estimates), and the drift toward the pooled acceptance it applies makes up
    for the skipped steps exactly; a request joining the batch is read at once, and every decision reads the
    requests while an estimate lies below the pooled one (the drift lifts it toward drafting)."""
    policy = DraftPolicy(n_max=4, measured=True)
    a, b, d = req(), req(), req()
    for _ in range(30):
        policy.record(a.request_id, proposed=4, accepted=0)  # the pooled estimate: low
    policy.record(b.request_id, proposed=4, accepted=4)  # b's own: higher
    policy._stats[a.request_id] = _Acceptance.worth_two_rounds(policy._pooled.alpha)  # a's: the pooled one
    policy.observe_step(4, 0, 1e-3)
    policy.observe_step(4, 4, 50e-3)  # rounds far too dear: k = 0 at any acceptance (batch bucket 4)
    reads = []
    cap = policy._cap
    monkeypatch.setattr(policy, "_cap", lambda r, *rest: reads.append(r.request_id) or cap(r, *rest))
    st = policy._stats[b.request_id]
    per_step = _Acceptance(st.accepted, st.rejected)  # drifting one step at a time, for comparison
    pooled = _Acceptance.worth_two_rounds(policy._pooled.alpha)
    decisions = 2 * QUIET_DECISIONS + 1
    assert all(policy.draft_lengths([a, b, d], DRAFTER) == [0, 0, 0] for _ in range(decisions))
    assert len(reads) == 3 * 3  # decisions 1, 1 + QUIET_DECISIONS and 1 + 2 * QUIET_DECISIONS read the three
    for _ in range(decisions):
        per_step.relax(pooled, 1.0 - policy.decay)
    assert (st.accepted, st.rejected) == pytest.approx((per_step.accepted, per_step.rejected))
    e = req()  # joins (the same batch bucket): read at once, then quiet again
    reads.clear()
    for _ in range(QUIET_DECISIONS):
        assert policy.draft_lengths([a, b, d, e], DRAFTER) == [0] * 4
    assert reads == [a.request_id, b.request_id, d.request_id, e.request_id]
    c = req()  # joins instead of e, its estimate below the pooled one: the drift lifts it, every decision reads
    policy._stats[c.request_id] = _Acceptance(0.0, 2.0)
    reads.clear()
    for _ in range(3):
        assert policy.draft_lengths([a, b, c, d], DRAFTER) == [0] * 4
    assert reads == [a.request_id, b.request_id, c.request_id, d.request_id] * 3


def test_costs_are_kept_per_batch_bucket_and_only_when_measuring():
    policy = DraftPolicy(measured=True)
    policy.observe_step(3, 2, 2.0)
    policy.observe_step(4, 2, 4.0)  # same bucket (4): a moving average
    assert policy.costs.get(4, 2) == pytest.approx(2.5) and policy.costs.get(8, 2) is None
    fixed = DraftPolicy(measured=False)
    fixed.observe_step(1, 0, 1.0)
    assert fixed.costs.get(1, 0) is None


def test_staged_drafts_regroup_a_chains_steps_by_request_and_fill_the_plans_lists():
    """A chain drafts step by step (each step's rows in request order); staged, the drafts stay on the device
    grouped by request, and a plan's (possibly shortened) placeholder lists get their values from them."""
    owners = [0, 2, 0, 2, 2]  # step 1: requests 0 and 2; step 2: both; step 3: request 2
    tokens = [torch.tensor([10, 30]), torch.tensor([11, 31]), torch.tensor([32])]
    conf = [torch.tensor([0.9, 0.8]), torch.tensor([0.7, 0.6]), torch.tensor([0.5])]
    staged = stage_drafts(owners, tokens, conf, 3)
    assert staged.counts == [2, 0, 3] and staged.ids.tolist() == [10, 11, 30, 31, 32]
    host = staged.to_host()
    assert host.tokens == [[10, 11], [], [30, 31, 32]]
    assert host.confidence[2] == pytest.approx([0.8, 0.6, 0.5])
    pending = PendingDrafts(staged.ids, {7: 0, 9: 2})  # request ids 7 and 9 drafted
    drafts = [[PENDING, PENDING], [], [PENDING, PENDING], [4]]  # request 9's cut to 2 by the scheduler; 5: host
    sources = pending.sources([7, 8, 9, 5], drafts)
    assert sources == [0, None, 2, None]
    pending.fill(drafts, sources)
    assert drafts == [[10, 11], [], [30, 31], [4]]


@pytest.mark.parametrize("preset", ["eagle3", "dflash"])
def test_the_policy_earns_close_to_the_best_fixed_draft_length(preset):
    """Against a simulated device at the 8B shape's measured costs (outrider_tools/policy_sim.py), the policy's own
    choices come within 5 % of the best fixed k where speculation pays, and never fall 3 % below plain where it
    does not."""
    from outrider_tools import policy_sim as sim

    costs = sim.PRESETS[preset]
    for alpha in (0.86, 0.7, 0.0):
        earned, _ = sim.simulate(alpha, *costs, requests=24, tokens=128, seed=0)
        best = max(sim.simulate(alpha, *costs, requests=24, tokens=128, seed=0, fixed_k=k)[0]
                   for k in range(costs[0] + 1))
        assert earned >= (0.97 if alpha == 0 else 0.95) * best, (alpha, earned, best)


def test_a_drafter_whose_catch_up_costs_tens_of_plain_steps_is_not_put_to_sleep_by_one_requests_misses():
    """SmolLM2's DFlash pair (outrider_tools/policy_sim.py): a round that wakes the drafter pays a 25 ms catch-up
    (26 plain steps) that the measured costs leave out. Where speculation pays (alpha 0.7 and 0.6), the policy earns
    within 10 and 15 % of the best fixed k; a drafter put to sleep at every request's unlucky streak earned 0.81x
    and 0.56x of it."""
    from outrider_tools import policy_sim as sim

    costs = sim.PRESETS["smollm2-dflash"]
    for alpha, share in ((0.7, 0.9), (0.6, 0.85)):
        earned, _ = sim.simulate(alpha, *costs, requests=24, tokens=128, seed=0)
        best = max(sim.simulate(alpha, *costs, requests=24, tokens=128, seed=0, fixed_k=k)[0]
                   for k in range(costs[0] + 1))
        assert earned >= share * best, (alpha, earned, best)


def test_a_faster_second_measurement_replaces_a_stalled_first_one():
    """The SmolLM2-shaped DFlash pair at batch 8 (H100): calibration's first round of one draft took 5.0 ms against
    0.77 ms plain steps (a first use), and averaged in, later rounds of about 1 ms left it priced at twice its cost
    for many rounds, so k = 0 held the whole run. A second measurement below the first replaces it; from the third
    on, measurements average as before."""
    costs = StepCosts()
    costs.observe(8, 0, 0.77e-3)
    costs.observe(8, 1, 5.0e-3)
    assert costs.get(8, 1) == pytest.approx(5.0e-3)
    costs.observe(8, 1, 1.0e-3)
    assert costs.get(8, 1) == pytest.approx(1.0e-3)
    costs.observe(8, 1, 0.6e-3)
    assert costs.get(8, 1) == pytest.approx(1.0e-3 + costs.weight * (0.6e-3 - 1.0e-3))
    costs.observe(8, 1, 0.2e-3)  # (a faster third one averages: only a first measurement is provisional)
    assert costs.get(8, 1) > 0.7e-3


def test_nothing_accepted_after_a_well_accepted_run_costs_no_catch_up_per_request():
    """DFlash at the 8B shape (outrider_tools/policy_sim.py): 16 requests at alpha 0.7, then 8 at alpha 0, served by
    the same policy, a round that wakes the drafter paying a 30 ms catch-up (an eager 8B forward over the rows slept
    through). The pooled acceptance unlearns 0.7 slowly, so each new request still tries a few rounds; the drafter
    stays awake meanwhile, and the alpha-0 phase earns 0.9x plain or more, where one put to sleep at each request's
    misses paid a catch-up per request and earned 0.61x."""
    from outrider_tools import policy_sim as sim

    *costs, _ = sim.PRESETS["dflash"]
    earned, _ = sim.simulate(0.7, *costs, 30.0, requests=16, tokens=128, seed=0, then=(0.0, 8))
    assert earned >= 0.9


def test_where_rounds_barely_pay_a_costly_catch_up_stretches_the_probes_instead_of_costing_a_fifth_of_the_run():
    """SmolLM2's DFlash pair at the acceptance its trained drafter reaches (about 0.5: tau 2.03) and below: rounds
    pay little or nothing, the drafter sleeps, and every exploratory round wakes it for a 25 ms catch-up. Probing at
    the bare round's interval earned 0.80x plain at alpha 0.5 and 0.83x at 0.4; with the measured catch-up in each
    probe's price the policy stays within 5 % of plain (or of the best fixed k)."""
    from outrider_tools import policy_sim as sim

    costs = sim.PRESETS["smollm2-dflash"]
    for alpha in (0.5, 0.4, 0.0):
        earned, _ = sim.simulate(alpha, *costs, requests=24, tokens=128, seed=0)
        best = max(sim.simulate(alpha, *costs, requests=24, tokens=128, seed=0, fixed_k=k)[0]
                   for k in range(costs[0] + 1))
        assert earned >= 0.95 * best, (alpha, earned, best)


def test_a_measured_catch_up_lengthens_the_wait_for_the_next_exploratory_round_only_where_the_drafter_sleeps():
    """While k = 0 stands, the next probe waits `every` times the extra plain steps it costs: a round of one draft,
    plus the catch-up it starts where the drafter sleeps (rounds priced out at the pooled acceptance too). Where a
    round would pay at the pooled acceptance the drafter stays awake, and a catch-up seen earlier adds nothing."""

    def wait_after(earlier_accepted: int, wake: float | None) -> int:
        policy = DraftPolicy(n_max=4, measured=True)
        for k, ms in enumerate((1.0, 3.0, 3.1, 3.2, 3.3)):
            policy.costs.observe(1, k, ms * 1e-3)
            policy.costs.observe(1, k, ms * 1e-3)
        for _ in range(100):  # earlier requests' rounds: the pooled acceptance
            policy.record(-1, proposed=4, accepted=earlier_accepted)
        if wake is not None:
            policy.observe_wake(1, wake)
        r = req()
        for _ in range(20):  # misses until k = 0 stands for this request
            if policy.draft_lengths([r], DRAFTER)[0] == 0 and policy.priced_out(1):
                break
            policy.record(r.request_id, proposed=4, accepted=0)
        return policy.probes[batch_bucket(1)].wait

    assert wait_after(0, None) == 32 * 2  # (3.0 / 1.0 - 1) extra plain steps
    assert wait_after(0, 25e-3) == 32 * 27  # ((3.0 + 25) / 1.0 - 1)
    assert wait_after(4, 25e-3) == 32 * 2  # the pooled acceptance pays: awake, no catch-up
