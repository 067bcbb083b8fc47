"""Tool calls in the model family's own syntax: parsing replies (whole or streamed) into OpenAI `tool_calls`, and
the grammar that makes `tool_choice` "required" or a named function binding.

The family comes from the chat template, never from the model's name:
- Qwen2.5/Qwen3 (Hermes style), templates that mention `<tool_call>`, and any other template by default:
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call;
- Llama 3.1+, templates with `<|start_header_id|>`: a bare JSON object `{"name": ..., "parameters": {...}}` (the
  template's `<|python_tag|>` is a special token, absent from the text), several joined by `;`.
Text that does not parse as a call (malformed JSON) stays content: never an error. A block that never closes (the
reply was cut by max_tokens) is dropped: half a call is not prose.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from outrider.structured.grammar import JSON_OPTIONS, closed_objects
from outrider.structured.reasoning import partial_suffix


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's form)
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Reply:
    content: str
    tool_calls: list[ToolCall]


def tool_call(obj: Any, args_key: str) -> ToolCall | None:
    """A ToolCall from a parsed JSON value, None unless it is {"name": str, args_key: object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class QwenFormat:
    """`<tool_call>{json}</tool_call>` blocks anywhere in the reply; the text around them is content."""

    name = "qwen"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str) -> Reply:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            call = _loads_call(m.group(1), "arguments")
            content.append(text[pos : m.start()] if call is not None else text[pos : m.end()])
            pos = m.end()
            if call is not None:
                calls.append(call)
        rest = text[pos:]
        content.append(rest[: rest.find(self.OPEN)] if self.OPEN in rest else rest)
        joined = "".join(content)
        return Reply(joined.strip() if calls else joined, calls)

    def grammar(self, schema: dict[str, Any], parallel: bool) -> str:
        """Lark (llguidance): one block, or several separated by newlines."""
        return _lark(f'"{self.OPEN}\\n" %json {json.dumps(schema)} "\\n{self.CLOSE}"', '"\\n"', parallel)

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return _named(name, "arguments", parameters)


class Llama3Format:
    """The whole reply is one JSON call, or several joined by `;`; anything else is content."""

    name = "llama3"

    def parse(self, text: str) -> Reply:
        stripped = text.strip()
        if not stripped.startswith("{"):
            return Reply(text, [])
        calls = [_loads_call(part, "parameters") for part in _split_top_level(stripped, ";")]
        if not calls or any(c is None for c in calls):
            return Reply(text, [])
        return Reply("", calls)

    def grammar(self, schema: dict[str, Any], parallel: bool) -> str:
        return _lark(f"%json {json.dumps(schema)}", '"; "', parallel)

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return _named(name, "parameters", parameters)


ToolFormat = QwenFormat | Llama3Format


def format_for_template(template: str | None) -> ToolFormat:
    """The tool-call syntax a chat template's family uses (Qwen's unless the template is Llama 3's)."""
    t = template or ""
    if "<tool_call>" not in t and "<|start_header_id|>" in t:
        return Llama3Format()
    return QwenFormat()


def tool_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool) -> str:
    """Lark text that admits only calls of these tools (OpenAI `tools` entries), with arguments that follow
    each tool's parameter schema."""
    options = [fmt.call_schema(t["function"]["name"], t["function"].get("parameters") or {"type": "object"})
               for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return fmt.grammar({**closed_objects(schema), "x-guidance": JSON_OPTIONS}, parallel)


def _lark(call: str, separator: str, parallel: bool) -> str:
    """start: one call, or (parallel) calls separated by `separator` (Lark literals)."""
    repeat = f" ({separator} call)*" if parallel else ""
    return f"start: call{repeat}\ncall: {call}\n"


def _named(name: str, args_key: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, args_key: parameters},
            "required": ["name", args_key], "additionalProperties": False}


def _loads_call(text: str, args_key: str) -> ToolCall | None:
    try:
        return tool_call(json.loads(text), args_key)
    except json.JSONDecodeError:
        return None


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split at `sep` outside JSON strings and brackets."""
    parts, depth, in_str, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_str:
            escaped = not escaped and ch == "\\"
            in_str = escaped or ch != '"'
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


class ToolCallStream:
    """Splits a streamed reply into content deltas and complete calls, as `parse` splits the whole reply.
    Qwen: text is passed on until it may start a `<tool_call>` block, which is held until it closes (a call) or
    the reply ends (dropped). Llama 3: a reply that starts with `{` is held to the end, then parsed whole.
    Whitespace-only content is held until more content follows (a reply with calls drops it, as parse does)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._held = ""
        self._space = ""  # whitespace-only content not sent yet
        self._whole: bool | None = None  # Llama 3: the reply is held whole (None: not known yet)
        self.num_calls = 0

    def push(self, text: str) -> Reply:
        """Content safe to send now, and the calls completed by this text."""
        self._held += text
        if isinstance(self.fmt, Llama3Format):
            if self._whole is None and self._held.strip():
                self._whole = self._held.lstrip().startswith("{")
            if self._whole is not False:
                return Reply("", [])
            text, self._held = self._held, ""
            return self._reply(text, [], final=False)
        return self._qwen_step(final=False)

    def finish(self) -> Reply:
        if isinstance(self.fmt, Llama3Format):
            reply, self._held = self.fmt.parse(self._held), ""
            return self._reply(reply.content, reply.tool_calls, final=True)
        return self._qwen_step(final=True)

    def _qwen_step(self, final: bool) -> Reply:
        fmt: QwenFormat = self.fmt
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self._held.find(fmt.OPEN)
            if start < 0:
                keep = 0 if final else partial_suffix(self._held, fmt.OPEN)
                content.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            end = self._held.find(fmt.CLOSE, start)
            if end < 0:
                content.append(self._held[:start])
                self._held = "" if final else self._held[start:]
                break
            call = _loads_call(self._held[start + len(fmt.OPEN) : end], "arguments")
            content.append(self._held[: end + len(fmt.CLOSE)] if call is None else self._held[:start])
            calls += [call] if call is not None else []
            self._held = self._held[end + len(fmt.CLOSE) :]
        return self._reply("".join(content), calls, final)

    def _reply(self, content: str, calls: list[ToolCall], final: bool) -> Reply:
        self.num_calls += len(calls)
        text = self._space + content
        if not text.strip():
            self._space = "" if final else text
            return Reply("" if self.num_calls or not final else text, calls)
        self._space = ""
        return Reply(text, calls)
