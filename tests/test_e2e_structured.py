"""Structured output through the real server (the bundled demo model, a Qwen-style template with tools):
JSON Schema and GBNF sampling, response_format, tool calls through the official openai client (streamed and
not), the reasoning split on a live reply, and the 400s of grammars that do not compile."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import jsonschema
import llguidance
import pytest
from openai import OpenAI

from e2e_harness import ServerProcess, sse_events
from outrider.demo import demo_path
from outrider.structured.grammar import GrammarCompiler
from outrider.testing.tokenizer import CHAT_TEMPLATE
from outrider.tokenizer import Tokenizer

SAMPLES = 50
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "admin": {"type": "boolean"}}, "required": ["name", "admin"]},
        "note": {"type": "string", "maxLength": 8}}, "required": ["user"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1,
              "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"]},
    "numbers": {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                                 "count": {"type": "integer", "minimum": 10, "maximum": 99}},
                "required": ["ratio", "count"]},
    "pattern": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}-[A-Z]{2}$"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["id"]},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "b": {"type": "string", "maxLength": 5},
                                                  "c": {"type": "array", "items": {"type": "boolean"},
                                                        "maxItems": 3}},
                 "required": ["a"]},
}
GBNF = {
    "arithmetic": 'root ::= expr\nexpr ::= term (op term){0,3}\nterm ::= [0-9]{1,3} | "(" [0-9]{1,3} op '
                  '[0-9]{1,3} ")"\nop ::= "+" | "-" | "*"',
    "list": 'root ::= item{1,4}\nitem ::= "- " [a-z]{1,8} "\\n"',
    "choice": 'root ::= ("yes" | "no" | "maybe") ("." | "!")',
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 100}, "b": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
THINKING = 'root ::= "<think>" [a-z ]{1,20} "</think>" [a-z ]{1,12}'


@dataclass
class Clients:
    http: httpx.Client
    oai: OpenAI


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """One demo server (no drafter, 64 slots: a request's 50 samples run together, each slot with the model's
    whole context (-kvu), Qwen-style tool template)."""
    template = tmp_path_factory.mktemp("structured") / "qwen.jinja"
    template.write_text(CHAT_TEMPLATE)
    srv = ServerProcess(["--demo-draft", "none", "-np", "64", "-kvu", "--chat-template-file", str(template)])
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            yield Clients(http, OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300))
    finally:
        srv.stop()


@pytest.fixture
def client(clients):
    return clients.http


@pytest.fixture
def oai(clients):
    return clients.oai


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer.from_pretrained(demo_path("target"))
    return GrammarCompiler(tok.to_json(), tok.vocab_size, tok.eos_token_ids)


def test_json_schema_samples_all_parse_and_validate(client):
    for name, schema in SCHEMAS.items():
        r = client.post("/completion", json={"prompt": "def parse(data):", "json_schema": schema, "n": SAMPLES,
                                             "temperature": 0.8, "n_predict": 200})
        assert r.status_code == 200, r.text
        bodies = r.json()
        assert len(bodies) == SAMPLES
        texts = [b["content"] for b in bodies]
        for b, text in zip(bodies, texts):
            assert b["stop_type"] == "eos", (name, text)
            jsonschema.validate(json.loads(text), schema)
        assert len(set(texts)) > 1, (name, texts[0])  # sampled, not one forced string


def test_gbnf_samples_are_accepted_by_the_grammar_engine(client, compiler):
    for name, grammar in GBNF.items():
        r = client.post("/completion", json={"prompt": "x = ", "grammar": grammar, "n": 20, "temperature": 0.8,
                                             "n_predict": 100, "return_tokens": True})
        assert r.status_code == 200, r.text
        compiled = compiler.gbnf(grammar)
        for body in r.json():
            matcher = llguidance.LLMatcher(compiled.tokenizer, compiled.compiled)
            assert matcher.consume_tokens(body["tokens"]) and matcher.is_accepting(), (name, body["content"])
        assert r.json()[0]["generation_settings"]["grammar"] == grammar


def test_response_format_json_schema_and_json_object(oai):
    schema = SCHEMAS["enum"]
    for fmt in ({"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}},
                {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}):
        reply = oai.chat.completions.create(model="m", messages=MESSAGES, response_format=fmt, max_tokens=60, n=4)
        for choice in reply.choices:
            jsonschema.validate(json.loads(choice.message.content), schema)
    reply = oai.chat.completions.create(model="m", messages=MESSAGES, response_format={"type": "json_object"},
                                        max_tokens=80, temperature=0)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def validate_call(call) -> None:
    tool = {t["function"]["name"]: t for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id and call.type == "function"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_bound_tool_choice_returns_a_valid_call(oai, choice):
    reply = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                        parallel_tool_calls=False, max_tokens=100)
    out = reply.choices[0]
    assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) == 1
    validate_call(out.message.tool_calls[0])
    if isinstance(choice, dict):
        assert out.message.tool_calls[0].function.name == "add"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_bound_tool_choice_streams_tool_call_deltas(oai, choice):
    stream = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                         parallel_tool_calls=False, max_tokens=100, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                calls.setdefault(d.index, d)
    assert finish == "tool_calls" and list(calls) == [0]
    validate_call(calls[0])


def test_parallel_calls_each_validate(oai):
    reply = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        max_tokens=90, seed=3)
    calls = reply.choices[0].message.tool_calls
    assert calls
    for call in calls:
        validate_call(call)


def test_tool_messages_round_trip_through_the_template(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    prompt = client.post("/apply-template", json={"messages": messages, "tools": TOOLS}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt and '"name": "add"' in prompt
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 200


def test_live_reasoning_is_split_streamed_and_not(client):
    body = {"messages": MESSAGES, "grammar": THINKING, "max_tokens": 60}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    assert "<think>" not in message["content"] + message["reasoning_content"]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True, "seed": 1}).iter_lines())
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    whole = client.post("/v1/chat/completions", json={**body, "seed": 1}).json()["choices"][0]["message"]
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    plain = client.post("/v1/chat/completions", json={**body, "reasoning_format": "none"}).json()
    assert plain["choices"][0]["message"]["content"].startswith("<think>")


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "grammar": 'root ::= "a" missing'}, "grammar"),
    ({"prompt": "x", "json_schema": {"type": "string", "pattern": "(unclosed"}}, "json_schema"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
     "response_format"),
    ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"prompt": "x", "grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
])
def test_bad_constraints_get_a_400_naming_the_field(client, body, field):
    route = "/v1/chat/completions" if "messages" in body else "/completion"
    r = client.post(route, json=body)
    assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"], r.text
