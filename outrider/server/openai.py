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
from outrider.server.state import Generation, ServerState
from outrider.server.structured import ChatShape, chat_shape, request_grammar, template_body, tool_choice_grammar
from outrider.structured.grammar import Grammar
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
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise proto.invalid("stream_options", "expected an object")
        return cls(id=prefix + secrets.token_hex(16), object=obj, model=state.config.model_alias,
                   created=int(time.time()), n=proto.get_int(body, "n", 1, lo=1, hi=state.n_slots), stream=stream,
                   include_usage=proto.get_bool(options, "include_usage", False), n_top=n_top,
                   timings_per_token=proto.get_bool(body, "timings_per_token", False),
                   ping_interval=state.ping_interval(body))

    def body(self, choices: list[dict], obj: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"choices": choices, "created": self.created, "model": self.model, "system_fingerprint": BUILD_INFO,
                "object": obj or self.object, "id": self.id, **extra}

    def submit(self, body: dict, state: ServerState, prompts: list[list[int]], grammar: Grammar | None) -> Generation:
        n_probs = 0 if self.n_top is None else max(self.n_top, 1)  # the chosen token's log-prob needs one
        params = proto.sampling_params(body, state.config.defaults, state.tokenizer, n_probs=n_probs,
                                       grammar=grammar)
        return state.admit(proto.make_requests(prompts, params, self.n, state.n_ctx))

    def usage(self, gen: Generation) -> dict[str, Any]:
        """Prompt figures count each prompt once, not once per choice."""
        firsts = gen.requests[:: self.n]
        prompt = sum(r.num_prompt for r in firsts)
        completion = sum(r.timing.predicted_n for r in gen.requests)
        return {"completion_tokens": completion, "prompt_tokens": prompt, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r.timing.cache_n for r in firsts)}}


def _finish_reason(out: RequestOutput, called: bool = False) -> str | None:
    """`called`: the reply holds tool calls ("tool_calls" when it ended on its own)."""
    if not out.finished:
        return None
    if out.finish_reason is FinishReason.STOP:
        return "tool_calls" if called else "stop"
    return "length"


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
    gen = call.submit(body, state, prompts, request_grammar(body, state.core.grammars))
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
            chunk = call.body([{"text": text, "index": i, "logprobs": logprobs_of([out], sent[i]),
                                "finish_reason": _finish_reason(out)}])
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
    body = template_body(await read_json(request), state.config)
    tok = state.tokenizer
    text = _chat_prompt(body, tok)
    shape = chat_shape(body, state.config, tok, text)
    grammar = request_grammar(body, state.core.grammars)
    tool_grammar = tool_choice_grammar(body, shape, state.core.grammars)
    if grammar is not None and tool_grammar is not None:
        raise ApiError(400, "'tool_choice' that requires a call cannot be combined with 'response_format', "
                            "'json_schema' or 'grammar'")
    want_logprobs = proto.get_bool(body, "logprobs", False)
    top = proto.get_int(body, "top_logprobs", 0, lo=0, hi=20)
    if top and not want_logprobs:
        raise proto.invalid("top_logprobs", "needs 'logprobs': true")
    call = Call.parse(body, state, "chatcmpl-", "chat.completion", top if want_logprobs else None)
    gen = call.submit(body, state, [proto.encode_chat(text, tok)], grammar or tool_grammar)

    def logprobs_of(outs: list[RequestOutput]) -> dict | None:
        if call.n_top is None:
            return None
        return {"content": token_probs(tok, [lp for o in outs for lp in o.logprobs or ()], call.n_top)}

    def choice(i: int, outs: list[RequestOutput]) -> dict:
        message, called = shape.message("".join(o.text for o in outs))
        return {"finish_reason": _finish_reason(outs[-1], called), "index": i, "message": message,
                "logprobs": logprobs_of(outs)}

    async def chunks(gen: Generation) -> AsyncIterator[dict]:
        obj = "chat.completion.chunk"
        streams = [shape.stream() for _ in gen.requests]  # each choice's reasoning and tool-call split
        started: set[int] = set()
        remaining = len(gen.requests)
        async for i, out in gen.outputs():
            if i not in started:
                started.add(i)
                yield call.body([{"finish_reason": None, "index": i,
                                  "delta": {"role": "assistant", "content": None}}], obj)
            deltas = streams[i].push(out.text) + (streams[i].finish() if out.finished else [])
            if not deltas and call.n_top is not None and out.logprobs:
                deltas = [{"content": ""}]  # (the text is held back: its log-probs go now)
            for j, delta in enumerate(deltas):
                chunk = call.body([{"finish_reason": None, "index": i, "delta": delta,
                                    "logprobs": logprobs_of([out]) if j == 0 else None}], obj)
                if call.timings_per_token:
                    chunk["timings"] = out.timing.to_timings()
                yield chunk
            if not out.finished:
                continue
            remaining -= 1
            final = call.body([{"finish_reason": _finish_reason(out, streams[i].called), "index": i, "delta": {}}],
                              obj)
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
    state = state_of(request)
    body = template_body(await read_json(request), state.config)
    return JSON({"input_tokens": len(proto.encode_chat(_chat_prompt(body, state.tokenizer), state.tokenizer))})


def _chat_prompt(body: dict, tok) -> str:
    """The rendered chat prompt. With tool_choice "none" the model may not call tools, so the template does not
    offer them (the body loses its `tools`)."""
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none", "required") and not isinstance(choice, dict):
        raise proto.invalid("tool_choice", 'expected "auto", "none", "required" or {"type": "function", ...}')
    if choice == "none":
        body.pop("tools", None)
    return proto.chat_prompt(body, tok)
