"""The drafter's side of a step, for Speculation (speculation.py): which requests draft and how far (DraftPolicy),
the drafter's proposals with blocks reserved for what it writes, the rows it learns after a step (queued, and handed
over in batches), drafting the next round from a verify step's verdict before the host reads it (draft_ahead),
the policy's bookkeeping (acceptance per request, measured step costs), and forgetting requests whose blocks were
freed.

While the measured costs price speculation out at the running batch size, for requests at the pooled acceptance too
(DraftPolicy.lets_sleep), the drafter sleeps: it learns nothing, not even the prompts joining such a batch, and
beside other requests the policy explores no rounds. On a launch-bound target learning costs a plain step a good
part of its time, for drafts no one makes.
The first round after that catches up: the target's hidden states at the rows skipped are recomputed in one forward
that writes no K/V (`hidden_rows`), and the drafter learns them then. That catch-up, like a device round's start, is
work paid once: it is timed apart (to the device's end) and left out of the step's measured cost. Charged to the
round, it would price rounds out on a large target (a catch-up there is a target forward over every row slept
through), the drafter would sleep again, and each exploratory round would measure the next catch-up. The blocks of
rows slept through are marked in the pool: a prefix hit on one is caught up the same way, as its drafter K/V is
whatever the block held before.

Asleep, a step would still read every request (deciding, learning, measuring), loops that run cold between
forwards and cost a launch-bound step a noticeable share. So where every running request decodes
and sleeps, the batch goes dormant: until it changes (Scheduler.running, by identity) or the policy's quiet run for
it ends (DraftPolicy.stands), a step decides, keeps, learns and is measured without reading a request. The
per-request work is done when it falls dormant: the blocks each request holds from its first row slept through are
marked then, and the pool marks those their decoding grows into as it hands them out (BlockPool.drafter_asleep).
The catch-up starts at each request's first row slept through, as ever.

The engine calls it at fixed points of a step (docs/speculative.md, "The step"); it never stamps timings."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from outrider.speculative.drafter import (LEARN_ROWS, PENDING, Commit, DraftPolicy, Drafter, PendingDrafts,
                                         StagedDrafts, VerifiedRows)
from outrider.steps import LaunchedStep, Status, StepOutput, StepPlan

if TYPE_CHECKING:
    from outrider.engine.request import Request

log = logging.getLogger("outrider.engine")

@dataclass(frozen=True)
class SpeculationLimits:
    """When the Speculator hands queued rows to the drafter (the defaults are the server's).

    learn_backlog_steps: steps whose committed rows may wait before the drafter learns them. Learning is a drafter
    forward (DFlash: fc, norm and K/V of every layer; MTP, EAGLE-3: a decoder layer and an LM head) whatever the row
    count, a graph replay and its copies on CUDA, dozens of eager launches elsewhere: on a launch-bound target it
    costs as much again as a plain step. Queued, it runs once per round (before each propose) and once per this many
    undrafted steps, or sooner at small batches, where more rows would no longer fit one learning graph
    (learn_graph_rows): a larger learn runs eager and ragged, as a prefill's does, at several times a replay's host
    cost. (Not at larger batches: a replay every step or two costs more than one eager learn every
    learn_backlog_steps steps.)

    piecewise_learn_graphs: a learn of up to this many of the largest learning graph's rows (a short prompt's) is
    handed over in pieces that each fit it: learning a short prompt eagerly costs a launch per kernel of the
    drafter's layers (milliseconds for a draft model), a replay a fraction of a millisecond. Beyond, a learn runs as
    one eager, ragged forward, whose cost grows with its rows more slowly.

    learn_graph_rows: the rows of the largest learning graph drafters capture (drafter.LEARN_ROWS)."""

    learn_backlog_steps: int = 16
    piecewise_learn_graphs: int = 4
    learn_graph_rows: int = LEARN_ROWS[-1]


@dataclass
class Drafts:
    """This step's proposals by request id: tokens (PENDING while `pending` holds them on the device), and q [k, V]
    where the drafts were sampled (absent: argmax)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: PendingDrafts | None = None


