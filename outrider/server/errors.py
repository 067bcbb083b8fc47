"""llama-server's JSON error format: `{"error": {"code", "message", "type"}}`, one exception for every route."""

from __future__ import annotations

from typing import Any

from outrider.server.render import JSON

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error a route answers with; `extra` adds fields (e.g. `n_prompt_tokens`, `n_ctx`)."""

    def __init__(self, status: int, message: str, type: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}

    def response(self, path: str = "") -> JSON:
        """The error as the route at `path` writes errors (Anthropic's format on /v1/messages...)."""
        return JSON(self.body_for(path), status_code=self.status)

    def body_for(self, path: str) -> dict[str, Any]:
        return self.anthropic_body() if path.startswith(ANTHROPIC_PREFIX) else self.body()

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's format: `{"type": "error", "error": {"type", "message"}}`."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def invalid(field: str, reason: str) -> ApiError:
    """400 naming the offending request field."""
    return ApiError(400, f"invalid value for '{field}': {reason}")


def context_exceeded(n_prompt: int, n_ctx: int) -> ApiError:
    return ApiError(
        400,
        f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it",
        "exceed_context_size_error",
        n_prompt_tokens=n_prompt,
        n_ctx=n_ctx,
    )


# Fresh instances: a raised exception keeps its traceback, so one shared instance would pin other requests' frames.
def loading() -> ApiError:
    return ApiError(503, "Loading model")


def busy() -> ApiError:
    return ApiError(503, "All slots are busy, try again later")


def unauthorized() -> ApiError:
    return ApiError(401, "Invalid API Key")


def body_too_large() -> ApiError:
    return ApiError(413, "Request body too large.")


def shutting_down() -> ApiError:
    return ApiError(503, "Server is shutting down")


def engine_failed(reason: str) -> ApiError:
    return ApiError(503, f"The engine failed and serves no more requests: {reason}")
