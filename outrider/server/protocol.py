"""Request validation shared by the native and OpenAI routes: JSON body -> prompts + SamplingParams -> Requests.

Nothing reaches the engine unless it passed here; every invalid or out-of-range field is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.request_fields import FIELDS, SUPPORTED, Field, tokenize
from outrider.sampler_chain import SamplerChainError, parse_chars, parse_names, restrict
from outrider.server.errors import ApiError, context_exceeded, invalid
from outrider.structured.grammar import Grammar
from outrider.tokenizer import ChatTemplateError, Tokenizer, content_text

log = logging.getLogger("outrider.server")

INT_MAX = 2**31 - 1
_MISSING = object()

# Fields of llama-server we do not implement, accepted only at the value that means "off" (the samplers among them
# are declared in request_fields.FIELDS).
_INERT = {
    "grammar_lazy": lambda v: not v,
    "grammar_triggers": lambda v: not v,
    "n_indent": lambda v: v == 0,
    "t_max_predict_ms": lambda v: v == 0,
    "lora": lambda v: not v,
    "multimodal_data": lambda v: not v,
    "n_cache_reuse": lambda v: v == 0,
    "image_data": lambda v: not v,
    "best_of": lambda v: v == 1,
    "functions": lambda v: not v,
    "prediction": lambda v: not v,
}
# Every request field the generation routes read (or refuse above); any other key is ignored, as llama-server
# ignores it, and named once in the log.
KNOWN_FIELDS = frozenset({
    *_INERT, *(name for f in FIELDS for name in f.spellings), "prompt", "n_predict", "max_tokens",
    "max_completion_tokens", "logit_bias", "seed", "n_probs", "stop", "speculative", "speculative.n_max",
    "speculative.n_min", "speculative.p_min", "samplers", "stream", "stream_options", "timings_per_token",
    "return_tokens", "return_progress", "post_sampling_probs", "response_fields", "sse_ping_interval", "n_cmpl",
    "n", "id_slot", "verbose", "grammar", "json_schema", "return_draft_provenance", "n_keep", "n_discard",
    # settings of things that are off or that we always do (the web UI sends them)
    "backend_sampling", "preserved_tokens", "chat_format",
    # OpenAI routes
    "model", "messages", "logprobs", "top_logprobs", "echo", "suffix", "user", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort", "reasoning_format",
    "add_generation_prompt", "continue_final_message", "prompt_logprobs",
})


@functools.cache
def _note_unknown(name: str) -> None:
    log.warning("request field %r is not one this server knows; ignored (as llama-server ignores it)", name)


# --- typed field readers: the one place types and ranges are checked ---
def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, "expected a boolean")
    return v


def get_int(body: dict, name: str, default: int, lo: int = -INT_MAX, hi: int = INT_MAX) -> int:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, "expected an integer")
    if not lo <= v <= hi:
        raise invalid(name, f"must be in [{lo}, {hi}]")
    return v


def get_float(body: dict, name: str, default: float, lo: float = -math.inf, hi: float = math.inf) -> float:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise invalid(name, "expected a finite number")
    if not lo <= v <= hi:
        raise invalid(name, f"must be in [{lo:g}, {hi:g}]")
    return float(v)


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer beyond any float
        return False


def get_object(body: dict, name: str) -> dict:
    """An object field ({} when absent)."""
    v = body.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid(name, "expected an object")
    return v


def get_field(body: dict, field: Field, default: Any, refuse: bool = True) -> Any:
    """A request field (request_fields.FIELDS) under the first of its spellings the body holds; with `refuse`,
    one outside the field's range is a 400."""
    name = first_present(body, field.spellings)
    lo, hi = (field.lo, field.hi) if refuse else (-math.inf, math.inf)
    if field.type is bool:
        return get_bool(body, name, default)
    if field.type is int:
        return get_int(body, name, default, lo=max(lo, -INT_MAX), hi=min(hi, INT_MAX))
    if field.type is float:
        return get_float(body, name, default, lo, hi)
    value = body.get(name)  # a list of strings
    if value is None:
        return default
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(name, "expected an array of strings")
    return tuple(value)


