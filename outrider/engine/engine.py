"""Engine: the step loop (plan = scheduler.schedule(); launched = runner.launch(plan); runner.sample(launched);
commit(collect(launched))), with three jobs: that loop with overlap, fault isolation, and commit, where tokens
become visible (stops, detokenization, timing stamps, the RequestOutput) once per committed batch. One thread runs
it (AsyncEngine's, or the caller's offline); engine/builder.py builds it.

Overlap scheduling (CUDA): step() launches step n+1 before it commits step n, so the host's work for one step runs
while the GPU computes the other; step n+1 feeds each request the token step n sampled, from device memory
(Request.num_pending). A token computed after its request stopped is discarded. A step whose sampling reads host
state the step in flight advances (a grammar's matcher, a penalty's window) launches its forward, then commits the
step in flight, then samples. Speculation (speculative/speculation.py) is one object called at fixed points of a
step; its rounds commit before the next step launches (docs/speculative.md).
"""

from __future__ import annotations

import logging
import secrets
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from outrider.attention import KVCache
from outrider.config import EngineConfig, ModelConfig
from outrider.engine.kv_cache import BlockPool
from outrider.engine.request import FinishReason, PromptProgress, Request, RequestOutput
from outrider.engine.runner import ModelRunner
from outrider.engine.scheduler import Scheduler
from outrider.quant.checkpoint import WeightsSummary
from outrider.speculative.speculation import Speculation
from outrider.steps import LaunchedStep, PlannedStep, Status, StepOutput, StepPlan
from outrider.structured.grammar import GrammarCompiler
from outrider.timing import now
from outrider.tokenizer import Detokenizer, Tokenizer

log = logging.getLogger("outrider.engine")

OutputCallback = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class EngineParts:
    """What an engine runs on, built by engine/builder.py."""

    device: torch.device
    model: torch.nn.Module
    model_config: ModelConfig
    model_path: str
    tokenizer: Tokenizer
    max_model_len: int
    kv_cache: KVCache
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    eos_ids: frozenset[int]
    grammars: GrammarCompiler  # (the routes')
    weights: WeightsSummary  # their formats and bytes (/props)
    speculation: Speculation | None = None  # None: no drafter
    drafter_error: str | None = None  # why the configured drafter was refused (serving without it)


@dataclass
class _Live:
    """Engine-side companions of a running request: who to tell, and its detokenizer."""

    request: Request
    on_output: OutputCallback
    detok: Detokenizer
    stop_ids: frozenset[int]  # ids that end the request past min_tokens: stop_token_ids, and EOS unless ignore_eos


@dataclass(frozen=True)
class _Appended:
    """What a step's tokens did to a request: the text each kept token added (tokens are kept up to the first
    stop), and that stop, if one came."""

    pieces: list[str]
    reason: FinishReason | None = None
    stop_type: str = "none"  # llama-server's: none | eos | word | limit
    word: str = ""

    @property
    def kept(self) -> int:
        return len(self.pieces)


