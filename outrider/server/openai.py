"""OpenAI-compatible routes: /v1/completions and /v1/chat/completions (plus llama-server's `timings`)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from outrider.engine.request import FinishReason, RequestOutput
from outrider.server import protocol as proto
from outrider.server.errors import ApiError
from outrider.server.native import state_of
from outrider.server.render import JSON, token_probs
from outrider.server.settings import BUILD_INFO
from outrider.server.state import Generation, ServerState, ended_error
from outrider.server.transport import read_json, sse_response, until_disconnected

router = APIRouter()


@dataclass(frozen=True)
class Call:
    """One OpenAI call: the envelope every body and chunk repeats, and the switches that shape the answer."""

    id: str
    object: str
    model: str
    created: int
    n: int  # choices per prompt
    stream: bool
    include_usage: bool
    n_top: int | None  # top log-probs per token; None = log-probs not requested
    timings_per_token: bool  # llama-server extension: `timings` on every streamed content chunk
    ping_interval: float

    @classmethod
    def parse(cls, body: dict, state: ServerState, prefix: str, obj: str, n_top: int | None) -> Call:
        stream = proto.get_bool(body, "stream", False)
        options = proto.get_object(body, "stream_options")
        return cls(id=prefix + secrets.token_hex(16), object=obj, model=state.config.model_alias,
                   created=int(time.time()), n=proto.get_int(body, "n", 1, lo=1, hi=state.n_slots), stream=stream,
                   include_usage=proto.get_bool(options, "include_usage", False), n_top=n_top,
                   timings_per_token=proto.get_bool(body, "timings_per_token", False),
                   ping_interval=state.ping_interval(body))

    def body(self, choices: list[dict], obj: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"choices": choices, "created": self.created, "model": self.model, "system_fingerprint": BUILD_INFO,
                "object": obj or self.object, "id": self.id, **extra}

    def submit(self, body: dict, state: ServerState, prompts: list[list[int]]) -> Generation:
        n_probs = 0 if self.n_top is None else max(self.n_top, 1)  # the chosen token's log-prob needs one
        params = proto.sampling_params(body, state.config.defaults, state.tokenizer, n_probs=n_probs)
        return state.admit(proto.make_requests(prompts, params, self.n, state.n_ctx))

    def usage(self, gen: Generation) -> dict[str, Any]:
        """Prompt figures count each prompt once, not once per choice."""
        firsts = gen.requests[:: self.n]
        prompt = sum(r.num_prompt for r in firsts)
        completion = sum(r.timing.predicted_n for r in gen.requests)
        return {"completion_tokens": completion, "prompt_tokens": prompt, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r.timing.cache_n for r in firsts)}}


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    if ended_error(out) is not None:  # ended by the server (shutdown): neither a stop nor a limit
        return "abort"
    return "stop" if out.finish_reason is FinishReason.STOP else "length"


def _with_error(chunk: dict, out: RequestOutput) -> dict:
    """A final chunk, with the `error` that says why the server ended its request early, if it did."""
    error = ended_error(out)
    return chunk if error is None else {**chunk, "error": error}


async def _respond(request: Request, call: Call, gen: Generation, choice, chunks) -> Any:
    """Non-streamed: one body with every choice; streamed: the route's chunks, then [DONE]."""
    if call.stream:
        return sse_response(chunks(gen), done=True, ping_interval=call.ping_interval)
    results = await until_disconnected(request, gen.collect())
    choices = [choice(i, outs) for i, outs in enumerate(results)]
    return JSON(call.body(choices, usage=call.usage(gen), timings=results[0][-1].timing.to_timings()))


