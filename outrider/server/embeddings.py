"""Embedding routes (`--embedding`): `POST /embedding`, `/embeddings` (llama-server's format) and `/v1/embeddings`
(OpenAI's). Each input runs as a one-token request whose prefill pools the prompt's hidden states (engine/pooling.py)
with the server's pooling: `--pooling`, else the model's (a GGUF's pooling type, or a sentence-transformers
Pooling config: modules.json -> 1_Pooling/config.json), else mean. Without `--embedding` these routes answer 501, as llama-server's do."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request

from outrider.models import gguf
from outrider.params import SamplingParams
from outrider.server import protocol as proto
from outrider.server.errors import ApiError, invalid
from outrider.server.native import state_of
from outrider.server.render import JSON
from outrider.server.state import ServerState
from outrider.server.transport import read_json, until_disconnected

router = APIRouter()

# sentence-transformers' Pooling config keys -> our modes, in the order they are tried
_ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"))


GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}  # llama.cpp's `<arch>.pooling_type` (4, rank: not served)


@functools.cache
def model_pooling(model_path: Path) -> str | None:
    """The pooling a checkpoint declares: a GGUF's `<arch>.pooling_type`, or a sentence-transformers layout's
    Pooling module (None: none declared)."""
    if gguf.is_gguf(model_path):
        ck = gguf.open_gguf(model_path)
        return GGUF_POOLING.get(ck.value(f"{ck.arch}.pooling_type"))
    modules = model_path / "modules.json" if model_path.is_dir() else None
    if modules is None or not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith("Pooling"):
            config = model_path / module.get("path", "") / "config.json"
            settings = json.loads(config.read_text()) if config.is_file() else {}
            return next((mode for key, mode in _ST_MODES if settings.get(key)), None)
    return None


def pooling_of(state: ServerState) -> str:
    return state.config.pooling or model_pooling(Path(state.core.model_path)) or "mean"


def normalize(v: torch.Tensor, p: float) -> torch.Tensor:
    """llama-server's `embd_normalize`: -1 none, 0 max-abs (scaled to int16), 1 taxicab, 2 Euclidean, > 2 p-norm;
    a zero vector stays zero."""
    if p < 0:
        return v
    v = v.double()
    scale = v.abs().max() / 32760.0 if p == 0 else v.abs().pow(p).sum().pow(1.0 / p)
    return (v / scale if scale > 0 else torch.zeros_like(v)).float()


def _inputs(value: Any, state: ServerState, field: str) -> list[list[int]]:
    """A string, a token list, or a list of those."""
    if value is None or value == [] or value == "":
        raise invalid(field, "expected a non-empty string, token array, or an array of those")
    items = value if isinstance(value, list) and value and not all(proto.is_token(x) for x in value) else [value]
    prompts = []
    for i, item in enumerate(items):
        if not isinstance(item, (str, list)) or not item:
            raise invalid(f"{field}[{i}]" if len(items) > 1 else field, "expected a non-empty string or token array")
        prompts.append(proto.tokenize_one(proto.fits(item, state.tokenizer, state.n_ctx), state.tokenizer, field,
                                          add_special=True))
    return prompts


async def _embed(request: Request, prompts: list[list[int]], mode: str) -> tuple[list[torch.Tensor], int]:
    """Each prompt's pooled embedding ([H], or [tokens, H] for none) and the prompt tokens in all."""
    state = state_of(request)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=mode, cache_prompt=False)
    gen = state.admit(proto.make_requests(prompts, params, 1, state.n_ctx))
    await until_disconnected(request, gen.collect())
    return [r.pooled.result() for r in gen.requests], sum(len(p) for p in prompts)


def _check_enabled(state: ServerState) -> None:
    if not state.config.embeddings:
        raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`")


@router.post("/embedding")
@router.post("/embeddings")
async def embeddings_native(request: Request):
    state = state_of(request)
    _check_enabled(state)
    body = await read_json(request)
    field = "input" if body.get("input") is not None else "content"
    p = proto.get_float(body, "embd_normalize", 2.0, lo=-1)
    mode = pooling_of(state)
    vectors, _ = await _embed(request, _inputs(body.get(field), state, field), mode)
    if mode == "none":  # one unnormalized row per token, as llama-server
        return JSON([{"index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)])
    return JSON([{"index": i, "embedding": [normalize(v, p).tolist()]} for i, v in enumerate(vectors)])


@router.post("/v1/embeddings")
async def embeddings_openai(request: Request):
    state = state_of(request)
    _check_enabled(state)
    body = await read_json(request)
    if body.get("input") is None and body.get("content") is not None:  # `content` asks for the native format
        return await embeddings_native(request)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid("encoding_format", 'expected "float" or "base64"')
    mode = pooling_of(state)
    if mode == "none":
        raise ApiError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type")
    vectors, n_tokens = await _embed(request, _inputs(body.get("input"), state, "input"), mode)
    data = []
    for i, v in enumerate(vectors):
        v = normalize(v, 2)
        embedding: Any = (base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if fmt == "base64"
                          else v.tolist())
        data.append({"embedding": embedding, "index": i, "object": "embedding"})
    return JSON({"model": state.config.model_alias, "object": "list",
                 "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data})
