"""OpenAI's Responses API: `POST /v1/responses` (and `/responses`), `GET`/`DELETE /v1/responses/{id}`,
`POST /v1/responses/input_tokens`.

A request is read into a chat body (server/chat_core.py renders, binds and reads it back as the chat route does):
`instructions` and the `input` items (messages, `function_call`, `function_call_output`, `reasoning`) become chat
messages; `previous_response_id` puts the stored conversation of an earlier response first. The reply comes back
as output items (`reasoning`, `message`, `function_call`), whole or as OpenAI's stream of events.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from outrider.engine.request import FinishReason, RequestOutput
from outrider.server import protocol as proto
from outrider.server.chat_core import chat_prompt_ids, function_tools, plan_chat, reply_deltas, submit_chat
from outrider.server.errors import ApiError, invalid
from outrider.server.native import state_of
from outrider.server.render import JSON
from outrider.server.state import ended_error
from outrider.server.transport import read_json, sse_response, until_disconnected

router = APIRouter()

STORE_CAPACITY = 1024  # responses kept for previous_response_id; the oldest goes first
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_REFUSED = ("prompt", "conversation", "background")  # server-side prompts, conversations, background runs


class ResponseStore:
    """Stored responses by id (bounded; the oldest is dropped first): the response object, and the conversation
    it ended (chat messages, without its instructions) for a later `previous_response_id`."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        if response_id not in self._items:
            raise ApiError(404, f"Response with id '{response_id}' not found.")
        return self._items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


