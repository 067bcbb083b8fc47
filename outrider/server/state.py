"""ServerState: what the routes share (engine, settings, metrics, in-flight requests) and the one way they run
requests on the engine: admit (or 503 when the queue is full, the server is shutting down or the engine failed),
then iterate the merged outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator

from outrider.engine.async_engine import AsyncEngine
from outrider.engine.request import FinishReason, Request, RequestOutput
from outrider.server import context_shift
from outrider.server.errors import ApiError, busy, engine_failed, loading, shutting_down
from outrider.server.metrics import Metrics
from outrider.params import SamplingParams
from outrider.server.protocol import get_float
from outrider.server.render import generation_settings
from outrider.server.settings import ServerConfig


log = logging.getLogger("outrider.server")


class ServerState:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.started = time.time()
        self.live: dict[int, Request] = {}  # admitted and not yet finished, by request_id (the queue limit)
        self.shutting_down = False  # set once by begin_shutdown: nothing new is admitted

    def begin_shutdown(self) -> None:
        self.shutting_down = True

    def check_health(self) -> None:
        """Raise the 503 /health answers while shutting down, or while the engine loop is stalled (the watchdog:
        no turn for --engine-stall-timeout seconds while requests wait). Loading and a failed engine are the
        Gate's: they answer 503 on every route."""
        if self.shutting_down:
            raise shutting_down()
        stalled, limit = self.engine.stalled_for(), self.config.stall_timeout
        if limit > 0 and stalled > limit:
            log.error("watchdog: the engine made no progress for %.1f s with %d request(s) waiting", stalled,
                      self.engine.pending)
            raise ApiError(503, f"Engine stalled: no progress for {stalled:.0f} s with {self.engine.pending} "
                                f"request(s) waiting")

    @property
    def core(self):
        """The loaded Engine (tokenizer, model config, limits); only valid once `engine.ready`."""
        if not self.engine.ready:
            raise loading()
        return self.engine.engine

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def n_ctx(self) -> int:
        return self.core.max_model_len

    @property
    def n_slots(self) -> int:
        return self.engine.config.max_num_seqs

    def generation_settings(self, params: SamplingParams, seed: int | None = None, **switches) -> dict:
        """llama-server's `generation_settings` of `params` on this server (render.generation_settings)."""
        return generation_settings(params, self.engine.config, seed, drafter_kind=self.engine.drafter_kind,
                                   eog_ids=self.core.eos_ids, **switches)

    def ping_interval(self, body: dict) -> float:
        """A request's `sse_ping_interval` (<= 0: no keep-alive comments)."""
        return get_float(body, "sse_ping_interval", self.config.sse_ping_interval, lo=-1)

    def admit(self, requests: list[Request]) -> Generation:
        """Submit requests now (a full queue is a 503 before any response starts)."""
        if self.shutting_down:
            raise shutting_down()
        if self.engine.failure is not None:
            raise engine_failed(self.engine.failure)
        if len(self.live) + len(requests) > self.n_slots + self.config.max_queue:
            raise busy()
        return Generation(self, requests)


class Generation:
    """Requests submitted together (a batch of prompts x n choices); their outputs merged in arrival order.

    Each request is pumped by its own task, so one slow consumer never stalls the engine thread's callbacks;
    closing the iterator (client gone, cancelled) cancels the pumps, which aborts the requests in the engine.
    """

    def __init__(self, state: ServerState, requests: list[Request]):
        self.state = state
        self.requests = requests
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = []
        for index, req in enumerate(requests):
            state.live[req.request_id] = req
            task = asyncio.create_task(self._pump(index, req))
            # A done callback also runs for a task cancelled before it started, so nothing stays "live".
            task.add_done_callback(lambda _, i=index: state.live.pop(self.requests[i].request_id, None))
            self._tasks.append(task)

    async def _pump(self, index: int, req: Request) -> None:
        try:
            while req is not None:
                req = await self._run(index, req)
        except Exception as e:  # surfaces in the consumer as a 500 (or an error frame)
            self._queue.put_nowait(ApiError(500, f"generation failed: {e}"))

    async def _run(self, index: int, req: Request) -> Request | None:
        """Pump one request's outputs; with --context-shift, one that fills its context hands over to its
        continuation (returned; its last output goes on as an unfinished one)."""
        async for out in self.state.engine.generate(req):
            if out.finished and out.finish_reason is FinishReason.CONTEXT and self.state.config.context_shift:
                nxt = context_shift.continuation(req, add_bos=self.state.tokenizer.add_bos)
                if nxt is not None:
                    self.requests[index] = nxt
                    self.state.live.pop(req.request_id, None)
                    self.state.live[nxt.request_id] = nxt
                    self._queue.put_nowait((index, dataclasses.replace(out, finished=False, finish_reason=None,
                                                                       stop_type="none")))
                    return nxt
            if out.finished and out.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR):
                self.state.metrics.on_finished(out.timing, pooled=req.params.pooling is not None)
            self._queue.put_nowait((index, out))
        return None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (index, output) until every request finished."""
        remaining = len(self._tasks)
        try:
            while remaining:
                item = await self._queue.get()
                if isinstance(item, ApiError):
                    raise item
                if item[1].finish_reason is FinishReason.ERROR:  # the engine failed this request
                    raise ApiError(500, item[1].error or "generation failed")
                if item[1].finished:
                    remaining -= 1
                yield item
        finally:
            for task in self._tasks:
                task.cancel()

    async def collect(self) -> list[list[RequestOutput]]:
        """Every request's outputs, in request order (non-streamed responses). A request the server ended (at
        shutdown) makes the whole answer a 503: a body of cut-short text would pass for a complete one."""
        per_request: list[list[RequestOutput]] = [[] for _ in self.requests]
        async for index, out in self.outputs():
            per_request[index].append(out)
        for outs in per_request:
            if (error := ended_error(outs[-1])) is not None:
                raise ApiError(503, error["message"])
        return per_request


def ended_error(out: RequestOutput) -> dict | None:
    """The `error` object of a final frame whose request the server ended early (at shutdown), else None."""
    if out.finish_reason is not FinishReason.ABORT or out.error is None:
        return None
    return ApiError(503, out.error).body()["error"]
