"""OpenAI-compatible routes: /v1/completions and /v1/chat/completions (plus llama-server's `timings`)."""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from outrider.engine.request import FinishReason, RequestOutput
from outrider.server import protocol as proto
from outrider.server import provenance
from outrider.server.errors import ApiError
from outrider.server.native import native_result, progress_fields, state_of
from outrider.server.prompt_probs import MAX_PROMPT_LOGPROBS, prompt_entry, vllm_prompt_logprobs
from outrider.server.render import JSON, timings_fields, token_probs
from outrider.server.settings import BUILD_INFO
from outrider.server.state import Generation, ServerState, ended_error
from outrider.server.chat_core import chat_prompt_ids, plan_chat
from outrider.server.structured import request_grammar
from outrider.server.transport import read_json, sse_response, until_disconnected
from outrider.structured.grammar import Grammar

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
    options: proto.RequestOptions  # id_slot, return_progress, verbose
    draft_provenance: bool  # outrider extension: per-token provenance in each choice (server/provenance.py)

    @classmethod
    def parse(cls, body: dict, state: ServerState, prefix: str, obj: str, n_top: int | None) -> Call:
        stream = proto.get_bool(body, "stream", False)
        options = proto.get_object(body, "stream_options")
        return cls(id=prefix + secrets.token_hex(16), object=obj, model=state.config.model_alias,
                   created=int(time.time()), n=proto.get_int(body, "n", 1, lo=1, hi=state.n_slots), stream=stream,
                   include_usage=proto.get_bool(options, "include_usage", False), n_top=n_top,
                   timings_per_token=proto.get_bool(body, "timings_per_token", False),
                   ping_interval=state.ping_interval(body),
                   options=proto.RequestOptions.parse(body, state.n_slots, state.config.verbose),
                   draft_provenance=proto.wants_draft_provenance(body))

    def body(self, choices: list[dict], obj: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"choices": choices, "created": self.created, "model": self.model, "system_fingerprint": BUILD_INFO,
                "object": obj or self.object, "id": self.id, **extra}

    def submit(self, body: dict, state: ServerState, prompts: list[list[int]], grammar: Grammar | None,
               prompt_logprobs: int | None = None) -> Generation:
        """`prompt_logprobs`: top-n log-probs of the prompt tokens too (engine/prompt_logprobs.py)."""
        n_probs = 0 if self.n_top is None else max(self.n_top, 1)  # the chosen token's log-prob needs one
        params = proto.sampling_params(body, state.config.defaults, state.tokenizer, n_probs=n_probs,
                                       grammar=grammar)
        if prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=prompt_logprobs)
        return state.admit(proto.make_requests(prompts, params, self.n, state.n_ctx, self.options))

    def usage(self, gen: Generation) -> dict[str, Any]:
        """Prompt figures count each prompt once, not once per choice."""
        firsts = gen.requests[:: self.n]
        prompt = sum(r.num_prompt for r in firsts)
        completion = sum(r.timing.predicted_n for r in gen.requests)
        return {"completion_tokens": completion, "prompt_tokens": prompt, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r.timing.cache_n for r in firsts)}}

    def with_provenance(self, choice: dict, outs: list[RequestOutput]) -> dict:
        """`choice` with the provenance of `outs`' tokens when the request asked for it."""
        if self.draft_provenance:
            choice[provenance.FIELD] = provenance.entries(outs)
        return choice

    def progress_chunk(self, out: RequestOutput, obj: str | None = None) -> dict[str, Any]:
        """A prefill report (return_progress) as a chunk without choices."""
        return self.body([], obj, **progress_fields(out))

    def verbose(self, state: ServerState, gen: Generation, index: int, outs: list[RequestOutput]) -> dict:
        """`__verbose` (with `verbose` or -v): the native result object of one choice (rendered prompt, raw
        text, settings)."""
        if not self.options.verbose:
            return {}
        return {"__verbose": native_result(state, gen.requests[index], outs, index, streamed=False,
                                           stream=self.stream)}


def _finish_reason(out: RequestOutput, called: bool = False) -> str | None:
    """`called`: the reply holds tool calls ("tool_calls" when it ended on its own)."""
    if not out.finished:
        return None
    if ended_error(out) is not None:  # ended by the server (shutdown): neither a stop nor a limit
        return "abort"
    if out.finish_reason is FinishReason.STOP:
        return "tool_calls" if called else "stop"
    return "length"


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
    # A call of several choices (`n` > 1, a prompt array) reports choice 0's timings, streamed or not.
    return JSON(call.body(choices, usage=call.usage(gen), **timings_fields(results[0][-1].timing),
                          **call.verbose(state_of(request), gen, 0, results[0])))


