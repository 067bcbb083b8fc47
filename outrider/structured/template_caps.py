"""What a chat template can render, found by rendering probe conversations (as llama-server's template engine
does), and the rewrites that let any template render any OpenAI conversation:

- a system message the template cannot show opens the next user message instead;
- assistant tool calls a template does not render become the message's text, a JSON object in the generic
  tool-call format (structured/generic_tools.py), so the model sees its earlier calls as it was asked to write them;
- tool results a template does not render become user messages holding `{"tool_response": {...}}`;
- a tool result without a `name` gets the name of the call it answers (its `tool_call_id`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TOOL = "outrider_probe_tool"
_CALL = "outrider_probe_call"
_RESULT = "outrider_probe_result"
_SYSTEM = "outrider_probe_system"
_USER = {"role": "user", "content": "Hi"}
_CALLING = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_probe0", "type": "function", "function": {"name": _CALL, "arguments": {"x": 1}}}]}

Render = Callable[[list[dict], "list | None", bool], str]  # (messages, tools, add_generation_prompt) -> prompt


@dataclass(frozen=True)
class TemplateCaps:
    system_role: bool  # shows a system message's text
    tools: bool  # shows the `tools` it is given
    tool_calls: bool  # shows an assistant message's tool calls
    tool_responses: bool  # shows a `tool` message's text

    @classmethod
    def probe(cls, render: Render) -> TemplateCaps:
        tool = {"type": "function", "function": {"name": _TOOL, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        return cls(
            system_role=_shows(render, [{"role": "system", "content": _SYSTEM}, _USER], None, _SYSTEM),
            tools=_shows(render, [_USER], [tool], _TOOL),
            tool_calls=_shows(render, [_USER, _CALLING], None, _CALL),
            tool_responses=_shows(render, [_USER, _CALLING, {"role": "tool", "tool_call_id": "call_probe0",
                                                             "name": _CALL, "content": _RESULT}], None, _RESULT),
        )


def _shows(render: Render, messages: list[dict], tools: list | None, marker: str) -> bool:
    try:
        return marker in render(messages, tools, False)
    except Exception:  # noqa: BLE001 - a template that fails on the probe cannot show it
        return False


def call_record(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (arguments already parsed) as the generic format writes one (the model writes no ids)."""
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    return {"name": fn.get("name"), "arguments": fn.get("arguments", {})}


def polyfill(messages: Sequence[dict], caps: TemplateCaps) -> list[dict]:
    """`messages` (normalised: content is a string) rewritten to what the template can show."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant messages
    out: list[dict] = []
    system = ""  # system text waiting for the next user message (a template without a system role)
    for m in messages:
        m = dict(m)
        for call in m.get("tool_calls") or ():
            if isinstance(call, Mapping) and call.get("id"):
                names[call["id"]] = call_record(call)["name"]
        if m["role"] == "tool" and not m.get("name") and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        if m["role"] == "assistant" and m.get("tool_calls") and not caps.tool_calls:
            record: dict[str, Any] = {"tool_calls": [call_record(c) for c in m.pop("tool_calls")]}
            if m["content"]:
                record["content"] = m["content"]
            m["content"] = json.dumps(record, ensure_ascii=False)
        if m["role"] == "tool" and not caps.tool_responses:
            response = {"tool": m.get("name"), "tool_call_id": m.get("tool_call_id"), "content": m["content"]}
            m = {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
        if m["role"] == "system" and not caps.system_role:
            system += m["content"] + "\n\n"
            continue
        if system and m["role"] == "user":
            m["content"], system = system + m["content"], ""
        out.append(m)
    if system:  # no user message followed: the system text stands as one
        out.append({"role": "user", "content": system.rstrip("\n")})
    return out


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that offers `tools` (OpenAI entries) to a model whose template cannot show them, in the
    generic tool-call format (structured/generic_tools.py)."""
    listed = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False, indent=2)
    example = json.dumps({"tool_calls": [{"name": "tool_name", "arguments": {"arg": "value"}}]})
    return ("You can call the following tools to answer the user's request:\n\n" + listed + "\n\n"
            "Respond in JSON format, either with `tool_calls` (a request to call tools) or with `response` (your "
            "reply to the user's request), for example:\n\n" + example + "\n\n" + json.dumps({"response": "..."}))


def with_system(messages: list[dict], text: str) -> list[dict]:
    """`text` added to the conversation's system message (a new one first when it has none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
