"""When drafters learn committed rows: queued, and handed over in batches (Speculator.learn / flush).

Deferred learning must leave every drafter exactly as learning each step would (same proposals, token for
token, in float32), learn a finishing request's rows before its blocks are released (they may serve prefix
hits), drop a preempted request's queue, and keep undrafted decode steps free of the drafter's forward.

What the drafter is asked and told is recorded through a public seam: a RecordingDrafter (outrider/testing/
recording.py) the engine drafts through (Speculation.drafting_with), and a forward hook on a drafter's model. The
members still replaced here have no seam: the DraftPolicy (its decisions, costs, probe interval), the Speculator
(its decisions, its hidden-row recomputation, its limits LEARN_BACKLOG_STEPS, PIECEWISE_LEARN_GRAPHS, LEARN_ROWS)
and the block pool (when it frees a request's blocks) are built by engine/builder.py, which takes none of them,
and StepOutput.keep_hidden is called on the engine's own step outputs. Each replacement wraps the member and
calls it, except where a test scripts the decision itself (force_lengths, pattern_policy)."""

from __future__ import annotations

import itertools
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import outrider
import outrider.speculative.speculator as speculator_mod
from outrider import LLM, SamplingParams
from outrider.engine.request import Request
from outrider.steps import StepOutput
from outrider.speculative.drafter import LEARN_ROWS
from outrider.speculative.speculator import LEARN_BACKLOG_STEPS, PIECEWISE_LEARN_GRAPHS
from outrider.testing.recording import RecordingDrafter
from spec_helpers import LOOKUP_SETUPS, SETUPS, write_attentive_families

HIDDEN_KINDS = ["dflash", "mtp", "mimo", "eagle3"]  # the drafters that read the target's hidden rows
LEARNING_KINDS = HIDDEN_KINDS + ["draft"]  # and the draft model, which learns committed tokens
PROMPTS = [[5, 9, 100, 13, 7, 200, 11, 17, 19, 23], [42, 300, 8, 8, 9], list(range(60, 81)), [7, 100, 200, 300]]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_attentive_families(tmp_path_factory.mktemp("learning"))


def spec_llm(families, kind: str, **kwargs) -> LLM:
    """(Rounds drafted after each commit: this file holds the learning queue to learning every step; drafting ahead
    learns a round's rows from its verdict, and test_spec_draft_ahead.py holds it to this path. A confidence stop
    that no draft falls below trims nothing, but reading the drafts keeps rounds from being drafted ahead.)"""
    arch, served, engine_kwargs, _ = SETUPS[kind]
    kwargs.setdefault("draft_p_min", 1e-30)
    kwargs.setdefault("overlap_schedule", True)
    return LLM(families[arch][served], dtype="float32", max_num_seqs=8, spec_draft_n_max=3, spec_measured_costs=False,
               **engine_kwargs(families[arch]), **kwargs)


@pytest.fixture
def recorder():
    """install(engine, min_lookahead=0): the engine drafts through a RecordingDrafter (outrider/testing/recording.py)
    around its loaded drafter until the test ends, which also logs ("free", request id, preemptions) in its events
    each time a request's blocks are released (preemption included)."""
    with ExitStack() as stack:
        def install(engine, min_lookahead: int = 0) -> RecordingDrafter:
            record = RecordingDrafter(engine.speculation.drafter, min_lookahead)
            stack.enter_context(engine.speculation.drafting_with(record, engine.speculation.rounds))
            # (A patch: the pool is the engine builder's and tells no one when it frees a request's blocks; the
            # release order against learning is what these tests check.)
            pool, free = engine.pool, engine.pool.free_request

            def recorded_free(req):
                record.note(("free", req.request_id, req.num_preemptions))
                return free(req)

            pool.free_request = recorded_free
            return record

        yield install


def force_lengths(engine, drafts: bool = True) -> None:
    """Drafted and undrafted steps in a fixed pattern: two rounds in a row, one six steps later, then 19 plain steps
    (more than LEARN_BACKLOG_STEPS), over and over; k cycles through 1-3. Decided by step count and output length
    only, so two engines that commit the same tokens draft the same steps."""
    steps = itertools.count()

    def lengths(running):
        n = next(steps)
        if not drafts or n % 29 not in (2, 3, 9):
            return {}
        ks = {r.request_id: min(1 + (len(r.output_ids) + n) % 3,
                                r.max_output_tokens - len(r.output_ids) - r.num_pending - 1)
              for r in running if r.num_computed == r.num_tokens - 1}
        return {rid: k for rid, k in ks.items() if k > 0}

    engine.speculation.speculator.draft_lengths = lengths


