"""The routes' side of structured output: request fields -> a compiled Grammar (a 400 naming the field when it
does not compile), and a chat reply -> `content`, `reasoning_content` and `tool_calls`, whole or as deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outrider.server import protocol as proto
from outrider.server.errors import ApiError, invalid
from outrider.server.settings import ServerConfig
from outrider.structured.grammar import Grammar, GrammarCompiler, GrammarError
from outrider.structured.reasoning import FORMATS, ReasoningStream, opens_in_reasoning, split_reasoning
from outrider.structured.generic_tools import GenericFormat, GenericStream
from outrider.structured.tool_calls import ToolCall, ToolCallStream, ToolFormat, format_for_template, tool_grammar
from outrider.tokenizer import Tokenizer


def request_grammar(body: dict, compiler: GrammarCompiler) -> Grammar | None:
    """The grammar of `grammar` (GBNF), `json_schema` or `response_format`; at most one of them may be given
    (null is not given, nor is an empty `grammar`, llama-server's default; anything else must be valid)."""
    given = [name for name in ("grammar", "json_schema", "response_format")
             if body.get(name) is not None and not (name == "grammar" and body[name] == "")]
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise invalid("response_format", 'expected {"type": "text" | "json_object" | "json_schema"}')
        if fmt["type"] == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise ApiError(400, f"give one of 'grammar', 'json_schema' and 'response_format', not {given}")
    if not given:
        return None
    name = given[0]
    try:
        if name == "grammar":
            if not isinstance(body["grammar"], str):
                raise invalid("grammar", "expected a GBNF grammar string")
            return compiler.gbnf(body["grammar"])
        return compiler.json_schema(_schema(body, name))
    except GrammarError as e:
        raise invalid(name, f"the grammar does not compile: {e}") from e


def _schema(body: dict, name: str) -> dict:
    """The JSON Schema of `json_schema`, or of `response_format` (json_object: any object unless it gives one;
    json_schema: `json_schema.schema`, `strict` or not: output always follows the schema)."""
    if name == "json_schema":
        schema = body["json_schema"]
    else:
        fmt = body["response_format"]
        if fmt["type"] == "json_object":
            schema = fmt.get("schema") or {"type": "object"}
        else:
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            schema = schema if schema is not None else fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid(name, "expected a JSON Schema object")
    return schema


def template_body(body: dict, config: ServerConfig) -> dict:
    """The chat body the template renders: the server's --chat-template-kwargs under the request's own, and
    tools refused under --no-jinja (as llama-server does)."""
    if body.get("tools") and not config.jinja:
        raise ApiError(400, "tools param requires --jinja flag")
    kwargs = body.get("chat_template_kwargs")
    if not config.chat_template_kwargs or (kwargs is not None and not isinstance(kwargs, dict)):
        return body  # (proto.chat_prompt names a bad chat_template_kwargs)
    return {**body, "chat_template_kwargs": {**config.chat_template_kwargs, **(kwargs or {})}}


@dataclass(frozen=True)
class ChatShape:
    """How a chat reply reads back: tool calls in the template family's syntax (None: no tools were offered),
    and the reasoning split."""

    tools: ToolFormat | GenericFormat | None
    reasoning: str  # a reasoning format (structured/reasoning.py)
    in_reasoning: bool  # the prompt opened the thoughts

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message, and whether it holds tool calls."""
        split = split_reasoning(text, self.reasoning, self.in_reasoning) if self.reasoning != "none" else None
        content = split.content if split is not None else text
        reply = self.tools.parse(content) if self.tools is not None else None
        msg: dict[str, Any] = {"role": "assistant", "content": reply.content if reply is not None else content}
        if split is not None and split.reasoning:
            msg["reasoning_content"] = split.reasoning
        if reply is not None and reply.tool_calls:
            msg["content"] = msg["content"] or None
            msg["tool_calls"] = [c.to_openai() for c in reply.tool_calls]
        return msg, bool(reply is not None and reply.tool_calls)

    def stream(self, arguments_in_pieces: bool) -> ChatStream:
        return ChatStream(self, arguments_in_pieces)


class ChatStream:
    """One choice's streamed reply as delta objects: reasoning_content, content and tool_calls."""

    def __init__(self, shape: ChatShape, arguments_in_pieces: bool) -> None:
        """arguments_in_pieces: generic calls stream their arguments as they are written (else each goes whole
        once the reply is, and a call cut short is dropped)."""
        self._reasoning = ReasoningStream(shape.reasoning, shape.in_reasoning) if shape.reasoning != "none" else None
        fmt = shape.tools
        self._tools = None if fmt is None else GenericStream(fmt, arguments_in_pieces) \
            if isinstance(fmt, GenericFormat) else ToolCallStream(fmt)

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def push(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(text, final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas("", final=True)

    def _deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        content = text
        if self._reasoning is not None:
            split = self._reasoning.finish() if final else self._reasoning.push(text)
            if split.reasoning:
                deltas.append({"reasoning_content": split.reasoning})
            content = split.content
        calls: list[ToolCall] = []
        if self._tools is not None:
            first = self._tools.num_calls
            reply = self._tools.push(content)
            if final:
                last = self._tools.finish()
                reply = type(reply)(reply.content + last.content, reply.tool_calls + last.tool_calls)
            content, calls = reply.content, reply.tool_calls
        if content:
            deltas.append({"content": content})
        entries = [c.to_openai(first + j) for j, c in enumerate(calls)]
        if isinstance(self._tools, GenericStream):  # (its calls stream in pieces)
            entries += self._tools.take_call_deltas()
        if entries:
            deltas.append({"tool_calls": entries})
        return deltas


def chat_shape(body: dict, config: ServerConfig, tokenizer: Tokenizer, prompt: str) -> ChatShape:
    """The reading of this chat request's reply (`prompt`: its rendered prompt)."""
    fmt = body.get("reasoning_format", config.reasoning_format)
    if fmt not in FORMATS:
        raise invalid("reasoning_format", f"expected one of {', '.join(FORMATS)}")
    tools = None
    if body.get("tools"):
        tools = format_for_template(tokenizer.chat_template) if tokenizer.template_caps.tools else GenericFormat()
    return ChatShape(tools, fmt, opens_in_reasoning(prompt))


def response_schema(body: dict) -> dict | None:
    """The JSON Schema `json_schema` or a JSON `response_format` gives (None: neither, or a GBNF `grammar`)."""
    name = "json_schema" if body.get("json_schema") is not None else "response_format"
    fmt = body.get("response_format")
    if name == "response_format" and not (isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")):
        return None
    return _schema(body, name)


def tool_choice_grammar(body: dict, shape: ChatShape, compiler: GrammarCompiler,
                        response: dict | None = None) -> Grammar | None:
    """`tool_choice` "required" or a named function: a grammar that admits only calls (of that function);
    "auto" constrains nothing but the generic format's JSON reply (whose `response` follows the `response` schema
    when given); "none" constrains nothing."""
    choice = body.get("tool_choice")
    generic = isinstance(shape.tools, GenericFormat)
    if choice == "none" or choice in (None, "auto") and not generic:
        return None
    tools = body.get("tools") or []
    if not tools:
        raise invalid("tool_choice", "needs 'tools'")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"tools[{i}]", 'expected {"type": "function", "function": {"name": ..., ...}}')
    if isinstance(choice, dict) or choice not in (None, "auto", "required"):
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise invalid("tool_choice", 'expected "auto", "none", "required" or a function named in \'tools\'')
    parallel = proto.get_bool(body, "parallel_tool_calls", True)
    try:
        if generic:
            return compiler.lark(shape.tools.grammar(tools, parallel, required=choice not in (None, "auto"),
                                                     response=response), kind="tool_calls")
        return compiler.lark(tool_grammar(shape.tools, tools, parallel), kind="tool_calls")
    except GrammarError as e:
        raise invalid("tools", f"a tool's parameters do not compile to a grammar: {e}") from e
