"""Prompt log-probabilities (OpenAI `echo` + `logprobs`, vLLM's `prompt_logprobs`), computed during the prefill,
only for the requests that ask (SamplingParams.prompt_logprobs).

A prefill chunk's hidden rows predict the prompt's next tokens: the row at position p gives the log-probability of
prompt token p + 1 (the first prompt token has none). `capture` enqueues, right after a step's forward, the LM head
over those rows a few at a time (never a [prompt, vocab] tensor at once), keeping only each row's target
log-probability and its top-n; `deliver` brings them to the host when the step is collected and files them by
position, so a prefill recomputed after a preemption writes the same entries again. A request asking for them
reads no cached prefix (SamplingParams.reads_every_prompt_row): what a prefix hit would skip is computed again, so every
prompt row is there.
"""

from __future__ import annotations

import torch

from outrider.engine.request import PromptLogprob
from outrider.steps import PendingRows, StepPlan

CHUNK_ROWS = 128  # LM-head rows per pass: [CHUNK_ROWS, vocab] float32 at most


def capture(plan: StepPlan, hidden: torch.Tensor, model: torch.nn.Module) -> list[PendingRows]:
    """Enqueue the prompt log-probs of this step's prefill rows (`hidden`: the step's [T, H] rows, in plan order)."""
    pending: list[PendingRows] = []
    row = 0
    for s in plan.scheduled:
        req, n = s.request, s.num_new_tokens
        top = req.params.prompt_logprobs
        start, end = s.start, min(s.start + n, req.num_prompt - 1)  # rows that predict a prompt token
        if top is not None and end > start:
            targets = torch.tensor(req.prompt_ids[start + 1 : end + 1], device=hidden.device)
            k = max(top, 1)
            parts = [_rows(model, hidden[row + a - start : row + min(a + CHUNK_ROWS, end) - start],
                           targets[a - start : min(a + CHUNK_ROWS, end) - start], k)
                     for a in range(start, end, CHUNK_ROWS)]
            pending.append(PendingRows(req, start + 1, *(torch.cat(p) for p in zip(*parts))))
        row += s.num_query_tokens
    return pending


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
