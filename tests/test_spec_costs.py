"""Draft lengths from measured costs, on the engine's real step loop against a simulated device: the engine
times its steps on its clock, the policy keeps the costs, and speculation turns itself off where a round costs
more than the tokens it gains, and stays on where it pays. Overlap scheduling is on, as on CUDA."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from outrider.engine.builder import calibrate_speculation, warm_up
from outrider.engine.request import Request
from outrider.timing import RequestTiming
from tests.spec_helpers import write_families
from tests.timing_sim import SimulatedDevice

P, R = 0.020, 0.001  # a prefill step, a plain decode step (seconds on the simulated device)
TOKENS = 120


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return write_families(tmp_path_factory.mktemp("costs"))["qwen3"]


def generate(family, verify_s: float | None, draft_s: float, speculate: bool):
    """One greedy request of TOKENS tokens; returns (simulated seconds from its first to last token, timing)."""
    sim = SimulatedDevice(P, R, verify_s=verify_s)
    kwargs = dict(draft_model=str(family["draft"]), spec_measured_costs=True) if speculate else {}
    engine = LLM(family["target"], clock=sim, max_num_seqs=2, overlap_schedule=True, **kwargs).engine
    sim.install(engine)
    if speculate:
        propose = engine.speculation.drafter.propose

        def timed_propose(*args, **kw):
            sim.advance(draft_s)
            return propose(*args, **kw)

        engine.speculation.drafter.propose = timed_propose
    # The first request teaches the engine the costs, as serving does (its probes come ever less often: after 32,
    # 64, 128, 256 decisions); the second is timed.
    for first, tokens in ((5, 500), (40, TOKENS)):
        req = Request(list(range(first, first + 20)), SamplingParams(max_tokens=tokens, temperature=0.0,
                      ignore_eos=True), timing=RequestTiming(t_arrival=sim.t))
        outs: list = []
        engine.add_request(req, outs.append)
        while not (outs and outs[-1].finished):
            engine.step()
    return req.timing.predicted_ms / 1e3, req.timing


def test_rounds_that_cost_more_than_they_gain_turn_speculation_off(family):
    plain_s, _ = generate(family, None, 0.0, speculate=False)
    spec_s, timing = generate(family, verify_s=6 * R, draft_s=4 * R, speculate=True)
    assert timing.draft_rounds <= 3  # it measured, backed off, and probes ever less often
    assert spec_s <= plain_s / 0.95


def test_rounds_that_pay_keep_speculation_on(family):
    plain_s, _ = generate(family, None, 0.0, speculate=False)
    spec_s, timing = generate(family, verify_s=1.2 * R, draft_s=0.3 * R, speculate=True)
    assert timing.draft_n_accepted / timing.draft_rounds > 0.5
    assert timing.predicted_n / (timing.draft_rounds + 1) > 1.3  # most tokens came from rounds of several
    assert spec_s < plain_s / 1.2


def test_warm_up_calibration_measures_every_bucket(family):
    """What the CUDA warm-up runs: a little traffic per batch bucket and draft length, after which the policy
    holds a plain step's cost and a round's for each bucket, and chooses from them on the first request."""
    sim = SimulatedDevice(P, R, verify_s=6 * R)
    engine = LLM(family["target"], clock=sim, max_num_seqs=2, overlap_schedule=True, spec_draft_n_max=3,
                 draft_model=str(family["draft"]), spec_measured_costs=True).engine
    sim.install(engine)
    calibrate_speculation(engine)
    for batch in (1, 2):
        measured = engine.speculation.policy.costs.at(batch)
        assert measured[0] == pytest.approx(R) and max(measured) >= 1
        assert all(t == pytest.approx(6 * R) for k, t in measured.items() if k > 0)
    assert not engine.has_work() and engine.pool.num_used == 0


def test_steps_that_compile_during_warm_up_do_not_price_the_calibrated_rounds(family):
    """The warm-up's first traffic compiles kernels (a first round measured 209 ms at 8B against 8 ms later);
    its step times are forgotten, so calibration drafts and measures a round of every length that pays."""
    sim = SimulatedDevice(P, R, verify_s=1.5 * R)
    engine = LLM(family["target"], clock=sim, max_num_seqs=2, overlap_schedule=True, spec_draft_n_max=3,
                 draft_model=str(family["draft"]), spec_measured_costs=True).engine
    sim.install(engine)
    launch, compiled = engine.runner.launch, []

    def compiling_launch(plan, *args, **kwargs):
        if not compiled and any(s.draft_tokens for s in plan.scheduled):
            compiled.append(plan)
            sim.advance(0.2)  # (a JIT compile on the host, in the step's measured time)
        return launch(plan, *args, **kwargs)

    engine.runner.launch = compiling_launch
    warm_up(engine)
    assert compiled
    for batch in (1, 2):
        measured = engine.speculation.policy.costs.at(batch)
        assert measured[0] == pytest.approx(R)
        assert {k for k in measured if k} == {1, 2, 3}
        assert all(t == pytest.approx(1.5 * R) for k, t in measured.items() if k > 0), measured
