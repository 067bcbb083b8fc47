"""What one engine step is, as the scheduler, the runner, the engine and speculation pass it between them: the plan
(which requests feed which tokens and drafts), the step once launched on the device, and what it outputs; and a
request's pending prompt log-probs and pooling. (A request's status, Status, is engine/request.py's.)

A module of data below both the engine and the speculative package, so that each reads the other's steps without
importing the other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from outrider.engine.request import Request, Status, TokenLogprob  # noqa: F401  (Status: re-exported)

if TYPE_CHECKING:
    from outrider.layers.gated_deltanet_types import StateBatch
    from outrider.speculative.drafter import PendingDrafts
    from outrider.speculative.verify import PendingVerdict


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # position of its first fed token (request.num_computed when scheduled)
    num_new_tokens: int  # known tokens fed this step (prompt chunk, or the last sampled token)
    samples: bool  # this step computes the request's last known token, so its logits are sampled
    draft_tokens: list[int] = field(default_factory=list)  # speculative proposals fed after them
    draft_kind: str | None = None  # the drafter kind that proposed them (RequestTiming.draft_kind)

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + len(self.draft_tokens)


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    admitted: list[Request] = field(default_factory=list)  # admissions (first, or a resume after preemption)
    # Whether a row may feed prompt positions (False: none does, so the prompt log-prob and pooling hooks skip
    # the step without walking its rows; the scheduler says so, anything else leaves it True)
    prompt_rows: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def has_prefill(self) -> bool:
        return any(s.num_new_tokens > 1 or not s.samples for s in self.scheduled)


@dataclass(frozen=True)
class PlannedStep:
    """A plan with its drafts: the values of drafts still on the device (the plan holds PENDING for them), q [k, V]
    by request id where drafts were sampled (absent: argmax), and whether the verify step counts its accepted drafts
    on the device (for drafting the next round from its verdict)."""

    plan: StepPlan
    pending: PendingDrafts | None = None
    probs: dict[int, torch.Tensor] | None = None
    count_accepted: bool = False


@dataclass
class StepOutput:
    """Per scheduled request (in plan order) unless noted."""

    tokens: list[list[int]]  # the tokens this step commits (empty mid-prefill; m+1 after a verify)
    logprobs: list[list[TokenLogprob]]  # one per committed token, when the request asked for n_probs
    accepted: list[int]  # m: drafts accepted this step
    # [T, H] pre-norm hidden states of every fed row (drafters read these; a CUDA-graph view, valid until the
    # next replay)
    hidden: torch.Tensor
    aux_hidden: torch.Tensor | None  # [T, A] outputs of the layers the runner taps for a drafter that reads them
    kept: bool = False  # hidden and aux_hidden are own copies (keep_hidden)

    def keep_hidden(self) -> None:
        """Own copies of the hidden rows (device-side, asynchronous), for a reader after the next graph replay;
        once only."""
        if self.kept:
            return
        self.hidden = self.hidden.clone()
        if self.aux_hidden is not None:
            self.aux_hidden = self.aux_hidden.clone()
        self.kept = True


@dataclass
class PendingRows:
    """One request's prompt rows of a step, on the device until delivered (engine/prompt_logprobs.py)."""

    request: Request
    first: int  # the position of the first predicted prompt token
    logprobs: torch.Tensor  # [n] each row's target log-probability
    ranks: torch.Tensor  # [n]
    top_values: torch.Tensor  # [n, k]
    top_ids: torch.Tensor  # [n, k]


@dataclass
class PendingPool:
    """One request's pooled part of a step, on the device until delivered (engine/pooling.py)."""

    request: Request
    restart: bool  # the chunk starts at position 0
    rows: torch.Tensor  # on the device
    count: int


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued (its forward by ModelRunner.launch, its sampling by
    ModelRunner.sample); its sampled tokens reach the host in ModelRunner.collect."""

    plan: StepPlan
    sampling: list[int]  # plan indices of the requests sampled this step
    out: StepOutput  # tokens and log-probs filled in by collect
    # A penalty reads a sampled request's recent tokens on the host, or a grammar its matcher state: sampling
    # must wait until every earlier step of the request is committed.
    reads_history: bool = False
    drafts_on_device: PendingDrafts | None = None  # the values of the plan's PENDING draft tokens
    logits: torch.Tensor | None = None  # [R, V] the sampling rows' logits, from launch until sample enqueues them
    verdict: PendingVerdict | None = None  # a verify step's, decided on the device; collect reads it
    starts: Sequence[int] = ()  # per sampled request, its first row in the log-prob tensors
    token_ids: torch.Tensor | None = None  # [R] sampled ids on the device, row r for sampling[r] (Request.sample_row)
    host: list[torch.Tensor] = field(default_factory=list)  # pinned copies in flight: ids, then log-prob parts
    ready: torch.cuda.Event | None = None  # recorded after the copies (CUDA)
    prompt_logprobs: list[PendingRows] = field(default_factory=list)  # prefill rows' (engine/prompt_logprobs.py)
    pooled: list[PendingPool] = field(default_factory=list)  # prefill rows' (engine/pooling.py)
    states: StateBatch | None = None  # a hybrid model's slots (a verify's are committed once its verdict is known)

    @property
    def awaits_sampling(self) -> bool:
        return self.logits is not None

    @property
    def overlappable(self) -> bool:
        """May the next step launch before this one is committed? Not after a verify: the next step's positions
        follow how many drafts were accepted."""
        return self.verdict is None
