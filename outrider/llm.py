"""Offline use: `LLM(model).generate(prompts, params)` runs the engine on the caller's thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from outrider.config import EngineConfig
from outrider.engine.builder import Seams, build_engine
from outrider.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from outrider.params import SamplingParams
from outrider.request_fields import tokenize
from outrider.timing import RequestTiming, now


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_type: str
    timing: RequestTiming
    logprobs: list[TokenLogprob]  # one per token when the request asked for n_probs, else empty


class LLM:
    def __init__(self, model: str, clock: Callable[[], float] = now, seams: Seams = Seams(), **engine_kwargs):
        """engine_kwargs: EngineConfig fields; clock: what the engine's timing stamps read; seams: what the engine's
        parts are made with (engine/builder.py)."""
        self.engine = build_engine(EngineConfig(model=str(model), **engine_kwargs), clock=clock, seams=seams)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts (text or token ids) to completion, all in one continuous batch."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        requests, outputs = [], {}
        for prompt, p in zip(prompts, plist):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req = Request(ids, tokenize(p, self.tokenizer))  # (fields whose meaning depends on the vocab)
            outputs[req.request_id] = []
            requests.append(req)
            self.engine.add_request(req, outputs[req.request_id].append)
        while self.engine.has_work():
            self.engine.step()
        return [self._collect(r, outputs[r.request_id]) for r in requests]

    @staticmethod
    def _collect(req: Request, outs: list[RequestOutput]) -> Completion:
        last = outs[-1]
        if last.error:
            raise RuntimeError(last.error)
        return Completion(req.prompt_ids, [t for o in outs for t in o.new_token_ids], "".join(o.text for o in outs),
                          last.finish_reason, last.stop_type, req.timing, [lp for o in outs for lp in o.logprobs or ()])
