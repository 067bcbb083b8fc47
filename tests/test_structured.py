"""Structured output without a server: grammar compilation and matching, the per-row masks (plain and verify rows),
the sampler applying them in a mixed batch, the tool-call parsers and the reasoning split on fixed strings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.demo import demo_path
from outrider.engine.request import Request
from outrider.sampler import RowSpec, Sampler, SamplingRows, TokenMasks
from outrider.steps import ScheduledRequest
from outrider.params import SamplingParams
from outrider.structured.grammar import Constraint, GrammarCompiler, GrammarError, closed_objects, token_masks
from outrider.structured.reasoning import split_reasoning
from outrider.structured.tool_calls import Llama3Format, QwenFormat, Reply, ToolCallStream
from outrider.tokenizer import Tokenizer

EOS = (0, 2)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(demo_path("target"))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.to_json(), tok.vocab_size, EOS)


def allowed(bits: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def test_bad_grammars_fail_to_compile_with_the_reason(compiler):
    with pytest.raises(GrammarError, match="nope"):
        compiler.gbnf('root ::= "a" nope')
    with pytest.raises(GrammarError, match="unclosed"):
        compiler.json_schema({"type": "string", "pattern": "(a"})
    with pytest.raises(GrammarError, match="Invalid type"):
        compiler.json_schema({"type": "nothing"})


def test_objects_are_closed_unless_the_schema_says_otherwise():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}},
              "enum": [{"properties": 1}]}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]  # the map of names is not a schema
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["enum"] == [{"properties": 1}] and "additionalProperties" not in schema


def test_constraint_masks_follow_the_grammar_and_end_it(compiler, tok):
    grammar = compiler.gbnf('root ::= "yes" | "no"')
    c = Constraint(grammar)
    bits = np.zeros((1, (tok.vocab_size + 31) // 32), dtype=np.int32)
    c.fill(bits)
    ok = allowed(bits[0], tok.vocab_size)
    yes = tok.encode("yes", add_special=False)
    assert ok[yes[0]] and not ok[tok.encode("maybe", add_special=False)[0]]
    assert not any(ok[e] for e in EOS)  # nothing is complete yet
    done = [c.accept(t) for t in yes]
    assert done[-1] and not any(done[:-1])  # complete after the last token: the request ends there


def test_verify_rows_are_masked_after_each_draft_prefix_and_rolled_back(compiler, tok):
    grammar = compiler.gbnf('root ::= "a" [0-9] [0-9] "z"')
    ids = lambda s: tok.encode(s, add_special=False)  # noqa: E731
    a, digit, z = ids("a")[0], ids("7")[0], ids("z")[0]
    req = Request([5, 6], SamplingParams(grammar=grammar))
    free = Request([5, 6], SamplingParams())
    plan = [ScheduledRequest(free, 1, 1, True, [z]), ScheduledRequest(req, 1, 1, True, [a, z, digit])]
    masks = token_masks(plan, tok.vocab_size)
    assert masks.rows.tolist() == [2, 3, 4, 5]  # the constrained request's 4 rows, after the free one's 2
    rows = [allowed(b, tok.vocab_size) for b in masks.bits]
    assert rows[0][a] and not rows[0][digit]  # committed state: "a" first
    assert rows[1][digit] and not rows[1][z]  # after "a": a digit
    assert rows[2].all() and rows[3].all()  # after the forbidden "z": unreachable, left free
    again = token_masks(plan, tok.vocab_size)  # the matcher was rolled back: same masks
    assert np.array_equal(again.bits, masks.bits)
    assert token_masks([ScheduledRequest(free, 1, 1, True)], tok.vocab_size) is None


def test_sampler_applies_masks_only_to_constrained_rows():
    vocab = 70
    sampler = Sampler(vocab, "cpu")
    logits = torch.zeros(3, vocab)
    logits[:, 5] = 10.0  # every row's favourite
    bits = np.zeros((1, 3), dtype=np.int32)
    bits[0, 1] = 1 << (40 - 32)  # row 1 may only emit token 40
    specs = [RowSpec(SamplingParams(temperature=0.0), 0, 0) for _ in range(3)]
    rows = SamplingRows.of(specs)
    rows.allowed = TokenMasks(np.array([1]), bits)
    assert sampler.sample(logits, sampler.prepare(rows)).token_ids.tolist() == [5, 40, 5]
    sampled = [RowSpec(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), s, 0) for s in range(3)]
    rows = SamplingRows.of(sampled)
    rows.allowed = TokenMasks(np.array([1]), bits)
    logp = sampler.process(logits, sampler.prepare(rows))
    assert torch.isfinite(logp[1]).sum() == 1 and logp[1, 40] == 0.0
    assert torch.isfinite(logp[0]).all()


# --- tool-call parsers ---
QWEN_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_qwen_parser_reads_several_calls_after_text():
    reply = QwenFormat().parse(QWEN_TWO)
    assert reply.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in reply.tool_calls}) == 2


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>', "plain text"])
def test_qwen_parser_leaves_malformed_calls_as_content(text):
    reply = QwenFormat().parse(text)
    assert reply.tool_calls == [] and reply.content == text


def test_a_call_cut_short_is_not_returned_as_content():
    assert QwenFormat().parse('Sure. <tool_call>{"name": "f", "argu') == Reply("Sure. ", [])


def test_llama3_parser_reads_json_calls_and_leaves_the_rest():
    fmt = Llama3Format()
    reply = fmt.parse('{"name": "add", "parameters": {"a": 1, "s": "x;y}"}}; {"name": "f", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("add", {"a": 1, "s": "x;y}"}),
                                                                             ("f", {})]
    for text in ('The answer is {"name": "add"}', '{"name": "add", "parameters": {"a": 1}', '{"x": 1}'):
        assert fmt.parse(text).tool_calls == [] and fmt.parse(text).content == text


def stream_pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(QWEN_TWO)), max_size=12),
       st.sampled_from([QWEN_TWO, "no calls at all", '{"name": "f", "parameters": {"x": 1}}', "<tool_call>{bad"]))
def test_streamed_calls_and_content_equal_the_whole_parse(cuts, text):
    for fmt in (QwenFormat(), Llama3Format()):
        stream = ToolCallStream(fmt)
        parts = [stream.push(p) for p in stream_pieces(text, cuts)] + [stream.finish()]
        whole = fmt.parse(text)
        assert [(c.name, c.arguments) for p in parts for c in p.tool_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls]
        assert "".join(p.content for p in parts).strip() == whole.content.strip()


# --- reasoning ---
@pytest.mark.parametrize("text, fmt, opened, reasoning, content", [
    ("<think>plan</think>\n\nAnswer", "deepseek", False, "plan", "Answer"),
    ("plan</think>Answer", "auto", True, "plan", "Answer"),
    ("Answer only", "deepseek", False, "", "Answer only"),
    ("<think>cut short", "deepseek", False, "cut short", ""),
    ("<think>plan</think>Answer", "deepseek-legacy", False, "plan", "<think>plan</think>Answer"),
])
def test_reasoning_split_on_fixed_strings(text, fmt, opened, reasoning, content):
    split = split_reasoning(text, fmt, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=10))
def test_streamed_reasoning_equals_the_whole_split(cuts):
    from outrider.structured.reasoning import ReasoningStream

    text = "<think>first, the plan</think>\nThen <the> answer"
    stream = ReasoningStream("deepseek", False)
    parts = [stream.push(p) for p in stream_pieces(text, cuts)] + [stream.finish()]
    whole = split_reasoning(text, "deepseek", False)
    assert "".join(p.reasoning for p in parts) == whole.reasoning
    assert "".join(p.content for p in parts) == whole.content


def test_chat_flags_reach_the_config_and_the_template_body():
    from outrider import cli
    from outrider.server.errors import ApiError
    from outrider.server.structured import template_body

    ns = cli.parse(cli.SERVE_GROUPS, ["--reasoning-format", "none", "--chat-template-kwargs", '{"a": 1}',
                                      "--reasoning-budget", "0", "--no-jinja"])
    cfg = cli.server_config(ns, "m")
    assert (cfg.reasoning_format, cfg.chat_template_kwargs, cfg.jinja) == ("none", {"a": 1, "enable_thinking": False},
                                                                          False)
    assert template_body({"chat_template_kwargs": {"a": 2}}, cfg)["chat_template_kwargs"] == {
        "a": 2, "enable_thinking": False}
    with pytest.raises(ApiError, match="requires --jinja"):
        template_body({"tools": [{"type": "function", "function": {"name": "f"}}]}, cfg)
    for bad in (["--reasoning-budget", "100"], ["--chat-template-kwargs", "[1]"], ["--reasoning-format", "x"]):
        with pytest.raises(SystemExit):
            cli.server_config(cli.parse(cli.SERVE_GROUPS, bad), "m")
