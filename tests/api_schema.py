"""A hand-kept OpenAPI 3.0 description of every route the server has, for the fuzz tests. The routes read raw JSON
bodies (FastAPI cannot derive their schema), so the request bodies here list the fields the server reads, with
the types and ranges it accepts; `openapi(app)` takes the paths from the app itself, so a route that is added
without a description here is still fuzzed (with any JSON object) and `undescribed(app)` names it.

Every field is nullable: the server reads null as "absent".
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute

N_SLOTS = 4  # the fuzzed server's -np
INT_MAX = 2**31 - 1


def _f(type_: str, **kw) -> dict:
    return {"type": type_, "nullable": True, **kw}


STRINGS = {"oneOf": [_f("string"), _f("array", items={"type": "string"})], "nullable": True}
PROMPT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [{"type": "integer", "minimum": 0,
                                                                                "maximum": 200},
                                                                               {"type": "string"}]}}]}
OFF = {"enum": [None, 0, False, ""]}  # features the server lacks: accepted only at their "off" value
SAMPLING = {
    "n_predict": _f("integer", minimum=-1, maximum=INT_MAX),
    "max_tokens": _f("integer", minimum=-1, maximum=INT_MAX),
    "temperature": _f("number"),
    "top_k": _f("integer", minimum=-INT_MAX, maximum=INT_MAX),
    "top_p": _f("number", minimum=0, maximum=1),
    "min_p": _f("number", minimum=0, maximum=1),
    "typical_p": _f("number", minimum=0, maximum=1),
    "repeat_penalty": _f("number", minimum=0, exclusiveMinimum=True),
    "repeat_last_n": _f("integer", minimum=-1, maximum=INT_MAX),
    "presence_penalty": _f("number"),
    "frequency_penalty": _f("number"),
    "seed": _f("integer", minimum=-1, maximum=2**64 - 1),
    "stop": STRINGS,
    "ignore_eos": _f("boolean"),
    "min_tokens": _f("integer", minimum=0, maximum=INT_MAX),
    "cache_prompt": _f("boolean"),
    "logit_bias": {"oneOf": [_f("array", items={"type": "array", "minItems": 2, "maxItems": 2,
                                                 "items": {"type": "integer", "minimum": 0, "maximum": 200}}),
                             _f("object", additionalProperties={"type": "number"})], "nullable": True},
    "speculative.n_max": _f("integer", minimum=0, maximum=INT_MAX),
    "speculative.n_min": _f("integer", minimum=0, maximum=INT_MAX),
    "speculative.p_min": _f("number", minimum=0, maximum=1),
    "stream": _f("boolean"),
    "timings_per_token": _f("boolean"),
    "sse_ping_interval": _f("number", minimum=-1),
    "grammar": _f("string"),  # GBNF (one that does not compile is a 400 naming the field too)
    "json_schema": _f("object"),
    "dry_multiplier": _f("number", minimum=0),
    "dry_base": _f("number", minimum=1),
    "dry_allowed_length": _f("integer", minimum=0, maximum=INT_MAX),
    "dry_penalty_last_n": _f("integer", minimum=-1, maximum=INT_MAX),
    "dry_sequence_breakers": _f("array", items={"type": "string"}),
    "xtc_probability": _f("number", minimum=0, maximum=1),
    "xtc_threshold": _f("number", minimum=0, maximum=1),
    "n_keep": _f("integer", minimum=-1, maximum=INT_MAX),  # (read on a context shift)
    "n_discard": _f("integer", minimum=0, maximum=INT_MAX),
    # llama-server's samplers we lack: accepted where they are off
    "mirostat": _f("integer", minimum=0, maximum=0),
    "min_keep": _f("integer", minimum=0, maximum=0),
    "dynatemp_range": _f("number", minimum=0, maximum=0),
    "top_n_sigma": _f("number", maximum=0),
    **{name: OFF for name in ("n_indent", "t_max_predict_ms", "lora")},
}
COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": PROMPT, **SAMPLING,
    "n_probs": _f("integer", minimum=0, maximum=INT_MAX),
    "n_cmpl": _f("integer", minimum=1, maximum=N_SLOTS),
    "id_slot": _f("integer", minimum=-1, maximum=N_SLOTS - 1),
    "return_tokens": _f("boolean"), "post_sampling_probs": _f("boolean"), "response_fields": STRINGS}}
OPENAI_COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": PROMPT, **SAMPLING, "n": _f("integer", minimum=1, maximum=N_SLOTS),
    "logprobs": _f("integer", minimum=0, maximum=INT_MAX),
    "stream_options": _f("object", properties={"include_usage": _f("boolean")})}}
MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"], "properties": {"role": {"enum": ["system", "user", "assistant"]},
                                                           "content": _f("string")}}}
CHAT_PROMPT = {"messages": MESSAGES, "add_generation_prompt": _f("boolean"), "continue_final_message": {"enum": [None, False]},
               "chat_template_kwargs": _f("object"), "tools": _f("array", maxItems=0)}
CHAT = {"type": "object", "required": ["messages"], "properties": {
    **CHAT_PROMPT, **SAMPLING, "n": _f("integer", minimum=1, maximum=N_SLOTS), "logprobs": _f("boolean"),
    "response_format": _f("object", required=["type"], properties={"type": {"enum": ["text"]}}),
    "tool_choice": {"enum": [None, "auto", "none"]},
    "stream_options": _f("object", properties={"include_usage": _f("boolean")})}}
RESPONSE_ITEMS = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"enum": ["message"]}, "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"], "properties": {"type": {"enum": ["input_text"]},
                                                                           "text": {"type": "string"}}}}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"enum": ["function_call"]}, "call_id": {"type": "string"}, "name": {"type": "string"},
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"enum": ["function_call_output"]}, "call_id": {"type": "string"}, "output": {"type": "string"}}}]}
FUNCTION = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"enum": ["function"]}, "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
    "parameters": {"type": "object"}}}
RESPONSES_BODY = {"type": "object", "properties": {
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": RESPONSE_ITEMS}]},
    "instructions": _f("string"), "max_output_tokens": _f("integer", minimum=1, maximum=INT_MAX),
    "temperature": _f("number"), "top_p": _f("number", minimum=0, maximum=1), "stream": _f("boolean"),
    "store": _f("boolean"), "previous_response_id": _f("string"), "tools": _f("array", items=FUNCTION),
    "tool_choice": {"enum": [None, "auto", "none", "required"]}, "parallel_tool_calls": _f("boolean")}}
ANTHROPIC_BLOCK = {"oneOf": [
    {"type": "object", "required": ["type", "text"], "properties": {"type": {"enum": ["text"]},
                                                                    "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"enum": ["tool_result"]}, "tool_use_id": {"type": "string"}, "content": {"type": "string"}}}]}
ANTHROPIC_PROMPT = {
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                           "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": ANTHROPIC_BLOCK}]}}}},
    "system": _f("string"),
    "tools": _f("array", items={"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "input_schema": {"type": "object"}}}),
    "tool_choice": _f("object", required=["type"], properties={"type": {"enum": ["auto", "any", "none"]}})}
ANTHROPIC_BODY = {"type": "object", "required": ["messages"], "properties": {
    **ANTHROPIC_PROMPT, "max_tokens": _f("integer", minimum=1, maximum=INT_MAX), "temperature": _f("number"),
    "top_p": _f("number", minimum=0, maximum=1), "top_k": _f("integer", minimum=0, maximum=INT_MAX),
    "stop_sequences": _f("array", items={"type": "string"}), "stream": _f("boolean")}}
EMBEDDING = {"type": "object", "properties": {
    "input": {"oneOf": [{"type": "string", "minLength": 1}, PROMPT, {"type": "array", "items": PROMPT}]},
    "content": _f("string"), "embd_normalize": _f("number", minimum=-1), "encoding_format": {"enum": ["float", "base64"]}}}
BODIES = {
    "/completion": COMPLETION, "/completions": COMPLETION, "/v1/completions": OPENAI_COMPLETION,
    "/v1/chat/completions": CHAT, "/chat/completions": CHAT,
    "/v1/chat/completions/input_tokens": {"type": "object", "required": ["messages"], "properties": CHAT_PROMPT},
    "/chat/completions/input_tokens": {"type": "object", "required": ["messages"], "properties": CHAT_PROMPT},
    "/apply-template": {"type": "object", "required": ["messages"], "properties": CHAT_PROMPT},
    "/tokenize": {"type": "object", "properties": {"content": PROMPT, "add_special": _f("boolean"),
                                                   "parse_special": _f("boolean"), "with_pieces": _f("boolean")}},
    "/detokenize": {"type": "object", "properties": {"tokens": _f("array", items={"type": "integer", "minimum": 0,
                                                                                   "maximum": 200})}},
    "/props": {"type": "object"},
    "/v1/responses": RESPONSES_BODY, "/responses": RESPONSES_BODY,
    "/v1/responses/input_tokens": RESPONSES_BODY, "/responses/input_tokens": RESPONSES_BODY,
    "/v1/messages": ANTHROPIC_BODY,
    "/embedding": EMBEDDING, "/embeddings": EMBEDDING, "/v1/embeddings": EMBEDDING,
    "/infill": {"type": "object", "required": ["input_prefix", "input_suffix"], "properties": {
        "input_prefix": {"type": "string"}, "input_suffix": {"type": "string"}, "prompt": _f("string"),
        "input_extra": _f("array", items={"type": "object", "properties": {"filename": {"type": "string"},
                                                                            "text": {"type": "string"}}}),
        **SAMPLING}},
    "/v1/messages/count_tokens": {"type": "object", "required": ["messages"], "properties": ANTHROPIC_PROMPT},
}
QUERIES = {"/slots": [{"name": "fail_on_no_slot", "in": "query", "schema": {"type": "string"}}]}
RESPONSES = {"200": {"description": "the answer"}, "default": {"description": "an error in llama-server's format"}}


def routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route the app answers (routers included)."""
    out = []

    def walk(items) -> None:
        for r in items:
            if isinstance(r, APIRoute):
                out.extend((m, r.path) for m in sorted(r.methods))
            elif hasattr(r, "original_router"):
                walk(r.original_router.routes)

    walk(app.routes)
    return out


def undescribed(app: FastAPI) -> list[str]:
    """POST routes that read a body this module does not describe (the 501 ones read none)."""
    from outrider.server.app import UNSUPPORTED

    skip = {p for paths in UNSUPPORTED for p in paths}
    return sorted({p for m, p in routes(app) if m == "POST" and p not in BODIES and p not in skip})


def openapi(app: FastAPI) -> dict:
    paths: dict = {}
    for method, path in routes(app):
        op = {"responses": RESPONSES, "parameters": list(QUERIES.get(path, []))}
        op["parameters"] += [{"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                             for name in path.split("/") if name.startswith("{")]
        if method == "POST":
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": BODIES.get(path, {"type": "object"})}}}
        paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.0.3", "info": {"title": "outrider", "version": "1"}, "paths": paths}
