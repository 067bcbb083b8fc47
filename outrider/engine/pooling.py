"""Embeddings from the prefill (`--embedding`): a request with SamplingParams.pooling has its prompt's final hidden
states (after the model's last norm, as transformers' `last_hidden_state`) pooled while its prefill runs:

- mean: the average over every prompt token; cls: the first token's; last: the last token's;
- none: every token's row.

`capture` enqueues each chunk's part right after the step's forward (a sum of rows for mean, one row for cls and
last, the rows for none); `deliver` brings it to the host when the step is collected. A request pooling reads no
cached prefix (KVCacheManager.match_prefix), so its prefill always starts at position 0, which is where a prefill
recomputed after a preemption restarts the pooling too.
"""

from __future__ import annotations

import torch

from outrider.engine.request import Pooled
from outrider.steps import PendingPool, StepPlan

MODES = ("mean", "cls", "last", "none")


def capture(plan: StepPlan, hidden: torch.Tensor, model: torch.nn.Module) -> list[PendingPool]:
    if not plan.prompt_rows or all(s.request.params.pooling is None for s in plan.scheduled):  # (the usual step)
        return []
    pending: list[PendingPool] = []
    row = 0
    for s in plan.scheduled:
        req, mode = s.request, s.request.params.pooling
        start, end = s.start, min(s.start + s.num_new_tokens, req.num_prompt)
        if mode is not None and end > start:
            normed = model.model.norm(hidden[row : row + end - start]).float()
            if mode == "mean":
                part = normed.sum(0, keepdim=True)
            elif mode == "cls":
                part = normed[:1] if start == 0 else normed[:0]
            elif mode == "last":
                part = normed[-1:] if end == req.num_prompt else normed[:0]
            else:
                part = normed
            pending.append(PendingPool(req, start == 0, part, end - start))
        row += s.num_query_tokens
    return pending


def deliver(pending: list[PendingPool]) -> None:
    for p in pending:
        req = p.request
        if req.pooled is None or p.restart:
            req.pooled = Pooled(req.params.pooling)
        req.pooled.rows.append(p.rows.cpu())
        req.pooled.count += p.count
