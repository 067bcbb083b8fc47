"""Speculation's part of an engine step, in one object: which requests draft and how far (DraftPolicy), the
drafter's proposals with blocks reserved for what it writes, the rows it learns after a step, the policy's
bookkeeping (acceptance per request, measured step costs), and forgetting requests whose blocks were freed.

The engine calls it at fixed points of a step (docs/speculative.md, "The step"); it never stamps timings."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from outrider.engine.kv_cache import BlockPool
from outrider.engine.request import Request, Status
from outrider.engine.scheduler import StepPlan
from outrider.speculative.drafter import Commit, DraftPolicy, Drafter

log = logging.getLogger("outrider.engine")


@dataclass
class Drafts:
    """This step's proposals by request id: tokens, and q [k, V] where the drafts were sampled (absent: argmax)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)


class Speculator:
    def __init__(self, drafter: Drafter, policy: DraftPolicy, pool: BlockPool):
        self.drafter = drafter
        self.policy = policy
        self.pool = pool
        self._kinds: dict[int, str] = {}  # request id -> the kind that drafted its latest round (combined kinds)

    def draft_lengths(self, running: Sequence[Request]) -> dict[int, int]:
        """This step's k by request id (only k > 0), decided once per step for the decoding requests, counting
        those whose last token is still on the device (the engine then commits the step in flight first)."""
        decoding = [r for r in running if r.num_computed == r.num_tokens - 1]
        if not decoding:
            return {}
        ks = self.policy.draft_lengths(decoding, self.drafter)  # (the whole decoding batch sizes the costs)
        return {r.request_id: k for r, k in zip(decoding, ks) if k and self.drafter.may_propose(r)}

    def propose(self, running: Sequence[Request], lengths: dict[int, int]) -> Drafts:
        """Drafts of the decided lengths, with blocks reserved for what the drafter writes. A drafter fault costs
        this step's drafts, never correctness."""
        decoding, ks = [], []
        for req in running:
            k = lengths.get(req.request_id, 0)
            # (no room to draft: a plain decode step, never a preemption)
            if k and req.num_pending == 0 and self.pool.ensure(req, req.num_tokens - 1 + self.drafter.lookahead(k)):
                decoding.append(req)
                ks.append(k)
        if not decoding:
            return Drafts()
        try:
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

    def learn(self, plan: StepPlan, accepted: Sequence[int], hidden: torch.Tensor, aux_hidden: torch.Tensor | None,
              live: set[int] | dict) -> None:
        """Let the drafter learn every committed row of the step for the requests that still hold their blocks
        (finishing ones too: their blocks may serve prefix hits)."""
        commits: list[Commit] = []
        rows: list[int] = []
        base = 0
        for i, s in enumerate(plan.scheduled):
            req = s.request
            if req.request_id in live and req.status is not Status.WAITING:  # (preempted meanwhile: blocks gone)
                # Target rows whose K/V stays valid and whose next token is on the host (a stop may cut a round;
                # with overlap scheduling the next step may already have fed a token that is still pending).
                known = req.num_prompt + len(req.output_ids)
                count = min(s.num_new_tokens + accepted[i], known - 1 - s.start)
                commits.append(Commit(req, s.start, count))
                rows.extend(range(base, base + count))
            base += s.num_query_tokens
        if not commits:
            return
        # (built on the host and copied without blocking: torch.tensor(..., device=cuda) would synchronise, and
        # with overlap scheduling the host would then wait out the step just launched on every step)
        index = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
        aux = aux_hidden.index_select(0, index) if aux_hidden is not None else None
        try:
            self.drafter.on_commit(commits, hidden.index_select(0, index), aux)
        except Exception as exc:  # a drafter fault costs acceptance, never correctness
            log.error("drafter failed to learn committed rows: %s\n%s", exc, traceback.format_exc())

    def record(self, request_id: int, proposed: int, accepted: int) -> None:
        self.policy.record(request_id, proposed, accepted)

    def round_kind(self, request_id: int) -> str:
        """The kind that drafted the request's latest round (RequestTiming.draft_kind)."""
        return self._kinds.get(request_id, self.drafter.kind)

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """A completed step's duration feeds the cost model, when the step was pure decoding (no prefill)."""
        if plan.has_prefill or not plan.scheduled:
            return
        k = max((len(s.draft_tokens) for s in plan.scheduled), default=0)
        self.policy.observe_step(len(plan.scheduled), k, seconds)

    def release(self, request_id: int) -> None:
        self.drafter.release(request_id)
        self.policy.release(request_id)
        self._kinds.pop(request_id, None)
