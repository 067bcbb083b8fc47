"""Agents and their clients against the served SmolLM2 file (a template without tools: the generic tool-call
format): the OpenAI Agents SDK's loop with its chat-completions and Responses models, the openai client's
`responses.create`, the anthropic client's `messages.create` and `count_tokens`, streamed and not.

SmolLM2-135M is too weak to choose tools on its own, so each run's first turn binds a call (`tool_choice`
required or named, which the server guarantees by its grammar); what follows is the model's own."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from e2e_harness import ServerProcess
from outrider.demo.smollm2 import smollm2_path

agents = pytest.importorskip("agents")

KEY = "agent-key"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "What is the weather and the local time in Paris?"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["-m", str(smollm2_path()), "-c", "2048", "-np", "2", "--api-key", KEY]) as srv:
        yield srv
        assert srv.proc.poll() is None, "".join(srv.stderr)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY)  # (sends x-api-key)


# --- the Agents SDK ---
def make_agent(model_kind: str, url: str, tool_choice: str, calls: list):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(("get_weather", city))
        return f"It is 21 degrees and sunny in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"It is 10:30 in {city}."

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY)
    model = (OpenAIChatCompletionsModel(model="m", openai_client=client) if model_kind == "chat"
             else OpenAIResponsesModel(model="m", openai_client=client))
    # reset_tool_choice (the SDK's default) lets the turns after the bound first one answer freely
    return Agent(name="assistant", instructions="Answer with the tools.", tools=[get_weather, get_time], model=model,
                 model_settings=ModelSettings(tool_choice=tool_choice, temperature=0, max_tokens=120))


async def run_agent(agent, streamed: bool):
    from agents import Runner

    if not streamed:
        return await Runner.run(agent, ASK, max_turns=6)
    result = Runner.run_streamed(agent, ASK, max_turns=6)
    kinds = set()
    async for event in result.stream_events():
        kinds.add(event.type)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("model_kind", ["chat", "responses"])
@pytest.mark.parametrize("tool_choice, tool", [("required", None), ("get_time", "get_time")])
def test_the_agents_sdk_runs_a_two_tool_loop_to_its_final_answer(server, model_kind, streamed, tool_choice, tool):
    from agents import ToolCallOutputItem, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list = []
    result = asyncio.run(run_agent(make_agent(model_kind, server.url, tool_choice, calls), streamed))
    assert calls and all(name in ("get_weather", "get_time") and isinstance(city, str) for name, city in calls)
    if tool is not None:
        assert calls[0][0] == tool
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert len(outputs) == len(calls)  # every call ran and its result went back to the model
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) >= 2  # the call's turn, then the answer's


# --- openai: responses.create ---
def test_responses_create_with_a_function_tool(oai, server):
    first = oai.responses.create(model="m", input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=60, temperature=0)
    assert first.status == "completed" and first.output
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    # the stored conversation goes on from previous_response_id
    follow = {"tools": [WEATHER], "tool_choice": "none",
              "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}]}
    second = oai.responses.create(model="m", previous_response_id=first.id, max_output_tokens=30, temperature=0,
                                  **follow)
    assert second.status in ("completed", "incomplete") and second.output_text.strip()

    def count(body):
        r = httpx.post(server.url + "/v1/responses/input_tokens", json=body, headers={"x-api-key": KEY})
        return r.json()["input_tokens"]

    assert second.usage.input_tokens == count({**follow, "previous_response_id": first.id}) > count(follow)
    assert oai.responses.retrieve(second.id).id == second.id
    timings = second.model_extra["timings"]
    assert timings["predicted_n"] == second.usage.output_tokens


def test_responses_create_streams_events_in_openai_order(oai):
    events = list(oai.responses.create(model="m", input="What is the weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=100, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    pieces = kinds.count("response.function_call_arguments.delta")
    assert pieces > 1  # the arguments stream as they are written
    assert kinds[2:5 + pieces] == ["response.output_item.added", *["response.function_call_arguments.delta"] * pieces,
                                   "response.function_call_arguments.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output[0].name == "get_weather"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        done.output[0].arguments
    text = list(oai.responses.create(model="m", input="Say hello.", instructions="Be brief.", max_output_tokens=12,
                                     temperature=0, stream=True, store=False))
    deltas = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    assert deltas and deltas == text[-1].response.output_text
    assert text[-1].type in ("response.completed", "response.incomplete")


def test_responses_refuse_bad_input_in_openai_format(oai, server):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="m", previous_response_id="resp_nope", input="x")
    r = httpx.post(server.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                   json={"input": [{"type": "computer_call_output", "call_id": "c"}]})
    assert r.status_code == 400 and "input[0].type" in r.json()["error"]["message"]


# --- anthropic: messages.create, count_tokens ---
GREEDY = {"temperature": 0}  # (this anthropic client takes no `temperature` argument; the API does)
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_messages_create_with_a_tool_and_count_tokens(claude):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model="m", max_tokens=100, system="Be brief.", messages=messages, tools=[TOOL],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use" and first.content[-1].type == "tool_use"
    use = first.content[-1]
    assert use.name == "get_weather" and isinstance(use.input, dict)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"}]}]
    counted = claude.messages.count_tokens(model="m", system="Be brief.", messages=messages, tools=[TOOL])
    second = claude.messages.create(model="m", max_tokens=30, system="Be brief.", messages=messages, tools=[TOOL],
                                    tool_choice={"type": "none"}, stop_sequences=["\n\n"])
    assert second.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert second.content and second.content[0].type == "text" and second.content[0].text
    assert second.usage.output_tokens > 0
    assert counted.input_tokens > first.usage.input_tokens
    # (tool_choice none leaves the tools out of the prompt, so that count is smaller than with them)
    assert second.usage.input_tokens < counted.input_tokens


def test_messages_stream_events_in_anthropic_order(claude):
    with claude.messages.stream(model="m", max_tokens=100, messages=[{"role": "user", "content": "Paris weather?"}],
                                tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                      "content_block_stop", "message_delta", "message_stop")]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    pieces = kinds.count("content_block_delta")
    assert pieces > 1 and kinds[1:3 + pieces] == ["content_block_start", *["content_block_delta"] * pieces,
                                                  "content_block_stop"]
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"
    assert isinstance(final.content[0].input, dict)
    text = claude.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "Hello!"}],
                                  stream=True, extra_body=GREEDY)
    events = list(text)
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta")


def test_messages_errors_are_in_anthropic_format(server):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": r.json()["error"][
        "message"]}} and "messages[0].content[0]" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "wrong"}, json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# --- chat completions: agent histories ---
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("assistant", [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                                       {"role": "assistant", "tool_calls": [CALL]}], ids=["null", "missing"])
def test_tool_call_histories_render(oai, assistant):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}, assistant,
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    reply = oai.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                        tools=[{"type": "function", "function": {
                                            k: v for k, v in WEATHER.items() if k != "type"}}])
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_tool_call_arguments_add_up_to_the_call(oai, parallel):
    """Streamed, a call's arguments come in pieces as the model writes them; the openai client's accumulation of
    the deltas gives the call the same request gives unstreamed (greedy)."""
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    ask = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}], tools=tools,
               tool_choice="required", max_tokens=80, temperature=0, parallel_tool_calls=parallel)
    whole = oai.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    with oai.chat.completions.stream(**ask) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        streamed = stream.get_final_completion().choices[0]
    pieces = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or ()]
    assert len(pieces) > len(whole.message.tool_calls) + 1  # not each call whole in one delta
    assert all(p.function.name is None for p in pieces if p.id is None)  # (a piece of arguments carries no name)
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c.id.startswith("call_") for c in streamed.message.tool_calls)


def test_a_call_cut_by_max_tokens_is_not_prose(oai):
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    reply = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Paris?"}], tools=tools,
                                        tool_choice="required", max_tokens=6)
    out = reply.choices[0]
    assert out.finish_reason == "length" and not out.message.content and not out.message.tool_calls
    chunks = list(oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Paris?"}],
                                              tools=tools, tool_choice="required", max_tokens=6, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the Responses and Messages routes, greedy, cut inside the call's arguments: unstreamed, no call; streamed, the
    # pieces already sent and a clean end
    ask = dict(model="m", input="Paris?", tools=[WEATHER], tool_choice="required", temperature=0)
    n = oai.responses.create(**ask, max_output_tokens=100).usage.output_tokens - 4
    cut = oai.responses.create(**ask, max_output_tokens=n)
    assert cut.status == "incomplete" and not cut.output
    events = list(oai.responses.create(**ask, max_output_tokens=n, stream=True))
    item = events[-1].response.output[0]
    assert events[-1].type == "response.incomplete" and item.status == "incomplete", item
    with pytest.raises(json.JSONDecodeError):
        json.loads(item.arguments)
    claude = anthropic.Anthropic(base_url=str(oai.base_url).removesuffix("/v1/"), api_key=KEY)
    ask = dict(model="m", messages=[{"role": "user", "content": "Paris?"}], tools=[TOOL], tool_choice={"type": "any"},
               extra_body=GREEDY)
    n = claude.messages.create(**ask, max_tokens=100).usage.output_tokens - 4
    whole = claude.messages.create(**ask, max_tokens=n)
    assert whole.stop_reason == "max_tokens" and not whole.content
    with claude.messages.stream(**ask, max_tokens=n) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].type == "tool_use"


# --- /infill: SmolLM2's vocabulary has repository tokens but no FIM ones ---
def test_infill_without_fim_tokens_is_a_clear_400(server):
    r = httpx.post(server.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "Infill is not supported by this model" in r.json()["error"]["message"]


def test_models_report_the_gguf_format(server):
    models = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).json()["models"]
    assert models[0]["details"]["format"] == "gguf"


def test_tools_and_a_response_format_share_one_grammar(oai):
    """A template without tools binds the generic reply: either calls, or a `response` that follows the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "degrees": {"type": "integer"}},
              "required": ["city", "degrees"]}
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    messages = [{"role": "user", "content": "It is 21 degrees in Paris. Answer in JSON."},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    reply = oai.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=80, temperature=0,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "w", "schema": schema}})
    out = reply.choices[0]
    if out.message.tool_calls:
        assert out.finish_reason == "tool_calls"
    else:
        import jsonschema

        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.message.content), schema)
