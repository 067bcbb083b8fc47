"""Chat messages as agents send them render with every template: null or missing content beside tool calls,
content as parts, tool results with and without names; a template without tools gets them in its system message
(the generic format) and its replies read back as calls; a template that raises names the message at fault."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.chat_templates import BUILTIN_TEMPLATES
from outrider.structured.generic_tools import GenericFormat, GenericStream, partial_json_string
from outrider.structured.template_caps import TemplateCaps, polyfill
from outrider.testing.tokenizer import CHAT_TEMPLATE, write_tiny_tokenizer
from outrider.tokenizer import ChatTemplateError, Tokenizer

# SmolLM2-Instruct's template (its GGUF's tokenizer.chat_template): no tools, content concatenated with `+`
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    {"role": "assistant", "tool_calls": [{**CALL, "id": "call_2"}]},  # content missing altogether
    {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "22 degrees"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return Tokenizer.from_pretrained(path)


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("name", [*BUILTIN_TEMPLATES, "smollm2"])
def test_agent_histories_render_with_every_template(tok, name):
    tok = with_template(tok, SMOLLM2_TEMPLATE if name == "smollm2" else BUILTIN_TEMPLATES[name])
    text = tok.apply_chat_template(HISTORY, tools=TOOLS)
    for shown in ("Weather\n\nin Paris?", "21 degrees", "22 degrees", '"name": "get_weather"', '"city": "Paris"'):
        assert shown in text, (name, shown, text)
    assert "None" not in text


def test_a_template_without_tools_gets_them_in_the_system_message(tok):
    tok = with_template(tok, SMOLLM2_TEMPLATE)
    assert tok.template_caps == TemplateCaps(system_role=True, tools=False, tool_calls=False, tool_responses=True)
    text = tok.apply_chat_template(HISTORY, tools=TOOLS)
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and '"name": "get_weather"' in system
    assert "`tool_calls`" in system and "`response`" in system
    # earlier calls are shown as the model is asked to write them
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in text


def test_a_template_with_tools_renders_them_itself(tok):
    tok = with_template(tok, CHAT_TEMPLATE)
    assert tok.template_caps.tools and tok.template_caps.tool_calls
    text = tok.apply_chat_template(HISTORY, tools=TOOLS)
    assert "`response`" not in text and "<tool_response>\n21 degrees\n</tool_response>" in text


def test_tool_results_without_a_name_get_the_name_of_their_call():
    caps = TemplateCaps(system_role=True, tools=False, tool_calls=True, tool_responses=False)
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c9", "function": {"name": "lookup", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "found"}]
    out = polyfill(messages, caps)
    assert json.loads(out[1]["content"]) == {"tool_response": {"tool": "lookup", "tool_call_id": "c9",
                                                               "content": "found"}}
    assert out[1]["role"] == "user"
    shown = polyfill(messages, TemplateCaps(True, True, True, True))
    assert shown[1] == {**messages[1], "name": "lookup"}


def test_a_system_message_without_a_system_role_opens_the_next_user_turn():
    caps = TemplateCaps(system_role=False, tools=False, tool_calls=True, tool_responses=True)
    out = polyfill([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], caps)
    assert out == [{"role": "user", "content": "S\n\nU"}]


@pytest.mark.parametrize("template, index, fault", [
    ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", 0, "TypeError"),
    ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
     "{{ m.content }}{% endfor %}", None, "no tools here"),  # (the probe finds no tool role: it is rewritten)
    ("{% for m in messages %}{{ m.content }}{% if loop.index0 == 2 %}{{ 1 // 0 }}{% endif %}{% endfor %}", 2,
     "ZeroDivisionError"),
])
def test_whatever_a_template_raises_names_the_message(tok, template, index, fault):
    tok = with_template(tok, template)
    if index is None:  # rewritten to a user message, it renders
        assert "21 degrees" in tok.apply_chat_template(HISTORY)
        return
    with pytest.raises(ChatTemplateError, match=rf"at messages\[{index}\]: .*{fault}"):
        tok.apply_chat_template(HISTORY)


# --- the generic format's replies ---
def test_generic_replies_read_back_as_calls_or_text():
    fmt = GenericFormat()
    reply = fmt.parse('{"tool_calls": [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]}')
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("a", {"x": 1}), ("b", {})]
    assert reply.content == ""
    assert fmt.parse('{"tool_call": {"name": "a", "arguments": {}}}').tool_calls[0].name == "a"
    assert fmt.parse('{"response": "Hi \\"you\\" \\u00e9"}').content == 'Hi "you" é'
    # cut by max_tokens: the response so far; nothing of a call
    assert fmt.parse('{"response": "Hel').content == "Hel"
    assert fmt.parse('{"tool_calls": [{"name": "a", "argu').content == ""
    assert fmt.parse('{"tool').content == ""
    assert fmt.parse('{"response": {"a": [1, "é"]}}').content == '{"a": [1, "é"]}'  # a response_format value


def test_partial_json_strings_hold_back_unfinished_escapes():
    assert partial_json_string('ab\\') == "ab"
    assert partial_json_string('ab\\u00') == "ab"
    assert partial_json_string('ab\\ud83d') == "ab"
    assert partial_json_string('ab\\ud83d\\ude00"}') == "ab😀"
    assert partial_json_string('a\\nb" tail') == "a\nb"


GENERIC_REPLIES = ['{"response": "It is \\"sunny\\"\\n\\u00e9 today"}',
                   '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
                   '{"response": "cut sho', '{"tool_calls": [{"name": "get_w', "plain words",
                   '{"response": {"answer": "Paris", "n": [1, 2]}}']


def streamed(text: str, cuts: list[int], pieces: bool) -> tuple[str, list[tuple[str, str]]]:
    """A generic reply pushed in pieces: its content, and its calls as a client accumulates the `tool_calls`
    deltas (OpenAI's rule: an entry with an id starts a call, the others extend its arguments)."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = GenericStream(GenericFormat(), arguments_in_pieces=pieces)
    content, calls = "", {}
    for a, b in zip(bounds, bounds[1:]):
        content += stream.push(text[a:b]).content
        for d in stream.take_call_deltas():
            calls.setdefault(d["index"], ["", ""])
            calls[d["index"]][0] = d["function"].get("name") or calls[d["index"]][0]
            calls[d["index"]][1] += d["function"]["arguments"]
    content += stream.finish().content
    for d in stream.take_call_deltas():
        calls.setdefault(d["index"], [d["function"].get("name", ""), ""])[1] += d["function"]["arguments"]
    assert stream.num_calls == len(GenericFormat().parse(text).tool_calls)
    return content, [tuple(calls[i]) for i in sorted(calls)]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(GENERIC_REPLIES), st.lists(st.integers(0, 80), max_size=10), st.booleans())