def assert_same_proposals(got: list, want: list) -> None:
    """The same requests, lengths and drafts token for token; the drafter's confidences equal up to float32
    rounding (rows learned in one batch or another go through GEMMs of other shapes)."""
    assert [p[:3] for p in got] == [p[:3] for p in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(sum(g[3], [])), torch.tensor(sum(w[3], [])), rtol=1e-5, atol=1e-6)


def generate(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    return [c.token_ids for c in llm.generate(prompts, params)]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", LEARNING_KINDS)
def test_deferred_learning_proposes_what_learning_every_step_proposes(families, kind, batch, recorder, monkeypatch):
    """With rounds and long plain stretches alternating, and requests finishing at different steps, a drafter
    that learns queued rows in batches proposes exactly (token for token, in float32) what one that learns every
    step proposes, and the greedy output is the same."""
    prompts, max_tokens = PROMPTS[:batch], [60 - 9 * i for i in range(batch)]
    runs = {}
    for cap in (1, LEARN_BACKLOG_STEPS):
        monkeypatch.setattr(speculator_mod, "LEARN_BACKLOG_STEPS", cap)
        llm = spec_llm(families, kind)
        force_lengths(llm.engine)
        record = recorder(llm.engine)
        runs[cap] = (generate(llm, prompts, max_tokens), record)
    (eager_out, eager), (deferred_out, deferred) = runs[1], runs[LEARN_BACKLOG_STEPS]
    assert deferred_out == eager_out
    assert len(deferred.proposals) >= 4 and any(any(t) for _, _, tokens, _ in deferred.proposals for t in tokens)
    assert_same_proposals(deferred.proposals, eager.proposals)
    learns = [e for e in deferred.events if e[0] == "learn"]
    assert len(learns) < len([e for e in eager.events if e[0] == "learn"]) / 2
    assert any(s > 0 and n >= LEARN_BACKLOG_STEPS for e in learns for _, s, n in e[1])  # steps merged in one commit


@pytest.mark.parametrize("kind", LEARNING_KINDS)
def test_a_short_prompt_is_learned_in_graph_sized_pieces_proposing_what_a_whole_learn_does(families, kind, recorder,
                                                                                             monkeypatch):
    """A prompt longer than the largest learning graph (LEARN_ROWS), within PIECEWISE_LEARN_GRAPHS of them, reaches the
    drafter in order, in pieces of at most LEARN_ROWS[-1] rows (each a graph replay on CUDA), every row once; a
    longer one in one piece. Learned in pieces, the drafter proposes what it proposes having learned the prompt
    whole (float32), and the output is the same."""
    pieces_max = PIECEWISE_LEARN_GRAPHS * LEARN_ROWS[-1]
    short, long = [[3 + (7 * i + j) % 400 for i in range(n)] for j, n in ((0, 150), (1, pieces_max + 8))]
    runs = {}
    for limit in (PIECEWISE_LEARN_GRAPHS, 0):  # (0: every learn whole)
        monkeypatch.setattr(speculator_mod, "PIECEWISE_LEARN_GRAPHS", limit)
        llm = spec_llm(families, kind)
        force_lengths(llm.engine)
        record = recorder(llm.engine)
        runs[limit] = ([generate(llm, [prompt], [24])[0] for prompt in (short, long)], record)  # (one at a time)
    (pieces_out, pieces), (whole_out, whole) = runs[PIECEWISE_LEARN_GRAPHS], runs[0]
    learns = [e[1] for e in pieces.events if e[0] == "learn"]
    assert [[(s, n) for _, s, n in e] for e in learns[:2]] == [[(0, 64)], [(64, 64)]] and learns[2][0][1:] == (128, 22)
    assert any([(s, n) for _, s, n in e] == [(0, len(long))] for e in learns)
    assert pieces_out == whole_out
    assert any(any(t) for _, _, tokens, _ in pieces.proposals for t in tokens)
    assert_same_proposals(pieces.proposals, whole.proposals)


def pattern_policy(engine, sleeps: bool, dormant: bool = False) -> None:
    """The policy drafts in force_lengths's pattern and, where it drafts nothing, says whether k = 0 stands at the
    batch size (sleeps: the drafter then sleeps until the next round). dormant: there k = 0 also stands for the
    requests of the last decision without reading them (DraftPolicy.stands), one step of the pattern each, so a
    batch asleep whole goes dormant."""
    step = 0

    def drafts(n: int) -> bool:
        return n % 29 in (2, 3, 9)

    def draft_lengths(requests, drafter, in_flight=None, explore=True):
        nonlocal step
        n, step = step, step + 1
        if not drafts(n):
            return [0] * len(requests)
        return [max(0, min(1 + (len(r.output_ids) + n) % 3, r.max_output_tokens - len(r.output_ids) - r.num_pending
                           - 1)) for r in requests]

    def stands(batch, explore=True):
        nonlocal step
        if drafts(step):
            return False
        step += 1
        return True

    engine.speculation.policy.draft_lengths = draft_lengths
    engine.speculation.policy.priced_out = lambda batch: sleeps
    if dormant:
        engine.speculation.policy.stands = stands


@dataclass
class PatternRun:
    """A pattern_policy run of requests of different lengths: the greedy output, what the drafter was asked and told,
    the rows of each catch-up's recomputation, the steps taken on the dormant path, and for each request that ended
    asleep, how many blocks holding its rows from the first slept through were not marked as lacking drafter K/V."""

    out: list[list[int]]
    record: RecordingDrafter
    recomputed: list[int]
    dormant_steps: int
    unmarked: list[int]


def pattern_run(families, recorder, kind: str, batch: int, sleeps: bool, dormant: bool = False,
                reach: int = 0) -> PatternRun:
    """(reach: a round reserves blocks this far past a request's last token at least, as if the drafter wrote there.)"""
    llm = spec_llm(families, kind)
    engine = llm.engine
    pattern_policy(engine, sleeps, dormant)
    record = recorder(engine, min_lookahead=reach)
    spec, pool, recomputed, dormant_steps, unmarked = engine.speculation.speculator, engine.pool, [], [], []
    hidden_rows, decide, free = spec.hidden_rows, spec.draft_lengths, pool.free_request
    spec.hidden_rows = lambda spans: recomputed.append(sum(c.count for c in spans)) or hidden_rows(spans)
    spec.draft_lengths = lambda running: (decide(running), dormant_steps.append(spec.dormant))[0]

    def checked_free(req):
        since = spec.asleep_since(req.request_id)
        if since is not None:  # (its rows: positions up to the one before its last token's)
            last = req.num_prompt + len(req.output_ids) - 2
            slept = req.block_ids[since // pool.block_size: last // pool.block_size + 1]
            unmarked.append(len(set(slept) - pool.drafter_stale))
        free(req)

    pool.free_request = checked_free
    out = generate(llm, PROMPTS[:batch], [60 - 9 * i for i in range(batch)])
    return PatternRun(out, record, recomputed, sum(dormant_steps), unmarked)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", LEARNING_KINDS)
def test_a_drafter_that_slept_through_plain_steps_catches_up_and_proposes_what_it_would_have(families, kind,
                                                                                              batch, recorder):
    """Where k = 0 stands the drafter learns nothing; the next round first learns every row it slept through (their
    hidden states recomputed, for the drafters that read them), then proposes what a drafter that never slept
    proposes (token for token; confidences to float32 rounding), and the greedy output is the same."""
    awake, slept = (pattern_run(families, recorder, kind, batch, sleeps) for sleeps in (False, True))
    assert slept.out == awake.out
    assert len(slept.record.proposals) >= 4 and any(any(t) for _, _, tokens, _ in slept.record.proposals
                                                    for t in tokens)
    assert_same_proposals(slept.record.proposals, awake.record.proposals)
    # Learned: prompts with their prefill, then before each round the stretch slept through (19 plain steps at
    # most: in one catch-up), and a round's own rows; never a finishing request's rows after its last round.
    rows = {run: [n for e in r.record.events if e[0] == "learn" for _, _, n in e[1]] for run, r in
            (("awake", awake), ("slept", slept))}
    assert sum(rows["slept"]) < sum(rows["awake"])
    assert any(n >= 19 for n in rows["slept"])
    assert (sum(slept.recomputed) > 0) == (kind in HIDDEN_KINDS)


@pytest.mark.parametrize("kind", LEARNING_KINDS)
def test_a_batch_woken_from_dormancy_catches_up_exactly_the_rows_it_slept_through(families, kind, recorder):
    """Four requests asleep whole between rounds go dormant (their steps read none of them). Each round first
    learns what each request slept through: every committed row of a request is learned once, in order, none
    missed before its last learned one (dormant steps learned nothing, and no catch-up starts elsewhere than at the
    first row slept through). The drafter then proposes what one that never slept proposes, token for token, and
    the output is plain greedy decoding's."""
    # (rounds reserve blocks 40 positions ahead: rows the batch sleeps through later lie in blocks taken before it
    # fell dormant, and in blocks taken while it is)
    awake = pattern_run(families, recorder, kind, 4, sleeps=False, reach=40)
    dormant = pattern_run(families, recorder, kind, 4, sleeps=True, dormant=True, reach=40)
    assert dormant.dormant_steps >= 20 and awake.dormant_steps == 0
    assert dormant.unmarked and not any(dormant.unmarked)  # (a prefix hit on them would be caught up too)
    arch, served, _, _ = SETUPS[kind]
    plain = LLM(families[arch][served], dtype="float32", spec_type="none")
    assert dormant.out == generate(plain, PROMPTS[:4], [60 - 9 * i for i in range(4)])
    assert any(any(t) for _, _, tokens, _ in dormant.record.proposals for t in tokens)
    assert_same_proposals(dormant.record.proposals, awake.record.proposals)
    ids = {rid for e in dormant.record.events if e[0] == "learn" for rid, _, _ in e[1]}
    for rid in ids:
        spans = dormant.record.learned(rid)
        assert [s for s, _ in spans] == list(itertools.accumulate((n for _, n in spans[:-1]), initial=0))
    assert any(n >= 19 for rid in ids for _, n in dormant.record.learned(rid))  # (a stretch caught up at once)
    assert (sum(dormant.recomputed) > 0) == (kind in HIDDEN_KINDS)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_speculation_priced_out_with_company_sleeps_and_resumes_when_the_request_is_alone(families, kind):
    """The policy's own decisions: drafting pays alone, not beside another request (costs injected). While two
    decode, the drafter sleeps and no round is explored; once the short request has finished, the long one catches up
    in one recomputed forward and drafts again. Both outputs are plain greedy decoding's."""
    llm = spec_llm(families, kind)
    engine = llm.engine
    engine.speculation.policy.probe_every = 2  # (it would explore a round every other step, were it not asleep)
    priced_out_beside_company(engine)
    recomputed: list[tuple[int, int, int]] = []  # (first row, rows, the request's tokens then)
    hidden_rows = engine.speculation.speculator.hidden_rows
    engine.speculation.speculator.hidden_rows = lambda spans: recomputed.extend(
        (c.start, c.count, c.request.num_tokens) for c in spans) or hidden_rows(spans)
    long, short = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), \
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = llm.generate(PROMPTS[:2], [long, short])
    arch, served, _, _ = SETUPS[kind]
    want = LLM(families[arch][served], dtype="float32", spec_type="none").generate(PROMPTS[:2], [long, short])
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert got[1].timing.draft_rounds == 0 and got[0].timing.draft_rounds > 0
    # One catch-up: the long request's rows from its prompt's first (the prompts joined a batch where rounds were
    # priced out by the time they were learned) to its last committed one (fed next), past the 11 decoded beside
    # the short request.
    ((start, rows, tokens),) = recomputed
    assert start == 0 and start + rows == tokens - 1 and rows >= len(PROMPTS[0]) + 11


class LineCount:
    """The lines of outrider's code run inside its `with` blocks, and whether the step they belong to was dormant."""

    package = str(Path(outrider.__file__).parent)

    def __init__(self) -> None:
        self.lines = 0
        self.dormant = False

    def __enter__(self) -> None:
        sys.settrace(lambda frame, event, arg: self._line if frame.f_code.co_filename.startswith(self.package)
                     else None)

    def __exit__(self, *exc) -> None:
        sys.settrace(None)

    def _line(self, frame, event, arg):
        self.lines += event == "line"
        return self._line


def test_a_dormant_step_reads_no_request_however_large_the_batch(families, monkeypatch):
    """Requests priced out beside each other, every one decoding, sleep whole and go dormant: then a step's
    speculative work (deciding, keeping, learning, measuring) reads none of them. It runs as many lines of outrider's
    code at batch 8 as at batch 2, where a step that reads the requests runs more at 8; it keeps no hidden rows and
    queues nothing."""
    kept: list[bool] = []  # per keep_hidden call: in a dormant step?
    keep = StepOutput.keep_hidden
    dormant, full = {}, {}  # batch -> the lines each dormant (else full) step ran in the Speculator's calls
    for batch in (2, 8):
        llm = spec_llm(families, "dflash")
        priced_out_beside_company(llm.engine)
        spec, steps = llm.engine.speculation.speculator, []
        monkeypatch.setattr(StepOutput, "keep_hidden", lambda out: kept.append(spec.dormant) or keep(out))

        def counted(call, starts_step):
            def run(*args):
                if starts_step:
                    steps.append(LineCount())
                with steps[-1]:
                    out = call(*args)
                steps[-1].dormant = spec.dormant and not spec.queued
                return out
            return run

        for name in ("draft_lengths", "keep", "learn", "observe_step"):
            setattr(spec, name, counted(getattr(spec, name), name == "draft_lengths"))
        generate(llm, [PROMPTS[i % len(PROMPTS)] + [400 + i] for i in range(batch)], [40] * batch)
        dormant[batch] = [s.lines for s in steps if s.dormant]
        full[batch] = [s.lines for s in steps if not s.dormant]
        assert len(dormant[batch]) >= len(steps) // 2
    assert dormant[8] == dormant[2] and max(full[8]) > max(full[2])
    assert kept and not any(kept)


def priced_out_beside_company(engine, factor: float = 100.0) -> None:
    """Rounds pay alone, not beside another request: there they cost `factor` times as much (costs injected)."""
    seconds = engine.speculation.policy.round_seconds
    engine.speculation.policy.round_seconds = lambda batch, k, cost: seconds(batch, k, cost) * (1 + (factor - 1) * (k > 0)
                                                                                   * (batch > 1))


def test_requests_joining_a_batch_where_rounds_are_priced_out_explore_no_round(families):
    """Beside company, rounds cost three times their price, which acceptance near 1 would still pay for: probes
    are due every few decisions. None is explored, neither while the drafter sleeps nor when a new pair of requests
    joins (their prompts are slept through, so a round would first recompute them)."""
    llm = spec_llm(families, "dflash")
    llm.engine.speculation.policy.probe_every = 2
    priced_out_beside_company(llm.engine, factor=3.0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        got = llm.generate(PROMPTS[:2], params)
        assert [c.timing.draft_rounds for c in got] == [0, 0]


def test_every_block_of_rows_the_drafter_slept_through_is_marked_when_the_request_ends(families):
    """Two requests decode priced out beside each other, across several 16-token blocks: when each ends, every
    block it held is marked as lacking the drafter's K/V (the pool marks a block once, at the row that begins it)."""
    llm = spec_llm(families, "eagle3")
    priced_out_beside_company(llm.engine)
    pool, unmarked = llm.engine.pool, []
    free = pool.free_request
    pool.free_request = lambda req: unmarked.append(set(req.block_ids) - pool.drafter_stale) or free(req)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True))
    assert unmarked == [set(), set()]