class Engine:
    def __init__(self, config: EngineConfig, parts: EngineParts, clock: Callable[[], float] = now):
        """config: resolved (the builder fills the defaults it decides, e.g. the draft length). `clock`: what every
        timing stamp reads (tests inject one that advances by chosen phase times)."""
        self.config = config
        self.clock = clock
        self.device, self.model, self.model_config = parts.device, parts.model, parts.model_config
        self.dtype = next(self.model.parameters()).dtype
        self.model_path, self.tokenizer, self.max_model_len = parts.model_path, parts.tokenizer, parts.max_model_len
        self.kv_cache, self.pool, self.scheduler = parts.kv_cache, parts.pool, parts.scheduler
        self.runner = parts.runner
        self.eos_ids, self.grammars, self.weights = parts.eos_ids, parts.grammars, parts.weights
        self.speculation, self.drafter_error = parts.speculation, parts.drafter_error
        self.drafter_kind = parts.speculation.kind if parts.speculation is not None else None
        self.live: dict[int, _Live] = {}
        # Requests of a step that failed with several in it: each runs alone until it passes or fails alone.
        self.suspects: set[int] = set()
        # Requests admitted in a step they did not run in (it failed, or was cut down to one suspect): their
        # prompt starts when they next run, so their admission is stamped again then.
        self.restamp: set[int] = set()
        self.overlap = config.overlap_schedule if config.overlap_schedule is not None else self.device.type == "cuda"
        self.inflight: LaunchedStep | None = None  # launched, not yet collected (overlap scheduling)
        self.counters = dict.fromkeys(("prompt_tokens", "predicted_tokens", "requests_finished", "steps",
                                       "busy_slots_total"), 0)

    def add_request(self, req: Request, on_output: OutputCallback) -> None:
        if req.params.seed is not None and req.params.seed >= 0:
            req.seed = req.params.seed
        elif self.config.seed >= 0:
            req.seed = self.config.seed
        else:
            req.seed = secrets.randbits(32)  # llama-server's seeds are uint32
        detok = Detokenizer(self.tokenizer, req.params.stop, context=req.prompt_ids[-4:])
        stop_ids = frozenset(req.params.stop_token_ids) | (frozenset() if req.params.ignore_eos else self.eos_ids)
        live = _Live(req, on_output, detok, stop_ids)
        if not req.prompt_ids or req.num_prompt >= self.max_model_len:
            self._finish(live, FinishReason.ERROR, error="prompt is empty or exceeds the context size")
            return
        req.limit_outputs(self.max_model_len)
        self.live[req.request_id] = live
        self.scheduler.add(req)

    def abort(self, request_id: int, error: str | None = None) -> None:
        """End a request now; `error` tells its owner why (e.g. the server is shutting down)."""
        live = self.live.get(request_id)
        if live is not None:
            self._finish(live, FinishReason.ABORT, error=error)

    def has_work(self) -> bool:
        return self.inflight is not None or self.scheduler.has_work()

    def step(self) -> None:
        """One step: launch the next batch, and commit the previous one (overlap) or this one (otherwise); or, for a
        request that decodes alone, one device round (Speculation.begin_step)."""
        t0 = self.clock()
        spec = self.speculation
        lengths = {}
        if spec is not None:
            lengths = spec.begin_step(self.scheduler.running, self)
            if lengths is None:
                return
        prev, self.inflight = self.inflight, None
        if prev is not None and (lengths or self.suspects):
            # Drafts follow the committed tokens, and a step cut down to one suspect must not leave the others'
            # tokens pending in a step it does not feed from: finish the step in flight first.
            self._complete(prev)
            prev, t0 = None, self.clock()
        launched = self._launch(prev, lengths)
        if prev is not None:
            self._complete(prev)
        if launched is not None and launched.awaits_sampling:  # its sampling reads what prev's commit advanced
            launched = self._sample(launched)
        if launched is None:
            return
        overlapped = self.overlap and launched.overlappable
        if spec is not None:  # (keep its rows for the drafter, or draft the next round ahead)
            spec.after_launch(launched, overlapped)
        if overlapped:
            self.inflight = launched
            done = prev
        else:
            self._complete(launched)
            done = None if prev is not None else launched  # (two steps completed: no one step's time)
        if done is not None and spec is not None:
            spec.observe(done.plan, self.clock() - t0)

    def _launch(self, feed: LaunchedStep | None, lengths: dict[int, int]) -> LaunchedStep | None:
        """Schedule and launch a step (feeding pending tokens from `feed`, the step in flight, and drafts of the
        decided `lengths`), and sample it unless its sampling must wait for feed's commit (reads_history)."""
        spec = self.speculation
        planned = (spec.plan_step(self.scheduler.running, lengths, self.scheduler.schedule) if spec is not None
                   else PlannedStep(self.scheduler.schedule()))
        plan = planned.plan
        t = self.clock()  # the step is launched now: its prompts' processing starts (docs/architecture.md)
        for req in plan.preempted:
            self._preempted(req, t)
        if self.suspects:
            plan = self._isolate(plan)
        if not plan.scheduled:
            return None
        admitted = plan.admitted
        if self.restamp:
            admitted = admitted + [s.request for s in plan.scheduled
                                   if s.request.request_id in self.restamp and s.request not in admitted]
            self.restamp.difference_update(req.request_id for req in admitted)
        for req in admitted:
            req.timing.mark_admitted(t, cache_n=req.num_computed, prompt_n=req.num_prompt - req.num_computed)
            if req.return_progress and req.timing.t_first_token is None:
                # llama-server's first progress report: before any prompt work, the cache only
                self.live[req.request_id].on_output(RequestOutput(
                    req.request_id, [], progress=self._progress(req, req.num_computed), timing=req.timing))
        self.count_step(len(plan.scheduled))
        try:
            launched = self.runner.launch(plan, feed, planned.pending)
        except Exception as exc:  # a fault fails the request that caused it, never the server
            self.fail(plan, exc, isolate=True)
            return None
        if feed is not None and launched.reads_history:
            return launched
        return self._sample(launched, planned.probs, planned.count_accepted)

    def _sample(self, launched: LaunchedStep, draft_probs: dict[int, torch.Tensor] | None = None,
                count_accepted: bool = False) -> LaunchedStep | None:
        """Enqueue a launched step's sampling; then advance each scheduled request past the tokens it feeds, with
        one pending token per sampled request."""
        plan = launched.plan
        try:
            self.runner.sample(launched, draft_probs, accepted_on_device=count_accepted)
        except Exception as exc:  # (nothing was advanced yet: each request can run again alone)
            self.fail(plan, exc, isolate=True)
            return None
        for s in plan.scheduled:
            req = s.request
            req.num_computed += s.num_new_tokens
            req.num_pending += s.samples
        return launched

    # --- what a device round needs of the engine (speculation.RoundHost) ---
    def lone_request(self) -> Request | None:
        running = self.scheduler.running
        return running[0] if len(running) == 1 and not self.scheduler.waiting and not self.suspects else None

    def complete_inflight(self) -> bool:
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._complete(prev)
        return prev is not None

    def count_step(self, num_requests: int) -> None:
        self.counters["steps"] += 1
        self.counters["busy_slots_total"] += num_requests

    def _preempted(self, req: Request, t: float) -> None:
        req.timing.mark_preempted(t)
        if self.speculation is not None:
            self.speculation.release(req.request_id)

    def _isolate(self, plan: StepPlan) -> StepPlan:
        """The plan cut down to one suspect (the others wait a step: nothing of theirs was advanced)."""
        self.suspects.intersection_update(self.live)
        suspect = next((s for s in plan.scheduled if s.request.request_id in self.suspects), None)
        if suspect is None:
            return plan
        self.suspects.discard(suspect.request.request_id)
        self.restamp.update(req.request_id for req in plan.admitted if req is not suspect.request)
        return StepPlan([suspect], plan.preempted, [req for req in plan.admitted if req is suspect.request])

    def fail(self, plan: StepPlan, exc: Exception, isolate: bool = False) -> None:
        """A step failed: fail its requests, or with `isolate` and several of them, suspect them all (the fault's
        owner is unknown; the launch advanced none of them, so each can run again alone). A device error is not a
        request's fault: the device context is lost for every request, so it ends the engine."""
        if isinstance(exc, torch.AcceleratorError):
            raise exc
        if isolate and len(plan.scheduled) > 1:
            log.error("a step of %d requests failed, running each alone to find the one at fault: %s",
                      len(plan.scheduled), exc)
            self.suspects.update(s.request.request_id for s in plan.scheduled)
            self.restamp.update(req.request_id for req in plan.admitted)
            t = self.clock()
            for req in self.scheduler.recompute_states([s.request for s in plan.scheduled]):
                self._preempted(req, t)
            return
        log.error("step failed: %s\n%s", exc, traceback.format_exc())
        for s in plan.scheduled:
            live = self.live.get(s.request.request_id)
            if live is not None:
                self._finish(live, FinishReason.ERROR, error=f"internal error: {exc}")

    def _complete(self, launched: LaunchedStep) -> None:
        """Collect a launched step's tokens and deliver them."""
        try:
            out = self.runner.collect(launched)
        except Exception as exc:
            self.fail(launched.plan, exc)
            return
        self.deliver(launched.plan, out)

    def deliver(self, plan: StepPlan, out: StepOutput) -> None:
        """Commit a step's tokens and deliver them, then let speculation learn the step, then release what
        finished."""
        t = self.clock()
        emits = self._commit(plan, out, t)
        for live, output in emits:
            if output.finished:
                self._mark_finished(live, output.finish_reason, t)
            live.on_output(output)
        if self.speculation is not None:  # (before finished requests release their blocks: prefix hits)
            self.speculation.after_commit(plan, out, self.live)
        for live, output in emits:
            if output.finished:
                self._release(live)

    def _commit(self, plan: StepPlan, out: StepOutput, t: float) -> list[tuple[_Live, RequestOutput]]:
        """Apply a step's results to its requests; returns their outputs, delivered (and finished requests
        retired) after drafters learn the step."""
        emits = []
        predicted = 0
        for i, s in enumerate(plan.scheduled):
            live = self.live.get(s.request.request_id)
            if live is None:  # aborted, or finished by the step before, meanwhile
                continue
            req = live.request
            accepted = out.accepted[i]
            req.num_computed += accepted  # (the fed tokens were counted at launch)
            tokens = out.tokens[i]
            # Prefill reports: each chunk, and the first token's step (the whole prompt processed).
            progress = self._progress(req) if req.return_progress and not req.output_ids else None
            if not tokens:  # a prefill chunk that does not reach the end of the prompt yet
                if progress is not None:
                    emits.append((live, RequestOutput(req.request_id, [], progress=progress, timing=req.timing)))
                continue
            req.num_pending -= 1  # (the launch of the next step may have added another)
            appended = self._append(live, tokens)
            n = appended.kept
            if s.draft_tokens:  # count only accepted drafts that were committed (a stop can cut a round short)
                req.timing.draft_kind = s.draft_kind
                req.timing.mark_draft_round(len(s.draft_tokens), min(accepted, n))
            req.timing.mark_tokens(n, t)
            predicted += n
            if req.timing.predicted_n == n:
                self.counters["prompt_tokens"] += req.timing.prompt_n
            self.pool.commit_full_blocks(req, req.num_computed)
            kept = tokens if n == len(tokens) else tokens[:n]  # (the step's lists are not reused: no copy needed)
            logprobs = out.logprobs[i][:n] or None
            emits.append((live, RequestOutput(req.request_id, kept, finished=appended.reason is not None,
                                              finish_reason=appended.reason, stop_type=appended.stop_type,
                                              stopping_word=appended.word, logprobs=logprobs,
                                              accepted_drafts=min(accepted, n), timing=req.timing,
                                              token_texts=appended.pieces, progress=progress)))
        self.counters["predicted_tokens"] += predicted
        return emits

    def _progress(self, req: Request, processed: int | None = None) -> PromptProgress:
        """The request's prefill progress now: `processed` prompt tokens (default: those scheduled so far)."""
        done = min(req.num_computed, req.num_prompt) if processed is None else processed
        return PromptProgress(total=req.num_prompt, cache=req.timing.cache_n, processed=done, t=self.clock())

    @staticmethod
    def _append(live: _Live, tokens: list[int]) -> _Appended:
        """Append a step's tokens to the request's outputs, up to the first stop."""
        req, detok = live.request, live.detok
        output_ids, min_tokens = req.output_ids, req.params.min_tokens
        pieces: list[str] = []
        for tok in tokens:
            output_ids.append(tok)
            num_outputs = len(output_ids)
            if tok in live.stop_ids and num_outputs > min_tokens:
                pieces.append(detok.flush())
                return _Appended(pieces, FinishReason.STOP, "eos")
            piece, word = detok.push((tok,))
            pieces.append(piece)
            if word is not None:
                return _Appended(pieces, FinishReason.STOP, "word", word)
            if req.constraint is not None and req.constraint.accept(tok):  # the grammar is complete
                pieces[-1] += detok.flush()
                return _Appended(pieces, FinishReason.STOP, "eos")
            if num_outputs >= req.max_output_tokens:
                pieces[-1] += detok.flush()
                return _Appended(pieces, req.limit_reason(num_outputs), "limit")
        return _Appended(pieces)

    def _finish(self, live: _Live, reason: FinishReason, error: str | None = None) -> None:
        """End a request outside a step's commit (refused, aborted, failed): no tokens, and `error` says why."""
        self._mark_finished(live, reason, self.clock())
        self._release(live)
        req = live.request
        live.on_output(RequestOutput(req.request_id, [], finished=True, finish_reason=reason, timing=req.timing,
                                     error=error))

    @staticmethod
    def _mark_finished(live: _Live, reason: FinishReason, t: float) -> None:
        req = live.request
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.timing.mark_finished(t)

    def _release(self, live: _Live) -> None:
        """Take a finished request out: scheduler (blocks and slot), drafter state."""
        req = live.request
        self.scheduler.remove(req)
        if self.speculation is not None:
            self.speculation.release(req.request_id)
        self.restamp.discard(req.request_id)
        self.live.pop(req.request_id, None)
        self.counters["requests_finished"] += 1

    def stats(self) -> dict:
        pool = self.pool
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used, "kv_block_size": pool.block_size,
                "prefix_cache_hit_tokens": pool.hits, **self.counters,
                **(self.scheduler.states.stats() if self.scheduler.states is not None else {})}
