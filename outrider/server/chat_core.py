"""A chat body, read once for every route that speaks chat (OpenAI chat, Responses, Anthropic Messages): the
rendered prompt's ids, the reading of the reply (reasoning split, tool calls) and the grammar that binds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from outrider.server import protocol as proto
from outrider.server.errors import ApiError
from outrider.engine.request import RequestOutput
from outrider.server.state import Generation, ServerState
from outrider.server.structured import (ChatShape, chat_shape, request_grammar, response_schema, template_body,
                                        tool_choice_grammar)
from outrider.structured.generic_tools import GenericFormat
from outrider.structured.grammar import Grammar


@dataclass(frozen=True)
class ChatPlan:
    body: dict  # the chat body as rendered (server template kwargs merged; no `tools` under tool_choice none)
    prompt_ids: list[int]
    shape: ChatShape
    grammar: Grammar | None  # response_format/json_schema/grammar, or the tool-call grammar


def plan_chat(body: dict, state: ServerState) -> ChatPlan:
    body = template_body(body, state.config)
    text = _chat_prompt(body, state)
    shape = chat_shape(body, state.config, state.tokenizer, text)
    grammar = request_grammar(body, state.core.grammars)
    response = None
    if isinstance(shape.tools, GenericFormat) and body.get("tool_choice") in (None, "auto"):
        response = response_schema(body)  # (the generic reply's `response` follows it: one grammar for both)
    tool_grammar = tool_choice_grammar(body, shape, state.core.grammars, response)
    if response is not None:
        grammar = None
    if grammar is not None and tool_grammar is not None:
        raise ApiError(400, "a 'tool_choice' that requires a call cannot be combined with 'response_format', "
                            "'json_schema' or 'grammar', nor 'tools' with a GBNF 'grammar' for this model's template")
    return ChatPlan(body, proto.encode_chat(text, state.tokenizer, state.n_ctx), shape, grammar or tool_grammar)


def chat_prompt_ids(body: dict, state: ServerState) -> list[int]:
    """The prompt a chat body renders to, as the chat routes tokenize it."""
    body = template_body(body, state.config)
    return proto.encode_chat(_chat_prompt(body, state), state.tokenizer, state.n_ctx)


def _chat_prompt(body: dict, state: ServerState) -> str:
    """The rendered chat prompt. With tool_choice "none" the model may not call tools, so the template does not
    offer them (the body loses its `tools`)."""
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none", "required") and not isinstance(choice, dict):
        raise proto.invalid("tool_choice", 'expected "auto", "none", "required" or {"type": "function", ...}')
    if choice == "none":
        body.pop("tools", None)
    return proto.chat_prompt(body, state.tokenizer, state.config.prefill_assistant)


def function_tools(tools: Any, accepted: Callable[[dict], bool], schema_key: str, refusal: str) -> list[dict] | None:
    """A route's tool list (Responses', Anthropic's) as chat `tools`: each a {"name", "description", schema_key}
    that `accepted` takes; any other is a 400 saying `refusal`."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise proto.invalid("tools", "expected an array")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not accepted(tool) or not isinstance(tool.get("name"), str):
            raise proto.invalid(f"tools[{i}]", refusal)
        schema = tool.get(schema_key) or {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise proto.invalid(f"tools[{i}].{schema_key}", "expected a JSON Schema object")
        fn = {"name": tool["name"], "parameters": schema}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


async def reply_deltas(gen: Generation, shape: ChatShape,
                       streamed: bool) -> AsyncIterator[tuple[list[dict[str, Any]], RequestOutput]]:
    """One request's reply as it arrives: each output (prefill reports skipped) with the chat deltas it makes
    (`reasoning_content`, `content`, `tool_calls` in OpenAI's form), the last ones with the final output.
    `streamed`: the client reads them as they come (calls' arguments in pieces; else each call whole, and a call
    cut short is dropped)."""
    stream = shape.stream(arguments_in_pieces=streamed)
    async for _, out in gen.outputs():
        if not out.new_token_ids and not out.finished:
            continue
        yield stream.push(out.text) + (stream.finish() if out.finished else []), out


def submit_chat(plan: ChatPlan, state: ServerState) -> Generation:
    """The plan as one request (no choices, no log-probs: the Responses and Messages routes)."""
    params = proto.sampling_params(plan.body, state.config.defaults, state.tokenizer, n_probs=0,
                                   grammar=plan.grammar)
    return state.admit(proto.make_requests([plan.prompt_ids], params, 1, state.n_ctx))
