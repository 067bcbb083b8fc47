"""`--context-shift` by recomputation: a request that fills its slot's context goes on as a continuation request
whose prompt is its tokens less a discarded span, by llama-server's rule: when the cache holds n_ctx - 1 tokens
(the last sampled token not yet in it), the first `n_keep` tokens stay (the request's field, -1 for the whole
prompt; plus one for the BOS when the tokenizer adds one; at most n_ctx - 4), then `n_discard` go (the request's
field, 0 for half of the cached tokens after the kept ones; at most all of them), and the continuation recomputes
the remainder and generates on. It shares the request's timing record, so the recomputation counts as a
stall inside `predicted_ms` (as a preemption after the first token does) and `predicted_n` keeps counting; replies
say `truncated: true`. A grammar-bound request is not shifted (its grammar state would restart): it ends at the
context, as without the flag."""

from __future__ import annotations

import dataclasses
import weakref

from outrider.engine.request import Request

# continuations made here -> the prompt length of the request they continue (what n_keep -1 keeps)
_SHIFTED: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()


def continuation(req: Request, add_bos: bool) -> Request | None:
    """The request that goes on from `req`, which filled its context (all its tokens: n_ctx), with the context
    shifted; None when it cannot be."""
    ids, p = req.all_ids, req.params
    n_ctx = len(ids)
    n_prompt = _SHIFTED.get(req, req.num_prompt)
    n_keep = max(0, min(n_ctx - 4, (n_prompt if p.n_keep < 0 else p.n_keep) + add_bos))  # (-1: the prompt, BOS too)
    n_left = n_ctx - 1 - n_keep  # cached tokens after the kept ones
    n_discard = min(p.n_discard or n_left // 2, n_left)
    if p.grammar is not None or n_discard <= 0:
        return None
    params = dataclasses.replace(p, max_tokens=p.max_tokens - len(req.output_ids) if p.max_tokens >= 0 else -1,
                                 min_tokens=max(0, p.min_tokens - len(req.output_ids)))
    nxt = Request(prompt_ids=ids[:n_keep] + ids[n_keep + n_discard:], params=params, slot_wanted=req.slot_wanted,
                  timing=req.timing)
    _SHIFTED[nxt] = n_prompt
    return nxt


def shifted(req: Request) -> bool:
    """Whether `req` continues a request whose context was shifted."""
    return req in _SHIFTED
