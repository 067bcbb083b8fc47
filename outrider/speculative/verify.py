"""The acceptance math of speculative decoding, over a ragged batch, in one place.

Row i verifies drafts d_1..d_k (k may be 0) with k+1 target positions: position j holds the target's
distribution for the slot d_{j+1} occupies, position k is the bonus slot. p is the PROCESSED target
distribution (Sampler.processed: bias, penalties, filters, temperature), q the distribution the drafter really
drew each d from (one-hot when it took an argmax; passing a softmax for an argmax draft biases the output).

    accept d_j with probability min(1, p(d_j) / q(d_j)), left to right;
    at the first rejection emit a draw from normalize(max(p - q, 0)) and stop;
    when all k are accepted emit a draw from p at the bonus slot.

The emitted tokens follow p exactly (Leviathan et al. 2023). At temperature 0, p is one-hot at the argmax, so
the same formulas are the greedy rule: accept while d_j == argmax, then emit the argmax. A batch whose rows are
all greedy and whose drafts are all argmax ones (q one-hot) takes that rule directly (`_verify_greedy`): the
argmax after bias, penalties and grammar (Sampler.greedy) and a comparison on the host, a handful of kernels
where the general path launches about forty; a property test holds the two to the same verdicts. All randomness
is counter-based (Sampler streams keyed by seed and output index), so seeded rows stay reproducible.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.sampler import (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, Sampler, SampleOutput,
                                     SamplingBatch)
from outrider.speculative.drafter import PendingDrafts


@dataclass
class Verdict:
    num_accepted: list[int]  # m_i: accepted drafts per row
    tokens: list[list[int]]  # the m_i + 1 tokens each row commits
    output: SampleOutput  # per position: the token emitted there, and its n_probs log-probs when asked
    starts: list[int]  # first position of each row in `output`; row i commits positions starts[i]..+m_i


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised distribution of the token emitted after a rejection."""
    return (p - q).clamp_min(0.0)


def verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[list[int]],
           draft_probs: Sequence[torch.Tensor | None] | None = None, pending: PendingDrafts | None = None,
           sources: Sequence[int | None] = ()) -> Verdict:
    """Accept or reject every row's drafts. logits [T, V] and `batch` cover the T = sum(k_i + 1) positions, rows
    one after another; position j of row i is sampled as output index len(outputs) + j after drafts[:j]
    (ModelRunner.row_specs). draft_probs[i] is row i's q as [k_i, V] (None: one-hot at the draft). Rows whose
    drafts stayed on the device (`pending`, at `sources[i]`) hold placeholders: their values are read in the
    verdict's sync and written into `drafts`."""
    lens = [len(d) + 1 for d in drafts]
    starts = list(itertools.accumulate(lens, initial=0))[:-1]
    if batch.all_greedy and (draft_probs is None or all(q is None for q in draft_probs)):
        return _verify_greedy(sampler, logits, batch, drafts, starts, pending, sources)
    if pending is not None:  # (the general path builds its draft tensor from the host lists)
        pending.fill(drafts, sources)
    device = logits.device
    flat = [t for d in drafts for t in (*d, -1)]  # -1 marks each row's bonus slot
    draft = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
    is_draft = draft >= 0

    proc = sampler.processed(logits, batch)
    p = proc.logp.exp()  # [T, W] over the candidate ids
    hit = proc.ids == draft[:, None]
    q = hit.to(p.dtype)  # one-hot drafts: q = 1 on the drafted token
    q_draft = torch.ones_like(p[:, 0])
    if draft_probs is not None and any(x is not None for x in draft_probs):
        q_full, has_q = _stack_probs(draft_probs, lens, logits.shape[-1], device)
        q = torch.where(has_q[:, None], q_full.gather(1, proc.ids), q)
        q_draft = torch.where(has_q, q_full.gather(1, draft.clamp_min(0)[:, None])[:, 0], q_draft)

    p_draft = (p * hit).sum(-1)
    u = sampler.uniform(batch, STREAM_ACCEPT)
    accept = is_draft & (u * q_draft < p_draft)  # u < p/q without dividing by q

    plain = sampler.gumbel_argmax(proc.logp, proc.ids, batch, STREAM_SAMPLE)  # what a plain step would draw
    r = residual(p, q)
    fixed = sampler.gumbel_argmax(r.log(), proc.ids, batch, STREAM_RESIDUAL)
    # p == q up to rounding leaves no residual mass; then acceptance was ~certain and p itself is the answer.
    fixed = torch.where(r.sum(-1) > 0, fixed, plain)
    emitted = torch.where(accept, draft, torch.where(is_draft, fixed, plain))

    # Accepted count per row = leading run of accepts; the bonus slot never accepts, so m_i <= k_i.
    rows = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)]).to(device, non_blocking=True)
    cols = torch.tensor([j for n in lens for j in range(n)]).to(device, non_blocking=True)
    grid = torch.zeros(len(lens), max(lens, default=1), dtype=torch.int64, device=device)
    grid.index_put_((rows, cols), accept.to(torch.int64))
    accepted = grid.cumprod(dim=1).sum(dim=1)

    output = sampler.with_logprobs(SampleOutput(emitted), proc.adjusted, batch)
    host = torch.cat([accepted, emitted]).tolist()  # the one host synchronisation
    m, em = host[: len(lens)], host[len(lens) :]
    return Verdict(m, [em[s : s + k + 1] for s, k in zip(starts, m)], output, starts)


def _verify_greedy(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[list[int]],
                   starts: list[int], pending: PendingDrafts | None, sources: Sequence[int | None]) -> Verdict:
    """Every row greedy, every q one-hot: p is one-hot at the argmax, so d_j is accepted iff it is the argmax, and
    every emitted token, accepted or not, is the argmax at its position."""
    output = sampler.greedy(logits, batch)
    if pending is None:
        best = output.token_ids.tolist()  # the one host synchronisation
    else:  # the drafts that stayed on the device come back in the same one
        host = torch.cat([output.token_ids, pending.ids.to(output.token_ids.dtype)]).tolist()
        best = host[: len(output.token_ids)]
        pending.fill(drafts, sources, host[len(output.token_ids) :])
    m = [next((j for j, d in enumerate(ds) if d != best[s + j]), len(ds)) for ds, s in zip(drafts, starts)]
    return Verdict(m, [best[s : s + k + 1] for s, k in zip(starts, m)], output, starts)


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
