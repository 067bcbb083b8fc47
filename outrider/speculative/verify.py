"""The acceptance math of speculative decoding, over a ragged batch, in one place.

Row i verifies drafts d_1..d_k (k may be 0) with k+1 target positions: position j holds the target's
distribution for the slot d_{j+1} occupies, position k is the bonus slot. p is the PROCESSED target
distribution (Sampler.processed: bias, penalties, DRY, filters, XTC, temperature).

Drafts that were argmax picks (every drafter's), sample and compare, as llama-server does: at each position
draw the target's token x_j from p with the noise a plain step draws with for that output index (Sampler stream
0, keyed by seed and output index); accept d_j while d_j == x_j; emit x_j at the first mismatch (and at the bonus
slot). Every emitted token is the token the plain path draws at its position, so a seeded request gives the
same tokens with or without a drafter, at any temperature. It is also rejection sampling's rule for q one-hot at
d: d_j is accepted with probability p(d_j) = min(1, p/q), and a rejected position emits x ~ p given x != d_j,
which is normalize(max(p - q, 0)); so the emitted tokens follow p exactly, and accept as often.

Drafts that came with their distribution q (draft_probs: a drafter that sampled) take the general rule
(Leviathan et al. 2023) on their own streams:

    accept d_j with probability min(1, p(d_j) / q(d_j)), left to right;
    at the first rejection emit a draw from normalize(max(p - q, 0)) and stop;
    when all k are accepted emit a draw from p at the bonus slot.

At temperature 0, p is one-hot at the argmax, so both rules are the greedy one: accept while d_j == argmax, then
emit the argmax. A batch whose rows are all greedy and whose drafts are all argmax ones takes that rule directly:
the argmax after bias, penalties and grammar (Sampler.greedy) and a comparison on the host (on the device when
the drafter drafts its next round before the host reads this one), a handful of kernels where the general path
launches about forty; a property test holds the two to the same verdicts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from outrider.sampler import (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, Processed, Sampler, SampleOutput,
                              SamplingBatch)
from outrider.speculative.drafter import PendingDrafts
from outrider.upload import copy_to_host, to_device


@dataclass
class Verdict:
    num_accepted: list[int]  # m_i: accepted drafts per row
    tokens: list[list[int]]  # the m_i + 1 tokens each row commits
    output: SampleOutput  # per position: the token emitted there, and its n_probs log-probs when asked
    starts: list[int]  # first position of each row in `output`; row i commits positions starts[i]..+m_i


@dataclass
class PendingVerdict:
    """A verdict decided on the device and not read yet. Its host copy starts when it is enqueued, behind an event,
    so `settle` (the round's one host synchronisation) waits for the verdict alone, not for device work enqueued
    after it (the drafter's next round: Speculator.draft_ahead reads `emitted` and `accepted` on the device)."""

    emitted: torch.Tensor  # [T] the token each position emits: its draft when accepted, else a correction or bonus
    accepted: torch.Tensor | None  # [R] m_i on the device (asked for, or the general path); None: counted on the host
    output: SampleOutput
    starts: list[int]
    drafts: Sequence[list[int]]
    pending: PendingDrafts | None
    sources: Sequence[int | None]
    host: torch.Tensor  # [accepted (when on the device)] + emitted + the pending drafts' ids, copied to the host
    ready: torch.cuda.Event | None

    def settle(self) -> Verdict:
        """Read the verdict (waiting for its copy only) and fill the rows' pending drafts with their values."""
        if self.ready is not None:
            self.ready.synchronize()
        host = self.host.tolist()
        rows, total = len(self.drafts), self.emitted.shape[0]
        m = host[:rows] if self.accepted is not None else None
        emitted = host[rows:] if m is not None else host
        if self.pending is not None:
            self.pending.fill(self.drafts, self.sources, emitted[total:])
        if m is None:  # (greedy: a draft is accepted iff it is the argmax at its position)
            m = [next((j for j, d in enumerate(ds) if d != emitted[s + j]), len(ds))
                 for ds, s in zip(self.drafts, self.starts)]
        return Verdict(m, [emitted[s : s + k + 1] for s, k in zip(self.starts, m)], self.output, self.starts)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised distribution of the token emitted after a rejection."""
    return (p - q).clamp_min(0.0)


def verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[list[int]],
           draft_probs: Sequence[torch.Tensor | None] | None = None, pending: PendingDrafts | None = None,
           sources: Sequence[int | None] = (), accepted_on_device: bool = False) -> PendingVerdict:
    """Accept or reject every row's drafts, on the device. logits [T, V] and `batch` cover the T = sum(k_i + 1)
    positions, rows one after another; position j of row i is sampled as output index len(outputs) + j after
    drafts[:j] (ModelRunner.row_specs). draft_probs[i] is row i's q as [k_i, V] (None: one-hot at the draft). Rows
    whose drafts stayed on the device (`pending`, at `sources[i]`) hold placeholders: their values are read with
    the verdict and written into `drafts`. accepted_on_device: count m_i on the device even on the greedy path
    (which otherwise counts them on the host, after the one copy)."""
    lens = [len(d) + 1 for d in drafts]
    starts = list(itertools.accumulate(lens, initial=0))[:-1]
    greedy = batch.all_greedy and (draft_probs is None or all(q is None for q in draft_probs))
    device = logits.device
    draft = layout = None
    if not greedy or accepted_on_device:
        draft, layout = _draft_tensor(drafts, lens, pending, sources, device)
    if greedy:
        # p is one-hot at the argmax: d_j is accepted iff it is the argmax, and every emitted token, accepted or
        # not, is the argmax at its position (after bias, penalties and grammar: Sampler.greedy).
        output = sampler.greedy(logits, batch)
        emitted = output.token_ids
        accepted = _leading_run(draft == emitted, layout, len(lens)) if draft is not None else None
    else:
        emitted, accepted, output = _verify_sampled(sampler, logits, batch, lens, draft_probs, draft, layout)
    parts = ([accepted] if accepted is not None else []) + [emitted]
    if pending is not None:
        parts.append(pending.ids.to(emitted.dtype))
    (host,), ready = copy_to_host(torch.cat(parts))
    return PendingVerdict(emitted, accepted, output, starts, drafts, pending, sources, host, ready)


def _verify_sampled(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, lens: list[int],
                    draft_probs: Sequence[torch.Tensor | None] | None, draft: torch.Tensor,
                    layout: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, SampleOutput]:
    """Sample and compare, or the general rule where a draft came with its q (module docstring):
    (emitted [T], m [R], the output with log-probs)."""
    is_draft = draft >= 0
    proc = sampler.processed(logits, batch)
    plain = sampler.gumbel_argmax(proc.logp, proc.ids, batch, STREAM_SAMPLE)  # what a plain step draws here
    accept = is_draft & (plain == draft)
    emitted = plain
    if draft_probs is not None and any(x is not None for x in draft_probs):
        q_full, has_q = _stack_probs(draft_probs, lens, logits.shape[-1], logits.device)
        by_q, fixed = _rejection(sampler, batch, proc, draft, q_full, plain)
        accept = torch.where(has_q, is_draft & by_q, accept)
        emitted = torch.where(has_q, torch.where(accept, draft, torch.where(is_draft, fixed, plain)), emitted)
    output = sampler.with_logprobs(SampleOutput(emitted), proc.adjusted, batch)
    return emitted, _leading_run(accept, layout, len(lens)), output


def _rejection(sampler: Sampler, batch: SamplingBatch, proc: Processed, draft: torch.Tensor, q_full: torch.Tensor,
               plain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling against q [T, V]: (accepted [T], the token a rejected position emits [T])."""
    p = proc.logp.exp()  # [T, W] over the candidate ids
    p_draft = (p * (proc.ids == draft[:, None])).sum(-1)
    q_draft = q_full.gather(1, draft.clamp_min(0)[:, None])[:, 0]
    accept = sampler.uniform(batch, STREAM_ACCEPT) * q_draft < p_draft  # u < p/q without dividing by q
    r = residual(p, q_full.gather(1, proc.ids))
    fixed = sampler.gumbel_argmax(r.log(), proc.ids, batch, STREAM_RESIDUAL)
    # p == q up to rounding leaves no residual mass; then acceptance was ~certain and p itself is the answer.
    return accept, torch.where(r.sum(-1) > 0, fixed, plain)


def _draft_tensor(drafts: Sequence[list[int]], lens: list[int], pending: PendingDrafts | None,
                  sources: Sequence[int | None], device: torch.device) -> tuple[torch.Tensor, tuple]:
    """Every position's draft on the device ([T]: d_{j+1} at position j, -1 at each row's bonus slot), the drafts
    that stayed on the device copied in there; and the positions' (row, column) layout for `_leading_run`."""
    flat = [t for d in drafts for t in (*d, -1)]
    rows = [i for i, n in enumerate(lens) for _ in range(n)]
    cols = [j for n in lens for j in range(n)]
    dst, src = [], []
    if pending is not None:
        for i, (first, start) in enumerate(zip(sources, itertools.accumulate(lens, initial=0))):
            if first is not None:
                dst.extend(range(start, start + lens[i] - 1))
                src.extend(range(first, first + lens[i] - 1))
    parts = [(flat, np.int64), (rows, np.int64), (cols, np.int64)] + ([(dst, np.int64), (src, np.int64)] if dst else [])
    dev = to_device(parts, device)
    draft = dev[0]
    if dst:
        draft.index_copy_(0, dev[3], pending.ids.to(draft.dtype).index_select(0, dev[4]))
    return draft, (dev[1], dev[2], max(lens, default=1))


def _leading_run(accept: torch.Tensor, layout: tuple[torch.Tensor, torch.Tensor, int], num_rows: int) -> torch.Tensor:
    """m_i: each row's leading run of accepted positions (its bonus slot never accepts, so m_i <= k_i)."""
    rows, cols, width = layout
    grid = torch.zeros(num_rows, width, dtype=torch.int64, device=accept.device)
    grid.index_put_((rows, cols), accept.to(torch.int64))
    return grid.cumprod(dim=1).sum(dim=1)
def _stack_probs(draft_probs: Sequence[torch.Tensor | None], lens: list[int], vocab: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """q for every position as [T, V] (zeros where a row gave none) and which positions have one."""
    q = torch.zeros(sum(lens), vocab, device=device)
    has = torch.zeros(sum(lens), dtype=torch.bool, device=device)
    start = 0
    for probs, n in zip(draft_probs, lens):
        if probs is not None and n > 1:
            q[start : start + n - 1] = probs[: n - 1, :vocab].to(device=device, dtype=q.dtype)
            has[start : start + n - 1] = True
        start += n
    return q, has
