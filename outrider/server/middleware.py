"""ASGI middleware, outermost first: CORS (preflight answered before anything else), model state (503 while
loading and once the engine failed), API keys (401), request body limit (413)."""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from outrider.server.errors import ApiError, body_too_large, engine_failed, loading, unauthorized
from outrider.server.render import dumps

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


def _header(scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


async def _send_error(send, scope, error: ApiError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = dumps(error.body_for(scope.get("path", ""))).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class CORS:
    """llama-server's CORS: an allowed Origin is echoed, with credentials and any header; OPTIONS never reaches
    auth. `origins` (--cors-origins): "*" allows any, "localhost" the loopback hosts on any port and scheme, and
    any other entry that exact origin. A request from another origin gets no Access-Control-Allow-Origin, so the
    browser keeps the answer from the page."""

    def __init__(self, app, origins: tuple[str, ...] = ("*",)):
        self.app = app
        self.any = "*" in origins
        self.loopback = "localhost" in origins
        self.exact = frozenset(o.encode() for o in origins)

    def allows(self, origin: bytes) -> bool:
        if self.any or origin in self.exact:
            return True
        if not self.loopback:
            return False
        try:
            url = urlsplit(origin.decode("latin-1"))
        except ValueError:  # e.g. an unclosed IPv6 bracket
            return False
        return url.scheme in ("http", "https") and url.hostname in LOOPBACK_HOSTS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = _header(scope, b"origin")
        allow = [(b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true")] \
            if origin and self.allows(origin) else []
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 200, "headers": [
                *allow, (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (b"access-control-allow-headers", b"*"), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message):
            if message["type"] == "http.response.start" and allow:
                message = {**message, "headers": [*message.get("headers", []), *allow]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


class Gate:
    """503 "Loading model" on every route until the engine is ready (and 503 with the reason on every route, /health
    included, once it failed), then the API-key check. `static_paths` (the web page's files) pass both, as in
    llama-server: the page loads first and then asks for the key."""

    def __init__(self, app, engine, api_keys: tuple[str, ...], static_paths: frozenset[str] = frozenset()):
        self.app = app
        self.engine = engine
        self.keys = tuple(k.encode() for k in api_keys)
        self.static_paths = static_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.static_paths:
            return await self.app(scope, receive, send)
        if not self.engine.ready:
            error = ApiError(500, f"model failed to load: {self.engine.load_error}") if self.engine.load_error \
                else loading()
            return await _send_error(send, scope, error)
        if self.engine.failure is not None:
            return await _send_error(send, scope, engine_failed(self.engine.failure))
        if self.keys and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
            return await _send_error(send, scope, unauthorized())
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        auth = _header(scope, b"authorization")
        key = auth.removeprefix(b"Bearer ") if auth is not None else _header(scope, b"x-api-key")
        if key is None:
            return False
        ok = False
        for k in self.keys:  # every key is compared, so the time taken says nothing about which matched
            ok |= hmac.compare_digest(k, key)
        return ok


class BodyLimit:
    """413 for a body over the limit: at once from Content-Length, else as soon as the read passes it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, scope, body_too_large())
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise body_too_large()  # answered by the app's ApiError handler
            return message

        await self.app(scope, counted_receive, send)
