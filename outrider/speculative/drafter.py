"""The Drafter protocol every speculative kind implements, and the policy that picks draft lengths.

One engine step with a drafter (docs/speculative.md walks it through):
  1. ks = policy.draft_lengths(decoding, drafter)            per-request k (0 = plain decode this step); 0 too
     where not drafter.may_propose(request)
  2. ensure each request's blocks cover num_tokens - 1 + drafter.lookahead(k) positions (else k = 0)
  3. proposals = policy.trim(decoding, drafter.propose(decoding, ks))
  4. one ragged target forward over [last, d1..dk] per request; verify() per row; commit m+1 tokens
  5. drafter.on_commit(commits, hidden, aux_hidden) for EVERY committed target row, deferred and batched: the
     Speculator queues each step's rows and hands a request's queue over as one Commit before the next propose,
     when a step prefills, every SpeculationLimits.learn_backlog_steps steps, and before a finishing request's
     blocks are released
  6. policy.record(request_id, k, m) beside timing.mark_draft_round(k, m)
  7. drafter.release(request_id) / policy.release(request_id) whenever a request's blocks are freed
  8. for a drafter that drafts_ahead, between a verify step's verdict (on the device) and the host reading it:
     drafter.draft_ahead(rows, ks) learns the step's rows and stages the next round's drafts (Speculator.draft_ahead);
     the next step verifies them without steps 1-3, and step 5 skips those rows
The engine reaches all of this through one object, speculation.py's Speculation.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from outrider.attention import KVCache
from outrider.kernels import ops

if TYPE_CHECKING:
    from outrider.engine.request import Request


# A drafter's KV pool, asked for by its constructor once its weights are loaded: (kv_shape, aux_layer_ids) ->
# a pool of that shape with the target's block ids and count (engine/builder.py sizes both pools in one budget
# then, its weights counted).
KVPool = Callable[[tuple[int, int, int], tuple[int, ...]], KVCache]


@dataclass(frozen=True)
class TargetView:
    """What a drafter may use of the target model, and nothing more: its token embedding, final norm, LM head (over
    normed hidden states) and rotary embedding. MTP heads and DFlash borrow these; they never reach into the
    target's modules."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    final_norm: Callable[[torch.Tensor], torch.Tensor]
    lm_head: Callable[[torch.Tensor], torch.Tensor]  # logits over draft_ids' rows of the head, when given
    rotary: torch.nn.Module
    draft_ids: torch.Tensor | None = None  # [N] int64: the token map (speculative/token_map.py); None: every token

    @classmethod
    def of(cls, model: torch.nn.Module, draft_ids: torch.Tensor | None = None) -> TargetView:
        """The target's view; with draft_ids, a head over those rows only (copied once, dequantized)."""
        head = model.lm_head
        if draft_ids is not None:
            draft_ids = draft_ids.to(head.weight.device)
            weight = head.weight  # (a tensor, or a QuantizedWeight whose embedding() dequantizes rows)
            rows = weight.index_select(0, draft_ids) if isinstance(weight, torch.Tensor) else weight.embedding(draft_ids)
            head = functools.partial(ops.linear, weight=rows)
        return cls(model.embed, model.model.norm, head, model.model.rotary_emb, draft_ids)

    def tokens(self, drafts: torch.Tensor) -> torch.Tensor:
        """Draft ids from lm_head's columns to the target's vocabulary."""
        return drafts if self.draft_ids is None else self.draft_ids[drafts]


@dataclass
class Proposals:
    """Drafts per request, in the order asked. probs[i] is q as [k_i, V] when drafts were sampled;
    None means argmax drafts (q one-hot). confidence[i][j] is the drafter's probability of token j. kinds[i] names
    the kind that drafted request i when several are combined (None: the drafter's own kind)."""

    tokens: list[list[int]]
    confidence: list[list[float]]
    probs: list[torch.Tensor | None] | None = None
    kinds: list[str] | None = None


@dataclass(frozen=True)
class Commit:
    """Target rows that are now committed: positions start..start+count-1 of one request, whose tokens
    (and the one after them) are already in request.all_ids. Hidden rows come in commit order."""

    request: Request
    start: int
    count: int