@dataclass
class _Queued:
    """A request's committed rows that the drafter has not learned yet: positions start..start+count-1, merged over
    consecutive steps (plain ints: this runs for every request on every step; Commits are built when handed over),
    the spans before a gap (which the engine never leaves), and the rows' places in the Speculator's kept hidden
    rows (when the drafter reads them)."""

    request: Request
    start: int
    count: int
    rows: list[int]
    before: list[Commit] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.count + sum(c.count for c in self.before)

    def add(self, start: int, count: int) -> None:
        if self.start + self.count != start:
            self.before.append(Commit(self.request, self.start, self.count))
            self.start, self.count = start, 0
        self.count += count

    def commits(self) -> list[Commit]:
        return [*self.before, Commit(self.request, self.start, self.count)]


@dataclass(frozen=True)
class _Ahead:
    """The next round's drafts, staged from a verify step's verdict before the host read it: the step's requests in
    order (the staged drafts follow it), and the lengths drafted, by request id (k > 0 only)."""

    requests: list[Request]
    lengths: dict[int, int]
    staged: StagedDrafts


# The target's (hidden, aux_hidden or None) at committed rows, recomputed without writing K/V (ModelRunner).
HiddenRows = Callable[[Sequence[Commit]], tuple[torch.Tensor, torch.Tensor | None]]


class BlockReservations(Protocol):
    """What speculation asks of the KV block pool (engine/kv_cache.py BlockPool): room for the positions drafts
    write, and which blocks hold drafter K/V that was slept through (a prefix hit on one is caught up)."""

    block_size: int
    drafter_asleep: bool  # the blocks handed out from now on are marked stale as they are taken

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Blocks for the request's first num_tokens positions (False: none left; nothing is preempted)."""

    def mark_drafter_stale(self, req: Request, start: int, end: int) -> None:
        """The drafter's K/V at positions start..end-1 of the request was not written."""

    def mark_drafter_written(self, req: Request, start: int) -> None:
        """It is written from position start on (caught up)."""

    def drafter_written_until(self, req: Request, end: int) -> int:
        """The first position before `end` whose drafter K/V is stale (end: none)."""