# --- /v1/completions ---
@router.post("/v1/completions")
async def completions(request: Request):
    state = state_of(request)
    body = await read_json(request)
    tok = state.tokenizer
    prompts = proto.tokenize_prompts(body.get("prompt"), tok)
    logprobs = proto.get_int(body, "logprobs", -1, lo=0)
    echo = proto.get_bool(body, "echo", False)
    if echo and logprobs >= 0:
        raise ApiError(400, "'echo' together with 'logprobs' is not supported (no prompt log-probs)")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server")
    call = Call.parse(body, state, "cmpl-", "text_completion", logprobs if logprobs >= 0 else None)
    gen = call.submit(body, state, prompts)
    prefixes = [tok.decode(r.prompt_ids) if echo else "" for r in gen.requests]

    def logprobs_of(outs: list[RequestOutput], offset: int) -> dict | None:
        """`offset`: characters of completion before these tokens (never the prompt: echo excludes log-probs)."""
        if call.n_top is None:
            return None
        content = token_probs(tok, [lp for o in outs for lp in o.logprobs or ()], call.n_top)
        offsets = []
        for c in content:
            offsets.append(offset)
            offset += len(c["token"])
        # OpenAI's legacy shape and llama-server's `content` list, so clients of either read it
        return {"content": content, "tokens": [c["token"] for c in content],
                "token_logprobs": [c["logprob"] for c in content],
                "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content],
                "text_offset": offsets}

    def choice(i: int, outs: list[RequestOutput]) -> dict:
        return {"text": prefixes[i] + "".join(o.text for o in outs), "index": i,
                "logprobs": logprobs_of(outs, 0), "finish_reason": _finish_reason(outs[-1])}

    async def chunks(gen: Generation) -> AsyncIterator[dict]:
        sent = [0] * len(gen.requests)  # completion characters sent per choice (log-prob text offsets)
        remaining = len(gen.requests)
        async for i, out in gen.outputs():
            text = prefixes[i] + out.text
            prefixes[i] = ""
            chunk = _with_error(call.body([{"text": text, "index": i, "logprobs": logprobs_of([out], sent[i]),
                                            "finish_reason": _finish_reason(out)}]), out)
            sent[i] += len(out.text)
            if out.finished:
                remaining -= 1
            if not remaining:  # the last chunk carries usage and timings
                chunk.update(usage=call.usage(gen), timings=out.timing.to_timings())
            elif call.timings_per_token:
                chunk["timings"] = out.timing.to_timings()
            yield chunk

    return await _respond(request, call, gen, choice, chunks)


# --- /v1/chat/completions ---
@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: Request):
    state = state_of(request)
    body = await read_json(request)
    tok = state.tokenizer
    prompt = _chat_prompt_ids(body, tok)
    want_logprobs = proto.get_bool(body, "logprobs", False)
    top = proto.get_int(body, "top_logprobs", 0, lo=0, hi=20)
    if top and not want_logprobs:
        raise proto.invalid("top_logprobs", "needs 'logprobs': true")
    call = Call.parse(body, state, "chatcmpl-", "chat.completion", top if want_logprobs else None)
    gen = call.submit(body, state, [prompt])

    def logprobs_of(outs: list[RequestOutput]) -> dict | None:
        if call.n_top is None:
            return None
        return {"content": token_probs(tok, [lp for o in outs for lp in o.logprobs or ()], call.n_top)}

    def choice(i: int, outs: list[RequestOutput]) -> dict:
        return {"finish_reason": _finish_reason(outs[-1]), "index": i,
                "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                "logprobs": logprobs_of(outs)}

    async def chunks(gen: Generation) -> AsyncIterator[dict]:
        obj = "chat.completion.chunk"
        started: set[int] = set()
        remaining = len(gen.requests)
        async for i, out in gen.outputs():
            if i not in started:
                started.add(i)
                yield call.body([{"finish_reason": None, "index": i,
                                  "delta": {"role": "assistant", "content": None}}], obj)
            if out.text or (call.n_top is not None and out.logprobs):
                chunk = call.body([{"finish_reason": None, "index": i, "delta": {"content": out.text},
                                    "logprobs": logprobs_of([out])}], obj)
                if call.timings_per_token:
                    chunk["timings"] = out.timing.to_timings()
                yield chunk
            if not out.finished:
                continue
            remaining -= 1
            final = _with_error(call.body([{"finish_reason": _finish_reason(out), "index": i, "delta": {}}], obj), out)
            if remaining:
                yield final
            elif call.include_usage:  # timings go on the very last chunk: the usage one
                yield final
                yield call.body([], obj, usage=call.usage(gen), timings=out.timing.to_timings())
            else:
                yield {**final, "timings": out.timing.to_timings()}

    return await _respond(request, call, gen, choice, chunks)


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def chat_input_tokens(request: Request):
    """The prompt length a chat request would have, rendered and tokenized exactly as the chat route does."""
    body = await read_json(request)
    return JSON({"input_tokens": len(_chat_prompt_ids(body, state_of(request).tokenizer))})


def _chat_prompt_ids(body: dict, tok) -> list[int]:
    """The chat prompt's ids. Chat-only fields that need machinery we lack (constrained decoding) are refused."""
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise proto.invalid("response_format", "expected {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
        if fmt["type"] != "text":
            raise ApiError(400, "'response_format' with JSON output is not supported by this server")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(400, "'tool_choice' other than \"auto\" or \"none\" is not supported by this server")
    if choice == "none":  # the model may not call tools, so the template should not offer them
        body.pop("tools", None)
    return proto.chat_prompt_ids(body, tok)