class Drafter(Protocol):
    kind: str  # "draft" | "mtp" | "dflash" | "eagle3" | "ngram", or several comma-joined (combined.py)
    aux_layer_ids: tuple[int, ...]  # target decoder layers whose outputs it reads (the engine's runner taps them)
    reads_hidden: bool  # on_commit reads the target's hidden rows (else it gets None and no rows are kept for it)
    learns: bool  # on_commit does anything (False: the engine never queues committed rows for it)
    max_draft: int  # most tokens one propose returns per request
    step_cost: float  # [est] marginal cost of one drafted token, in target decode steps (policy input)
    kv_shape: tuple[int, int, int]  # (layers, KV heads, head dim) of its own KV pool
    kv: KVCache | None  # that pool, with the target's block ids and count, from the KVPool its constructor is given

    def lookahead(self, k: int) -> int:
        """KV positions from the last committed token on that proposing k tokens writes (blocks must exist)."""

    def may_propose(self, request: Request) -> bool:
        """Host-only and cheap, before the step in flight is committed: False when propose could not draft for the
        request this step, so the engine keeps overlapping plain steps (n-gram lookup misses). True is safe."""

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        """Up to ks[i] drafts for each decoding request (fewer near the end of its block table)."""

    # Drafters whose argmax drafts are made on the device also `stage` them (stages_on_device): what propose does,
    # without reading the drafts back, so the verify forward is fed from the device and the host reads drafts and
    # verdict in one sync.
    stages_on_device: bool

    def stage(self, requests: Sequence[Request], ks: Sequence[int]) -> StagedDrafts:
        """propose's drafts, left on the device (only when stages_on_device)."""

    # Drafters that learn a verify step's rows and draft the next round from the verdict still on the device
    # (drafts_ahead): the next round's drafting then runs on the device while the host reads and commits this one.
    drafts_ahead: bool

    def draft_ahead(self, rows: VerifiedRows, ks: Sequence[int]) -> StagedDrafts:
        """Learn the verified rows (VerifiedRows says why all of them) and stage up to ks[i] drafts for
        rows.requests[i] from its last committed row (only when drafts_ahead; blocks cover the worst case)."""

    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor | None,
                  aux_hidden: torch.Tensor | None) -> None:
        """Learn committed target rows: hidden [sum count, H] pre-norm (None unless reads_hidden), aux_hidden
        [sum count, A] or None. A commit may span several steps' rows: it is causal over them, like a prefill."""

    def release(self, request_id: int) -> None:
        """Forget a request whose blocks were freed (finish, abort, preemption)."""

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        """CUDA: capture graphs for the drafter's own uniform forwards, up to max_batch sequences, into the
        target graphs' memory pool (the engine calls it once at start-up, after the target's graphs; their
        replays never interleave). A drafter may have none to capture."""


# Learning a round's few committed rows replays a CUDA graph of up to this many rows. Each row is its own one-token
# sequence (attention reads the keys the rows before it wrote in the same launch), so a learn has the uniform shape
# of a decode step; a larger one (a prefill's) runs eager, ragged.
LEARN_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class VerifiedRows:
    """A verify step's rows as the device decided them, before the host reads the verdict. Request i fed counts[i]
    rows (its last token, then its drafts) from position starts[i], one request's rows after another's; its first
    accepted[i] + 1 rows are committed (m_i, on the device), and emitted[row] is the token after each row (the next
    row's input where committed). hidden and aux_hidden are the target's rows (as StepOutput has them).

    A drafter learns every row, the rejected ones too: their K/V lies at positions past p_i + m_i, which whatever
    drafts from there next (this round drafted ahead, or a later one) writes before it reads them."""

    requests: Sequence[Request]
    starts: list[int]
    counts: list[int]
    accepted: torch.Tensor  # [R] int64
    emitted: torch.Tensor  # [T] int64
    hidden: torch.Tensor
    aux_hidden: torch.Tensor | None

    def seqs(self) -> list[tuple[list[int], int, int]]:
        """Every row as a one-token sequence (see LEARN_ROWS)."""
        return [(r.block_ids, start + j, 1) for r, start, n in zip(self.requests, self.starts, self.counts)
                for j in range(n)]

    def last(self) -> torch.Tensor:
        """[R] int64 on the device: each request's last committed row (where its next round starts)."""
        first = torch.tensor(list(itertools.accumulate(self.counts, initial=0))[:-1], dtype=torch.int64)
        return first.to(self.accepted.device, non_blocking=True) + self.accepted


def row_seqs(commits: Sequence[Commit]) -> list[tuple[list[int], int, int]]:
    """The committed rows as one-token sequences (block table, position, 1), in commit order (see LEARN_ROWS)."""
    return [(c.request.block_ids, c.start + j, 1) for c in commits for j in range(c.count)]


DEFAULT_N_MAX = 4  # drafts per round when neither the server nor the drafter says otherwise
MAX_VERIFY_TOKENS = 256  # sum of (k+1) over drafting requests: keeps verify memory-bound on a GPU