class Speculator:
    def __init__(self, drafter: Drafter, policy: DraftPolicy, pool: BlockReservations,
                 hidden_rows: HiddenRows | None, max_rows: int, clock: Callable[[], float],
                 synchronize: Callable[[], None], limits: SpeculationLimits):
        """hidden_rows: None where the target cannot recompute committed rows (a hybrid model's linear layers have
        moved past them): a drafter that reads them then never sleeps, as it could not catch up. max_rows: the
        most rows one catch-up forward runs (a step's token budget: its activations fit). clock: the engine's;
        synchronize: waits for the device (one-off work is timed to its end); limits: when queued rows are handed
        to the drafter."""
        self.drafter = drafter
        self.policy = policy
        self.pool = pool
        self.hidden_rows = hidden_rows
        self.max_rows = max_rows
        self.clock = clock
        self.synchronize = synchronize
        self.limits = limits
        self._one_off = 0.0  # seconds of this step's one-off work (left out of its measured cost)
        self._kinds: dict[int, str] = {}  # request id -> the kind that drafted its latest round (combined kinds)
        # The learning queue: rows by request id (in the order requests joined it), and the queued steps' hidden
        # and aux rows (own copies; concatenated when first read), of which `_rows` there are in all.
        self._queued: dict[int, _Queued] = {}
        self._hidden: list[torch.Tensor] = []
        self._aux: list[torch.Tensor] = []
        self._rows = 0
        self._steps = 0  # steps queued since the queue was last empty
        self._committed = 0  # committed rows queued (what one learn will run over)
        self._ahead: _Ahead | None = None  # drafts staged by draft_ahead, for the next step
        self._learned_ahead: StepPlan | None = None  # the step whose rows draft_ahead learned (learn skips them)
        self._sleeping = False  # this step's decision: k = 0 stands at this batch size (learn nothing)
        self._dormant = False  # and it was taken on the dormant path (reading no request)
        self._sleepers: Sequence[Request] | None = None  # the running batch the dormant path is for (by identity)
        self._unkept: StepOutput | None = None  # the last step launched asleep (keep left its hidden rows)
        self._asleep: dict[int, int] = {}  # request id -> its first row the drafter has not learned (asleep since)

    @property
    def dormant(self) -> bool:
        """Was this step's decision taken on the dormant path (reading no request)?"""
        return self._dormant

    @property
    def queued(self) -> bool:
        """Are committed rows waiting for the drafter to learn them?"""
        return bool(self._queued)

    def asleep_since(self, request_id: int) -> int | None:
        """The request's first row the drafter has not learned, asleep (None: it is awake for it)."""
        return self._asleep.get(request_id)

    def draft_lengths(self, running: Sequence[Request]) -> dict[int, int]:
        """This step's k by request id (only k > 0), decided once per step for the decoding requests, counting
        those whose last token is still on the device (the engine then commits the step in flight first). After a
        round drafted ahead, its lengths for the requests still decoding. On the dormant path, none, reading no
        request. (Called first in every step: the one-off work counted for observe_step starts here.)"""
        self._one_off = 0.0
        n = len(running)
        self._dormant = running is self._sleepers and self.policy.stands(n, explore=n == 1)
        if self._dormant:
            return {}
        lengths = self._lengths(running)
        # (every request decoding, none mid-prompt: a prompt that ends would change the batch the policy decides
        # for, not the list)
        self._doze(running if self._sleeping and all(r.num_computed == r.num_tokens - 1 and r.request_id in
                                                     self._asleep for r in running) else None)
        return lengths

    def _lengths(self, running: Sequence[Request]) -> dict[int, int]:
        """draft_lengths's decision, reading the requests."""
        asleep, self._sleeping = self._sleeping or bool(self._asleep), False
        if self._ahead is not None:
            lengths = self._ahead.lengths
            lengths = {r.request_id: lengths[r.request_id] for r in running
                       if r.request_id in lengths and r.num_computed == r.num_tokens - 1}
            if not lengths:
                self._ahead = None
            return lengths
        decoding = [r for r in running if r.num_computed == r.num_tokens - 1]
        may = [self.drafter.may_propose(r) for r in decoding]
        if not any(may):  # (n-gram lookup that finds nothing: not even the policy's decision to pay for)
            return {}
        # (the whole decoding batch sizes the costs.) No exploratory round wakes a sleeping drafter beside other
        # requests: its catch-up is a forward over every row slept through, as many a step as there are requests,
        # which at large batches costs a good share of the steps it follows. Nor where k = 0 stands at this batch size
        # for requests that just joined it: their prompts are slept through (_skips). Alone, a round now and then
        # stays cheap, and a long request's acceptance may change.
        n = len(decoding)
        ks = self.policy.draft_lengths(decoding, self.drafter,
                                       explore=n == 1 or not (asleep or self.policy.priced_out(n)))
        lengths = {r.request_id: k for r, k, ok in zip(decoding, ks, may) if k and ok}
        self._sleeping = not lengths and self._may_sleep() and self.policy.lets_sleep(n)
        return lengths

    def _may_sleep(self) -> bool:
        drafter = self.drafter
        return drafter.learns and (self.hidden_rows is not None or not drafter.reads_hidden)

    def _doze(self, batch: Sequence[Request] | None) -> None:
        """Take the dormant path for this batch, every request of it asleep, from the next decision on (None: for
        none). The blocks its requests hold from their first row slept through are marked now, and those their
        decoding grows into as they are taken, for the steps that learn nothing row by row."""
        if batch is not None and batch is not self._sleepers:
            for r in batch:
                self.pool.mark_drafter_stale(r, self._asleep[r.request_id], len(r.block_ids) * self.pool.block_size)
        self._sleepers = batch
        self.pool.drafter_asleep = batch is not None

    def propose(self, running: Sequence[Request], lengths: dict[int, int]) -> Drafts:
        """Drafts of the decided lengths, with blocks reserved for what the drafter writes. A drafter fault costs
        this step's drafts, never correctness."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # (blocks were reserved when they were drafted)
            return self._staged(ahead.requests, ahead.staged, lengths)
        decoding, ks = [], []
        for req in running:
            k = lengths.get(req.request_id, 0)
            # (no room to draft: a plain decode step, never a preemption)
            if k and req.num_pending == 0 and self.pool.ensure(req, req.num_tokens - 1 + self.drafter.lookahead(k)):
                decoding.append(req)
                ks.append(k)
        if not decoding:
            return Drafts()
        self._catch_up(running)
        self.flush()  # drafts follow every committed row
        on_device = self.drafter.stages_on_device and not any(self.policy.trims(r) for r in decoding)
        try:
            if on_device:
                return self._staged(decoding, self.drafter.stage(decoding, ks))
            props = self.policy.trim(decoding, self.drafter.propose(decoding, ks))
        except Exception as exc:
            log.error("drafter failed to propose: %s\n%s", exc, traceback.format_exc())
            return Drafts()
        drafts = Drafts({r.request_id: d for r, d in zip(decoding, props.tokens) if d})
        if props.kinds is not None:
            self._kinds.update((r.request_id, kind) for r, kind, d in zip(decoding, props.kinds, props.tokens) if d)
        if props.probs is not None:
            drafts.probs = {r.request_id: q for r, q in zip(decoding, props.probs) if q is not None}
        return drafts

    @staticmethod
    def _staged(decoding: Sequence[Request], staged: StagedDrafts, only: dict[int, int] | None = None) -> Drafts:
        """Drafts left on the device: PENDING placeholders of the right lengths, the values in `pending` (`only`:
        for these request ids)."""
        tokens, offsets, at = {}, {}, 0
        for req, count in zip(decoding, staged.counts):
            if count and (only is None or req.request_id in only):
                tokens[req.request_id] = [PENDING] * count
                offsets[req.request_id] = at
            at += count
        return Drafts(tokens, pending=PendingDrafts(staged.ids, offsets) if offsets else None)

    def drafts_ahead(self, plan: StepPlan) -> bool:
        """Does the drafter draft the next round from this step's verdict on the device (draft_ahead)? For steps
        that verify drafts and decode only, when no request trims its drafts (p_min, n_min: that reads them)."""
        # (every sampled step asks: a plain one answers at its first test that reads the plan)
        return (self.drafter.drafts_ahead and any(s.draft_tokens for s in plan.scheduled) and not plan.has_prefill
                and not any(self.policy.trims(s.request) for s in plan.scheduled))

    def draft_ahead(self, launched: LaunchedStep) -> None:
        """Learn a verify step's committed rows and stage the next round's drafts from its verdict while it is still
        on the device, so the drafter runs while the host reads and commits the round. The policy picks the next
        lengths a verdict late (this round's acceptance is recorded at commit); blocks are reserved for the worst
        case, every draft accepted, and the next verify forward on top. A drafter fault costs the drafts: the rows
        are then learned after the commit."""
        plan, verdict = launched.plan, launched.verdict
        requests = [s.request for s in plan.scheduled]
        in_flight = [len(s.draft_tokens) for s in plan.scheduled]
        ks = self.policy.draft_lengths(requests, self.drafter, in_flight)
        # Room for the worst case: the drafter's writes and the next verify's from p_i + k_i + 1 (every draft
        # accepted), for every request the next step would feed (k = 0 where there is none).
        lookahead, ensure = self.drafter.lookahead, self.pool.ensure
        last = [r.num_tokens - 1 + extra for r, extra in zip(requests, in_flight)]  # the worst case's bonus position
        ks = [k if k and ensure(r, p + max(lookahead(k), k + 1)) else 0 for r, k, p in zip(requests, ks, last)]
        rows = VerifiedRows(requests, [s.start for s in plan.scheduled], [k + 1 for k in in_flight],
                            verdict.accepted, verdict.emitted, launched.out.hidden, launched.out.aux_hidden)
        try:
            staged = self.drafter.draft_ahead(rows, ks)
        except Exception as exc:
            log.error("drafter failed to draft ahead: %s\n%s", exc, traceback.format_exc())
            return
        self._learned_ahead = plan
        lengths = {r.request_id: count for r, count in zip(requests, staged.counts) if count}
        self._ahead = _Ahead(requests, lengths, staged) if lengths else None

    def device_round_drafts(self, request: Request, k: int) -> torch.Tensor | list[int] | None:
        """The first k drafts of device rounds for a request that now decodes alone (on the device where the drafter
        stages them there): every row it committed is learned first, and the drafter's own state for it dropped,
        as the rounds carry it from here (what they commit is never queued for learning). None: the drafter cannot
        draft k tokens now. The caller starts the rounds' clock after this: it is one-off work, done by then."""
        self._ahead = None  # (a round drafted ahead for the engine's own next step: the device round drafts anew)
        self._catch_up([request])
        with self.one_off():
            self.flush([request.request_id])
            try:
                if self.drafter.stages_on_device:
                    staged = self.drafter.stage([request], [k])
                    drafts = staged.ids if staged.counts[0] == k else None
                else:
                    drafts = self.drafter.propose([request], [k]).tokens[0]
                    drafts = drafts if len(drafts) == k else None
            except Exception as exc:
                log.error("drafter failed to draft a device round: %s\n%s", exc, traceback.format_exc())
                return None
        self.drafter.release(request.request_id)
        return drafts

    @contextmanager
    def one_off(self) -> Iterator[None]:
        """Time work a round pays once (a catch-up, a device round's start) from an idle device to its end, for
        observe_step to leave out (only around such work: the synchronisations cost a launch-bound step)."""
        self.synchronize()
        t0 = self.clock()
        try:
            yield
        finally:
            self.synchronize()
            self._one_off += self.clock() - t0

    def _dormant_step(self, plan: StepPlan) -> bool:
        """Does this step decode the batch put to sleep whole, none joining it (k = 0: nothing to learn or read)? Where
        the step now deciding went dormant: that batch fell dormant by the decision before at the latest, so the step
        before (which overlap scheduling learns and measures now) decoded it too."""
        return self._dormant and not plan.admitted

    def _skips(self, plan: StepPlan) -> bool:
        """Does the drafter sleep through this step's rows? A decode step's: while k = 0 stands (draft_lengths). A
        prompt's: where the drafter may sleep at the step's batch size beside other requests, as no exploratory
        round wakes it there (learning a large batch's prompts adds a sizeable part to their step)."""
        if self._dormant_step(plan):
            return True
        if plan.has_prefill:
            return self._may_sleep() and len(plan.scheduled) > 1 and self.policy.lets_sleep(len(plan.scheduled))
        return self._sleeping

    def keep(self, plan: StepPlan, out: StepOutput) -> None:
        """Own copies of a launched step's hidden rows, when the drafter reads them and the step is committed only
        after the next one has launched (overlap scheduling): a graph replay overwrites the originals. Not while
        the drafter sleeps: learn then skips the step's rows, whatever it decides by then."""
        if self._skips(plan):
            self._unkept = out
        elif self.drafter.reads_hidden:
            out.keep_hidden()

    def learn(self, plan: StepPlan, out: StepOutput, live: set[int] | dict) -> None:
        """Queue every committed row of the step for the requests that still hold their blocks, and let the drafter
        learn the queue: all of it when the step prefilled (a heavy step anyway) or the queue spans
        limits.learn_backlog_steps steps; a finishing request's rows now, before its blocks are released (they may serve
        prefix hits). Propose learns the rest first. Rows slept through (_skips) are left for the catch-up, and
        their blocks marked in the pool, so that a prefix hit on them is caught up too."""
        if not self.drafter.learns:
            return
        if plan is self._learned_ahead:
            self._learned_ahead = None
            return
        if self._dormant_step(plan):  # (its blocks were marked when the batch fell dormant, or as they were taken)
            return
        sleeping = self._skips(plan) or out is self._unkept
        if sleeping and self._queued:
            self.flush()  # (falling asleep: what is queued is learned, the rest waits for the catch-up)
        rows, largest = out.hidden.shape[0], self.limits.learn_graph_rows
        if 0 < self._committed <= largest < self._committed + rows and rows <= largest // 4:
            self.flush()  # (what is queued fits one learning graph; with this step's rows it might not)
        reads_hidden, queue, asleep, bs = self.drafter.reads_hidden, self._queued, self._asleep, self.pool.block_size
        offset = base = self._rows  # the step's first row among the kept ones
        added = 0
        finished = []
        admitted = {r.request_id for r in plan.admitted} if plan.admitted else ()
        for i, s in enumerate(plan.scheduled):
            req = s.request
            rid = req.request_id
            if rid in live and req.status is not Status.WAITING:  # (preempted meanwhile: blocks gone)
                if rid in admitted and s.start:  # a prefix hit: the drafter's K/V holds only what it wrote there
                    written = self.pool.drafter_written_until(req, s.start)
                    if written < s.start:
                        asleep.setdefault(rid, written)
                # Target rows whose K/V stays valid and whose next token is on the host (a stop may cut a round;
                # with overlap scheduling the next step may already have fed a token that is still pending).
                count = min(s.num_new_tokens + out.accepted[i], req.num_prompt + len(req.output_ids) - 1 - s.start)
                if count > 0 and (sleeping or rid in asleep):
                    start = s.start
                    # (the block holding `start` was marked with the row before it, unless it begins there)
                    if asleep.setdefault(rid, start) != start and start % bs:
                        start += bs - start % bs
                    if start < s.start + count:
                        self.pool.mark_drafter_stale(req, start, s.start + count)
                elif count > 0:
                    added += count
                    queued = queue.get(rid)
                    if queued is None:
                        queue[rid] = queued = _Queued(req, s.start, 0, [])
                    queued.add(s.start, count)
                    if reads_hidden:
                        queued.rows.extend(range(base, base + count))
                    if req.status is Status.FINISHED:
                        finished.append(rid)
            base += s.num_new_tokens + len(s.draft_tokens)
        if not added:
            return
        self._steps += 1
        self._committed += added
        now = plan.has_prefill or self._steps >= self.limits.learn_backlog_steps
        if reads_hidden:
            if not now:
                out.keep_hidden()  # (done at launch with overlap scheduling; else the next replay overwrites them)
            self._hidden.append(out.hidden)
            if out.aux_hidden is not None:
                self._aux.append(out.aux_hidden)
            self._rows = offset + rows
        self.flush(None if now else finished)

    def _catch_up(self, running: Sequence[Request]) -> None:
        """_wake for these requests as one-off work, its seconds told to the policy (DraftPolicy.observe_wake)
        where any of them slept."""
        if not any(r.request_id in self._asleep for r in running):
            return
        before = self._one_off
        with self.one_off():
            self._wake(running)
        self.policy.observe_wake(len(running), self._one_off - before)

    def _wake(self, running: Sequence[Request]) -> None:
        """Before a round: the drafter learns every row it slept through, of every running request (a round
        drafts after a verify step's verdict for all of them: draft_ahead)."""
        if not self._asleep:
            return
        starts = [(r, self._asleep.pop(r.request_id)) for r in running if r.request_id in self._asleep]
        if self.hidden_rows is None and self.drafter.reads_hidden:
            return  # (a prefix hit on rows the drafter never learned, on a target that cannot recompute them)
        spans = [Commit(r, start, r.num_tokens - 1 - start) for r, start in starts if r.num_tokens - 1 > start]
        try:
            for chunk in _chunks(spans, self.max_rows):
                hidden, aux = self.hidden_rows(chunk) if self.drafter.reads_hidden else (None, None)
                self.drafter.on_commit(chunk, hidden, aux)
            for r, start in starts:
                self.pool.mark_drafter_written(r, start)
        except Exception as exc:  # a drafter fault costs acceptance, never correctness
            log.error("drafter failed to catch up on the rows it slept through: %s\n%s", exc, traceback.format_exc())

    def flush(self, request_ids: Iterable[int] | None = None) -> None:
        """Let the drafter learn the queued rows of these requests (default: every queued one): in one call, or in
        pieces that each fit the largest learning graph where they are a few graphs' worth
        (limits.piecewise_learn_graphs)."""
        ids = list(self._queued) if request_ids is None else [r for r in request_ids if r in self._queued]
        if not ids:
            return
        queued = [self._queued.pop(r) for r in ids]
        rows = sum(q.total for q in queued)
        self._committed -= rows
        hidden = aux = None
        if self.drafter.reads_hidden:
            # (the index is built on the host and copied without blocking: torch.tensor(..., device=cuda) would
            # synchronise, and with overlap scheduling the host would then wait out the step just launched)
            index = torch.tensor([r for q in queued for r in q.rows], dtype=torch.int64)
            index = index.to(self._hidden[0].device, non_blocking=True)
            hidden = _joined(self._hidden).index_select(0, index)
            aux = _joined(self._aux).index_select(0, index) if self._aux else None
        if not self._queued:
            self._forget_rows()
        commits = [c for q in queued for c in q.commits()]
        largest = self.limits.learn_graph_rows
        pieces = (_chunks(commits, largest) if largest < rows <= self.limits.piecewise_learn_graphs * largest
                  else [commits])
        first = 0
        try:
            for piece in pieces:
                end = first + sum(c.count for c in piece)
                self.drafter.on_commit(piece, None if hidden is None else hidden[first:end],
                                       None if aux is None else aux[first:end])
                first = end
        except Exception as exc:  # a drafter fault costs acceptance, never correctness
            log.error("drafter failed to learn committed rows: %s\n%s", exc, traceback.format_exc())

    def _forget_rows(self) -> None:
        self._hidden, self._aux, self._rows, self._steps, self._committed = [], [], 0, 0, 0

    def record(self, request_id: int, proposed: int, accepted: int) -> None:
        self.policy.record(request_id, proposed, accepted)

    def round_kind(self, request_id: int) -> str:
        """The kind that drafted the request's latest round (RequestTiming.draft_kind)."""
        return self._kinds.get(request_id, self.drafter.kind)

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """A completed step's duration feeds the cost model, when the step was pure decoding (no prefill), less the
        one-off work done since this step began (one_off)."""
        dormant = self._dormant_step(plan)
        if not dormant and (plan.has_prefill or not plan.scheduled):
            return
        k = 0 if dormant else max((len(s.draft_tokens) for s in plan.scheduled), default=0)
        self.policy.observe_step(len(plan.scheduled), k, seconds - self._one_off)

    def release(self, request_id: int) -> None:
        """Forget a request whose blocks are freed: finished ones were learned in `learn`; what is still queued
        (preemption, abort) is dropped, its blocks being gone."""
        self._asleep.pop(request_id, None)
        queued = self._queued.pop(request_id, None)
        if queued is not None:
            self._committed -= queued.total
            if not self._queued:
                self._forget_rows()
        self.drafter.release(request_id)
        self.policy.release(request_id)
        self._kinds.pop(request_id, None)


def _joined(kept: list[torch.Tensor]) -> torch.Tensor:
    """The kept steps' rows as one tensor, concatenated once (a later flush of other requests reads it again)."""
    if len(kept) > 1:
        kept[:] = [torch.cat(kept)]
    return kept[0]


def _chunks(spans: Sequence[Commit], limit: int) -> Iterable[list[Commit]]:
    """The spans in order, cut into lists of at most `limit` rows."""
    chunk, size = [], 0
    for c in spans:
        start, left = c.start, c.count
        while left:
            n = min(left, limit - size)
            chunk.append(Commit(c.request, start, n))
            start, left, size = start + n, left - n, size + n
            if size == limit:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk
