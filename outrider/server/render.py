"""Response pieces several routes share: JSON bodies, generation_settings, token probabilities."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import Response

from outrider.config import EngineConfig
from outrider.engine.request import TokenLogprob
from outrider.params import SamplingParams
from outrider.request_fields import CHAIN, FIELDS
from outrider.speculative.kinds import KINDS as DRAFTER_KINDS
from outrider.timing import RequestTiming
from outrider.tokenizer import Tokenizer

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # what llama-server shows for "random seed"
SAMPLERS = list(CHAIN)  # our fixed chain (sampler.py), in llama-server's sampler names
# Our drafter kinds by llama-server's --spec-type names: `speculative.types` is a comma-joined string of these
# ("none" without a drafter), which clients compare and split as a string.
SPEC_TYPE_NAMES = {k.name: k.llama_name for k in DRAFTER_KINDS}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class JSON(Response):
    """Compact UTF-8 JSON, as llama-server writes it."""

    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode()


def timings_fields(timing: RequestTiming) -> dict[str, Any]:
    """`timings`, and beside it `draft_kind` (an outrider extension) once the request drafted: clients read
    `timings` as a map of numbers."""
    fields: dict[str, Any] = {"timings": timing.to_timings()}
    if timing.draft_n > 0:
        fields["draft_kind"] = timing.draft_kind
    return fields


def generation_settings(params: SamplingParams, engine: EngineConfig, seed: int | None = None, *,
                        stream: bool = False, timings_per_token: bool = False, post_sampling_probs: bool = False,
                        drafter_kind: str | None = None, eog_ids: frozenset[int] = frozenset()) -> dict[str, Any]:
    """llama-server's task params object; features we lack are shown at their "off" values. With ignore_eos the
    end-of-generation ids are listed in `logit_bias` at -inf (null), as llama-server bans them."""
    if seed is None:
        seed = params.seed if params.seed is not None else (engine.seed if engine.seed >= 0 else LLAMA_DEFAULT_SEED)
    banned = [(t, -math.inf) for t in sorted(eog_ids)] if params.ignore_eos else []
    bias = [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in [*params.logit_bias, *banned]]
    return {
        "seed": seed,
        # (the samplers we lack at their defaults: off)
        **{f.name: list(v) if isinstance(v := getattr(params, f.name) if f.supported else f.default, tuple) else v
           for f in FIELDS if f.shown},
        "stop": list(params.stop),
        "max_tokens": params.max_tokens,
        "n_predict": params.max_tokens,
        "n_keep": params.n_keep,
        "n_discard": params.n_discard,
        "stream": stream,
        "logit_bias": bias,
        "n_probs": params.n_probs,
        "grammar": params.grammar.source if params.grammar is not None else "",
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": "Content-only",
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "samplers": list(params.samplers) or SAMPLERS,
        "speculative.n_max": engine.spec_draft_n_max if params.spec_n_max is None else params.spec_n_max,
        "speculative.n_min": engine.spec_draft_n_min if params.spec_n_min is None else params.spec_n_min,
        "speculative.p_min": engine.draft_p_min if params.spec_p_min is None else params.spec_p_min,
        "speculative.types": ",".join(SPEC_TYPE_NAMES.get(k, k) for k in drafter_kind.split(",")) if drafter_kind
        else "none",
        "timings_per_token": timings_per_token,
        "post_sampling_probs": post_sampling_probs,
        "backend_sampling": False,
        "lora": [],
    }


def _lp(x: float) -> float | None:
    """-inf (a banned token) is not valid JSON; llama-server writes null there too."""
    return x if math.isfinite(x) else None


def _entry(tok: Tokenizer, token_id: int, logprob: float, post_sampling: bool) -> dict[str, Any]:
    raw = tok.token_bytes(token_id)
    entry = {"id": token_id, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}
    if post_sampling:
        entry["prob"] = math.exp(logprob)
    else:
        entry["logprob"] = _lp(logprob)
    return entry


def token_probs(tok: Tokenizer, logprobs: list[TokenLogprob] | None, n_top: int,
                post_sampling: bool = False) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities` (also OpenAI chat's `logprobs.content`)."""
    top_key = "top_probs" if post_sampling else "top_logprobs"
    return [
        {**_entry(tok, lp.token_id, lp.logprob, post_sampling),
         top_key: [_entry(tok, t, v, post_sampling) for t, v in lp.top[:n_top]]}
        for lp in logprobs or ()
    ]
