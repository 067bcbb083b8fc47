"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, with Anthropic's error
format (errors.py) and its stream of named events. As llama-server: no `timings` (Anthropic's clients have no
place for them).

A request is read into a chat body (server/chat_core.py renders, binds and reads it back as the chat route does):
`system`, text blocks, `tool_use` blocks (assistant tool calls), `tool_result` blocks (tool messages) and
`thinking` blocks (the assistant's reasoning_content). The reply's reasoning split gives `thinking` blocks, its
text `text` blocks, its calls `tool_use` blocks.
"""

from __future__ import annotations

import json
import secrets
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


def _blocks(content: Any, field: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(field, "expected a string or an array of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{field}[{i}]", "expected a content block with a 'type'")
    return content


def _text_of(content: Any, field: str) -> str:
    """Text blocks (or a string) as one text; other blocks are refused."""
    texts = []
    for i, block in enumerate(_blocks(content, field)):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{field}[{i}]", f"content block type {block['type']!r} is not supported here")
        texts.append(block["text"])
    return "\n\n".join(texts)


def chat_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty array of messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{field}.role", 'expected "user" or "assistant"')
        texts: list[str] = []
        if m["role"] == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": ""}
            for j, block in enumerate(_blocks(m.get("content"), f"{field}.content")):
                kind, where = block["type"], f"{field}.content[{j}]"
                if kind == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                elif kind == "thinking" and isinstance(block.get("thinking"), str):
                    message["reasoning_content"] = message.get("reasoning_content", "") + block["thinking"]
                elif kind == "redacted_thinking":
                    continue
                elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("id"), str):
                    args = block.get("input", {})
                    if not isinstance(args, dict):
                        raise invalid(f"{where}.input", "expected an object")
                    message.setdefault("tool_calls", []).append({"id": block["id"], "type": "function", "function": {
                        "name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
                else:
                    raise invalid(where, f"content block type {kind!r} is not supported here (or lacks its fields)")
            message["content"] = "\n\n".join(texts)
            out.append(message)
            continue
        for j, block in enumerate(_blocks(m.get("content"), f"{field}.content")):
            kind, where = block["type"], f"{field}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text_of(result, f"{where}.content") if result else ""})
            else:
                raise invalid(where, f"content block type {kind!r} is not supported here (or lacks its fields)")
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def chat_body(body: dict) -> dict:
    chat: dict[str, Any] = {"messages": chat_messages(body.get("messages"))}
    system = body.get("system")
    if system is not None:
        chat["messages"].insert(0, {"role": "system", "content": _text_of(system, "system")})
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if (stop := proto.get_str_list(body, "stop_sequences")) is not None:
        chat["stop"] = stop
    tools = function_tools(body.get("tools"), lambda t: t.get("type", "custom") == "custom", "input_schema",
                           "only custom tools with a 'name' and an 'input_schema' are supported")
    if tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none") or kind == "tool" and not isinstance(choice.get("name"), str):
            raise invalid("tool_choice", 'expected {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}')
        chat["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
                               else "required" if kind == "any" else kind)
        chat["parallel_tool_calls"] = not proto.get_bool(choice, "disable_parallel_tool_use", False)
    thinking = proto.get_object(body, "thinking")
    if thinking:
        if thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise invalid("thinking", 'expected {"type": "enabled" | "disabled" | "adaptive"}')
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    return chat


def _stop_reason(out: RequestOutput, called: bool) -> str:
    if out.finish_reason is FinishReason.LENGTH:
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if out.stop_type == "word" else "end_turn"


class MessageBuilder:
    """Turns chat deltas into content blocks, and the stream events that build them, in Anthropic's order."""

    def __init__(self, message: dict) -> None:
        self.message = message
        self.open: dict | None = None  # the text, thinking or tool_use block being written
        self._arguments = ""  # the open tool_use block's input JSON so far
        self.called = False

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": {**self.message, "content": []}}]

    def push(self, deltas: list[dict]) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_use(call)
        return events

    def _index(self) -> int:
        return len(self.message["content"]) - 1

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            self.message["content"].append(self.open)
            events.append({"type": "content_block_start", "index": self._index(), "content_block": dict(self.open)})
        self.open[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        return events + [{"type": "content_block_delta", "index": self._index(), "delta": delta}]

    def _close(self) -> list[dict]:
        block, self.open = self.open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _json_object(self._arguments)
        index = self.message["content"].index(block)
        return [{"type": "content_block_stop", "index": index}]

    def _tool_use(self, call: dict) -> list[dict]:
        """A `tool_calls` delta entry: one with an id starts a tool_use block (its input may follow in more)."""
        events = []
        fn = call["function"]
        if "id" in call:
            events += self._close()
            self.called = True
            self.open = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
            self._arguments = ""
            self.message["content"].append(self.open)
            events.append({"type": "content_block_start", "index": self._index(), "content_block": dict(self.open)})
        if fn["arguments"]:
            self._arguments += fn["arguments"]
            events.append({"type": "content_block_delta", "index": self._index(),
                           "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return events

    def finish(self, out: RequestOutput) -> list[dict]:
        events = self._close()
        error = ended_error(out)
        if error is not None:  # ended by the server (shutdown): the stream ends with Anthropic's error event
            raise ApiError(503, error["message"])
        reason = _stop_reason(out, self.called)
        word = out.stopping_word if reason == "stop_sequence" else None
        self.message.update(stop_reason=reason, stop_sequence=word)
        self.message["usage"]["output_tokens"] = out.timing.predicted_n
        self.message["usage"]["cache_read_input_tokens"] = out.timing.cache_n
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": word},
                          "usage": {"output_tokens": out.timing.predicted_n}},
                         {"type": "message_stop"}]


@router.post("/v1/messages")
async def create_message(request: Request):
    state = state_of(request)
    body = await read_json(request)
    plan = plan_chat(chat_body(body), state)
    gen = submit_chat(plan, state)
    builder = MessageBuilder({
        "id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": state.config.model_alias,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(plan.prompt_ids), "output_tokens": 0, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}})

    streamed = proto.get_bool(body, "stream", False)

    async def events() -> AsyncIterator[dict]:
        for event in builder.start():
            yield event
        async for deltas, out in reply_deltas(gen, plan.shape, streamed):
            for event in builder.push(deltas):
                yield event
            if out.finished:
                for event in builder.finish(out):
                    yield event

    if streamed:
        return sse_response(events(), done=False, ping_interval=state.ping_interval(body), named=True,
                            error_event=ApiError.anthropic_body)

    async def run() -> None:
        async for _ in events():
            pass

    await until_disconnected(request, run())
    return JSON(builder.message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    body = await read_json(request)
    return JSON({"input_tokens": len(chat_prompt_ids(chat_body(body), state_of(request)))})


def _json_object(text: str) -> dict:
    """A streamed call's input: its arguments, or {} for a call cut short (max_tokens) whose JSON never closed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}