@pytest.mark.parametrize("kind", ["dflash", "draft"])
def test_a_prefix_hit_on_rows_the_drafter_slept_through_is_caught_up_before_it_drafts(families, kind, recorder):
    """Two requests with a 40-token prompt prefix decode together, priced out: the drafter sleeps through their
    prompts, and their blocks go to the prefix cache holding target K/V only. A later request alone hits that
    prefix; before its first round the drafter learns it from its first row, and proposes what a drafter that
    learned the whole prompt proposes (an engine without the earlier traffic)."""
    prefix = list(range(100, 140))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = spec_llm(families, kind)
    priced_out_beside_company(llm.engine)
    llm.generate([prefix + [7], prefix + [8]], params)
    recomputed: list[int] = []
    hidden_rows = llm.engine.speculation.speculator.hidden_rows
    llm.engine.speculation.speculator.hidden_rows = lambda spans: recomputed.extend(c.start for c in spans) or hidden_rows(spans)
    hits = llm.engine.pool.hits
    record = recorder(llm.engine)
    got = llm.generate([prefix + [9, 10]], params)[0]
    assert llm.engine.pool.hits - hits == 32  # two blocks of 16
    fresh = spec_llm(families, kind)
    priced_out_beside_company(fresh.engine)
    want_record = recorder(fresh.engine)
    want = fresh.generate([prefix + [9, 10]], params)[0]
    assert got.token_ids == want.token_ids and got.timing.draft_rounds > 0
    assert_same_proposals(record.proposals, want_record.proposals)
    learned = [start for e in record.events if e[0] == "learn" for _, start, _ in e[1]]
    assert (recomputed if kind in HIDDEN_KINDS else learned)[0] == 0


