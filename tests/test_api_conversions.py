"""The Responses and Anthropic Messages requests read into chat bodies: every item and block kind maps to the
chat message the template renders, and what cannot be served is a 400 naming the field."""

from __future__ import annotations

import pytest

from outrider.server.errors import ApiError
from outrider.server.messages import chat_body as anthropic_chat
from outrider.server.responses import chat_body as responses_chat
from outrider.server.responses import input_messages


def test_response_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "I should look it up."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "21 degrees"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "10:30"}]},
        {"type": "function_call", "call_id": "c3", "name": "time", "arguments": "{}"},
    ]
    call = lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}}  # noqa: E731
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\n\nin Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should look it up.",
         "tool_calls": [call("c1", "weather", '{"city": "Paris"}'), call("c2", "time", "{}")]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"},
        {"role": "tool", "tool_call_id": "c2", "content": "10:30"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "time", "{}")]},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_a_responses_body_maps_its_fields():
    chat, conversation = responses_chat({
        "input": "hi", "instructions": "Be kind.", "max_output_tokens": 9, "temperature": 0,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "text": {"format": {"type": "json_object"}},
        "reasoning": {"effort": "low"}}, history=[{"role": "user", "content": "before"}])
    assert chat["messages"][0] == {"role": "system", "content": "Be kind."}
    assert conversation == [{"role": "user", "content": "before"}, {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 9 and chat["reasoning_effort"] == "low"
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("body, field", [
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
    ({"input": []}, "input"),
])
def test_responses_refusals_name_the_field(body, field):
    with pytest.raises(ApiError) as e:
        responses_chat(body, [])
    assert e.value.status == 400 and f"'{field}'" in e.value.message


def test_anthropic_blocks_become_chat_messages():
    chat = anthropic_chat({
        "system": [{"type": "text", "text": "Be brief."}], "max_tokens": 5, "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21 degrees"},
                                         {"type": "text", "text": "And tomorrow?"}]}],
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "21 degrees"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat["stop"] == ["END"] and chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]},
     "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": [1]}, "stop_sequences"),
])
def test_anthropic_refusals_name_the_field(body, field):
    with pytest.raises(ApiError) as e:
        anthropic_chat(body)
    assert e.value.status == 400 and f"'{field}'" in e.value.message


# --- replies: the chat deltas of one reply as Responses output items and Anthropic blocks, with their events ---
def _reply():
    from outrider.engine.request import FinishReason, RequestOutput
    from outrider.timing import RequestTiming

    timing = RequestTiming(prompt_n=10, predicted_n=6)
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    pushes = [([{"reasoning_content": "Let me "}], [1]), ([{"reasoning_content": "think."}], [2]),
              ([{"content": "Calling."}], [3, 4]), ([{"tool_calls": [call]}], [5, 6])]
    outs = [RequestOutput(1, ids, timing=timing) for _, ids in pushes]
    last = RequestOutput(1, [], finished=True, finish_reason=FinishReason.STOP, stop_type="eos", timing=timing)
    return [(d, o) for (d, _), o in zip(pushes, outs)], last


def test_a_reply_as_responses_output_items_and_events():
    from outrider.server.responses import ResponseBuilder

    builder = ResponseBuilder({"id": "resp_1", "output": [], "status": "in_progress"})
    events = builder.start()
    pushes, last = _reply()
    for deltas, out in pushes:
        events += builder.push(deltas, out)
    events += builder.finish(last, prompt_tokens=10)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["reasoning", "message", "function_call"]
    assert done["output"][0]["content"][0]["text"] == "Let me think."
    assert done["output"][1]["content"][0]["text"] == "Calling."
    assert done["output"][2]["arguments"] == '{"x": 1}' and done["output"][2]["call_id"] == "call_1"
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == 2 and done["usage"]["output_tokens"] == 6
    assert builder.conversation() == [{"role": "assistant", "content": "Calling.", "reasoning_content": "Let me think.",
                                       "tool_calls": [{"id": "call_1", "type": "function",
                                                       "function": {"name": "f", "arguments": '{"x": 1}'}}]}]


def test_a_reply_as_anthropic_blocks_and_events():
    from outrider.server.messages import MessageBuilder

    builder = MessageBuilder({"content": [], "usage": {"input_tokens": 10, "output_tokens": 0}})
    events = builder.start()
    pushes, last = _reply()
    for deltas, _ in pushes:
        events += builder.push(deltas)
    events += builder.finish(last)
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2), ("message_delta", None),
        ("message_stop", None)]
    assert events[2]["delta"] == {"type": "thinking_delta", "thinking": "Let me "}
    assert events[9]["delta"] == {"type": "input_json_delta", "partial_json": '{"x": 1}'}
    assert builder.message["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                                          {"type": "text", "text": "Calling."},
                                          {"type": "tool_use", "id": "call_1", "name": "f", "input": {"x": 1}}]
    assert builder.message["stop_reason"] == "tool_use" and events[-2]["usage"] == {"output_tokens": 6}
