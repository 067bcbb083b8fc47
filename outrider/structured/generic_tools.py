"""Generic tool calling, for chat templates that do not show tools (SmolLM2's, chatml, ...), as llama-server does:

- the tools are described in the system message, with the reply's format;
- the reply is one JSON object, bound by a grammar: `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`
  (`{"tool_call": {...}}` when parallel calls are off) or `{"response": "text for the user"}` (not offered when
  `tool_choice` requires a call; with a response_format, `response` is a value of its schema);
- the reply reads back as OpenAI `tool_calls`, or as the `response` text for `content` (streamed as it is written).
A reply cut short (max_tokens) inside a call gives no call and no text: half a call is not prose.

Streamed, each call goes out as OpenAI's `tool_calls` deltas while it is written: its name once the grammar has
written it, then its arguments in pieces, rewritten as the final call's `arguments` string will read (json.dumps
of the parsed object; the grammar's separators are json.dumps' own, so only string escapes and number spellings
need rewriting), so the pieces add up to the call the whole reply parses to.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from outrider.structured.grammar import JSON_OPTIONS, closed_objects
from outrider.structured.tool_calls import Reply, ToolCall, tool_call

RESPONSE_PREFIX = '{"response": "'  # a text response, streamed as it is written
VALUE_PREFIX = '{"response": '  # followed by anything else: a response_format value, held to the end
_CALL_PREFIXES = ('{"tool_calls": ', '{"tool_call": ')
_CALL_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')  # a call object up to its arguments


class GenericFormat:
    name = "generic"

    def parse(self, text: str) -> Reply:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return self._partial(text)
        calls = _calls(obj)
        if calls is not None:
            return Reply("", calls)
        if isinstance(obj, dict) and "response" in obj:  # text, or a value of the response_format schema
            value = obj["response"]
            return Reply(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False), [])
        return Reply(text, [])

    def _partial(self, text: str) -> Reply:
        """A reply that is not whole JSON (cut by max_tokens): the response text written so far; nothing of a
        call."""
        stripped = text.lstrip()
        if stripped.startswith(RESPONSE_PREFIX):
            return Reply(partial_json_string(stripped[len(RESPONSE_PREFIX):]), [])
        if any(stripped.startswith(p) or p.startswith(stripped) for p in _CALL_PREFIXES):
            return Reply("", [])
        return Reply(text, [])

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, required: bool,
                response: dict[str, Any] | None = None) -> str:
        """Lark (llguidance) for a reply: calls of `tools` (OpenAI entries) and, unless `required`, a response (a
        string, or a value of the `response` schema: the request's response_format)."""
        schema = {**closed_objects(self.schema(tools, parallel, required, response)), "x-guidance": JSON_OPTIONS}
        return f"start: %json {json.dumps(schema)}\n"

    def schema(self, tools: list[dict[str, Any]], parallel: bool, required: bool,
               response: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON Schema of a reply: calls of `tools` and, unless `required`, a response."""
        options = [_call_schema(t["function"]) for t in tools]
        one = options[0] if len(options) == 1 else {"anyOf": options}
        if parallel:
            calls = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
                     "required": ["tool_calls"]}
        else:
            calls = {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"]}
        if required:
            return calls
        reply = {"type": "object", "properties": {"response": response or {"type": "string"}},
                 "required": ["response"]}
        return {"anyOf": [calls, reply]}


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"]}


def _calls(obj: Any) -> list[ToolCall] | None:
    """The calls of a parsed reply, None when it holds none (or one that is not a call)."""
    if not isinstance(obj, dict):
        return None
    listed = obj.get("tool_calls") if "tool_calls" in obj else [obj["tool_call"]] if "tool_call" in obj else None
    if not isinstance(listed, list) or not listed:
        return None
    calls = [tool_call(c, "arguments") for c in listed]
    return None if any(c is None for c in calls) else calls


def partial_json_string(body: str) -> str:
    """The text of a JSON string literal's body (after the opening quote) up to its closing quote, or all of it
    when it does not close yet, less an escape sequence still being written."""
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == '"':
            break
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        end = i + (6 if body[i + 1 : i + 2] == "u" else 2)
        if end > len(body):
            break
        if body[i + 1 : i + 2] == "u" and 0xD800 <= int(body[i + 2 : end], 16) < 0xDC00:
            end += 6  # a high surrogate: its low half must follow before it decodes
            if end > len(body):
                break
        try:
            out.append(json.loads('"' + body[i:end] + '"'))
        except json.JSONDecodeError:
            break
        i = end
    return "".join(out)


class ArgumentsStream:
    """A call's arguments (a JSON object, as the grammar writes it) rewritten as they arrive into json.dumps'
    spelling (ensure_ascii off): each string character escaped as json.dumps escapes it, each number as json.dumps
    writes its value; a token still being written (an escape, a number) is held."""

    def __init__(self) -> None:
        self.text = ""  # the rewritten arguments so far
        self.done = False
        self._depth = 0
        self._in_string = False
        self._held = ""  # an escape sequence or a number being written

    def feed(self, raw: str) -> tuple[str, int]:
        """The rewritten text `raw` adds, and how many of its characters belong to the arguments (all of them
        until the object closes)."""
        out: list[str] = []
        for i, ch in enumerate(raw):
            out.append(self._char(ch))
            if self.done:
                piece = "".join(out)
                self.text += piece
                return piece, i + 1
        piece = "".join(out)
        self.text += piece
        return piece, len(raw)

    def _char(self, ch: str) -> str:
        if self._in_string:
            if self._held:
                self._held += ch
                return self._escape()
            if ch == "\\":
                self._held = ch
                return ""
            self._in_string = ch != '"'
            return ch if ch == '"' else json.dumps(ch, ensure_ascii=False)[1:-1]
        out = ""
        if self._held:  # a number: it ends at the first character that cannot continue it
            if ch in "+-.0123456789eE":
                self._held += ch
                return ""
            out, self._held = json.dumps(json.loads(self._held)), ""
        if ch in "-0123456789":
            self._held = ch
            return out
        self._in_string = ch == '"'
        self._depth += (ch in "{[") - (ch in "}]")
        self.done = self._depth == 0 and ch in "}]"
        return out + ch

    def _escape(self) -> str:
        """The held escape sequence's character(s), rewritten, once it is whole."""
        held = self._held
        size = 6 if held[1] == "u" else 2
        if len(held) >= 6 and held[1] == "u" and 0xD800 <= int(held[2:6], 16) < 0xDC00:
            size = 12  # a high surrogate: its low half follows
        if len(held) < size:
            return ""
        self._held = ""
        return json.dumps(json.loads('"' + held + '"'), ensure_ascii=False)[1:-1]


class GenericStream:
    """A streamed generic reply: the response text as it is written; each call's name and arguments as they are
    written (OpenAI `tool_calls` deltas, taken with `take_call_deltas`), the rest of the calls once the reply is
    whole."""

    def __init__(self, fmt: GenericFormat, arguments_in_pieces: bool) -> None:
        """arguments_in_pieces: False sends each call whole once the reply is (a call cut short never goes out)."""
        self.fmt = fmt
        self.arguments_in_pieces = arguments_in_pieces
        self._text = ""
        self._sent = 0  # characters of the response text sent
        self._mode: str | None = None  # response | whole (calls, a response_format value) | text, once it tells
        self.num_calls = 0
        self._calls: list[ArgumentsStream] = []  # the calls streamed so far, the last one maybe still open
        self._scan = 0  # where the stripped reply is read from next for calls
        self._call_deltas: list[dict[str, Any]] = []

    def push(self, text: str) -> Reply:
        self._text += text
        stripped = self._text.lstrip()
        if self._mode is None:
            if stripped.startswith(RESPONSE_PREFIX):
                self._mode = "response"
            elif any(stripped.startswith(p) for p in _CALL_PREFIXES) or len(stripped) > len(VALUE_PREFIX) and \
                    stripped.startswith(VALUE_PREFIX):
                self._mode = "whole"
            elif stripped and not any(p.startswith(stripped) for p in (RESPONSE_PREFIX, *_CALL_PREFIXES)):
                self._mode = "text"
        if self._mode == "response":
            return Reply(self._new(partial_json_string(stripped[len(RESPONSE_PREFIX):])), [])
        if self._mode == "text":
            return Reply(self._new(self._text), [])
        if self.arguments_in_pieces and self._mode == "whole" and any(stripped.startswith(p) for p in _CALL_PREFIXES):
            self._stream_calls(stripped)
        return Reply("", [])

    def finish(self) -> Reply:
        """The rest of the reply: its text, and (as deltas) what the calls streamed so far lack and the calls not
        streamed at all."""
        reply = self.fmt.parse(self._text)
        for j, call in enumerate(reply.tool_calls):
            if j >= len(self._calls):
                self._call_deltas.append(call.to_openai(j))
            elif len(call.arguments) > len(self._calls[j].text) and call.arguments.startswith(self._calls[j].text):
                self._call_deltas.append({"index": j, "function": {
                    "arguments": call.arguments[len(self._calls[j].text):]}})
        self.num_calls = len(reply.tool_calls)
        return Reply(self._new(reply.content) if not reply.tool_calls else "", [])

    def take_call_deltas(self) -> list[dict[str, Any]]:
        """The `tool_calls` delta entries made since the last take."""
        deltas, self._call_deltas = self._call_deltas, []
        return deltas

    def _stream_calls(self, reply: str) -> None:
        """Read the calls on from where the last text left them: a call's head (its name) opens it, then its
        arguments go out as they are written."""
        while True:
            if not self._calls or self._calls[-1].done:
                head = _CALL_HEAD.search(reply, self._scan)
                if head is None:
                    return
                index = len(self._calls)
                self._calls.append(ArgumentsStream())
                self._scan = head.end()
                self._call_deltas.append({"index": index, "id": "call_" + secrets.token_hex(12), "type": "function",
                                          "function": {"name": json.loads(head[1]), "arguments": ""}})
            args = self._calls[-1]
            piece, used = args.feed(reply[self._scan:])
            self._scan += used
            if piece:
                self._call_deltas.append({"index": len(self._calls) - 1, "function": {"arguments": piece}})
            if not args.done:
                return

    def _new(self, content: str) -> str:
        """What `content` adds to the text sent so far."""
        new = content[self._sent:] if content.startswith(content[: self._sent]) else ""
        self._sent = max(self._sent, len(content))
        return new
