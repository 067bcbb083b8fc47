"""llama-server's native routes: /completion(s), /tokenize, /detokenize, /apply-template, /health, /props,
/slots, /metrics, /models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from outrider.engine.request import FinishReason, RequestOutput
from outrider.engine.request import Request as EngineRequest
from outrider.models.gguf import is_gguf
from outrider.server import context_shift
from outrider.server import protocol as proto
from outrider.server import provenance
from outrider.server.errors import ApiError
from outrider.server.render import JSON, timings_fields, token_probs
from outrider.server.settings import BUILD_INFO
from outrider.server.state import Generation, ServerState, ended_error
from outrider.server.structured import request_grammar, template_body
from outrider.server.transport import read_json, sse_response, until_disconnected

router = APIRouter()


def state_of(request: Request) -> ServerState:
    return request.app.state.server


@dataclass(frozen=True)
class NativeOptions:
    """Per-request switches of /completion that shape the response, not the sampling."""

    stream: bool
    timings_per_token: bool
    return_tokens: bool
    post_sampling_probs: bool
    response_fields: tuple[str, ...]
    ping_interval: float
    draft_provenance: bool  # outrider extension: per-token provenance (server/provenance.py)

    @classmethod
    def parse(cls, body: dict, state: ServerState) -> NativeOptions:
        fields = proto.get_str_list(body, "response_fields") or []
        return cls(
            stream=proto.get_bool(body, "stream", False),
            timings_per_token=proto.get_bool(body, "timings_per_token", False),
            return_tokens=proto.get_bool(body, "return_tokens", False),
            post_sampling_probs=proto.get_bool(body, "post_sampling_probs", False),
            response_fields=tuple(fields),
            ping_interval=state.ping_interval(body),
            draft_provenance=proto.wants_draft_provenance(body),
        )


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request):
    state = state_of(request)
    body = await read_json(request)
    return await complete(request, body, proto.tokenize_prompts(body.get("prompt"), state.tokenizer, state.n_ctx))


async def complete(request: Request, body: dict, prompts: list[list[int]]):
    """/completion's answer for these prompts (also /infill's, with its FIM prompt)."""
    state = state_of(request)
    tok = state.tokenizer
    params = proto.sampling_params(body, state.config.defaults, tok,
                                   grammar=request_grammar(body, state.core.grammars))
    n = proto.get_int(body, proto.first_present(body, ("n_cmpl", "n")), 1, lo=1, hi=state.n_slots)
    opts = NativeOptions.parse(body, state)
    options = proto.RequestOptions.parse(body, state.n_slots, state.config.verbose)
    gen = state.admit(proto.make_requests(prompts, params, n, state.n_ctx, options))
    if opts.stream:
        return sse_response(_stream(state, gen, opts), done=False, ping_interval=opts.ping_interval)
    results = await until_disconnected(request, gen.collect())
    bodies = [_final(state, req, outs, opts, i, streamed=False) for i, (req, outs) in
              enumerate(zip(gen.requests, results))]
    return JSON(bodies[0] if len(bodies) == 1 else bodies)


def _final(state: ServerState, req: EngineRequest, outs: list[RequestOutput], opts: NativeOptions, index: int,
           streamed: bool) -> dict[str, Any]:
    """The complete result object (non-streamed body, or the last SSE frame with the text already sent)."""
    result = native_result(state, req, outs, index, streamed, stream=opts.stream, return_tokens=opts.return_tokens,
                           timings_per_token=opts.timings_per_token, post_sampling_probs=opts.post_sampling_probs)
    if opts.draft_provenance and not streamed:  # (streamed, each token's frame carried its entry)
        result[provenance.FIELD] = provenance.entries(outs)
    return _project(result, opts.response_fields) if opts.response_fields else result


def native_result(state: ServerState, req: EngineRequest, outs: list[RequestOutput], index: int, streamed: bool,
                  stream: bool = False, return_tokens: bool = False, timings_per_token: bool = False,
                  post_sampling_probs: bool = False) -> dict[str, Any]:
    """llama-server's result object of one request (also the OpenAI routes' `__verbose`)."""
    last = outs[-1]
    text = "".join(o.text for o in outs)
    ids = [t for o in outs for t in o.new_token_ids]
    params = req.params
    result = {
        "index": index,
        "content": "" if streamed else text,
        "tokens": ids if return_tokens and not streamed else [],
        "id_slot": req.id_slot,
        "stop": True,
        "model": state.config.model_alias,
        "tokens_predicted": len(ids),
        "tokens_evaluated": req.num_prompt,
        "generation_settings": state.generation_settings(params, req.seed, stream=stream,
                                                         timings_per_token=timings_per_token,
                                                         post_sampling_probs=post_sampling_probs),
        "prompt": state.tokenizer.decode(req.prompt_ids),
        "has_new_line": "\n" in text,
        # stopped because the context is full, or (--context-shift) went on after shifting it
        "truncated": last.finish_reason is FinishReason.CONTEXT or context_shift.shifted(req),
        "stop_type": last.stop_type,
        "stopping_word": last.stopping_word,
        "tokens_cached": req.num_prompt + max(len(ids) - 1, 0),  # the last sampled token has no K/V yet
        **timings_fields(last.timing),
    }
    if (error := ended_error(last)) is not None:  # cut short at shutdown: the stream's last frame says so
        result["error"] = error
    if params.n_probs > 0 and not streamed:
        lps = [lp for o in outs for lp in o.logprobs or ()]
        result["completion_probabilities"] = token_probs(state.tokenizer, lps, params.n_probs, post_sampling_probs)
    return result


def _project(result: dict[str, Any], paths: tuple[str, ...]) -> dict[str, Any]:
    """`response_fields`: keep only these paths; "a/b" picks a nested value under the key "a/b"."""
    out = {}
    for path in paths:
        value: Any = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def progress_fields(out: RequestOutput) -> dict[str, Any]:
    """llama-server's `prompt_progress` of a prefill report (time_ms: since the prompt's processing started)."""
    p, t0 = out.progress, out.timing.t_prompt_start
    return {"prompt_progress": {"total": p.total, "cache": p.cache, "processed": p.processed,
                                "time_ms": max(0.0, (p.t - t0) * 1e3) if t0 is not None else 0.0}}


async def _stream(state: ServerState, gen: Generation, opts: NativeOptions) -> AsyncIterator[dict]:
    """A frame per prefill report (return_progress) and per generated token, then the final object per request
    (the native stream has no [DONE]). The tokens of one engine output share its timings."""
    history: list[list[RequestOutput]] = [[] for _ in gen.requests]
    predicted = [0] * len(gen.requests)
    async for index, out in gen.outputs():
        req = gen.requests[index]
        history[index].append(out)
        head = {"index": index, "content": "", "tokens": [], "stop": False, "id_slot": req.id_slot,
                "tokens_predicted": predicted[index], "tokens_evaluated": req.num_prompt}
        timings = timings_fields(out.timing) if opts.timings_per_token else {}
        if out.progress is not None:
            progress = out.timing.at_progress(out.progress.processed, out.progress.t)
            yield {**head, **progress_fields(out), **(timings_fields(progress) if opts.timings_per_token else {})}
        for step in provenance.split_by_token(out):
            predicted[index] += 1
            frame = {**head, "content": step.text, "tokens": [step.token_id], "tokens_predicted": predicted[index],
                     **timings}
            if req.params.n_probs > 0:
                frame["completion_probabilities"] = token_probs(state.tokenizer, [step.logprob], req.params.n_probs,
                                                                opts.post_sampling_probs)
            if opts.draft_provenance:
                frame[provenance.FIELD] = [provenance.entry(step)]
            yield frame
        if out.finished:
            yield _final(state, req, history[index], opts, index, streamed=True)


# --- tokenizer routes ---
@router.post("/tokenize")
async def tokenize(request: Request):
    body = await read_json(request)
    tok = state_of(request).tokenizer
    ids = proto.tokenize_one(body.get("content", ""), tok, "content",
                             add_special=proto.get_bool(body, "add_special", False),
                             parse_special=proto.get_bool(body, "parse_special", True))
    if not proto.get_bool(body, "with_pieces", False):
        return JSON({"tokens": ids})
    return JSON({"tokens": [{"id": i, "piece": _piece(tok.token_bytes(i))} for i in ids]})


def _piece(raw: bytes) -> str | list[int]:
    """A piece as text, or as its byte values when it is not valid UTF-8 on its own."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/detokenize")
