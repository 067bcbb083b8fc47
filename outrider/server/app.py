"""FastAPI assembly: routes, llama-server's error format for every failure, and the middleware stack."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from outrider.engine.async_engine import AsyncEngine
from outrider.server import embeddings, infill, messages, native, openai, responses, webui
from outrider.server.errors import ApiError
from outrider.server.middleware import CORS, BodyLimit, Gate
from outrider.server.settings import ServerConfig
from outrider.server.state import ServerState
from outrider.server.transport import ClientGone

log = logging.getLogger("outrider.server")

# llama-server routes we do not implement: a 501 naming the feature says more than a 404.
UNSUPPORTED = {
    ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"): "reranking",
    ("/v1/chat/completions/control",): "reasoning control",
    ("/audio/transcriptions", "/v1/audio/transcriptions"): "audio",
    ("/lora-adapters",): "LoRA adapters",
    ("/slots/{id_slot}",): "slot save/restore",
}


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The ASGI app over an engine that is started (or loading); it never starts or stops the engine."""
    app = FastAPI(title="outrider", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.server = ServerState(engine, config)
    app.include_router(native.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(infill.router)
    app.include_router(embeddings.router)
    app.state.responses = responses.ResponseStore()
    if config.webui:
        webui.add_routes(app)
    for paths, feature in UNSUPPORTED.items():
        for path in paths:
            app.add_api_route(path, _unsupported(feature), methods=["GET", "POST"], include_in_schema=False)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return ApiError(400, str(exc.errors())).response(request.url.path)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone):
        return Response(status_code=499)  # nobody reads it; the requests are already aborted

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"{type(exc).__name__}: {exc}").response(request.url.path)

    # add_middleware wraps: the last added runs first.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(Gate, engine=engine, api_keys=config.api_keys,
                       static_paths=webui.PATHS if config.webui else frozenset())
    app.add_middleware(CORS, origins=config.cors_origins)
    return app


def _unsupported(feature: str):
    async def route():
        raise ApiError(501, f"This server does not support {feature}")

    return route
