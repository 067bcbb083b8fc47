"""AsyncEngine: runs the Engine on its own thread and bridges it to asyncio.

Handlers never touch the engine directly: they submit a request and iterate its outputs. Commands (add,
abort) cross into the engine thread through a queue; outputs cross back with call_soon_threadsafe. Closing
or cancelling the iterator aborts the request, which frees its KV blocks on the next loop turn.

A fault that escapes an engine step (one the engine cannot pin on a request, e.g. a lost device) ends the loop:
every request it was given and had not finished, running or queued, gets a final error output at once, and
`failure` says why (the server then answers 503 and exits). Each loop turn is a heartbeat: `stalled_for` is how
long the loop has gone without one while requests wait on it (a watchdog's input).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import traceback
from typing import AsyncIterator, Callable

from outrider.config import EngineConfig
from outrider.engine.builder import build_engine
from outrider.engine.engine import Engine
from outrider.engine.request import FinishReason, Request, RequestOutput
from outrider.testing.faults import FaultPlan
from outrider.timing import now

log = logging.getLogger("outrider.engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig, faults: FaultPlan | None = None):
        """`faults`: test-only fault injection into the target's forward (outrider/testing/faults.py)."""
        self._config = config
        self.faults = faults
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.failure: str | None = None  # why the engine loop ended on a fault (it serves nothing more)
        self.pending = 0  # requests submitted and not yet finished (event-loop side: the watchdog's "work waits")
        self._beat = now()  # the engine loop's last completed turn
        self._open: dict[int, Callable[[RequestOutput], None]] = {}  # engine thread: unfinished requests' outputs
        self._submit = threading.Lock()  # no request is queued after a failure drained the queue
        self._ready = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="outrider-engine", daemon=True)
        self._lock = threading.Lock()  # guards the snapshot views read from other threads
        self._slots: list[dict] = []
        self._last_task: dict[int, Request] = {}  # slot -> the request it serves or served last (as /slots shows)
        self._stats: dict = {}

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration: once it is built, with the defaults the builder resolved (the draft length)."""
        return self.engine.config if self.engine is not None else self._config

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.ready

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit req and yield its outputs until the finished one; abort it if the consumer goes away."""
        if not self.ready:
            raise RuntimeError("engine is not ready")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(out: RequestOutput) -> None:  # (engine thread)
            if out.finished:
                self._open.pop(out.request_id, None)
            if out.timing is not None:  # the frame shows the record as of its own tokens
                out.timing = out.timing.snapshot()
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        with self._submit:
            if self.failure is not None:
                raise RuntimeError(f"engine failed: {self.failure}")
            self._commands.put(("add", (req, deliver)))
        self.pending += 1
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            self.pending -= 1
            if not finished:
                self.abort(req.request_id)

    def stalled_for(self) -> float:
        """Seconds since the engine loop's last turn while requests wait on it (0 when none does)."""
        return now() - self._beat if self.pending else 0.0

    @property
    def drafter_kind(self) -> str | None:
        """The speculative kind actually loaded (None: no drafter, or it failed to load)."""
        return self.engine.drafter_kind if self.engine is not None else None

    def abort(self, request_id: int, error: str | None = None) -> None:
        """End a request; its final output carries `error` (why it was ended) when given."""
        self._commands.put(("abort", (request_id, error)))

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def slots(self) -> list[dict]:
        with self._lock:
            return [dict(s) for s in self._slots]

    # --- engine thread ---
    def _run(self) -> None:
        try:
            self.engine = build_engine(self._config)
            # Everything alive now (model, tokenizer, framework) lives as long as the server: keep the cyclic
            # garbage collector from walking it again in every collection it runs between steps.
            gc.collect()
            gc.freeze()
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("failed to load the model: %s\n%s", exc, traceback.format_exc())
            self._ready.set()
            return
        if self.faults is not None:
            self.faults.install(self.engine.model)
        self._publish()
        self._ready.set()
        try:
            while not self._stop:
                self._turn()
        except Exception as exc:
            self._fail_all(exc)

    def _turn(self) -> None:
        """Apply the commands waiting (blocking briefly when idle), run a step if there is work, publish."""
        engine = self.engine
        block = not engine.has_work()
        try:
            while True:
                kind, arg = self._commands.get(block=block, timeout=0.5 if block else None)
                block = False
                self._apply(kind, arg)
        except queue.Empty:
            pass
        self._beat = now()  # (a request just added counts its wait from here)
        if engine.has_work():
            engine.step()
        self._publish()
        self._beat = now()

    def _apply(self, kind: str, arg) -> None:
        try:
            if kind == "add":
                req, deliver = arg
                self._open[req.request_id] = deliver
                self.engine.add_request(req, deliver)
            elif kind == "abort":
                self.engine.abort(*arg)
        except Exception as exc:  # one bad request must not stop the engine thread
            log.error("%s failed: %s\n%s", kind, exc, traceback.format_exc())
            if kind == "add":
                req, deliver = arg
                self.engine.abort(req.request_id)
                deliver(RequestOutput(req.request_id, [], True, FinishReason.ERROR, error=str(exc)))

    def _fail_all(self, exc: Exception) -> None:
        """The loop is over: fail every request it was given that has not finished, queued ones included."""
        log.critical("engine failed, failing every request: %s\n%s", exc, traceback.format_exc())
        with self._submit:
            self.failure = f"{type(exc).__name__}: {exc}"
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._open[arg[0].request_id] = arg[1]
        for request_id, deliver in list(self._open.items()):
            deliver(RequestOutput(request_id, [], finished=True, finish_reason=FinishReason.ERROR,
                                  error=f"engine failed: {self.failure}"))

    def _publish(self) -> None:
        engine = self.engine
        slots = []
        running = {r.id_slot: r for r in engine.scheduler.running}
        states = engine.scheduler.states
        self._last_task.update(running)
        for i in range(engine.config.max_num_seqs):
            req = self._last_task.get(i)
            slots.append({
                "id": i,
                "n_ctx": engine.max_model_len,
                "is_processing": i in running,
                "request": req,
                "n_decoded": len(req.output_ids) if req is not None else 0,
                # a hybrid model's: the linear-attention state slot and KV blocks the request holds
                "state_slot": states.slot(running[i]) if states is not None and i in running else None,
                "kv_blocks": len(running[i].block_ids) if i in running else 0,
            })
        stats = engine.stats()
        with self._lock:
            self._slots, self._stats = slots, stats
