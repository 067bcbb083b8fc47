"""When drafters learn committed rows: queued, and handed over in batches (Speculator.learn / flush).

Deferred learning must leave every drafter exactly as learning each step would (same proposals, token for
token, in float32), learn a finishing request's rows before its blocks are released (they may serve prefix
hits), drop a preempted request's queue, and keep undrafted decode steps free of the drafter's forward.

Everything is observed or scripted through public seams, no member replaced: the engine is built (build_engine's
Seams) with this file's block pool (WatchedPool: logs and checks each release of a request's blocks), Speculator
(WatchedSpeculator: logs its decisions, catch-ups and hidden-row copies) and draft policy (PatternPolicy scripts the
decisions; PricedPolicy decides on injected costs), and with the Speculator's limits a test sets; it drafts through
a RecordingDrafter (outrider/testing/recording.py, Speculation.drafting_with), and a drafter's model is watched
through a forward hook. Each subclass calls the class it extends, except where the script is the point."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import pytest
import torch

import outrider
from outrider import LLM, SamplingParams
from outrider.engine.builder import Seams
from outrider.engine.kv_cache import BlockPool
from outrider.engine.request import Request
from outrider.speculative.drafter import DraftPolicy
from outrider.speculative.speculator import SpeculationLimits, Speculator
from outrider.steps import StepOutput, StepPlan
from outrider.testing.recording import RecordingDrafter
from spec_helpers import LOOKUP_SETUPS, SETUPS, write_attentive_families, write_hybrid_family

HIDDEN_KINDS = ["dflash", "mtp", "mimo", "eagle3"]  # the drafters that read the target's hidden rows
LEARNING_KINDS = HIDDEN_KINDS + ["draft"]  # and the draft model, which learns committed tokens
PROMPTS = [[5, 9, 100, 13, 7, 200, 11, 17, 19, 23], [42, 300, 8, 8, 9], list(range(60, 81)), [7, 100, 200, 300]]
LIMITS = SpeculationLimits()  # the server's


class WatchedPool(BlockPool):
    """A block pool that logs ("free", request id, preemptions) in `events` each time it frees a request's blocks
    (preemption included), after `check(pool, request)` where given (a test's look at them before they go)."""

    def __init__(self, *args, check: Callable[[BlockPool, Request], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.check = check
        self.events: list[tuple] = []

    def free_request(self, req: Request) -> None:
        if self.check is not None:
            self.check(self, req)
        self.events.append(("free", req.request_id, req.num_preemptions))
        super().free_request(req)


@dataclass(frozen=True)
class Decision:
    """A step's draft lengths (of the requests drafting), its batch, and whether it was taken on the dormant path."""

    ks: list[int]
    batch: int
    dormant: bool

    @property
    def dormant_batch(self) -> int:
        """Its batch where it was taken on the dormant path, else 0."""
        return self.batch if self.dormant else 0


class WatchedSpeculator(Speculator):
    """A Speculator that logs each decision (`decisions`), each catch-up's recomputed hidden rows as (first row, rows,
    the request's tokens then) per span (`catch_ups`), each taking `catch_up_seconds` longer (slow one-off work), and
    for each step whose hidden rows it copied (StepOutput.keep_hidden), whether that happened on the dormant path
    (`kept`)."""

    def __init__(self, drafter, policy, pool, hidden_rows, *args, catch_up_seconds: float = 0.0):
        self.decisions: list[Decision] = []
        self.catch_ups: list[list[tuple[int, int, int]]] = []
        self.kept: list[bool] = []

        def recomputed(spans):
            self.catch_ups.append([(c.start, c.count, c.request.num_tokens) for c in spans])
            if catch_up_seconds:
                time.sleep(catch_up_seconds)
            return hidden_rows(spans)

        super().__init__(drafter, policy, pool, recomputed if hidden_rows is not None else None, *args)

    def draft_lengths(self, running: Sequence[Request]) -> dict[int, int]:
        lengths = super().draft_lengths(running)
        self.decisions.append(Decision(list(lengths.values()), len(running), self.dormant))
        return lengths

    def keep(self, plan: StepPlan, out: StepOutput) -> None:
        copied = out.kept
        super().keep(plan, out)
        self._note_copy(out, copied)

    def learn(self, plan: StepPlan, out: StepOutput, live) -> None:
        copied = out.kept
        super().learn(plan, out, live)
        self._note_copy(out, copied)

    def _note_copy(self, out: StepOutput, before: bool) -> None:
        if out.kept and not before:
            self.kept.append(self.dormant)


@dataclass
class PatternPolicy(DraftPolicy):
    """Scripted decisions: rounds in a fixed pattern, two in a row, one six decisions later, then 19 plain ones (more
    than learn_backlog_steps), over and over; k cycles through 1-3 (none where `drafts` is False). Decided by
    decision count and output length only, so two engines that commit the same tokens draft the same steps. Where it
    drafts nothing, k = 0 stands at the batch size where `sleeps` (the drafter then sleeps until the next round).
    `dormant`: there k = 0 also stands for the requests of the last decision without reading them (stands), one
    decision of the pattern each, so a batch asleep whole goes dormant."""

    drafts: bool = True
    sleeps: bool = False
    dormant: bool = False
    decided: int = 0  # decisions so far

    def restart(self, drafts: bool = True) -> None:
        """The pattern anew from its first decision."""
        self.drafts, self.decided = drafts, 0

    def _rounds_at(self, n: int) -> bool:
        return self.drafts and n % 29 in (2, 3, 9)

    def draft_lengths(self, requests, drafter, in_flight=None, explore=True) -> list[int]:
        n, self.decided = self.decided, self.decided + 1
        if not self._rounds_at(n):
            return [0] * len(requests)
        return [max(0, min(1 + (len(r.output_ids) + n) % 3, r.max_output_tokens - len(r.output_ids) - r.num_pending
                           - 1)) for r in requests]

    def priced_out(self, batch: int) -> bool:
        return self.sleeps

    def stands(self, batch: int, explore: bool = True) -> bool:
        if not self.dormant or self._rounds_at(self.decided):
            return False
        self.decided += 1
        return True


@dataclass
class PricedPolicy(DraftPolicy):
    """The policy's own decisions on injected costs: a round costs `round_factor` times its price, and
    `company_factor` times that beside other requests. `reads`: k = 0 never stands without reading the requests
    (stands is False, so the Speculator reads them at every decision). Each measured step's (batch, k, seconds)
    is logged in `observed`, each catch-up's (batch, seconds) in `wakes`."""

    round_factor: float = 1.0
    company_factor: float = 1.0
    reads: bool = False
    observed: list[tuple[int, int, float]] = field(default_factory=list)
    wakes: list[tuple[int, float]] = field(default_factory=list)

    def round_seconds(self, batch: int, k, step_cost: float):
        factor = self.round_factor * (self.company_factor if batch > 1 else 1.0)
        return super().round_seconds(batch, k, step_cost) * (1 + (factor - 1) * (k > 0))

    def stands(self, batch: int, explore: bool = True) -> bool:
        return not self.reads and super().stands(batch, explore)

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        self.observed.append((batch, k, seconds))
        super().observe_step(batch, k, seconds)

    def observe_wake(self, batch: int, seconds: float) -> None:
        self.wakes.append((batch, seconds))
        super().observe_wake(batch, seconds)


def priced_beside_company(factor: float = 100.0, **settings) -> Callable[..., DraftPolicy]:
    """Rounds pay alone, not beside another request: there they cost `factor` times as much (costs injected)."""
    return partial(PricedPolicy, company_factor=factor, **settings)


def watched(policy: Callable[..., DraftPolicy] = DraftPolicy,
            speculator: Callable[..., Speculator] = WatchedSpeculator, limits: SpeculationLimits = LIMITS,
            check: Callable[[BlockPool, Request], None] | None = None) -> Seams:
    """An engine's seams: a WatchedPool (with `check`), this policy, Speculator and limits."""
    return Seams(partial(WatchedPool, check=check), policy, speculator, limits)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_attentive_families(tmp_path_factory.mktemp("learning"))


def spec_llm(families, kind: str, seams: Seams | None = None, **kwargs) -> LLM:
    """(Rounds drafted after each commit: this file holds the learning queue to learning every step; drafting ahead
    learns a round's rows from its verdict, and test_spec_draft_ahead.py holds it to this path. A confidence stop
    that no draft falls below trims nothing, but reading the drafts keeps rounds from being drafted ahead.)"""
    arch, served, engine_kwargs, _ = SETUPS[kind]
    kwargs.setdefault("draft_p_min", 1e-30)
    kwargs.setdefault("overlap_schedule", True)
    return LLM(families[arch][served], seams=seams or watched(), dtype="float32", max_num_seqs=8, spec_draft_n_max=3,
               spec_measured_costs=False, **engine_kwargs(families[arch]), **kwargs)


@pytest.fixture
def recorder():
    """install(engine, min_lookahead=0): the engine drafts through a RecordingDrafter (outrider/testing/recording.py)
    around its loaded drafter until the test ends; its events hold the WatchedPool's block releases too, from then
    on (the release order against learning is what these tests check)."""
    with ExitStack() as stack:
        def install(engine, min_lookahead: int = 0) -> RecordingDrafter:
            engine.pool.events.clear()
            record = RecordingDrafter(engine.speculation.drafter, min_lookahead, events=engine.pool.events)
            stack.enter_context(engine.speculation.drafting_with(record, engine.speculation.rounds))
            return record

        yield install


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
def test_deferred_learning_proposes_what_learning_every_step_proposes(families, kind, batch, recorder):
    """With rounds and long plain stretches alternating, and requests finishing at different steps, a drafter
    that learns queued rows in batches proposes exactly (token for token, in float32) what one that learns every
    step proposes, and the greedy output is the same."""
    prompts, max_tokens = PROMPTS[:batch], [60 - 9 * i for i in range(batch)]
    runs = {}
    for cap in (1, LIMITS.learn_backlog_steps):
        llm = spec_llm(families, kind, watched(PatternPolicy, limits=replace(LIMITS, learn_backlog_steps=cap)))
        record = recorder(llm.engine)
        runs[cap] = (generate(llm, prompts, max_tokens), record)
    (eager_out, eager), (deferred_out, deferred) = runs[1], runs[LIMITS.learn_backlog_steps]
    assert deferred_out == eager_out
    assert len(deferred.proposals) >= 4 and any(any(t) for _, _, tokens, _ in deferred.proposals for t in tokens)
    assert_same_proposals(deferred.proposals, eager.proposals)
    learns = [e for e in deferred.events if e[0] == "learn"]
    assert len(learns) < len([e for e in eager.events if e[0] == "learn"]) / 2
    # (steps merged in one commit)
    assert any(s > 0 and n >= LIMITS.learn_backlog_steps for e in learns for _, s, n in e[1])


@pytest.mark.parametrize("kind", LEARNING_KINDS)
def test_a_short_prompt_is_learned_in_graph_sized_pieces_proposing_what_a_whole_learn_does(families, kind, recorder):
    """A prompt longer than the largest learning graph (learn_graph_rows), within piecewise_learn_graphs of them,
    reaches the drafter in order, in pieces of at most learn_graph_rows (each a graph replay on CUDA), every row once; a
    longer one in one piece. Learned in pieces, the drafter proposes what it proposes having learned the prompt
    whole (float32), and the output is the same."""
    pieces_max = LIMITS.piecewise_learn_graphs * LIMITS.learn_graph_rows
    short, long = [[3 + (7 * i + j) % 400 for i in range(n)] for j, n in ((0, 150), (1, pieces_max + 8))]
    runs = {}
    for limit in (LIMITS.piecewise_learn_graphs, 0):  # (0: every learn whole)
        llm = spec_llm(families, kind, watched(PatternPolicy, limits=replace(LIMITS, piecewise_learn_graphs=limit)))
        record = recorder(llm.engine)
        runs[limit] = ([generate(llm, [prompt], [24])[0] for prompt in (short, long)], record)  # (one at a time)
    (pieces_out, pieces), (whole_out, whole) = runs[LIMITS.piecewise_learn_graphs], runs[0]
    learns = [e[1] for e in pieces.events if e[0] == "learn"]
    assert [[(s, n) for _, s, n in e] for e in learns[:2]] == [[(0, 64)], [(64, 64)]] and learns[2][0][1:] == (128, 22)
    assert any([(s, n) for _, s, n in e] == [(0, len(long))] for e in learns)
    assert [(s, n) for _, s, n in next(e[1] for e in whole.events if e[0] == "learn")] == [(0, len(short))]
    assert pieces_out == whole_out
    assert any(any(t) for _, _, tokens, _ in pieces.proposals for t in tokens)
    assert_same_proposals(pieces.proposals, whole.proposals)


@dataclass
class PatternRun:
    """A PatternPolicy run of requests of different lengths: the greedy output, what the drafter was asked and told,
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
    unmarked: list[int] = []

    def check(pool, req):
        since = llm.engine.speculation.speculator.asleep_since(req.request_id)
        if since is not None:  # (its rows: positions up to the one before its last token's)
            last = req.num_prompt + len(req.output_ids) - 2
            slept = req.block_ids[since // pool.block_size: last // pool.block_size + 1]
            unmarked.append(len(set(slept) - pool.drafter_stale))

    llm = spec_llm(families, kind, watched(partial(PatternPolicy, sleeps=sleeps, dormant=dormant), check=check))
    record = recorder(llm.engine, min_lookahead=reach)
    out = generate(llm, PROMPTS[:batch], [60 - 9 * i for i in range(batch)])
    spec = llm.engine.speculation.speculator
    return PatternRun(out, record, [sum(n for _, n, _ in spans) for spans in spec.catch_ups],
                      sum(d.dormant for d in spec.decisions), unmarked)


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
    # (probe_every 2: it would explore a round every other step, were it not asleep)
    llm = spec_llm(families, kind, watched(priced_beside_company(probe_every=2)))
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
    ((start, rows, tokens),) = [span for spans in llm.engine.speculation.speculator.catch_ups for span in spans]
    assert start == 0 and start + rows == tokens - 1 and rows >= len(PROMPTS[0]) + 11


@pytest.fixture(scope="module")
def hybrid_family(tmp_path_factory):
    return write_hybrid_family(tmp_path_factory.mktemp("hybrid"), "qwen3_5")


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_on_a_hybrid_target_a_priced_out_drafter_learns_every_row_instead_of_sleeping(hybrid_family, recorder,
                                                                                       kind):
    """A hybrid target cannot recompute committed rows' hidden states (its linear layers' state has moved past
    them), so a drafter that reads them could never catch up: priced out beside another request it drafts
    nothing but still learns every committed row, and drafts again once the request is alone. Outputs are plain
    greedy decoding's."""
    kw = dict(seams=watched(priced_beside_company(probe_every=2)), dtype="float32", max_num_seqs=8,
              spec_draft_n_max=3, spec_measured_costs=False, draft_p_min=1e-30, overlap_schedule=True)
    llm = (LLM(str(hybrid_family["mtp"]), **kw) if kind == "mtp"
           else LLM(str(hybrid_family["target"]), draft_model=str(hybrid_family[kind]), **kw))
    record = recorder(llm.engine)
    long, short = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), \
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = llm.generate(PROMPTS[:2], [long, short])
    want = LLM(str(hybrid_family["target"]), dtype="float32", spec_type="none").generate(PROMPTS[:2], [long, short])
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert got[1].timing.draft_rounds == 0 and got[0].timing.draft_rounds > 0
    speculator = llm.engine.speculation.speculator
    assert not speculator.catch_ups and any(not d.ks and d.batch == 2 for d in speculator.decisions)
    ids = {rid for e in record.events if e[0] == "learn" for rid, _, _ in e[1]}
    learned = {rid: sorted({row for start, count in record.learned(rid) for row in range(start, start + count)})
               for rid in ids}
    # Every row of both requests but their last token's (never fed).
    assert sorted(map(len, learned.values())) == [len(PROMPTS[1]) + 12 - 1, len(PROMPTS[0]) + 40 - 1]
    assert all(rows == list(range(len(rows))) for rows in learned.values())


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


class LineCountingSpeculator(WatchedSpeculator):
    """A WatchedSpeculator that counts, in `steps`, the lines of outrider's code each step's speculative calls ran
    (deciding, keeping, learning, measuring), each step marked dormant where its decision was and nothing was
    queued."""

    def __init__(self, *args, **kwargs):
        self.steps: list[LineCount] = []
        super().__init__(*args, **kwargs)

    def _counted(self, call, *args):
        with self.steps[-1]:
            out = call(*args)
        self.steps[-1].dormant = self.dormant and not self.queued
        return out

    def draft_lengths(self, running):
        self.steps.append(LineCount())  # (called first in every step)
        return self._counted(super().draft_lengths, running)

    def keep(self, plan, out):
        return self._counted(super().keep, plan, out)

    def learn(self, plan, out, live):
        return self._counted(super().learn, plan, out, live)

    def observe_step(self, plan, seconds):
        return self._counted(super().observe_step, plan, seconds)


def test_a_dormant_step_reads_no_request_however_large_the_batch(families):
    """Requests priced out beside each other, every one decoding, sleep whole and go dormant: then a step's
    speculative work (deciding, keeping, learning, measuring) reads none of them. It runs as many lines of outrider's
    code at batch 8 as at batch 2, where a step that reads the requests runs more at 8; it keeps no hidden rows and
    queues nothing."""
    kept: list[bool] = []  # per copy of a step's hidden rows: on the dormant path?
    dormant, full = {}, {}  # batch -> the lines each dormant (else full) step ran in the Speculator's calls
    for batch in (2, 8):
        llm = spec_llm(families, "dflash", watched(priced_beside_company(), LineCountingSpeculator))
        spec = llm.engine.speculation.speculator
        generate(llm, [PROMPTS[i % len(PROMPTS)] + [400 + i] for i in range(batch)], [40] * batch)
        dormant[batch] = [s.lines for s in spec.steps if s.dormant]
        full[batch] = [s.lines for s in spec.steps if not s.dormant]
        assert len(dormant[batch]) >= len(spec.steps) // 2
        kept += spec.kept
    assert dormant[8] == dormant[2] and max(full[8]) > max(full[2])
    assert kept and not any(kept)


def test_requests_joining_a_batch_where_rounds_are_priced_out_explore_no_round(families):
    """Beside company, rounds cost three times their price, which acceptance near 1 would still pay for: probes
    are due every few decisions. None is explored, neither while the drafter sleeps nor when a new pair of requests
    joins (their prompts are slept through, so a round would first recompute them)."""
    llm = spec_llm(families, "dflash", watched(priced_beside_company(3.0, probe_every=2)))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        got = llm.generate(PROMPTS[:2], params)
        assert [c.timing.draft_rounds for c in got] == [0, 0]


def test_every_block_of_rows_the_drafter_slept_through_is_marked_when_the_request_ends(families):
    """Two requests decode priced out beside each other, across several 16-token blocks: when each ends, every
    block it held is marked as lacking the drafter's K/V (the pool marks a block once, at the row that begins it)."""
    unmarked = []
    llm = spec_llm(families, "eagle3", watched(priced_beside_company(), check=lambda pool, req: unmarked.append(
        set(req.block_ids) - pool.drafter_stale)))
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
    llm = spec_llm(families, kind, watched(priced_beside_company()))
    llm.generate([prefix + [7], prefix + [8]], params)
    spec = llm.engine.speculation.speculator
    earlier = len(spec.catch_ups)
    hits = llm.engine.pool.hits
    record = recorder(llm.engine)
    got = llm.generate([prefix + [9, 10]], params)[0]
    assert llm.engine.pool.hits - hits == 32  # two blocks of 16
    fresh = spec_llm(families, kind, watched(priced_beside_company()))
    want_record = recorder(fresh.engine)
    want = fresh.generate([prefix + [9, 10]], params)[0]
    assert got.token_ids == want.token_ids and got.timing.draft_rounds > 0
    assert_same_proposals(record.proposals, want_record.proposals)
    learned = [start for e in record.events if e[0] == "learn" for _, start, _ in e[1]]
    recomputed = [start for spans in spec.catch_ups[earlier:] for start, _, _ in spans]
    assert (recomputed if kind in HIDDEN_KINDS else learned)[0] == 0


def test_a_lone_request_asleep_still_explores_rounds_and_catches_up_for_each(families):
    """Priced out even alone (rounds injected at three times their cost: they would pay only at high acceptance),
    the drafter sleeps, yet the policy's exploratory rounds go on (a lone request's acceptance may change), each
    first catching up on the rows slept through; output is plain greedy's."""
    llm = spec_llm(families, "mtp", watched(partial(PricedPolicy, round_factor=3.0, probe_every=4)))
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    got = llm.generate([PROMPTS[0]], params)[0]
    want = LLM(families["qwen3"]["mtp"], dtype="float32", spec_type="none").generate([PROMPTS[0]], params)[0]
    recomputed = [sum(n for _, n, _ in spans) for spans in llm.engine.speculation.speculator.catch_ups]
    assert got.token_ids == want.token_ids
    assert got.timing.draft_rounds >= 2 and len(recomputed) >= 2 and all(n > 0 for n in recomputed)


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
    policy = priced_beside_company(round_factor=3.0, probe_every=4, reads=not dormant)
    llm = spec_llm(families, "mtp", watched(policy), overlap_schedule=overlap)
    engine = llm.engine
    record, decisions = recorder(engine), engine.speculation.speculator.decisions
    reqs = [Request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for prompt, n in zip(PROMPTS, (24, 16, 20, 96))]
    outs: dict[int, list] = {r.request_id: [] for r in reqs}
    for r in reqs[:3]:
        engine.add_request(r, outs[r.request_id].append)
    while engine.has_work():
        if len(decisions) == 8:
            engine.add_request(reqs[3], outs[reqs[3].request_id].append)
        engine.step()
    policy = engine.speculation.policy
    return ScheduleRun(decisions, [(batch, k) for batch, k, _ in policy.observed], record,
                       [[t for o in outs[r.request_id] for t in o.new_token_ids] for r in reqs],
                       {bucket: replace(p, ids=len(p.ids)) for bucket, p in policy.probes.items()})  # (ids differ)


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
    stay priced out, re-measured each time with the next catch-up. Each catch-up is timed apart and told to the
    policy (observe_wake), which prices the next exploratory round with it."""
    llm = spec_llm(families, "mtp", watched(partial(PricedPolicy, round_factor=3.0, probe_every=4),
                                            partial(WatchedSpeculator, catch_up_seconds=0.25)))
    got = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    observed = [(k, seconds) for _, k, seconds in llm.engine.speculation.policy.observed]
    assert got.timing.draft_rounds >= 2 and len(llm.engine.speculation.speculator.catch_ups) >= 2
    assert any(k > 0 for k, _ in observed) and max(s for _, s in observed) < 0.2
    wakes = llm.engine.speculation.policy.wakes
    assert len(wakes) == len(llm.engine.speculation.speculator.catch_ups)
    assert all(batch == 1 and seconds >= 0.25 for batch, seconds in wakes)


def test_a_draft_model_feeds_one_token_per_request_when_it_proposes(families, recorder):
    """The draft model learns the prompt with the prefill and committed tokens in the Speculator's batches, so a
    propose's first forward feeds each drafting request its last token alone (a decode step's shape: a CUDA graph on
    a GPU), even after 19 plain steps; before, it caught up there on everything unseen, eagerly."""
    llm = spec_llm(families, "draft", watched(PatternPolicy))
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
    learn_backlog_steps - 1 decode steps, then all of them as one commit, and the rest before its blocks are
    released; together exactly its rows 0..n-2, each once, with as many hidden rows."""
    llm = spec_llm(families, kind, watched(partial(PatternPolicy, drafts=False)))
    record = recorder(llm.engine)
    backlog = LIMITS.learn_backlog_steps
    prompt, tokens = PROMPTS[0], 2 * backlog + 9
    req = Request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    outs: list = []
    llm.engine.add_request(req, outs.append)
    learned_by_step = []
    while llm.engine.has_work():
        before = len(record.events)
        llm.engine.step()
        learned_by_step.append(sum(1 for e in record.events[before:] if e[0] in ("learn", "free")))
    decode = tokens - 1  # the prefill step commits the prompt rows; each decode step one row
    counts = [len(prompt)] + [backlog] * (decode // backlog) + [decode % backlog]
    assert [n for _, n in record.learned(req.request_id)] == counts
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    assert [s for s, _ in record.learned(req.request_id)] == starts
    assert [e[2] for e in record.events if e[0] == "learn"] == counts  # one hidden row per learned row
    assert sum(learned_by_step) == len(counts) + 1  # the learning calls, and the release of the blocks
    assert [e[0] for e in record.events[-2:]] == ["free", "release"]


def test_drafters_without_hidden_rows_keep_none(families, recorder):
    """N-gram lookup (alone or beside a draft model) reads committed tokens only: no step copies its hidden rows
    for it, and on_commit gets none; alone, nothing is queued for it at all (its lookups index what they read)."""
    for kind in ("ngram", "ngram,draft"):
        arch, served, kwargs, _, prompt = LOOKUP_SETUPS[kind]
        llm = LLM(families[arch][served], seams=watched(), max_num_seqs=4, overlap_schedule=True,
                  **kwargs(families[arch]))
        assert not llm.engine.speculation.drafter.reads_hidden
        record = recorder(llm.engine)
        outs = llm.generate([prompt, prompt[::-1]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        assert any(c.timing.draft_rounds for c in outs)
        learns = [e for e in record.events if e[0] == "learn"]
        assert all(rows is None for _, _, rows in learns)
        assert bool(learns) == llm.engine.speculation.drafter.learns == (kind != "ngram")
        assert not llm.engine.speculation.speculator.kept


@pytest.mark.parametrize("kind", HIDDEN_KINDS)
def test_finished_request_is_learned_before_its_blocks_serve_a_prefix_hit(families, kind, recorder):
    """A finishes with rows still queued, some in a block its finish publishes; B's prompt is A's whole sequence,
    so B reuses that block from the prefix cache. A's rows are all learned before its blocks are released, and B
    then drafts exactly what it drafts when every step is learned at once."""
    prompt, tokens = list(range(20, 40)), 30  # rows 36..48 are queued at A's finish; block 2 (32..47) is full
    runs = {}
    for cap in (1, LIMITS.learn_backlog_steps):
        llm = spec_llm(families, kind, watched(partial(PatternPolicy, drafts=False),
                                               limits=replace(LIMITS, learn_backlog_steps=cap)))
        record = recorder(llm.engine)
        first = generate(llm, [prompt], [tokens])[0]
        a_id = next(e[1][0][0] for e in record.events if e[0] == "learn")
        freed = next(i for i, e in enumerate(record.events) if e[0] == "free")
        learned = record.learned(a_id)
        assert [e for e in record.events[:freed] if e[0] == "learn"] == [e for e in record.events if e[0] == "learn"]
        assert sum(n for _, n in learned) == len(prompt) + tokens - 1
        llm.engine.speculation.policy.restart(drafts=True)
        hits = llm.engine.pool.hits
        runs[cap] = (generate(llm, [prompt + first], [24]), record.proposals)
        assert llm.engine.pool.hits - hits == 48
    assert runs[LIMITS.learn_backlog_steps][0] == runs[1][0]
    assert_same_proposals(runs[LIMITS.learn_backlog_steps][1], runs[1][1])
    assert any(any(t) for _, _, tokens, _ in runs[1][1] for t in tokens)


def test_preempted_request_drops_its_queue(families, recorder):
    """B is preempted with decode rows queued: they are never learned into its freed blocks; after it runs again
    the drafter learns its recomputed rows, and the output is still the target's own."""
    arch, served, kwargs, _ = SETUPS["mtp"]
    path = families[arch][served]
    # Four usable blocks of 16: A (30 + 30 tokens) takes its third while B (10 + 30) is decoding; B needs its
    # second block after its first tokens, finds none and is preempted until A is done.
    llm = LLM(path, seams=watched(partial(PatternPolicy, drafts=False)), dtype="float32", max_num_seqs=4,
              overlap_schedule=True, num_kv_blocks=5, enable_prefix_caching=False, spec_measured_costs=False,
              **kwargs(families[arch]))
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


@pytest.mark.parametrize("largest_graph", [LIMITS.learn_graph_rows, 16])
@pytest.mark.parametrize("kind", ["dflash", "draft"])
def test_undrafted_steps_learn_in_graph_sized_pieces_at_small_batches_and_in_backlogs_at_large_ones(
        families, kind, largest_graph, recorder):
    """Eight requests that never draft fill the queue with eight rows a step. Where that is at most a quarter of the
    largest learning graph (learn_graph_rows: 64), the queue is handed over before it would outgrow the graph, not
    after learn_backlog_steps steps as one eager, ragged forward; where it is more (a largest graph of 16 here, as a
    batch of 32 against 64 rows), a replay every step or two would cost more, and the backlog waits its steps. Every
    decode row is learned, once."""
    llm = spec_llm(families, kind, watched(partial(PatternPolicy, drafts=False),
                                           limits=replace(LIMITS, learn_graph_rows=largest_graph)))
    record = recorder(llm.engine)
    prompts = [PROMPTS[i % len(PROMPTS)] + [400 + i] for i in range(8)]
    backlog = LIMITS.learn_backlog_steps
    generate(llm, prompts, [3 * backlog] * 8)
    decode_learns = [sum(n for _, _, n in e[1]) for e in record.events
                     if e[0] == "learn" and all(s > 0 for _, s, _ in e[1])]
    assert max(decode_learns) == (largest_graph if largest_graph == LIMITS.learn_graph_rows else 8 * backlog)
    assert sum(decode_learns) == 8 * (3 * backlog - 1)
