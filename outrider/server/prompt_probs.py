"""Prompt log-probs as the completions route renders them: entries of the echoed prompt in the `logprobs` object
(the first one null: nothing predicts it), and vLLM's `prompt_logprobs` list."""

from __future__ import annotations

import math
from typing import Any

from outrider.engine.request import PromptLogprob
from outrider.server.render import token_probs
from outrider.tokenizer import Tokenizer

MAX_PROMPT_LOGPROBS = 20  # top-n per prompt token, as vLLM's default max_logprobs


def prompt_entry(tok: Tokenizer, token_id: int, lp: PromptLogprob | None, n_top: int) -> dict[str, Any]:
    """A prompt token's entry in the `content` shape of generated tokens (render.token_probs)."""
    if lp is not None:
        return token_probs(tok, [lp], n_top)[0]
    raw = tok.token_bytes(token_id)
    return {"id": token_id, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": None,
            "top_logprobs": []}


def vllm_prompt_logprobs(tok: Tokenizer, ids: list[int], lps: list[PromptLogprob | None],
                         n_top: int) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt's own token first, then the top-n."""
    out: list[dict[str, dict] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): _vllm(tok, lp.token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(lp.top[:n_top], start=1):
            entry.setdefault(str(t), _vllm(tok, t, v, rank))
        out.append(entry)
    return out


def _vllm(tok: Tokenizer, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob if math.isfinite(logprob) else None, "rank": rank,
            "decoded_token": tok.decode_one(token_id)}