def test_a_lone_request_asleep_still_explores_rounds_and_catches_up_for_each(families):
    """Priced out even alone (rounds injected at three times their cost: they would pay only at high acceptance),
    the drafter sleeps, yet the policy's exploratory rounds go on (a lone request's acceptance may change), each
    first catching up on the rows slept through; output is plain greedy's."""
    llm = spec_llm(families, "mtp")
    engine = llm.engine
    engine.speculation.policy.probe_every = 4
    seconds = engine.speculation.policy.round_seconds
    engine.speculation.policy.round_seconds = lambda batch, k, cost: seconds(batch, k, cost) * (1 + 2 * (k > 0))
    recomputed: list[int] = []
    hidden_rows = engine.speculation.speculator.hidden_rows
    engine.speculation.speculator.hidden_rows = lambda spans: recomputed.append(sum(c.count for c in spans)) or hidden_rows(spans)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    got = llm.generate([PROMPTS[0]], params)[0]
    want = LLM(families["qwen3"]["mtp"], dtype="float32", spec_type="none").generate([PROMPTS[0]], params)[0]
    assert got.token_ids == want.token_ids
    assert got.timing.draft_rounds >= 2 and len(recomputed) >= 2 and all(n > 0 for n in recomputed)


@dataclass(frozen=True)
class Decision:
    """A step's draft lengths (of the requests drafting), and its batch where it was taken on the dormant path."""

    ks: list[int]
    dormant_batch: int


