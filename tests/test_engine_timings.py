"""The timing rule on the engine's real step loop, against a simulated device with known phase times
(tests/timing_sim.py): overlap scheduling on and off, a second request decoding, chunked prefill, a prefix-cache
hit, preemption before and after the first token, and a drafter that learns slowly.

prompt_ms runs from the launch of the step holding the request's (last started) prefill to its first token on
the host; predicted_ms from there to its last token. The simulation knows when each step was launched and when
the device finished it, so every expectation below comes from the device's record, not from the engine's stamps."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from outrider.engine.request import Request
from outrider.timing import RequestTiming
from outrider.testing import write_tiny_checkpoint
from tests.spec_helpers import write_family
from tests.timing_sim import SimulatedDevice

P, R, L = 0.050, 0.010, 0.020  # a prefill step, any other step, the host's launch of a prefill step (seconds)
MS = pytest.approx  # stamps are sums of these phase times: equal up to float rounding


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", hidden_size=64, layers=2, seed=3)


def setup(ckpt, **engine_kwargs):
    sim = SimulatedDevice(P, R, L)
    engine = LLM(ckpt, clock=sim, **engine_kwargs).engine
    return engine, sim.install(engine)


def submit(engine, sim, prompt: list[int], max_tokens: int) -> tuple[Request, list]:
    req = Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                  timing=RequestTiming(t_arrival=sim.t))
    outs: list = []
    engine.add_request(req, outs.append)
    return req, outs


def run_until_finished(engine, outs) -> None:
    while not (outs and outs[-1].finished):
        engine.step()


def first_token_step(sim, req):
    """The step whose collect gave the request its first token: the first one that sampled for it."""
    return next(s for s in sim.steps_of(req) if req in s.sampled)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_prompt_ms_is_the_prefill_while_another_request_decodes(ckpt, overlap):
    """A prompt arriving while another request decodes: prompt_ms covers its prefill step from launch to token
    (with overlap, also the in-flight step it queued behind, at most one round), never less than the prefill."""
    engine, sim = setup(ckpt, overlap_schedule=overlap, max_num_seqs=4)
    _, a_outs = submit(engine, sim, list(range(3, 20)), 40)
    for _ in range(5):
        engine.step()
    b, b_outs = submit(engine, sim, list(range(50, 90)), 8)
    run_until_finished(engine, b_outs)
    t = b.timing.to_timings()
    prefill = sim.steps_of(b)[0]
    assert prefill.prefill and first_token_step(sim, b) is prefill
    assert t["prompt_n"] == 40 and t["cache_n"] == 0
    assert t["prompt_ms"] == MS((prefill.end - prefill.launched) * 1e3)
    assert P * 1e3 - 1e-6 <= t["prompt_ms"] <= (P + (R if overlap else 0)) * 1e3 + 1e-6
    assert t["predicted_n"] == 8
    assert t["predicted_ms"] == MS(7 * R * 1e3)  # seven more rounds, back to back on the device
    assert b.timing.queue_ms == MS((prefill.launched - b.timing.t_arrival) * 1e3)
    run_until_finished(engine, a_outs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_chunked_prefill_counts_every_chunk(ckpt, overlap):
    engine, sim = setup(ckpt, overlap_schedule=overlap, max_num_batched_tokens=16)
    req, outs = submit(engine, sim, list(range(3, 43)), 4)
    run_until_finished(engine, outs)
    t = req.timing.to_timings()
    steps = sim.steps_of(req)
    assert [s.prefill for s in steps[:3]] == [True, True, True]  # 16 + 16 + 8 prompt tokens
    assert t["prompt_n"] == 40
    assert t["prompt_ms"] == MS(3 * P * 1e3)
    assert t["predicted_ms"] == MS(3 * R * 1e3)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_prefix_cache_hit_counts_only_the_computed_prompt(ckpt, overlap):
    engine, sim = setup(ckpt, overlap_schedule=overlap)
    prompt = list(range(3, 43))
    _, first = submit(engine, sim, prompt, 2)
    run_until_finished(engine, first)
    req, outs = submit(engine, sim, prompt, 4)
    run_until_finished(engine, outs)
    t = req.timing.to_timings()
    assert (t["cache_n"], t["prompt_n"]) == (32, 8)  # two full 16-token blocks reused
    assert t["prompt_ms"] == MS(P * 1e3)
    assert t["predicted_ms"] == MS(3 * R * 1e3)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_preemption_before_the_first_token_restarts_the_prompt(ckpt, overlap):
    """B is preempted while its prompt is still being prefilled: the discarded work and the wait until it runs
    again are queue wait; prompt_ms, prompt_n and cache_n describe the prefill that gave the first token."""
    # Six usable blocks of 16: A (30 + 60 tokens) grows into all of them while B's 40-token prompt is still
    # being prefilled in 15-token chunks beside A's decodes.
    engine, sim = setup(ckpt, overlap_schedule=overlap, num_kv_blocks=7, max_num_batched_tokens=16,
                        enable_prefix_caching=False)
    a, a_outs = submit(engine, sim, list(range(3, 33)), 60)
    while len(a.output_ids) + a.num_pending < 17:
        engine.step()
    b, b_outs = submit(engine, sim, list(range(100, 140)), 4)
    run_until_finished(engine, b_outs)
    assert b.num_preemptions > 0
    admitted = [s for s in sim.steps if b in s.admitted]
    assert len(admitted) > 1  # admitted, preempted before any token, admitted again
    last = admitted[-1]
    assert first_token_step(sim, b).launched >= last.launched
    t = b.timing.to_timings()
    assert (t["prompt_n"], t["cache_n"]) == (40, 0)
    assert t["prompt_ms"] == MS((first_token_step(sim, b).end - last.launched) * 1e3)
    assert t["prompt_ms"] <= (3 * P + R) * 1e3 + 1e-6  # three chunks, and at most one round queued behind
    assert b.timing.queue_ms == MS((last.launched - b.timing.t_arrival) * 1e3)
    assert b.timing.queue_ms > (admitted[1].launched - admitted[0].launched) * 1e3  # the discarded work is in it
    assert t["predicted_ms"] == MS(3 * R * 1e3)
    run_until_finished(engine, a_outs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_prompt_admitted_into_a_failed_step_starts_when_it_really_runs(ckpt, overlap):
    """A step holding A's decode and B's admission fails with its owner unknown, so each of them runs alone, A
    first: B's prompt starts at the launch of the step that runs it, not at the failed step or at A's."""
    engine, sim = setup(ckpt, overlap_schedule=overlap, max_num_seqs=4)
    a, a_outs = submit(engine, sim, list(range(3, 20)), 40)
    for _ in range(5):
        engine.step()
    launch, failed = engine.runner.launch, []

    def faulty(plan, *args, **kwargs):
        if not failed and len(plan.scheduled) > 1:
            failed.append(sim.t)
            raise RuntimeError("injected fault")
        return launch(plan, *args, **kwargs)

    engine.runner.launch = faulty
    b, b_outs = submit(engine, sim, list(range(50, 90)), 4)
    run_until_finished(engine, b_outs)
    first = sim.steps_of(b)[0]
    assert failed and first.requests == [b]  # the failed step, then B alone
    assert any(s.requests == [a] and failed[0] <= s.launched < first.launched for s in sim.steps)  # A alone first
    t = b.timing.to_timings()
    assert (t["prompt_n"], t["cache_n"]) == (40, 0)
    assert t["prompt_ms"] == MS((first_token_step(sim, b).end - first.launched) * 1e3)
    assert b.timing.queue_ms == MS((first.launched - b.timing.t_arrival) * 1e3)
    run_until_finished(engine, a_outs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_preemption_after_the_first_token_keeps_the_prompt_figures(ckpt, overlap):
    """B has its first token when A's growth preempts it: its prompt figures stay those of its first prefill; the
    stall (wait and recomputation) shows in predicted_ms, and the wait joins the queue wait."""
    # Four usable blocks of 16: A (30 + 30 tokens) takes its third while B (10 + 30) is decoding; B needs its
    # second block after its first tokens, finds none and is preempted until A is done.
    engine, sim = setup(ckpt, overlap_schedule=overlap, num_kv_blocks=5, enable_prefix_caching=False)
    a, a_outs = submit(engine, sim, list(range(3, 33)), 30)
    engine.step()
    b, b_outs = submit(engine, sim, list(range(100, 110)), 30)
    run_until_finished(engine, b_outs)
    assert b.num_preemptions > 0
    prefill = sim.steps_of(b)[0]
    assert first_token_step(sim, b) is prefill
    t = b.timing.to_timings()
    assert (t["prompt_n"], t["cache_n"]) == (10, 0)
    assert t["prompt_ms"] == MS((prefill.end - prefill.launched) * 1e3)
    last = [s for s in sim.steps if b in s.sampled][-1]
    assert t["predicted_ms"] == MS((last.end - prefill.end) * 1e3)
    assert t["predicted_ms"] > (t["predicted_n"] - 1) * R * 1e3 + P * 1e3  # the stall is in it
    resumed = [s for s in sim.steps if b in s.admitted][-1]
    first_wait = (prefill.launched - b.timing.t_arrival) * 1e3
    assert b.timing.queue_ms > first_wait  # the wait after the preemption joined it
    assert b.timing.queue_ms <= first_wait + (resumed.launched - prefill.end) * 1e3 + 1e-6
    run_until_finished(engine, a_outs)


def test_first_token_is_delivered_before_the_drafter_learns(tmp_path):
    """A drafter's pass over the prompt (MTP learning every prompt row) runs after the first token is handed
    over: with learning made to take 200 ms, the token still arrives when it was stamped."""
    family = write_family(tmp_path, "qwen3", ("mtp",))
    sim = SimulatedDevice(P, R, L)
    engine = LLM(family["mtp"], clock=sim, max_num_seqs=2).engine
    sim.install(engine)
    assert engine.speculation is not None
    learn = engine.speculation.drafter.on_commit

    def slow_learn(*args, **kwargs):
        sim.advance(0.200)
        return learn(*args, **kwargs)

    engine.speculation.drafter.on_commit = slow_learn
    delivered: list[float] = []
    req = Request(list(range(3, 30)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                  timing=RequestTiming(t_arrival=sim.t))
    outs: list = []
    engine.add_request(req, lambda o: (delivered.append(sim.t), outs.append(o)))
    run_until_finished(engine, outs)
    assert delivered[0] == req.timing.t_first_token
    assert req.timing.prompt_ms == MS(P * 1e3)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_constrained_round_costs_a_plain_round_with_overlap(ckpt, overlap):
    """Building a step (H) and a constrained request's masks (M) are host work. With overlap, the next step's
    forward is launched while the step in flight finishes, and the masks are computed while that forward runs:
    with H + M under a round, constrained decoding at batch 1 takes one device round a token, as plain decoding
    does. Without overlap, the host's build and the device's round add up."""
    H, M = 0.003, 0.004
    sim = SimulatedDevice(P, R, L, host_s=H, mask_s=M)
    engine = LLM(ckpt, clock=sim, overlap_schedule=overlap).engine
    sim.install(engine)
    letters = engine.grammars.gbnf("root ::= [a-z]+")  # (never complete: ignore_eos bans the end)
    outs: dict[str, list] = {}
    for name, grammar, prompt in (("plain", None, range(3, 20)), ("constrained", letters, range(50, 67))):
        req = Request(list(prompt), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                   grammar=grammar), timing=RequestTiming(t_arrival=sim.t))
        outs[name] = []
        engine.add_request(req, outs[name].append)
        run_until_finished(engine, outs[name])
        while engine.has_work():
            engine.step()
        t = req.timing.to_timings()
        assert t["predicted_n"] == 12
        assert t["prompt_ms"] == MS((H + P) * 1e3)
        assert t["predicted_ms"] == MS(11 * (R if overlap else H + R) * 1e3), name
    assert "".join(o.text for o in outs["constrained"]).isalpha()