@dataclasses.dataclass(frozen=True)
class Sent:
    """A prompt as the client sent it (OpenAI's `echo`): its text, and how many leading ids the server added."""

    text: str
    added: int


def _as_sent(source: Any, ids: list[int], tok) -> Sent:
    """A text as is, token ids decoded; without the BOS the server added before a leading text."""
    if isinstance(source, list) and len(source) == 1 and isinstance(source[0], (str, dict)):
        source = source[0]  # (a batch of one)
    if isinstance(source, dict):
        source = source.get("prompt_string")
    starts_with_text = isinstance(source, str) or isinstance(source, list) and bool(source) and isinstance(
        source[0], str)
    added = 1 if tok.add_bos and starts_with_text and ids and ids[0] == tok.bos_token_id else 0
    return Sent(source if isinstance(source, str) else tok.decode(ids[added:]), added)


# --- /v1/completions ---
@router.post("/v1/completions")
async def completions(request: Request):
    state = state_of(request)
    body = await read_json(request)
    tok = state.tokenizer
    prompts = proto.tokenize_prompts(body.get("prompt"), tok, state.n_ctx)
    logprobs = proto.get_int(body, "logprobs", -1, lo=0, hi=tok.vocab_size)
    echo = proto.get_bool(body, "echo", False)
    prompt_top = proto.get_int(body, "prompt_logprobs", -1, lo=0, hi=MAX_PROMPT_LOGPROBS)  # vLLM's field
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server")
    call = Call.parse(body, state, "cmpl-", "text_completion", logprobs if logprobs >= 0 else None)
    echo_top = logprobs if echo and logprobs >= 0 else -1  # echo + logprobs: the prompt's log-probs lead
    wanted = max(echo_top, prompt_top)
    gen = call.submit(body, state, prompts, request_grammar(body, state.core.grammars),
                      prompt_logprobs=wanted if wanted >= 0 else None)
    sources = body["prompt"] if isinstance(body["prompt"], list) and len(prompts) > 1 else [body["prompt"]]
    sent_as = [_as_sent(sources[i // call.n], r.prompt_ids, tok) for i, r in enumerate(gen.requests)]
    prefixes = [s.text if echo else "" for s in sent_as]

    def prompt_part(i: int) -> list[dict]:
        """The echoed prompt's log-prob entries (the first one's log-prob null: nothing predicts it)."""
        if echo_top < 0:
            return []
        return [prompt_entry(tok, tok_id, lp, echo_top) for tok_id, lp in
                zip(gen.requests[i].prompt_ids, gen.requests[i].prompt_logprobs)][sent_as[i].added:]

    def extras(i: int) -> dict:
        if prompt_top < 0:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(tok, gen.requests[i].prompt_ids,
                                                        gen.requests[i].prompt_logprobs, prompt_top)}

    def logprobs_of(outs: list[RequestOutput], offset: int, lead: list[dict] = ()) -> dict | None:
        """`offset`: characters of the text before these tokens; `lead`: the echoed prompt's entries first."""
        if call.n_top is None:
            return None
        content = [*lead, *token_probs(tok, [lp for o in outs for lp in o.logprobs or ()], call.n_top)]
        offsets = []
        for c in content:
            offsets.append(offset)
            offset += len(c["token"])
        # OpenAI's legacy shape and llama-server's `content` list, so clients of either read it
        return {"content": content, "tokens": [c["token"] for c in content],
                "token_logprobs": [c["logprob"] for c in content],
                "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} if c["logprob"] is not None
                                 or c["top_logprobs"] else None for c in content],
                "text_offset": offsets}

    def choice(i: int, outs: list[RequestOutput]) -> dict:
        return call.with_provenance({"text": prefixes[i] + "".join(o.text for o in outs), "index": i,
                                     "logprobs": logprobs_of(outs, 0, prompt_part(i)),
                                     "finish_reason": _finish_reason(outs[-1]), **extras(i)}, outs)

    async def chunks(gen: Generation) -> AsyncIterator[dict]:
        sent = [0] * len(gen.requests)  # characters sent per choice (log-prob text offsets)
        started: set[int] = set()  # choices whose first text chunk went (it carries the prompt's log-probs)
        history: list[list[RequestOutput]] = [[] for _ in gen.requests]
        remaining = len(gen.requests)
        async for i, out in gen.outputs():
            history[i].append(out)
            if out.progress is not None:
                yield call.progress_chunk(out)
            if not out.new_token_ids and not out.finished:
                continue
            first = i not in started
            started.add(i)
            text = prefixes[i] + out.text
            prefixes[i] = ""
            part = {"text": text, "index": i, "logprobs": logprobs_of([out], sent[i], prompt_part(i) if first else ()),
                    "finish_reason": _finish_reason(out), **(extras(i) if first else {})}
            chunk = _with_error(call.body([call.with_provenance(part, [out])]), out)
            sent[i] += len(text)
            if out.finished:
                remaining -= 1
            if out.finished:
                chunk.update(call.verbose(state, gen, i, history[i]))
            if not remaining:  # the last chunk carries usage and timings (choice 0's)
                chunk.update(usage=call.usage(gen), **timings_fields(history[0][-1].timing))
            elif call.timings_per_token:
                chunk.update(timings_fields(out.timing))
            yield chunk

    return await _respond(request, call, gen, choice, chunks)


# --- /v1/chat/completions ---
@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: Request):
    state = state_of(request)
    body = await read_json(request)
    plan = plan_chat(body, state)
    body, tok, shape = plan.body, state.tokenizer, plan.shape
    want_logprobs = proto.get_bool(body, "logprobs", False)
    top = proto.get_int(body, "top_logprobs", 0, lo=0, hi=20)
    if top and not want_logprobs:
        raise proto.invalid("top_logprobs", "needs 'logprobs': true")
    call = Call.parse(body, state, "chatcmpl-", "chat.completion", top if want_logprobs else None)
    gen = call.submit(body, state, [plan.prompt_ids], plan.grammar)

    def logprobs_of(outs: list[RequestOutput]) -> dict | None:
        if call.n_top is None:
            return None
        return {"content": token_probs(tok, [lp for o in outs for lp in o.logprobs or ()], call.n_top)}

    def choice(i: int, outs: list[RequestOutput]) -> dict:
        message, called = shape.message("".join(o.text for o in outs))
        return call.with_provenance({"finish_reason": _finish_reason(outs[-1], called), "index": i,
                                     "message": message, "logprobs": logprobs_of(outs)}, outs)

    async def chunks(gen: Generation) -> AsyncIterator[dict]:
        obj = "chat.completion.chunk"
        streams = [shape.stream(arguments_in_pieces=True) for _ in gen.requests]  # each choice's reasoning and tool-call split
        started: set[int] = set()
        history: list[list[RequestOutput]] = [[] for _ in gen.requests]
        remaining = len(gen.requests)
        async for i, out in gen.outputs():
            history[i].append(out)
            if out.progress is not None:
                yield call.progress_chunk(out, obj)
            if not out.new_token_ids and not out.finished:
                continue
            if i not in started:
                started.add(i)
                yield call.body([{"finish_reason": None, "index": i,
                                  "delta": {"role": "assistant", "content": None}}], obj)
            deltas = streams[i].push(out.text) + (streams[i].finish() if out.finished else [])
            if not deltas and out.new_token_ids and (call.n_top is not None or call.draft_provenance):
                deltas = [{"content": ""}]  # (the text is held back: its tokens' log-probs and provenance go now)
            for j, delta in enumerate(deltas):  # the output's tokens (log-probs, provenance) go with its first
                part = {"finish_reason": None, "index": i, "delta": delta, "logprobs": None}
                if j == 0:
                    part = call.with_provenance({**part, "logprobs": logprobs_of([out])}, [out])
                chunk = call.body([part], obj)
                if call.timings_per_token:
                    chunk.update(timings_fields(out.timing))
                yield chunk
            if not out.finished:
                continue
            remaining -= 1
            final = _with_error(call.body([{"finish_reason": _finish_reason(out, streams[i].called), "index": i,
                                            "delta": {}}], obj, **call.verbose(state, gen, i, history[i])), out)
            if remaining:
                yield final
            elif call.include_usage:  # timings (choice 0's) go on the very last chunk: the usage one
                yield final
                yield call.body([], obj, usage=call.usage(gen), **timings_fields(history[0][-1].timing))
            else:
                yield {**final, **timings_fields(history[0][-1].timing)}

    return await _respond(request, call, gen, choice, chunks)


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def chat_input_tokens(request: Request):
    """The prompt length a chat request would have, rendered and tokenized exactly as the chat route does."""
    state = state_of(request)
    return JSON({"input_tokens": len(chat_prompt_ids(await read_json(request), state))})