@dataclass
class ScheduleRun:
    """A run of test_probes_fire_on_schedule_after_a_dormant_stretch: each step's decision, each measured step's
    (batch, k), what the drafter was asked and told, the outputs, and the policy's probes in the end."""

    steps: list[Decision]
    measured: list[tuple[int, int]]
    record: RecordingDrafter
    out: list[list[int]]
    probes: dict


def schedule_run(families, recorder, overlap: bool, dormant: bool) -> ScheduleRun:
    """(dormant False: DraftPolicy.stands never takes k = 0 without reading the requests, so the Speculator reads
    them at every decision.)"""
    llm = spec_llm(families, "mtp", overlap_schedule=overlap)
    engine = llm.engine
    engine.speculation.policy.probe_every = 4
    priced_out_beside_company(engine)
    seconds = engine.speculation.policy.round_seconds
    engine.speculation.policy.round_seconds = lambda batch, k, cost: seconds(batch, k, cost) * (1 + 2 * (k > 0))
    if not dormant:
        engine.speculation.policy.stands = lambda batch, explore=True: False
    spec, run = engine.speculation.speculator, ScheduleRun([], [], recorder(engine), [], {})
    decide, observe = spec.draft_lengths, engine.speculation.policy.observe_step

    def draft_lengths(running):
        lengths = decide(running)
        run.steps.append(Decision(list(lengths.values()), len(running) if spec.dormant else 0))
        return lengths

    spec.draft_lengths = draft_lengths
    engine.speculation.policy.observe_step = lambda batch, k, s: run.measured.append((batch, k)) or observe(batch, k, s)
    reqs = [Request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for prompt, n in zip(PROMPTS, (24, 16, 20, 96))]
    outs: dict[int, list] = {r.request_id: [] for r in reqs}
    for r in reqs[:3]:
        engine.add_request(r, outs[r.request_id].append)
    while engine.has_work():
        if len(run.steps) == 8:
            engine.add_request(reqs[3], outs[reqs[3].request_id].append)
        engine.step()
    run.out = [[t for o in outs[r.request_id] for t in o.new_token_ids] for r in reqs]
    run.probes = {bucket: replace(p, ids=len(p.ids)) for bucket, p in engine.speculation.policy.probes.items()}  # (ids differ)
    return run


@pytest.mark.parametrize("overlap", [True, False])
def test_probes_fire_on_schedule_after_a_dormant_stretch(families, overlap, recorder):
    """Three requests priced out beside each other go dormant, and a fourth joins them; as they finish, the longest
    is left alone and explores rounds (probe_every 4, rounds at three times their price), dormant in between. Step
    for step, the lengths decided, the step costs measured and the drafts proposed, then the outputs and the
    policy's probe schedule, are those of an engine that never takes the dormant path (reading the requests at
    every decision): dormant decisions are counted, not skipped, and a step that admits a request is learned as
    ever."""
    got, read = (schedule_run(families, recorder, overlap, dormant=True),
                 schedule_run(families, recorder, overlap, dormant=False))
    assert [d.ks for d in got.steps] == [d.ks for d in read.steps] and got.measured == read.measured
    assert_same_proposals(got.record.proposals, read.record.proposals)
    assert got.out == read.out and got.probes == read.probes
    assert got.steps[8].dormant_batch == 3  # (the fourth request is admitted by a dormant step)
    assert {1, 2, 3, 4} <= {d.dormant_batch for d in got.steps} and not any(d.dormant_batch for d in read.steps)
    alone = got.steps[next(i for i, d in enumerate(got.steps) if d.dormant_batch == 1):]  # (the longest, alone)
    assert sum(1 for d in alone if d.ks) >= 3  # (probes, between dormant stretches; then rounds that pay)


def test_a_catch_up_is_left_out_of_the_measured_cost_of_the_round_that_does_it(families):
    """A lone request's exploratory rounds catch up on the rows slept through first, here made slow (0.25 s a
    catch-up): the step costs the policy measures leave that one-off work out, else the round it priced out would
    stay priced out, re-measured each time with the next catch-up."""
    llm = spec_llm(families, "mtp")
    engine = llm.engine
    engine.speculation.policy.probe_every = 4
    seconds = engine.speculation.policy.round_seconds
    engine.speculation.policy.round_seconds = lambda batch, k, cost: seconds(batch, k, cost) * (1 + 2 * (k > 0))
    hidden_rows, catch_ups = engine.speculation.speculator.hidden_rows, []

    def slow_hidden_rows(spans):
        catch_ups.append(len(spans))
        time.sleep(0.25)
        return hidden_rows(spans)

    engine.speculation.speculator.hidden_rows = slow_hidden_rows
    observed: list[tuple[int, float]] = []
    observe = engine.speculation.policy.observe_step
    engine.speculation.policy.observe_step = lambda batch, k, s: observed.append((k, s)) or observe(batch, k, s)
    got = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    assert got.timing.draft_rounds >= 2 and len(catch_ups) >= 2
    assert any(k > 0 for k, _ in observed) and max(s for _, s in observed) < 0.2


def test_a_draft_model_feeds_one_token_per_request_when_it_proposes(families, recorder):
    """The draft model learns the prompt with the prefill and committed tokens in the Speculator's batches, so a
    propose's first forward feeds each drafting request its last token alone (a decode step's shape: a CUDA graph on
    a GPU), even after 19 plain steps; before, it caught up there on everything unseen, eagerly."""
    llm = spec_llm(families, "draft")
    force_lengths(llm.engine)
    record = recorder(llm.engine)
    record.inner.model.register_forward_pre_hook(lambda module, args: record.note(("forward", args[0].shape[0])))
    generate(llm, PROMPTS, [60, 50, 40, 30])
    calls = [e for e in record.events if e[0] in ("propose", "forward")]
    first_forwards = [calls[i + 1][1] for i, e in enumerate(calls) if e[0] == "propose"]
    drafting = [sum(1 for k in ks if k > 0) for _, ks, _, _ in record.proposals]
    assert len(drafting) >= 4 and first_forwards == drafting


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_undrafted_decode_steps_learn_nothing_until_the_queue_is_full(families, kind, recorder):
    """A request that never drafts: the drafter learns its prompt with the prefill, then nothing for
    LEARN_BACKLOG_STEPS - 1 decode steps, then all of them as one commit, and the rest before its blocks are
    released; together exactly its rows 0..n-2, each once, with as many hidden rows."""
    llm = spec_llm(families, kind)
    force_lengths(llm.engine, drafts=False)
    record = recorder(llm.engine)
    prompt, tokens = PROMPTS[0], 2 * LEARN_BACKLOG_STEPS + 9
    req = Request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    outs: list = []
    llm.engine.add_request(req, outs.append)
    learned_by_step = []
    while llm.engine.has_work():
        before = len(record.events)
        llm.engine.step()
        learned_by_step.append(sum(1 for e in record.events[before:] if e[0] in ("learn", "free")))
    decode = tokens - 1  # the prefill step commits the prompt rows; each decode step one row
    counts = [len(prompt)] + [LEARN_BACKLOG_STEPS] * (decode // LEARN_BACKLOG_STEPS) + [decode % LEARN_BACKLOG_STEPS]
    assert [n for _, n in record.learned(req.request_id)] == counts
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    assert [s for s, _ in record.learned(req.request_id)] == starts
    assert [e[2] for e in record.events if e[0] == "learn"] == counts  # one hidden row per learned row
    assert sum(learned_by_step) == len(counts) + 1  # the learning calls, and the release of the blocks
    assert [e[0] for e in record.events[-2:]] == ["free", "release"]


def test_drafters_without_hidden_rows_keep_none(families, recorder, monkeypatch):
    """N-gram lookup (alone or beside a draft model) reads committed tokens only: no step copies its hidden rows
    for it, and on_commit gets none; alone, nothing is queued for it at all (its lookups index what they read)."""
    copies = []
    keep = StepOutput.keep_hidden
    monkeypatch.setattr(StepOutput, "keep_hidden", lambda self: copies.append(1) or keep(self))
    for kind in ("ngram", "ngram,draft"):
        arch, served, kwargs, _, prompt = LOOKUP_SETUPS[kind]
        llm = LLM(families[arch][served], max_num_seqs=4, overlap_schedule=True, **kwargs(families[arch]))
        assert not llm.engine.speculation.drafter.reads_hidden
        record = recorder(llm.engine)
        outs = llm.generate([prompt, prompt[::-1]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        assert any(c.timing.draft_rounds for c in outs)
        learns = [e for e in record.events if e[0] == "learn"]
        assert all(rows is None for _, _, rows in learns)
        assert bool(learns) == llm.engine.speculation.drafter.learns == (kind != "ngram")
    assert not copies


@pytest.mark.parametrize("kind", HIDDEN_KINDS)
def test_finished_request_is_learned_before_its_blocks_serve_a_prefix_hit(families, kind, recorder, monkeypatch):
    """A finishes with rows still queued, some in a block its finish publishes; B's prompt is A's whole sequence,
    so B reuses that block from the prefix cache. A's rows are all learned before its blocks are released, and B
    then drafts exactly what it drafts when every step is learned at once."""
    prompt, tokens = list(range(20, 40)), 30  # rows 36..48 are queued at A's finish; block 2 (32..47) is full
    runs = {}
    for cap in (1, LEARN_BACKLOG_STEPS):
        monkeypatch.setattr(speculator_mod, "LEARN_BACKLOG_STEPS", cap)
        llm = spec_llm(families, kind)
        record = recorder(llm.engine)
        force_lengths(llm.engine, drafts=False)
        first = generate(llm, [prompt], [tokens])[0]
        a_id = next(e[1][0][0] for e in record.events if e[0] == "learn")
        freed = next(i for i, e in enumerate(record.events) if e[0] == "free")
        learned = record.learned(a_id)
        assert [e for e in record.events[:freed] if e[0] == "learn"] == [e for e in record.events if e[0] == "learn"]
        assert sum(n for _, n in learned) == len(prompt) + tokens - 1
        force_lengths(llm.engine)
        hits = llm.engine.pool.hits
        runs[cap] = (generate(llm, [prompt + first], [24]), record.proposals)
        assert llm.engine.pool.hits - hits == 48
    assert runs[LEARN_BACKLOG_STEPS][0] == runs[1][0]
    assert_same_proposals(runs[LEARN_BACKLOG_STEPS][1], runs[1][1])
    assert any(any(t) for _, _, tokens, _ in runs[1][1] for t in tokens)


def test_preempted_request_drops_its_queue(families, recorder):
    """B is preempted with decode rows queued: they are never learned into its freed blocks; after it runs again
    the drafter learns its recomputed rows, and the output is still the target's own."""
    arch, served, kwargs, _ = SETUPS["mtp"]
    path = families[arch][served]
    # Four usable blocks of 16: A (30 + 30 tokens) takes its third while B (10 + 30) is decoding; B needs its
    # second block after its first tokens, finds none and is preempted until A is done.
    llm = LLM(path, dtype="float32", max_num_seqs=4, overlap_schedule=True, num_kv_blocks=5,
              enable_prefix_caching=False, spec_measured_costs=False, **kwargs(families[arch]))
    force_lengths(llm.engine, drafts=False)
    record = recorder(llm.engine)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    a, b = Request(list(range(3, 33)), params), Request(list(range(100, 110)), params)
    outs: dict[int, list] = {a.request_id: [], b.request_id: []}
    engine.add_request(a, outs[a.request_id].append)
    engine.step()
    engine.add_request(b, outs[b.request_id].append)
    while engine.has_work():
        engine.step()
    assert b.num_preemptions > 0
    preempted = next(i for i, e in enumerate(record.events) if e[:2] == ("free", b.request_id))
    rows_then = next(i for i, e in enumerate(record.events) if e[0] == "learn" and i > preempted
                     and any(rid == b.request_id for rid, _, _ in e[1]))
    before = [(s, n) for e in record.events[:preempted] if e[0] == "learn" for rid, s, n in e[1]
              if rid == b.request_id]
    assert sum(n for _, n in before) == 10  # the prompt rows; the decode rows were still queued
    assert record.events[rows_then][1][0][1] == 0  # after its re-admission: its recomputation, from position 0
    plain = LLM(path, dtype="float32", max_num_seqs=4, spec_type="none")
    assert [[t for o in outs[r.request_id] for t in o.new_token_ids] for r in (a, b)] == generate(
        plain, [a.prompt_ids, b.prompt_ids], [30, 30])


@pytest.mark.parametrize("largest_graph", [LEARN_ROWS[-1], 16])
@pytest.mark.parametrize("kind", ["dflash", "draft"])
def test_undrafted_steps_learn_in_graph_sized_pieces_at_small_batches_and_in_backlogs_at_large_ones(
        families, kind, largest_graph, recorder, monkeypatch):
    """Eight requests that never draft fill the queue with eight rows a step. Where that is at most a quarter of the
    largest learning graph (LEARN_ROWS: 64), the queue is handed over before it would outgrow the graph, not after
    LEARN_BACKLOG_STEPS steps as one eager, ragged forward; where it is more (a largest graph of 16 here, as a batch
    of 32 against 64 rows), a replay every step or two would cost more, and the backlog waits its steps. Every
    decode row is learned, once."""
    monkeypatch.setattr(speculator_mod, "LEARN_ROWS", LEARN_ROWS[: LEARN_ROWS.index(largest_graph) + 1])
    llm = spec_llm(families, kind)
    force_lengths(llm.engine, drafts=False)
    record = recorder(llm.engine)
    prompts = [PROMPTS[i % len(PROMPTS)] + [400 + i] for i in range(8)]
    generate(llm, prompts, [3 * LEARN_BACKLOG_STEPS] * 8)
    decode_learns = [sum(n for _, _, n in e[1]) for e in record.events
                     if e[0] == "learn" and all(s > 0 for _, s, _ in e[1])]
    assert max(decode_learns) == (largest_graph if largest_graph == LEARN_ROWS[-1] else 8 * LEARN_BACKLOG_STEPS)
    assert sum(decode_learns) == 8 * (3 * LEARN_BACKLOG_STEPS - 1)
