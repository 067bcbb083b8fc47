"""Speculation as the engine sees it: one object behind six calls, made at fixed points of every step.

    lengths = speculation.begin_step(running, host)     decide each decoding request's draft length; or run a
                                                        whole round on the device (None: that was the step)
    planned = speculation.plan_step(running, lengths, schedule)
                                                        the drafts, and the plan the scheduler makes with them
    speculation.after_launch(launched, overlapped)      keep its hidden rows (overlap), or draft the next round
                                                        from its verdict while still on the device
    speculation.after_commit(plan, out, live)           record acceptance; the drafter learns the committed rows
    speculation.observe(plan, seconds)                  a completed step's duration, for the policy's costs
    speculation.release(request_id)                     forget a request whose blocks were freed

It owns the drafter, the draft-length policy, the Speculator (learning, drafting ahead, sleeping; speculator.py)
and the device rounds with the round in flight (device_round.py). The engine knows nothing else of speculation; a
device round reaches back into the engine only through the RoundHost it is handed (commit the step in flight,
deliver a round's tokens, fail it).

Device rounds: a request that decodes alone, greedy and unconstrained, runs its rounds whole on the device, one
replay each, its verdict copied to the host, the round before it (in flight since the last step) committed
meanwhile as a verify step is. The device's state already follows that round, so the host reads and commits it
while the device runs the next (docs/speculative.md, "Device rounds")."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from outrider.speculative.device_round import DeviceRound, RoundCopy, committed
from outrider.speculative.drafter import PENDING, DraftPolicy, Drafter
from outrider.speculative.speculator import Drafts, Speculator
from outrider.steps import LaunchedStep, PlannedStep, ScheduledRequest, Status, StepOutput, StepPlan

if TYPE_CHECKING:
    from outrider.engine.request import Request


class RoundHost(Protocol):
    """What a device round needs of the engine that runs it."""

    def lone_request(self) -> Request | None:
        """The one running request, when nothing waits and no request is suspected of a fault."""

    def complete_inflight(self) -> bool:
        """Commit the step in flight, if any (False: there was none)."""

    def count_step(self, num_requests: int) -> None:
        """A step of this many requests launched (the engine's counters)."""

    def deliver(self, plan: StepPlan, out: StepOutput) -> None:
        """Commit a step's tokens and deliver them (after_commit follows, as for any step)."""

    def fail(self, plan: StepPlan, exc: Exception) -> None:
        """A step failed: fail its requests."""


@dataclass(frozen=True)
class _RoundFlight:
    """A device round replayed and not yet committed."""

    request: Request
    k: int  # its length (what its time is the cost of)
    drafts: int  # the drafts it verified: k, or fewer in the first round after a switch from a shorter length
    copy: RoundCopy  # its verdict, on its way to the host
    t0: float  # when its time began: its launch, or the landing of the round before it (still running then)


Schedule = Callable[[dict[int, list[int]]], StepPlan]


class Speculation:
    def __init__(self, speculator: Speculator, rounds: dict[int, DeviceRound], clock: Callable[[], float]):
        """rounds: a DeviceRound per draft length the policy may choose (empty: no device rounds)."""
        self.speculator = speculator
        self.rounds = rounds
        self.clock = clock
        self._owner: tuple[int, int] | None = None  # the (request id, k) whose round state the device holds
        self._flight: _RoundFlight | None = None  # replayed, its verdict not yet read
        self._delivering: StepPlan | None = None  # a round being committed (its rows are learned already)

    @property
    def drafter(self) -> Drafter:
        return self.speculator.drafter

    @property
    def policy(self) -> DraftPolicy:
        return self.speculator.policy

    @property
    def kind(self) -> str:
        return self.speculator.drafter.kind

    @property
    def round_in_flight(self) -> bool:
        """Is a device round replayed whose verdict the host has not committed yet?"""
        return self._flight is not None

    @contextmanager
    def drafting_with(self, drafter: Drafter, rounds: dict[int, DeviceRound]) -> Iterator[None]:
        """Draft with another drafter, and its device rounds, inside the block (benchmarks wrap the loaded one to
        control acceptance); the loaded drafter and its rounds afterwards."""
        loaded = self.speculator.drafter, self.rounds
        self.speculator.drafter, self.rounds = drafter, rounds
        try:
            yield
        finally:
            self.speculator.drafter, self.rounds = loaded

    # --- the engine's calls ---
    def begin_step(self, running: Sequence[Request], host: RoundHost) -> dict[int, int] | None:
        """This step's k by request id (only k > 0). None: a device round was this step (device rounds, when a
        request qualifies); otherwise a round in flight is committed first."""
        lengths = self.speculator.draft_lengths(running)
        if self.rounds and self._device_round(lengths, host):
            return None
        self._land_round(host)
        self._owner = None
        return lengths

    def plan_step(self, running: Sequence[Request], lengths: dict[int, int], schedule: Schedule) -> PlannedStep:
        """Drafts of the decided lengths (none without lengths) and the plan `schedule` makes with them; whether the
        verify step counts its accepted drafts on the device, for drafting the next round ahead."""
        drafts = self.speculator.propose(running, lengths) if lengths else Drafts()
        plan = schedule(drafts.tokens)
        if drafts.tokens:
            for s in plan.scheduled:
                if s.draft_tokens:
                    s.draft_kind = self.speculator.round_kind(s.request.request_id)
        return PlannedStep(plan, drafts.pending, drafts.probs, self.speculator.drafts_ahead(plan))

    def after_launch(self, launched: LaunchedStep, overlapped: bool) -> None:
        """A step was launched and sampled. `overlapped`: it is committed only after the next one launches, so the
        drafter's hidden rows are kept from the next replay; else a verify step's next round is drafted from its
        verdict, still on the device, while the host commits this one (Speculator.draft_ahead)."""
        verdict = launched.verdict
        if overlapped:
            self.speculator.keep(launched.plan, launched.out)
        # (m on the device, as plan_step asked for it: a plan cut down to one suspect since may not have)
        elif verdict is not None and verdict.accepted is not None and self.speculator.drafts_ahead(launched.plan):
            self.speculator.draft_ahead(launched)

    def after_commit(self, plan: StepPlan, out: StepOutput, live: set[int] | dict) -> None:
        """A step's tokens were committed and delivered: record each round's acceptance, and let the drafter learn
        the committed rows (before finished requests release their blocks: they may serve prefix hits)."""
        for i, s in enumerate(plan.scheduled):
            if s.draft_tokens and s.request.request_id in live:
                self.speculator.record(s.request.request_id, len(s.draft_tokens), out.accepted[i])
        if plan is not self._delivering:  # (a device round's rows were learned on the device)
            self.speculator.learn(plan, out, live)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """A completed step's duration (the policy's measured costs)."""
        self.speculator.observe_step(plan, seconds)

    def release(self, request_id: int) -> None:
        """Forget a request whose blocks are freed (finished, aborted, preempted), its device round included."""
        if self._flight is not None and self._flight.request.request_id == request_id:
            self._flight = None
        if self._owner is not None and self._owner[0] == request_id:
            self._owner = None
        self.speculator.release(request_id)

    # --- device rounds ---
    def _device_round(self, lengths: dict[int, int], host: RoundHost) -> bool:
        """A whole round on the device for the lone greedy decoder, of the length this step decided. False: no
        request qualifies now, or it drafts nothing (a round in flight is committed, and the step runs as usual)."""
        req = self._lone_greedy(host)
        k = lengths.get(req.request_id, 0) if req is not None else 0
        rounds = self.rounds.get(k) if k else None
        flight = self._flight
        # The round in flight commits 1 .. drafts + 1 tokens: where they may reach the limit, the next round waits
        # for its verdict rather than run after the request ends.
        if flight is not None and (rounds is None or flight.request is not req
                                   or flight.drafts + 1 >= req.outputs_left):
            self._land_round(host)  # (its request's state must be on the host before anything else uses it)
            flight, req = None, self._lone_greedy(host)
        if req is None or rounds is None:
            return False
        if host.complete_inflight():  # (its token is the round's first input: committed first)
            if req.status is not Status.RUNNING or req.num_computed != req.num_tokens - 1:
                return False
        # The round launched now starts where the one in flight ends, which the host has not read: room for the
        # worst case, every draft of that one kept.
        start = req.num_tokens - 1 + (flight.drafts + 1 if flight is not None else 0)
        if not self.speculator.pool.ensure(req, start + rounds.reach()):
            self._land_round(host)
            return False
        owner, verified = self._owner, k
        if owner is None or owner[0] != req.request_id:  # (then nothing is in flight: a flight's owner is this one)
            drafts = self.speculator.device_round_drafts(req, k)  # (one-off work: done before the round's clock)
            if drafts is None:
                return False
            rounds.load(req.all_ids[-1], drafts, start, req.block_ids)
        elif owner[1] != k:  # (the device's state follows the owner's rounds: the new length takes over from them)
            rounds.continue_from(self.rounds[owner[1]])
            verified = min(k, owner[1])
        rounds.follow(req)
        self._owner = (req.request_id, k)
        t0 = self.clock()
        host.count_step(1)
        try:
            rounds.replay()
            copy = rounds.verdict_to_host()
        except Exception as exc:
            self._owner = self._flight = None
            host.fail(self._round_plan(req, k), exc)
            return True
        self._flight = _RoundFlight(req, k, verified, copy, t0)
        if flight is not None:
            self._land(flight, host)  # (a round that ends the request releases the one just launched: moot)
            if self._flight is not None:  # (the device runs this round once that one is done: from its launch on,
                self._flight = replace(self._flight, t0=self.clock())  # it would count both)
        return True

    def _lone_greedy(self, host: RoundHost) -> Request | None:
        """The lone running request when its next token is the plain argmax (its last token sampled, maybe still in
        flight): no temperature, bias, penalty, grammar, log-probs, or min_tokens left to hold end-of-generation
        back; and its drafts untrimmed (no p_min or n_min: a device round verifies all k)."""
        req = host.lone_request()
        if req is None:
            return None
        p = req.params
        if (not p.temperature <= 0 or p.penalized or p.logit_bias or p.n_probs or req.constraint is not None
                or len(req.output_ids) + req.num_pending <= p.min_tokens or self.policy.trims(req)):
            return None
        return req if req.num_computed == req.num_tokens - 1 else None  # (min_tokens >= 0: one token is out)

    def _land_round(self, host: RoundHost) -> None:
        """Commit the device round in flight, if any."""
        flight, self._flight = self._flight, None
        if flight is not None:
            self._land(flight, host)

    def _land(self, flight: _RoundFlight, host: RoundHost) -> None:
        """Read a device round's verdict (waiting for its copy alone) and commit it as a verify step's: the request
        had fed its last token and verified its drafts, and its rows are learned already. Its time is the cost of a
        round of its length, whatever it was given to verify."""
        req = flight.request
        tokens = committed(flight.copy)
        if req.status is not Status.RUNNING:  # (ended meanwhile: nothing to commit)
            return
        req.num_computed += 1  # (the fed token, and the sampled one pending, as a launched verify step counts them)
        req.num_pending += 1
        self._delivering = plan = self._round_plan(req, flight.drafts)
        try:
            host.deliver(plan, StepOutput([tokens], [[]], [len(tokens) - 1], torch.empty(0), None))
        finally:
            self._delivering = None
        self.speculator.observe_step(self._round_plan(req, flight.k), self.clock() - flight.t0)

    def _round_plan(self, req: Request, k: int) -> StepPlan:
        """A device round as the step it stands for: the request feeds its last token and verifies k drafts."""
        return StepPlan([ScheduledRequest(req, req.num_computed, 1, True, [PENDING] * k,
                                          self.speculator.round_kind(req.request_id))], [])
