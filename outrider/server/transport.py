"""HTTP plumbing the routes share: reading a JSON body, SSE responses, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from outrider.server.errors import ApiError
from outrider.server.render import dumps

T = TypeVar("T")
SSE_PING = b":\n\n"
SSE_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its non-streamed answer was ready."""


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON body: {e}") from e
    except RecursionError as e:
        raise ApiError(400, "invalid JSON body: nested too deeply") from e
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone
    return task.result()


def sse(obj: Any, named: bool = False) -> bytes:
    """One event; `named`: with an `event:` line holding the object's `type` (Responses, Anthropic Messages)."""
    head = f"event: {obj['type']}\n" if named else ""
    return f"{head}data: {dumps(obj)}\n\n".encode()


async def _sse(events: AsyncIterator[dict], done: bool, ping_interval: float, named: bool,
               error_event: Callable[[ApiError], dict]) -> AsyncIterator[bytes]:
    try:
        async for event in _with_pings(events, ping_interval):
            yield SSE_PING if event is None else sse(event, named)
        if done:
            yield SSE_DONE
    except ApiError as e:  # after the headers went out, an error can only be a frame
        yield sse(error_event(e), named)


async def _with_pings(events: AsyncIterator[dict], interval: float) -> AsyncIterator[dict | None]:
    """`events`, with None after every `interval` seconds of silence (never, when interval <= 0)."""
    if interval <= 0:
        async for event in events:
            yield event
        return
    it = aiter(events)
    while True:
        # One pending step, waited on repeatedly: a timeout must not cancel the step itself.
        step = asyncio.ensure_future(anext(it))
        try:
            while not (await asyncio.wait({step}, timeout=interval))[0]:
                yield None
        finally:
            step.cancel()  # a no-op once it is done; on disconnect it aborts the requests
        try:
            event = step.result()
        except StopAsyncIteration:
            return
        yield event


def sse_response(events: AsyncIterator[dict], done: bool, ping_interval: float, named: bool = False,
                 error_event: Callable[[ApiError], dict] = ApiError.body) -> StreamingResponse:
    """An SSE stream of `events`, closed by `data: [DONE]` when `done` (OpenAI routes), with a `:` comment after
    `ping_interval` seconds of silence; an error after the start is the frame `error_event` makes of it.
    Starlette cancels it when the client disconnects, aborting the requests."""
    return StreamingResponse(_sse(events, done, ping_interval, named, error_event), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