def test_streamed_generic_replies_equal_the_whole_parse(text, cuts, pieces):
    """Either way a reply streams (calls' arguments in pieces or each call whole), the content and calls a client
    accumulates equal the whole reply's parse; a call cut short never goes out whole."""
    whole = GenericFormat().parse(text)
    content, calls = streamed(text, cuts, pieces)
    assert content == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]


ARGUMENT_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=4), ARGUMENT_VALUES, max_size=4), min_size=1, max_size=3),
       st.booleans(), st.booleans(), st.lists(st.integers(0, 400), max_size=12))
def test_streamed_call_arguments_add_up_to_the_parsed_call(arguments, ascii_escapes, parallel, cuts):
    """Arguments as the grammar may spell them (escaped or literal characters, any number spelling json emits)
    stream in pieces that add up to the whole parse's `arguments`, for every way the text is cut."""
    calls = [{"name": f"f{i}", "arguments": a} for i, a in enumerate(arguments)]
    reply = {"tool_calls": calls} if parallel else {"tool_call": calls[0]}
    text = json.dumps(reply, ensure_ascii=ascii_escapes)
    _, got = streamed(text, cuts, pieces=True)
    assert got == [(c.name, c.arguments) for c in GenericFormat().parse(text).tool_calls]


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=8)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={"content": JSON_VALUES | st.text(max_size=5), "tool_calls": JSON_VALUES | st.just([CALL]),
              "tool_call_id": JSON_VALUES, "name": JSON_VALUES}), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(MESSAGES, st.sampled_from(["chatml", "llama3", "gemma", "smollm2", "tools"]))
def test_any_message_renders_or_is_a_template_error(tok, messages, name):
    """Whatever the messages hold, rendering either works or raises ChatTemplateError (a 400): never another
    exception (a 500)."""
    template = {"smollm2": SMOLLM2_TEMPLATE, "tools": CHAT_TEMPLATE}.get(name) or BUILTIN_TEMPLATES[name]
    tok = with_template(tok, template)
    try:
        tok.apply_chat_template(messages, tools=TOOLS)
    except ChatTemplateError:
        pass