def block_capacity(request: Request, block_size: int) -> int:
    """Positions the request's block table can hold: drafters never write past it."""
    return len(request.block_ids) * block_size


def expected_tokens(alpha, k):
    """E[tokens per round] for per-position acceptance alpha and k drafts: (1 - a^(k+1)) / (1 - a), k + 1 at a = 1.
    Scalars give a float; numpy arrays (broadcast together) give an array, for the policy's per-step grid."""
    a, k = np.asarray(alpha, dtype=np.float64), np.asarray(k)
    with np.errstate(divide="ignore", invalid="ignore"):  # (the a = 1 branch is the other one)
        out = np.where(a >= 1.0, k + 1.0, (1.0 - a ** (k + 1)) / (1.0 - a))
    return float(out) if out.ndim == 0 else out


def _rates(alphas, caps, ks: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Expected tokens per second over a batch for every k at once (rows: k; columns: requests at these
    acceptances, each drafting up to its cap), a round of k costing seconds[k]."""
    tokens = expected_tokens(np.asarray(alphas)[None, :], np.minimum(ks[:, None], np.asarray(caps)[None, :]))
    return tokens.sum(axis=1) / seconds


@dataclass
class _Acceptance:
    accepted: float  # decayed counts of accepted drafts and of rounds ending in a rejection:
    rejected: float  # accepted / (accepted + rejected) estimates the per-position acceptance

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @classmethod
    def worth_two_rounds(cls, alpha: float) -> _Acceptance:
        return cls(2 * alpha, 2 * (1 - alpha))

    def add(self, decay: float, accepted: float, rejected: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.rejected = decay * self.rejected + rejected

    def relax(self, toward: _Acceptance, rate: float) -> None:
        """Move a step of `rate` toward another estimate's counts (its alpha and its weight)."""
        self.accepted += rate * (toward.accepted - self.accepted)
        self.rejected += rate * (toward.rejected - self.rejected)


def batch_bucket(n: int) -> int:
    """The power of two at or above n: step costs are measured per bucket of decoding sequences."""
    return 1 << max(0, n - 1).bit_length()


@dataclass
class StepCosts:
    """Measured seconds of one engine step of pure decoding by batch bucket and draft length (k = 0: a plain
    step; k > 0: a speculative round with drafts of up to k, drafting, verifying and learning included), as
    moving averages. The engine feeds it from its clock, at warm-up and while serving.

    A draft length not measured again within `stale_after` measurements of its bucket counts as unmeasured (`at`
    leaves it out while another round is fresh, and its next measurement starts afresh): the policy stops choosing
    a k whose cost looks high, so without this one slow early round (a warm-up, a busy host) would rule that k out
    for good. Re-priced from its neighbours, it is tried again if it then looks best. The plain step goes stale
    too (speculation that always wins stops measuring it): then the policy takes a plain step first, as it does
    before anything is measured.

    A measurement counts at most `stall_factor` times what the length cost before (a first one: `first_factor`
    times the plain step), and a second one faster than the first replaces it: a stall (a kernel compiled or a
    graph captured on first use, a collection, a busy host) would otherwise price a draft length out of reach
    for many rounds (the warm-up's one round of a length at a batch size may be its only measurement for long),
    while a real change still moves the average, a bounded step at a time."""

    weight: float = 0.25  # of a new measurement
    stale_after: int = 256
    stall_factor: float = 4.0
    first_factor: float = 16.0  # (a round may cost several plain steps: the demo's draft model at batch 8, eight)
    seconds: dict[int, dict[int, float]] = field(default_factory=dict)  # batch bucket -> k -> seconds
    _measured_at: dict[int, dict[int, int]] = field(default_factory=dict)  # bucket -> k -> its count then
    _counts: dict[int, int] = field(default_factory=dict)  # measurements per bucket
    _samples: dict[int, dict[int, int]] = field(default_factory=dict)  # bucket -> k -> its measurements

    def observe(self, batch: int, k: int, seconds: float) -> None:
        bucket = batch_bucket(batch)
        old = self._current(bucket, k)
        samples = self._samples.setdefault(bucket, {})
        if old is None:  # measured afresh
            samples[k] = 0
            if (plain := self._current(bucket, 0)) is not None:
                seconds = min(seconds, self.first_factor * plain)
        elif samples[k] == 1 and seconds < old:
            pass  # the first measurement may have been a stall: a faster second one replaces it
        else:
            seconds = old + self.weight * (min(seconds, self.stall_factor * old) - old)
        self.seconds.setdefault(bucket, {})[k] = seconds
        self._counts[bucket] = count = self._counts.get(bucket, 0) + 1
        self._measured_at.setdefault(bucket, {})[k] = count
        samples[k] += 1

    def get(self, batch: int, k: int) -> float | None:
        return self._current(batch_bucket(batch), k)

    def clear(self) -> None:
        for measured in (self.seconds, self._measured_at, self._counts, self._samples):
            measured.clear()

    def _current(self, bucket: int, k: int) -> float | None:
        """The bucket's seconds for k, unless unmeasured or stale (one lookup: `observe` runs every step)."""
        seconds = self.seconds.get(bucket, {}).get(k)
        if seconds is None or self._counts[bucket] - self._measured_at[bucket][k] > self.stale_after:
            return None
        return seconds

    def confirmed(self, batch: int) -> bool:
        """Was some round length the batch's bucket is priced by (`at`) measured more than once? A first measurement
        may be a stall of up to first_factor plain steps."""
        samples = self._samples.get(batch_bucket(batch), {})
        return any(samples.get(k, 0) > 1 for k in self.at(batch) if k)

    def at(self, batch: int) -> dict[int, float]:
        """Every draft length of the batch's bucket measured lately, with its seconds; and, while no round is, the
        rounds measured before: a stale round gives way to the rounds measured since, never to the drafter's own
        guess. (Where plain steps win, rounds go stale together, and priced from the guess a round would look cheap
        again: a round several plain steps long every stale_after plain steps, each resetting the probe interval and
        waking a sleeping drafter.)"""
        bucket = batch_bucket(batch)
        since, count = self._measured_at.get(bucket, {}), self._counts.get(bucket, 0)
        seconds = self.seconds.get(bucket, {})
        fresh = {k: s for k, s in seconds.items() if count - since[k] <= self.stale_after}
        if not any(fresh.keys() - {0}):
            fresh.update((k, s) for k, s in seconds.items() if k)
        return fresh


@dataclass
class _Probe:
    """Backoff of exploratory rounds while the measured costs say speculation does not pay at a batch bucket."""

    every: int  # the doubling interval, in decisions
    wait: int = 0  # decisions from the last probe to the next one: `every`, stretched by what a round costs
    idle: int = 0
    # The caps, acceptances and drafter estimate k = 0 was last chosen from: while they hold, k = 0 stands without
    # recomputing the grid every step (the measured costs drift meanwhile; the next probe re-decides from them).
    standing: tuple | None = None
    # The requests it stood for, and the decisions since taken without looking (QUIET_DECISIONS)
    ids: tuple = ()
    quiet: int = 0
    drafting: int = 0  # the k of the last decision that drafted (KEEP_MARGIN)
    accepted: int = 0  # the policy's count of accepted drafts when the backoff last restarted
    pooled_pays: bool = False  # where k = 0 stands: would a round pay for requests at the pooled acceptance?


# While k = 0 stands for the same requests, this many decisions in a row return it without reading any request: the
# caps, estimates and their drift cost host work per request on every undrafted step, the whole of a launch-bound
# target's step. (The drift of the skipped steps is applied at the next full decision; none are skipped while an
# estimate lies below the pooled one, as the drift then raises it toward drafting.)
QUIET_DECISIONS = 8
# Without exploring (a sleeping drafter: Speculator), nothing a skipped decision would read can turn k = 0 into a
# round but the batch (which ends the quiet run) or the plain step's cost: full decisions this far apart.
QUIET_DECISIONS_ASLEEP = 64
QUIET_MARGIN = 0.005  # an estimate this far below the pooled one still drifts up: decisions stay full
# A draft length whose expected tokens per second lie this close to the best stays chosen. Among neighbouring k the
# argmax flips with the measured costs' noise alone, and a switch is not free: the first device round of a longer k
# verifies only the drafts of the shorter one before it (DeviceRound.continue_from).
KEEP_MARGIN = 0.03


@dataclass
class DraftPolicy:
    """Draft lengths: request caps, a batch-size cap, and the k that maximises expected tokens per second.

    Expected tokens of a round come from each request's measured acceptance; a round's seconds come from
    `costs` (measured, when `measured`), else from the drafter's own estimate of a draft's cost relative to a
    plain step (`Drafter.step_cost`). k = 0 (a plain step) competes too, so speculation turns itself down or off
    where it does not pay. While it is off, an exploratory round now and then (with a doubling interval, stretched
    by the round's measured cost) re-measures acceptance and cost.

    A request's estimate starts from the prior and the drafter's acceptance over all requests (slowly decayed), and
    drifts back toward the latter on each step the request does not draft: a few unlucky rounds (at alpha 0.7,
    three misses in a row happen every ~40 rounds) would otherwise switch a good request to plain steps until the
    next probe, since plain steps measure no acceptance."""

    n_max: int = DEFAULT_N_MAX  # server default for SamplingParams.spec_n_max (--draft-max)
    n_min: int = 0  # shorter drafts are dropped (--draft-min)
    p_min: float = 0.0  # drafting stops at the first token the drafter gives less than this (--draft-p-min)
    measured: bool = False  # choose k from measured step costs (on by default on CUDA: EngineConfig)
    max_verify_tokens: int = MAX_VERIFY_TOKENS
    max_batch: int = 64  # no drafting above this many decoding requests
    max_draft: int | None = None  # drafts a round may verify whatever the drafter could (a hybrid target's verify rows)
    prior_alpha: float = 0.7  # acceptance assumed before measurements (worth 2 rounds, decaying like them)
    decay: float = 0.9  # weight of the past per round (a request's estimate; its drift per undrafted step: 1 - decay)
    pooled_decay: float = 0.99  # weight of the past per round in the estimate over all requests
    probe_every: int = 32  # first interval (in decisions) of exploratory rounds while k = 0 wins
    probe_max: int = 2048  # the interval doubles after each probe that changes nothing, up to this
    costs: StepCosts = field(default_factory=StepCosts)
    _stats: dict[int, _Acceptance] = field(default_factory=dict, repr=False)
    _pooled: _Acceptance | None = field(default=None, repr=False)  # over all requests' rounds
    _probes: dict[int, _Probe] = field(default_factory=dict, repr=False)
    _accepted: int = field(default=0, repr=False)  # drafts accepted, over all requests
    # batch bucket -> seconds of a sleeping drafter's catch-up before a round (observe_wake; a mean of the last few)
    _wakes: dict[int, float] = field(default_factory=dict, repr=False)

    def draft_lengths(self, requests: Sequence[Request], drafter: Drafter,
                      in_flight: Sequence[int] | None = None, explore: bool = True) -> list[int]:
        """k for each decoding request this step: one k for the batch, capped per request. in_flight[i]: tokens
        request i may still commit beyond its pending one (drafting ahead of a verdict: its drafts). explore=False:
        no exploratory round where k = 0 wins (a sleeping drafter would have to catch up for it: Speculator)."""
        n = len(requests)
        if n > self.max_batch:
            return [0] * n
        bucket = batch_bucket(n)
        probe = self._probes.get(bucket) or self._probes.setdefault(bucket, _Probe(self.probe_every))
        ids = tuple([r.request_id for r in requests])
        if probe.ids == ids and self._quiet(probe, explore):
            return [0] * n
        batch_cap = min(self.max_verify_tokens // max(n, 1) - 1, drafter.max_draft)
        if self.max_draft is not None:
            batch_cap = min(batch_cap, self.max_draft)
        caps = [self._cap(r, batch_cap, extra) for r, extra in zip(requests, in_flight or itertools.repeat(0))]
        if max(caps, default=0) <= 0:
            return [0] * n
        stats = [self._acceptance(r.request_id) for r in requests]
        pooled = _Acceptance.worth_two_rounds(self._pooled.alpha) if self._pooled is not None else None
        if probe.quiet and pooled is not None:  # the drift of the decisions taken without looking, for the requests
            stood = set(probe.ids)  # they stood for (one that joined since lived through none of them)
            self._relax(stats, [c if r.request_id in stood else 0 for r, c in zip(requests, caps)], pooled,
                        1.0 - self.decay ** probe.quiet)
        k = self._batch_length(probe, n, caps, [st.alpha for st in stats], drafter.step_cost, explore)
        # (quiet only where the drift cannot lift an estimate toward drafting: after a few misses a request's
        # estimate climbs back to the pooled one, and the step it pays again should not wait for a full decision)
        lifts = pooled is not None and any(st.alpha < pooled.alpha - QUIET_MARGIN for st, c in zip(stats, caps) if c)
        probe.quiet, probe.ids = 0, () if lifts else ids
        if k == 0 and pooled is not None:
            self._relax(stats, caps, pooled, 1.0 - self.decay)
        return [min(k, c) for c in caps]

    def stands(self, batch: int, explore: bool = True) -> bool:
        """Does k = 0 stand again for the requests of the last decision at this batch size, as one of draft_lengths's
        quiet decisions (and counted as one)? For a caller that knows the requests unchanged without reading them
        (the Speculator's dormant path); False: the next decision must be draft_lengths's own."""
        probe = self._probes.get(batch_bucket(batch))
        return probe is not None and len(probe.ids) == batch and self._quiet(probe, explore)

    @staticmethod
    def _quiet(probe: _Probe, explore: bool) -> bool:
        """k = 0 again for the requests it stands for, without reading them, while their quiet run lasts and
        (exploring) no probe is due: counted, as the decisions it skips count toward the next probe and drift."""
        quiet = QUIET_DECISIONS if explore else QUIET_DECISIONS_ASLEEP
        if probe.standing is None or probe.quiet >= quiet - 1 or (explore and probe.idle + 1 >= probe.wait):
            return False
        probe.quiet += 1
        probe.idle += 1
        return True

    @staticmethod
    def _relax(stats: list[_Acceptance], caps: list[int], pooled: _Acceptance, rate: float) -> None:
        """Undrafted requests' estimates drift toward the pooled one (those that may draft at all)."""
        for st, cap in zip(stats, caps):
            if cap > 0:
                st.relax(pooled, rate)

    def _cap(self, req: Request, cap: int, in_flight: int = 0) -> int:
        p = req.params
        left = req.outputs_left - in_flight
        return max(0, min(cap, p.spec_n_max if p.spec_n_max is not None else self.n_max, left - 1))  # +1 bonus

    def round_seconds(self, batch: int, k, step_cost: float):
        """Seconds of a step with drafts of up to k (k = 0: a plain step). Measured; else estimated from the measured
        rounds. A round is synchronous, so it costs a fixed part (drafting, the verify forward, its host work: on a
        launch- or weight-bound target most of it) and a part per draft. So an unmeasured k lies on the line between
        the measured rounds around it; beyond them, it costs the nearest measured round plus the drafter's own
        estimate per draft (step_cost plain steps). Never on a line through the plain step: that would charge the
        fixed part per draft, and a probe round of one draft would then price every longer one out of reach, unmeasured.
        With no round measured: the drafter's estimate relative to the plain step. A scalar k gives a float; an array
        of them (the policy's grid, every step) an array, computed at once."""
        known = self.costs.at(batch) if self.measured else {}
        k = np.asarray(k, dtype=np.float64)
        plain = known.get(0, 1.0)
        rounds = sorted(n for n in known if n > 0)
        if rounds:
            measured = np.array(rounds, dtype=np.float64)
            cost = np.array([known[n] for n in rounds])
            per_draft = plain * step_cost
            out = np.interp(k, measured, cost)  # measured, or on the line between the measured rounds around k
            out = np.where(k > measured[-1], cost[-1] + per_draft * (k - measured[-1]), out)
            out = np.where(k < measured[0], np.maximum(cost[0] - per_draft * (measured[0] - k), plain), out)
        else:
            out = plain * (1.0 + step_cost * k)
        out = np.where(k == 0, plain, out)
        return float(out) if out.ndim == 0 else out

    def priced_out(self, batch: int) -> bool:
        """Does k = 0 stand at this batch size: chosen from the measured costs by the last full decision, with
        nothing it was chosen from changed since?"""
        probe = self._probes.get(batch_bucket(batch))
        return probe is not None and probe.standing is not None

    def lets_sleep(self, batch: int) -> bool:
        """May a drafter sleep through this batch size's steps (learning nothing until a round catches it up)? Where
        k = 0 stands (priced_out) for requests at the pooled acceptance too, not only at theirs. After a few misses a
        request's estimate dips below the pooled one and drifts back within about 1 / (1 - decay) steps; a drafter
        asleep through that dip would wake for the next round with a catch-up over every row slept through, work
        the costs compared here leave out (Speculator.one_off). On a small target a catch-up costs tens of plain
        steps, and such dips come every few rounds."""
        probe = self._probes.get(batch_bucket(batch))
        return self.priced_out(batch) and not (probe is not None and probe.pooled_pays)

    def _batch_length(self, probe: _Probe, batch: int, caps: list[int], alphas: list[float], step_cost: float,
                      explore: bool) -> int:
        if self.measured and self.costs.get(batch, 0) is None:
            return 0  # a plain step first: every estimate is relative to it

        # (acceptances rounded: drifting toward the pooled estimate, they settle there only to within rounding)
        inputs = (tuple(caps), tuple(round(a, 3) for a in alphas), step_cost)
        if probe.standing != inputs:
            # (this runs on decode steps: one numpy grid over k and requests, not a loop per cell)
            ks = np.arange(max(caps) + 1)
            seconds = self.round_seconds(batch, ks, step_cost)
            rates = _rates(alphas, caps, ks, seconds)
            k = int(np.argmax(rates))  # (the first best, as max() picked)
            if k > 0:
                kept = probe.drafting
                if 0 < kept < len(rates) and rates[kept] >= (1.0 - KEEP_MARGIN) * rates[k]:
                    k = kept
                # (the backoff restarts once a draft was accepted since it began: a round that a new request's
                # prior alone chose, and that then accepted nothing, leaves it doubling, or at alpha = 0 each
                # request would bring back probes every probe_every decisions)
                if self._accepted > probe.accepted:
                    probe.every, probe.accepted = self.probe_every, self._accepted
                probe.idle, probe.standing, probe.drafting = 0, None, k
                return k
            probe.standing = inputs
            pooled = self._pooled.alpha if self._pooled is not None else self.prior_alpha
            probe.pooled_pays = int(np.argmax(_rates([pooled] * len(caps), caps, ks, seconds))) > 0
            wake = 0.0 if probe.pooled_pays else self._wakes.get(batch_bucket(batch), 0.0)
            probe.wait = self._probe_wait(probe.every, batch, seconds, wake)
        probe.idle += 1
        if probe.idle < probe.wait or not explore:
            return 0
        probe.idle, probe.every, probe.standing = 0, min(2 * probe.every, self.probe_max), None
        return 1  # the cheapest round re-measures acceptance and cost

    def _probe_wait(self, every: int, batch: int, seconds: np.ndarray, wake: float) -> int:
        """Decisions before the next exploratory round while k = 0 stands, from the rounds' `seconds` by draft length
        (the grid the decision priced): `every`, times the extra plain steps a round of one draft costs, with the
        `wake` seconds of the catch-up it starts where the drafter sleeps (so exploring takes about 1/every of the
        time, whatever a round costs: on a small target a catch-up costs tens of plain steps, and probing at the
        bare round's interval cost more than the probes could win), and
        probe_max where no round could pay even with every draft accepted (only its cost could change, not
        whether it pays: at large batches a round of one draft can cost several plain steps), as the costs measured
        more than once say: a length's first measurement may be a stall (a round timed while the warm-up compiled
        costs many times a later one, and priced so would hold k = 0 for thousands of decisions)."""
        ks = np.arange(len(seconds))
        if np.all((ks[1:] + 1) / seconds[1:] <= 1.0 / seconds[0]) and self.costs.confirmed(batch):
            return self.probe_max
        return max(every, round(every * ((seconds[1] + wake) / seconds[0] - 1.0)))

    def limits(self, req: Request) -> tuple[float, int]:
        """The request's confidence stop p_min and minimum draft length n_min (its own, else the server's)."""
        p = req.params
        return (p.spec_p_min if p.spec_p_min is not None else self.p_min,
                p.spec_n_min if p.spec_n_min is not None else self.n_min)

    def trims(self, req: Request) -> bool:
        """Could `trim` cut this request's drafts? (Not with p_min 0 and n_min <= 1: then it needs no values.)"""
        p_min, n_min = self.limits(req)
        return p_min > 0.0 or n_min > 1

    def trim(self, requests: Sequence[Request], proposals: Proposals) -> Proposals:
        """Apply each request's confidence stop (p_min) and minimum length (n_min) to fresh proposals."""
        out = Proposals([], [], [] if proposals.probs is not None else None, proposals.kinds)
        for i, req in enumerate(requests):
            p_min, n_min = self.limits(req)
            conf = proposals.confidence[i]
            n = next((j for j, c in enumerate(conf) if c < p_min), len(conf))
            if n < max(n_min, 1):
                n = 0
            out.tokens.append(proposals.tokens[i][:n])
            out.confidence.append(conf[:n])
            if out.probs is not None:
                q = proposals.probs[i]
                out.probs.append(None if q is None or n == 0 else q[:n])
        return out

    def record(self, request_id: int, proposed: int, accepted: int) -> None:
        """One verify round's outcome for a request."""
        if proposed <= 0:
            return
        rejected = 1 if accepted < proposed else 0
        self._accepted += accepted
        self._acceptance(request_id).add(self.decay, accepted, rejected)
        self._pooled = self._pooled or _Acceptance.worth_two_rounds(self.prior_alpha)
        self._pooled.add(self.pooled_decay, accepted, rejected)

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A pure decode step of `batch` sequences with drafts of up to k (0: none) took `seconds`."""
        if self.measured:
            self.costs.observe(batch, k, seconds)

    def observe_wake(self, batch: int, seconds: float) -> None:
        """A sleeping drafter's catch-up before a round at `batch` sequences took `seconds` (Speculator.one_off,
        left out of observe_step's costs): what an exploratory round costs more while the drafter sleeps."""
        if self.measured:
            bucket = batch_bucket(batch)
            last = self._wakes.get(bucket)
            self._wakes[bucket] = seconds if last is None else 0.5 * (last + seconds)

    def release(self, request_id: int) -> None:
        self._stats.pop(request_id, None)

    @property
    def probes(self) -> dict:
        """Each batch bucket's probe state (exploratory rounds while k = 0 stands), as a copy."""
        return dict(self._probes)

    def forget_acceptance(self) -> None:
        """Drop what rounds so far said of acceptance (warm-up traffic: synthetic prompts)."""
        self._stats, self._pooled = {}, None

    def forget_costs(self) -> None:
        """Drop the measured step costs (steps that compiled their kernels: priced from those, no round would be tried,
        or measured, again for hundreds of decisions)."""
        self.costs.clear()
        self._wakes.clear()

    def _acceptance(self, request_id: int) -> _Acceptance:
        """The request's decayed counts; a new one starts fresh (`_fresh`)."""
        if request_id not in self._stats:
            self._stats[request_id] = self._fresh()
        return self._stats[request_id]

    def _fresh(self) -> _Acceptance:
        """What a request knows before its own rounds, worth two rounds: one of the prior, one of the pooled
        acceptance (the prior again until any round). The prior's half keeps a new request trying a round or two
        where earlier ones were not accepted, as it is not measured otherwise."""
        pooled = self._pooled.alpha if self._pooled is not None else self.prior_alpha
        return _Acceptance.worth_two_rounds((self.prior_alpha + pooled) / 2)


def greedy_drafts(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax drafts and their probabilities from drafter logits [N, V'] (columns past the target's vocab,
    e.g. padding rows of a draft model, are never proposed)."""
    return ops.argmax_confidence(logits[:, :vocab_size])


@dataclass(frozen=True)
class StagedDrafts:
    """Argmax drafts still on the device, one request's after another: ids and conf [sum counts]; counts[i] drafts
    for request i (known on the host without a sync)."""

    ids: torch.Tensor
    conf: torch.Tensor
    counts: list[int]

    def to_host(self) -> Proposals:
        """The drafts as Proposals, in one host synchronisation."""
        out = Proposals([[] for _ in self.counts], [[] for _ in self.counts])
        total = sum(self.counts)
        if not total:
            return out
        host = torch.cat([self.ids.double(), self.conf.double()]).tolist()
        at = 0
        for i, c in enumerate(self.counts):
            out.tokens[i] = [int(t) for t in host[at : at + c]]
            out.confidence[i] = host[total + at : total + at + c]
            at += c
        return out


def stage_drafts(owners: list[int], tokens: list[torch.Tensor], conf: list[torch.Tensor], n: int) -> StagedDrafts:
    """Drafts still on the device -> StagedDrafts for n requests, without a host sync. The concatenated `tokens`
    and `conf` list drafts in order; owners[j] is the index of the request draft j belongs to (a chain lists each
    step's drafts in turn: they are regrouped by request, in order)."""
    counts = [0] * n
    for i in owners:
        counts[i] += 1
    if not owners:
        empty = torch.empty(0, dtype=torch.int64)
        return StagedDrafts(empty, empty.double(), counts)
    ids, cf = torch.cat(tokens), torch.cat(conf)
    order = sorted(range(len(owners)), key=owners.__getitem__)  # (stable: a request's drafts keep their order)
    if order != list(range(len(owners))):
        index = torch.tensor(order, dtype=torch.int64).to(ids.device, non_blocking=True)
        ids, cf = ids.index_select(0, index), cf.index_select(0, index)
    return StagedDrafts(ids, cf, counts)


PENDING = -1  # a draft token still on the device, in a plan's draft list: PendingDrafts holds its value


@dataclass(frozen=True)
class PendingDrafts:
    """A step's drafts that stayed on the device (Drafter.stage): the ids, and each drafting request's first index
    in them. The plan's draft lists hold PENDING until the verify step reads the values, in the one host sync it
    makes anyway; whatever needs them earlier (grammar masks or penalty windows over drafts, the general
    acceptance path) reads them first (`fill`)."""

    ids: torch.Tensor
    offsets: dict[int, int]  # request id -> its first draft's index in ids

    def sources(self, request_ids: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[int | None]:
        """Per row: the index of its first pending draft in ids, or None (no drafts, or drafts on the host)."""
        return [self.offsets.get(rid) if d else None for rid, d in zip(request_ids, drafts)]

    def fill(self, drafts: Sequence[list[int]], sources: Sequence[int | None], host: list[int] | None = None) -> None:
        """Write the drafts' values into the rows' lists, from `host` (ids already read) or with a sync now."""
        if all(src is None for src in sources):
            return
        host = self.ids.tolist() if host is None else host
        for d, src in zip(drafts, sources):
            if src is not None:
                d[:] = host[src : src + len(d)]