def get_str_list(body: dict, name: str) -> list[str] | None:
    """A string or a list of strings (None when absent)."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid(name, "expected a string or a list of strings")
    return v


def wants_draft_provenance(body: dict) -> bool:
    """outrider extension, off by default: per-token draft provenance in the response (server/provenance.py)."""
    return get_bool(body, "return_draft_provenance", False)


def first_present(body: dict, names: tuple[str, ...]) -> str:
    return next((n for n in names if body.get(n) is not None), names[0])


# --- sampling ---
def sampling_params(body: dict, defaults: SamplingParams, tokenizer: Tokenizer,
                    n_probs: int | None = None, grammar: Grammar | None = None) -> SamplingParams:
    """The body's sampling and stopping fields over the server defaults. `n_probs` overrides the body's (the
    OpenAI routes derive it from their own `logprobs` fields); `grammar` is the route's compiled constraint
    (server/structured.py reads the body's fields for it)."""
    for name, inert in _INERT.items():
        value = body.get(name)
        if value is not None and not _is_off(inert, value):
            raise ApiError(400, f"'{name}' is not supported by this server")
    for f in FIELDS:
        if not f.supported and not f.lo <= get_field(body, f, f.default, refuse=False) <= f.hi:
            raise ApiError(400, f"'{f.name}' is not supported by this server")
    for name in body.keys() - KNOWN_FIELDS:
        _note_unknown(name)
    # llama-server reads flat "speculative.n_max" keys; a nested {"speculative": {...}} object works too
    nested = body.get("speculative") if isinstance(body.get("speculative"), dict) else {}
    spec = {**{f"speculative.{k}": v for k, v in nested.items()}, **body}
    n_name = first_present(body, ("n_predict", "max_tokens", "max_completion_tokens"))
    max_tokens = get_int(body, n_name, defaults.max_tokens, lo=-1)
    if max_tokens == 0:
        max_tokens = 1  # llama-server samples the first token before it checks the limit
    if defaults.max_tokens > 0 and not 0 < max_tokens <= defaults.max_tokens:
        max_tokens = defaults.max_tokens  # the server's -n caps every request
    seed = get_int(body, "seed", -1, lo=-1, hi=2**64 - 1)
    stop = get_str_list(body, "stop") or []
    fields = dict(
        {f.name: get_field(body, f, getattr(defaults, f.name)) for f in SUPPORTED},
        max_tokens=max_tokens,
        logit_bias=_logit_bias(body.get("logit_bias"), tokenizer) or defaults.logit_bias,
        seed=defaults.seed if seed == -1 else seed,
        n_probs=min(get_int(body, "n_probs", defaults.n_probs, lo=0) if n_probs is None else n_probs,
                    tokenizer.vocab_size),
        stop=tuple(s for s in stop if s) or defaults.stop,
        spec_n_max=get_int(spec, "speculative.n_max", defaults.spec_n_max, lo=0),
        spec_n_min=get_int(spec, "speculative.n_min", defaults.spec_n_min, lo=0),
        spec_p_min=get_float(spec, "speculative.p_min", defaults.spec_p_min, 0.0, 1.0),
        n_keep=get_int(body, "n_keep", defaults.n_keep, lo=-1),
        n_discard=get_int(body, "n_discard", defaults.n_discard, lo=0),
        grammar=grammar,
    )
    try:
        params = dataclasses.replace(defaults, **fields)
    except ValueError as e:  # SamplingParams' own cross-field checks
        raise ApiError(400, str(e)) from e
    samplers = _samplers(body.get("samplers"))
    try:
        params = restrict(params, samplers or params.samplers) if samplers or params.samplers else params
    except SamplerChainError as e:
        raise invalid("samplers", str(e)) from e
    return tokenize(params, tokenizer)


def _samplers(value: Any) -> tuple[str, ...] | None:
    """llama-server's `samplers`: a list of names, or a string of one-letter codes."""
    if value is None:
        return None
    try:
        if isinstance(value, str):
            return parse_chars(value)
        if isinstance(value, list):
            return parse_names(value)
    except SamplerChainError as e:
        raise invalid("samplers", str(e)) from e
    raise invalid("samplers", "expected an array of sampler names or a string of sampler letters")


def _is_off(inert, value: Any) -> bool:
    try:
        return bool(inert(value))
    except TypeError:  # a value of another type (a string where a number is compared) is not "off"
        return False


def _logit_bias(value: Any, tokenizer: Tokenizer) -> tuple[tuple[int, float], ...]:
    """llama-server's `[[token|text, bias|false], ...]` or OpenAI's `{"token": bias}`; text biases all its tokens."""
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = [(int(k) if k.lstrip("-").isdecimal() else k, v) for k, v in value.items()]
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise invalid("logit_bias", "expected [[token, bias], ...] or {token: bias}")
    out = []
    for key, bias in pairs:
        if bias is False:
            bias = -math.inf  # llama-server: false bans the token
        elif (isinstance(bias, bool) or not isinstance(bias, (int, float))
              or isinstance(bias, int) and not _finite(bias) or math.isnan(bias)):  # (+-inf floats are allowed)
            raise invalid("logit_bias", f"bias of {key!r} must be a number or false")
        ids = tokenizer.encode(key, add_special=False) if isinstance(key, str) else [key]
        for tok in ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < tokenizer.vocab_size:
                raise invalid("logit_bias", f"token id {tok!r} is out of range")
            out.append((tok, float(bias)))
    return tuple(out)


# --- prompts ---
def tokenize_prompts(prompt: Any, tokenizer: Tokenizer, n_ctx: int, field: str = "prompt") -> list[list[int]]:
    """llama-server prompt forms: string, token array, mixed array, {prompt_string}, or a list of those (a batch).
    A string that cannot fit `n_ctx` tokens is refused before it is tokenized."""
    if prompt is None:
        raise ApiError(400, f"'{field}' is required")
    if isinstance(prompt, list) and prompt and not _is_single(prompt):
        return [tokenize_one(fits(p, tokenizer, n_ctx), tokenizer, field, add_special=True) for p in prompt]
    return [tokenize_one(fits(prompt, tokenizer, n_ctx), tokenizer, field, add_special=True)]


def fits(text: Any, tokenizer: Tokenizer, n_ctx: int) -> Any:
    """`text` unchanged, unless it is a string too long for the context whatever its tokens: a 400 then, at no
    cost (tokenizing megabytes holds the event loop for seconds)."""
    if isinstance(text, str):
        at_least = -(-len(text) // tokenizer.max_token_chars)
        if at_least >= n_ctx:
            raise context_exceeded(at_least, n_ctx)
    return text


def _is_single(prompt: list) -> bool:
    """A flat array of token ids and strings is one prompt unless it holds only strings (then a batch)."""
    return all(is_token(x) or isinstance(x, str) for x in prompt) and any(is_token(x) for x in prompt)


def is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def tokenize_one(prompt: Any, tokenizer: Tokenizer, field: str, add_special: bool,
                 parse_special: bool = True) -> list[int]:
    """One prompt; in a mixed array only a leading string gets the special tokens (BOS)."""
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise ApiError(400, f"'{field}': multimodal input is not supported by this server")
        prompt = prompt.get("prompt_string")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special=add_special, parse_special=parse_special)
    if not isinstance(prompt, list):
        raise invalid(field, "expected a string, a token array or a list of those")
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += tokenizer.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif is_token(part) and 0 <= part < tokenizer.vocab_size:
            ids.append(part)
        else:
            raise invalid(field, f"token {part!r} is not a string or an id in [0, {tokenizer.vocab_size})")
    return ids


# --- chat ---
def chat_prompt(body: dict, tokenizer: Tokenizer, prefill_assistant: bool = True) -> str:
    """Render an OpenAI chat body (`messages`, `tools`, `chat_template_kwargs`, ...) with the chat template. A final
    assistant message is a prefill (as llama-server: unless --no-prefill-assistant, or asked by
    `continue_final_message`): the prompt opens the assistant's turn and ends with that message's content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty array of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}]", "expected an object with a string 'role'")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise invalid(f"messages[{i}].content", "expected a string or an array of content parts")
    continue_final = get_bool(body, "continue_final_message", False)
    add_generation_prompt = get_bool(body, "add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise ApiError(400, "cannot have both 'add_generation_prompt' and 'continue_final_message'")
    last = messages[-1]
    if continue_final and (last["role"] != "assistant" or not last.get("content")):
        raise ApiError(400, "'continue_final_message' needs a final assistant message with content")
    prefill = last["role"] == "assistant" and (prefill_assistant or continue_final)
    if prefill:
        if len(messages) > 1 and messages[-2]["role"] == "assistant":
            raise invalid("messages", "cannot have 2 or more assistant messages at the end of the list")
        messages, add_generation_prompt = messages[:-1], True
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", "expected an array")
    kwargs = get_object(body, "chat_template_kwargs")
    if body.get("reasoning_effort") is not None:
        kwargs = {"reasoning_effort": body["reasoning_effort"], **kwargs}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools=tools, **kwargs)
        return text + (content_text(last.get("content")) or "") if prefill else text
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from e


def encode_chat(text: str, tokenizer: Tokenizer, n_ctx: int) -> list[int]:
    """Token ids of a rendered chat prompt; BOS is added unless the template already wrote it."""
    ids = tokenizer.encode(fits(text, tokenizer, n_ctx), add_special=True)
    bos = tokenizer.bos_token_id
    if len(ids) > 1 and bos is not None and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids


# --- requests ---
@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """Per-request fields every generation route reads that are not sampling: the slot (llama-server `id_slot`,
    -1: any), prefill progress reports (`return_progress`, streams only) and `verbose` (`__verbose` objects)."""

    id_slot: int = -1
    return_progress: bool = False
    verbose: bool = False

    @classmethod
    def parse(cls, body: dict, n_slots: int, verbose: bool) -> RequestOptions:
        return cls(id_slot=get_int(body, "id_slot", -1, lo=-1, hi=n_slots - 1),
                   return_progress=get_bool(body, "return_progress", False) and get_bool(body, "stream", False),
                   verbose=get_bool(body, "verbose", verbose))


def make_requests(prompts: list[list[int]], params: SamplingParams, n: int, n_ctx: int,
                  options: RequestOptions = RequestOptions()) -> list[Request]:
    """prompts x n choices, in llama-server's index order; a seeded choice i > 0 gets seed + i so they differ."""
    requests = []
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt is empty")
        if len(ids) >= n_ctx:
            raise context_exceeded(len(ids), n_ctx)
        for i in range(n):
            p = params if i == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            requests.append(Request(prompt_ids=list(ids), params=p, slot_wanted=options.id_slot,
                                    return_progress=options.return_progress))
    return requests
