"""Graceful shutdown on SIGTERM or SIGINT: stop admitting (503, /health "Server is shutting down"), let the
requests in flight finish for up to --shutdown-timeout seconds, end the rest with a final frame that says so,
then stop serving (the process exits 0). A second SIGINT exits at once (status 130); a repeated SIGTERM
changes nothing.

The listening socket stays open while draining, so a new request gets a 503 it can act on (retry elsewhere)
rather than a refused connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import uvicorn

from outrider.server.state import ServerState

log = logging.getLogger("outrider.server")

FLUSH_S = 5.0  # after ending the requests left: time for their final frames to go out
INTERRUPTED = 130  # the status of a second SIGINT (128 + SIGINT, as shells report it)


class Shutdown:
    def __init__(self, state: ServerState, server: uvicorn.Server, timeout: float):
        self.state = state
        self.server = server
        self.timeout = timeout
        self.drain: asyncio.Task | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        if self.drain is None:
            log.info("%s: shutting down; %d request(s) in flight may run for up to %g s", sig.name,
                     len(self.state.live), self.timeout)
            self.drain = asyncio.ensure_future(self._drain())
        elif sig == signal.SIGINT:
            log.warning("second interrupt: exiting now")
            os._exit(INTERRUPTED)
        else:
            log.info("%s: already shutting down", sig.name)

    async def _drain(self) -> None:
        self.state.begin_shutdown()
        if not await self._wait_idle(self.timeout):
            left = list(self.state.live)
            log.warning("ending %d request(s) still running after the --shutdown-timeout of %g s", len(left),
                        self.timeout)
            for request_id in left:
                self.state.engine.abort(request_id, error=f"The server is shutting down: the request was ended "
                                                          f"after the --shutdown-timeout of {self.timeout:g} s")
            await self._wait_idle(FLUSH_S)
        self.server.should_exit = True

    async def _wait_idle(self, seconds: float) -> bool:
        """Wait up to `seconds` for every admitted request to finish; whether they did."""
        deadline = asyncio.get_running_loop().time() + seconds
        while self.state.live and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return not self.state.live
