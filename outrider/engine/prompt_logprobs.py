"""Prompt log-probabilities (OpenAI `echo` + `logprobs`, vLLM's `prompt_logprobs`), computed during the prefill,
only for the requests that ask (SamplingParams.prompt_logprobs).

A prefill chunk's hidden rows predict the prompt's next tokens: the row at position p gives the log-probability of
prompt token p + 1 (the first prompt token has none). `capture` enqueues, right after a step's forward, the LM head
over those rows a few at a time (never a [prompt, vocab] tensor at once), keeping only each row's target
log-probability and its top-n; `deliver` brings them to the host when the step is collected and files them by
position, so a prefill recomputed after a preemption writes the same entries again.

A request asking for them still reuses a cached prefix (its K/V, and `cache_n` in its timings): the step that admits
it recomputes the hidden rows of the cached positions with forwards that read the cache and write nothing to it
(ModelRunner.hidden_rows), CHUNK_ROWS positions at a time, and takes their log-probs as it does a prefill chunk's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from outrider.engine.request import PromptLogprob, Request
from outrider.steps import PendingRows, StepPlan

CHUNK_ROWS = 128  # LM-head rows per pass ([CHUNK_ROWS, vocab] float32 at most), and cached rows per recompute forward

# (request, start, count) -> the [count, H] hidden rows of its committed positions start.., recomputed
HiddenRows = Callable[[Request, int, int], torch.Tensor]


def capture(plan: StepPlan, hidden: torch.Tensor, model: torch.nn.Module,
            hidden_rows: HiddenRows) -> list[PendingRows]:
    """Enqueue the prompt log-probs of this step's prefill rows (`hidden`: the step's [T, H] rows, in plan order),
    and of the cached prefix of each asking request the step admits (recomputed through `hidden_rows`)."""
    if not plan.prompt_rows or all(s.request.params.prompt_logprobs is None for s in plan.scheduled):  # (the usual step)
        return []
    pending: list[PendingRows] = []
    row = 0
    for s in plan.scheduled:
        req, n = s.request, s.num_new_tokens
        top = req.params.prompt_logprobs
        start, end = s.start, min(s.start + n, req.num_prompt - 1)  # rows that predict a prompt token
        if top is not None and start > 0 and any(r is req for r in plan.admitted):  # a prefix-cache hit
            for a in range(0, start, CHUNK_ROWS):
                count = min(CHUNK_ROWS, start - a)
                pending.append(_pending(model, req, hidden_rows(req, a, count), a, a + count))
        if top is not None and end > start:
            pending.append(_pending(model, req, hidden[row : row + end - start], start, end))
        row += s.num_query_tokens
    return pending


def _pending(model: torch.nn.Module, req: Request, hidden: torch.Tensor, start: int, end: int) -> PendingRows:
    """The log-probs of the prompt tokens start+1..end from the hidden rows of positions start..end-1."""
    targets = torch.tensor(req.prompt_ids[start + 1 : end + 1], device=hidden.device)
    k = max(req.params.prompt_logprobs, 1)
    parts = [_rows(model, hidden[a - start : min(a + CHUNK_ROWS, end) - start],
                   targets[a - start : min(a + CHUNK_ROWS, end) - start], k)
             for a in range(start, end, CHUNK_ROWS)]
    return PendingRows(req, start + 1, *(torch.cat(p) for p in zip(*parts)))


def _rows(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, k: int):
    logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    target = logprobs.gather(1, targets[:, None])
    return target[:, 0], (logprobs > target).sum(dim=-1) + 1, values, ids


def deliver(pending: list[PendingRows]) -> None:
    """Bring captured rows to the host (a synchronisation) and file them in each request's `prompt_logprobs`."""
    for p in pending:
        req = p.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt
        top = req.params.prompt_logprobs
        rows = zip(p.logprobs.tolist(), p.ranks.tolist(), p.top_values.tolist(), p.top_ids.tolist())
        for j, (lp, rank, values, ids) in enumerate(rows):
            pos = p.first + j
            req.prompt_logprobs[pos] = PromptLogprob(req.prompt_ids[pos], lp, rank, list(zip(ids[:top], values[:top])))