async def detokenize(request: Request):
    body = await read_json(request)
    tok = state_of(request).tokenizer
    tokens = body.get("tokens") or []
    if not isinstance(tokens, list) or not all(proto.is_token(t) and 0 <= t < tok.vocab_size for t in tokens):
        raise proto.invalid("tokens", f"expected an array of token ids in [0, {tok.vocab_size})")
    return JSON({"content": tok.decode(tokens)})


@router.post("/apply-template")
async def apply_template(request: Request):
    state = state_of(request)
    body = template_body(await read_json(request), state.config)
    return JSON({"prompt": proto.chat_prompt(body, state.tokenizer, state.config.prefill_assistant)})


# --- server information ---
@router.get("/health")
@router.get("/v1/health")
async def health(request: Request):
    state_of(request).check_health()  # 503 while shutting down or stalled (the Gate's while loading or failed)
    return JSON({"status": "ok"})


@router.get("/props")
async def get_props(request: Request):
    state = state_of(request)
    core, cfg = state.core, state.config
    tok = core.tokenizer
    return JSON({
        "default_generation_settings": {
            "params": state.generation_settings(cfg.defaults),
            "n_ctx": state.n_ctx,
        },
        "total_slots": state.n_slots,
        "model_alias": cfg.model_alias,
        "model_path": str(core.model_path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": cfg.endpoint_slots,
        "endpoint_props": cfg.endpoint_props,
        "endpoint_metrics": cfg.endpoint_metrics,
        "chat_template": tok.chat_template or "",
        "bos_token": tok.bos_token or "",
        "eos_token": tok.eos_token or "",
        "build_info": BUILD_INFO,
        "is_sleeping": False,
        # outrider's: why a drafter that was detected is not in use (speculative.types then says "none")
        "drafter_error": core.drafter_error,
        # outrider's: the weights in memory, by format (number of tensors in each) and their bytes
        "model_weights": {"formats": core.weights.formats, "bytes": core.weights.nbytes},
    })


@router.post("/props")
async def set_props(request: Request):
    """llama-server (with --props) answers success and changes nothing: it has no settable property yet. We set
    what it sets, nothing, and name any property asked for instead of dropping it."""
    if not state_of(request).config.endpoint_props:
        raise ApiError(501, "This server does not support changing global properties. Start it with `--props`")
    body = await read_json(request)
    if body:
        raise ApiError(400, f"property {sorted(body)[0]!r} cannot be changed: no server property is settable")
    return JSON({"success": True})


@router.get("/slots")
async def slots(request: Request, fail_on_no_slot: str | None = None):
    state = state_of(request)
    if not state.config.endpoint_slots:
        raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`")
    views = [_slot(state, s) for s in state.engine.slots()]
    if fail_on_no_slot not in (None, "", "0", "false") and all(v["is_processing"] for v in views):
        raise ApiError(503, "no slot available")
    return JSON(views)


# What a request said, left out of /slots unless --slots-debug (LLAMA_SERVER_SLOTS_DEBUG): llama-server shows
# these only then, beside the prompt and the generated text.
PRIVATE_PARAMS = ("dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy", "grammar_triggers",
                  "preserved_tokens")


def _slot(state: ServerState, snap: dict) -> dict[str, Any]:
    """One slot as llama-server shows it, from the engine's snapshot: the request it serves, or (idle) the last
    one it served, with its next-token state reset. Its text (prompt, generated, stop words) only with
    --slots-debug."""
    view = {"id": snap["id"], "n_ctx": snap["n_ctx"], "speculative": state.engine.drafter_kind is not None,
            "is_processing": snap["is_processing"]}
    req = snap["request"]
    if req is None:
        return view
    busy = snap["is_processing"]
    n_decoded = snap["n_decoded"]
    tok = state.tokenizer
    generated = tok.decode(req.output_ids[:n_decoded])
    next_token = {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
    if busy:
        next_token = {"has_next_token": True, "has_new_line": "\n" in generated,
                      "n_remain": req.params.max_tokens - n_decoded if req.params.max_tokens >= 0 else -1,
                      "n_decoded": n_decoded}
    params = state.generation_settings(req.params, req.seed)
    debug = state.config.slots_debug
    if snap["state_slot"] is not None:  # a hybrid model's request: its state slot beside its KV blocks
        view.update(state_slot=snap["state_slot"], kv_blocks=snap["kv_blocks"])
    view.update({"id_task": req.request_id, "n_prompt_tokens": req.num_prompt,
                 "n_prompt_tokens_processed": req.timing.prompt_n, "n_prompt_tokens_cache": req.timing.cache_n,
                 "params": params if debug else {k: v for k, v in params.items() if k not in PRIVATE_PARAMS},
                 "next_token": [next_token]})
    if debug:
        view.update(prompt=tok.decode(req.prompt_ids), generated=generated)
    return view


@router.get("/metrics")
async def metrics(request: Request):
    state = state_of(request)
    if not state.config.endpoint_metrics:
        raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
    return PlainTextResponse(state.metrics.render(state.engine.stats()),
                             media_type="text/plain; version=0.0.4",
                             headers={"Process-Start-Time-Unix": str(int(state.started))})


@router.get("/models")
@router.get("/v1/models")
async def models(request: Request):
    state = state_of(request)
    core, cfg = state.core, state.config
    mc = core.model_config
    n_params = sum(p.numel() for p in core.model.parameters())
    size = sum(p.numel() * p.element_size() for p in core.model.parameters())
    return JSON({
        "object": "list",
        "data": [{
            "id": cfg.model_alias,
            "aliases": sorted(cfg.aliases),
            "tags": list(cfg.tags),
            "object": "model",
            "created": int(state.started),
            "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": mc.vocab_size, "n_ctx": state.n_ctx,
                     "n_ctx_train": mc.max_position_embeddings, "n_embd": mc.hidden_size, "n_params": n_params,
                     "size": size, "ftype": str(core.dtype).removeprefix("torch.")},
        }],
        "models": [{"name": cfg.model_alias, "model": cfg.model_alias, "modified_at": "", "size": str(size),
                    "digest": "", "type": "model", "description": "", "tags": list(cfg.tags) or [""],
                    "capabilities": ["completion"], "parameters": "",
                    "details": {"parent_model": "", "format": "gguf" if is_gguf(core.model_path) else "safetensors",
                                "family": mc.architecture,
                                "families": [mc.architecture], "parameter_size": str(n_params),
                                "quantization_level": ""}}],
    })
