"""Boot the real `outrider serve` in a subprocess on loopback and talk to it (shared by the e2e test files); the
launcher and the SSE parser are outrider_tools' (the soak driver uses them too)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from outrider_tools.server_process import ServerProcess, sse_events  # noqa: F401  (the e2e tests import them here)

REPO = Path(__file__).resolve().parents[1]


class Stream(threading.Thread):
    """A streamed request read in the background: its status and every SSE event; `first` is set at the first."""

    def __init__(self, url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.first = threading.Event()
        self.status: int | None = None
        self.events: list = []
        self.cut = False
        self.start()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120) as c, c.stream("POST", self.path, json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.extend(sse_events([line]))
                        self.first.set()
        except httpx.TransportError:
            self.cut = True  # the server went away mid-stream
        self.first.set()

    def result(self, timeout: float = 120) -> list:
        self.join(timeout)
        assert not self.is_alive(), "the stream never ended"
        return self.events