# --- request -> chat body ---
def _text(content: Any, field: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text, ...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(field, "expected a string or an array of content parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise invalid(f"{field}[{i}]", f"content part type {kind!r} is not supported (text parts only)")
        texts.append(part.get("text", part.get("refusal")))
    return "\n\n".join(texts)


def input_messages(items: Any) -> list[dict]:
    """`input` (a string, or a list of items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise invalid("input", "expected a string or an array of input items")
    messages: list[dict] = []
    reasoning = ""
    for i, item in enumerate(items):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(field, "expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"{field}.role", 'expected "user", "assistant", "system" or "developer"')
            message = {"role": "system" if role == "developer" else role,
                       "content": _text(item.get("content"), f"{field}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            call_id = item.get("call_id") or item.get("id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise invalid(field, "a function_call needs string 'call_id', 'name' and 'arguments'")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and _calls_may_join(items, i):
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = reasoning, ""
                messages.append(message)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{field}.call_id", "expected a string")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(item.get("output"), f"{field}.output")})
        elif kind == "reasoning":
            parts = [*(item.get("content") or []), *(item.get("summary") or [])]
            reasoning += _text(parts, f"{field}.content") if parts else ""
        else:
            raise invalid(f"{field}.type", f"input item type {kind!r} is not supported")
    return messages


def _calls_may_join(items: list, i: int) -> bool:
    """A function_call joins the assistant message its previous item made (its text, or the calls before it)."""
    prev = items[i - 1] if i > 0 else None
    return isinstance(prev, dict) and (prev.get("type") == "function_call" or
                                       prev.get("type", "message") == "message" and prev.get("role") == "assistant")


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", 'expected "auto", "none", "required" or {"type": "function", "name": ...}')


def _response_format(text: Any) -> dict | None:
    fmt = proto.get_object(text if isinstance(text, dict) else {"format": text} if text is not None else {},
                           "format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    raise invalid("text.format", 'expected {"type": "text" | "json_object" | "json_schema"}')


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """The chat body of a Responses request, and its conversation (history + input, without instructions)."""
    for name in _REFUSED:
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported by this server")
    conversation = [*history, *input_messages(body.get("input"))]
    if not conversation:
        raise invalid("input", "expected at least one input item")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "expected a string")
    messages = [{"role": "system", "content": instructions}, *conversation] if instructions else conversation
    chat: dict[str, Any] = {"messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = proto.get_int(body, "max_output_tokens", -1, lo=1)
    for name in ("temperature", "top_p", "parallel_tool_calls", "seed", "timings_per_token"):
        if body.get(name) is not None:
            chat[name] = body[name]
    effort = proto.get_object(body, "reasoning").get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    tools = function_tools(body.get("tools"), lambda t: t.get("type") == "function", "parameters",
                           "only function tools with a 'name' are supported")
    if tools is not None:
        chat["tools"] = tools
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    if (fmt := _response_format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    return chat, conversation


# --- the reply as output items and events ---
def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


class ResponseBuilder:
    """Turns chat deltas into output items, and the stream events that build them, in OpenAI's order."""

    def __init__(self, response: dict) -> None:
        self.response = response
        self.seq = 0
        self.open: dict | None = None  # the item being written (reasoning, message or function_call)
        self.reasoning_tokens = 0

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def snapshot(self) -> dict:
        return {**self.response, "output": [dict(i) for i in self.response["output"]]}

    def push(self, deltas: list[dict], out: RequestOutput) -> list[dict]:
        events: list[dict] = []
        if deltas and all("reasoning_content" in d for d in deltas):
            self.reasoning_tokens += len(out.new_token_ids)
        for delta in deltas:
            if "reasoning_content" in delta:
                events += self._text("reasoning", delta["reasoning_content"])
            if "content" in delta and delta["content"]:
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = ({"id": _id("rs_"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                    if kind == "reasoning" else
                    {"id": _id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                     "content": []})
            self.open = item
            self.response["output"].append(item)
            part = self._part(kind, "")
            events += [self.event("response.output_item.added", output_index=self._index(), item=dict(item)),
                       self.event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                  content_index=0, part=part)]
            item["content"] = [part]
        part = self.open["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(name, item_id=self.open["id"], output_index=self._index(), content_index=0,
                                    delta=text, **extra)]

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.response["output"].index(item)
        if item["type"] == "function_call":
            if not _whole_json(item["arguments"]):
                item["status"] = "incomplete"  # cut short (max_output_tokens): its arguments never closed
            return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=dict(item))]
        part = item["content"][0]
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [self.event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def _call(self, call: dict) -> list[dict]:
        """A `tool_calls` delta entry: one with an id starts a call (its arguments may follow in more entries)."""
        events = []
        fn = call["function"]
        if "id" in call:
            events += self._close()
            self.open = {"id": _id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                         "name": fn["name"], "arguments": ""}
            self.response["output"].append(self.open)
            events.append(self.event("response.output_item.added", output_index=self._index(), item=dict(self.open)))
        if fn["arguments"]:
            self.open["arguments"] += fn["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=self._index(), delta=fn["arguments"]))
        return events

    def finish(self, out: RequestOutput, prompt_tokens: int) -> list[dict]:
        events = self._close()
        timing = out.timing
        self.response["usage"] = {
            "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": timing.cache_n},
            "output_tokens": timing.predicted_n, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": prompt_tokens + timing.predicted_n}
        self.response["timings"] = timing.to_timings()
        error = ended_error(out)
        if error is not None:
            self.response.update(status="failed", error={"code": "server_error", "message": error["message"]})
            return events + [self.event("response.failed", response=self.snapshot())]
        if out.finish_reason is FinishReason.LENGTH:
            self.response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            return events + [self.event("response.incomplete", response=self.snapshot())]
        self.response["status"] = "completed"
        return events + [self.event("response.completed", response=self.snapshot())]

    def conversation(self) -> list[dict]:
        """The output as chat messages (for a later previous_response_id)."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.response["output"]:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return [message]


def _response_object(body: dict, state) -> dict:
    return {
        "id": _id("resp_"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": state.config.model_alias, "output": [],
        "parallel_tool_calls": proto.get_bool(body, "parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": proto.get_object(body, "reasoning").get("effort"), "summary": None},
        "store": proto.get_bool(body, "store", True), "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}} if body.get("text") is None else body["text"],
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "top_p": body.get("top_p"), "truncation": "disabled", "usage": None,
        "user": body.get("user"), "metadata": body.get("metadata") or {},
    }


def _chat(body: dict, request: Request) -> tuple[dict, list[dict]]:
    """The chat body and the conversation of a Responses request (after the stored one it continues)."""
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("previous_response_id", "expected a string")
    history = store_of(request).get(previous)[1] if previous else []
    return chat_body(body, history)


@router.post("/v1/responses")
@router.post("/responses")
async def create_response(request: Request):
    state = state_of(request)
    body = await read_json(request)
    chat, conversation = _chat(body, request)
    stream = proto.get_bool(body, "stream", False)
    store = proto.get_bool(body, "store", True)
    plan = plan_chat(chat, state)
    gen = submit_chat(plan, state)
    builder = ResponseBuilder(_response_object(body, state))

    async def events() -> AsyncIterator[dict]:
        for event in builder.start():
            yield event
        async for deltas, out in reply_deltas(gen, plan.shape, stream):
            for event in builder.push(deltas, out):
                yield event
            if out.finished:
                for event in builder.finish(out, len(plan.prompt_ids)):
                    yield event
        if store:
            store_of(request).put(builder.snapshot(), [*conversation, *builder.conversation()])

    if stream:
        return sse_response(events(), done=False, ping_interval=state.ping_interval(body), named=True)

    async def run() -> None:
        async for _ in events():
            pass

    await until_disconnected(request, run())
    return JSON(builder.snapshot())


@router.get("/v1/responses/{response_id}")
@router.get("/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    return JSON(store_of(request).get(response_id)[0])


@router.delete("/v1/responses/{response_id}")
@router.delete("/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    store_of(request).delete(response_id)
    return JSON({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens")
async def response_input_tokens(request: Request):
    """The prompt length a Responses request would have (as OpenAI's `input_tokens` count)."""
    body = await read_json(request)
    chat, _ = _chat(body, request)
    return JSON({"object": "response.input_tokens", "input_tokens": len(chat_prompt_ids(chat, state_of(request)))})


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
