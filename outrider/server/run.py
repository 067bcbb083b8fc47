"""Run the server: start the engine thread (it loads the model while /health says 503), bind, serve, and drain
on SIGINT/SIGTERM (server/shutdown.py). A model that fails to load ends the process with status 1, as
llama-server does; so does an engine that fails later (after a short grace), unless --no-exit-on-engine-failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys

import uvicorn

from outrider.config import EngineConfig
from outrider.engine.async_engine import AsyncEngine
from outrider.server.app import create_app
from outrider.server.settings import ServerConfig
from outrider.server.shutdown import Shutdown
from outrider.testing.faults import FaultPlan

log = logging.getLogger("outrider.server")

FAILURE_GRACE_S = 2.0  # a failed engine: time for the error frames to go out and a probe to see the 503


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (a UNIX socket when host ends in .sock); port 0 picks a free port."""
    if host.endswith(".sock"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(host)
    else:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    sock.listen(2048)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: Shutdown drains instead (uvicorn would close the listening socket
    at once, cut streams after its graceful timeout, and raise the signal again on the way out)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _watch_engine(engine: AsyncEngine, server: uvicorn.Server, exit_on_failure: bool) -> int:
    """Wait for the model, then watch for an engine failure; either one stops serving with status 1."""
    while not engine.ready and engine.load_error is None:
        await asyncio.sleep(0.05)
    if engine.load_error is not None:
        log.error("failed to load the model: %s", engine.load_error)
        server.should_exit = True
        return 1
    log.info("model loaded; server ready")
    while engine.failure is None:
        await asyncio.sleep(0.1)
    if not exit_on_failure:
        log.error("the engine failed; answering 503 until stopped (--no-exit-on-engine-failure)")
        await asyncio.Event().wait()  # until the server stops and cancels this watcher
    log.error("the engine failed; exiting in %g s: %s", FAILURE_GRACE_S, engine.failure)
    await asyncio.sleep(FAILURE_GRACE_S)
    server.should_exit = True
    return 1


async def _serve(engine: AsyncEngine, server: uvicorn.Server, sock: socket.socket, shutdown: Shutdown,
                 exit_on_failure: bool) -> int:
    shutdown.install(asyncio.get_running_loop())
    watcher = asyncio.create_task(_watch_engine(engine, server, exit_on_failure))
    await server.serve(sockets=[sock])
    if not watcher.done():
        watcher.cancel()
        return 0
    return watcher.result()


def configure_logging(config: ServerConfig) -> None:
    """-v: debug level; --log-file: a file beside stderr; --log-disable: nothing (the listening line, which scripts
    wait for, is printed regardless)."""
    handlers: list[logging.Handler] = [] if config.log_disable else [logging.StreamHandler(sys.stderr)]
    if config.log_file and not config.log_disable:
        handlers.append(logging.FileHandler(config.log_file, encoding="utf-8"))
    logging.basicConfig(level=logging.DEBUG if config.verbose else logging.INFO,
                        handlers=handlers or [logging.NullHandler()], force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    configure_logging(config)
    engine = AsyncEngine(engine_config, faults=FaultPlan.from_env())
    engine.start()
    sock = bind(config.host, config.port)
    if config.host.endswith(".sock"):
        where = config.host
    else:
        host, port = sock.getsockname()[:2]
        where = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    # Tests and scripts wait for this line (with --port 0 it is the only way to learn the port).
    print(f"outrider: listening on {where}", file=sys.stderr, flush=True)
    app = create_app(engine, config)
    server = _Uvicorn(uvicorn.Config(app, log_level="warning", access_log=False,
                                     timeout_keep_alive=config.timeout, timeout_graceful_shutdown=5))
    shutdown = Shutdown(app.state.server, server, config.shutdown_timeout)
    try:
        return asyncio.run(_serve(engine, server, sock, shutdown, config.exit_on_engine_failure))
    finally:
        engine.shutdown()
