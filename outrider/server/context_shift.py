"""`--context-shift` by recomputation: a request that fills its slot's context goes on as a continuation request
whose prompt is its tokens less a discarded span, as llama-server shifts its KV cache: the first `n_keep` tokens
stay (the BOS, when the tokenizer adds one), then half of the rest (`n_discard`) goes, and the continuation
recomputes the remainder and generates on. It shares the request's timing record, so the recomputation counts as a
stall inside `predicted_ms` (as a preemption after the first token does) and `predicted_n` keeps counting; replies
say `truncated: true`. A grammar-bound request is not shifted (its grammar state would restart): it ends at the
context, as without the flag."""

from __future__ import annotations

import dataclasses
import weakref

from outrider.engine.request import Request

_SHIFTED: weakref.WeakSet[Request] = weakref.WeakSet()  # continuations made here


def continuation(req: Request, n_keep: int) -> Request | None:
    """The request that goes on from `req` with its context shifted, None when it cannot be."""
    ids = req.all_ids
    n_discard = (len(ids) - n_keep) // 2
    if req.params.grammar is not None or n_discard <= 0:
        return None
    p = req.params
    params = dataclasses.replace(p, max_tokens=p.max_tokens - len(req.output_ids) if p.max_tokens >= 0 else -1,
                                 min_tokens=max(0, p.min_tokens - len(req.output_ids)))
    nxt = Request(prompt_ids=ids[:n_keep] + ids[n_keep + n_discard:], params=params, slot_wanted=req.slot_wanted,
                  timing=req.timing)
    _SHIFTED.add(nxt)
    return nxt


def shifted(req: Request) -> bool:
    """Whether `req` continues a request whose context was shifted."""
    return req in _SHIFTED
