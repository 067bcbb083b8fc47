"""`outrider serve` in a subprocess on loopback, ready when /health says so, and the SSE frames of its streams:
how the soak driver and the end-to-end tests talk to a real server."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    """`python -m outrider.cli serve ARGS --port 0`; waits for the listening line and then for /health = 200."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout: float = 180.0):
        cmd = [sys.executable, "-m", "outrider.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.stderr: collections.deque[str] = collections.deque(maxlen=2000)
        self.url = self._wait_for_listening(ready_timeout)
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_ready(ready_timeout)

    def _wait_for_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"server exited ({self.proc.wait()}):\n" + "".join(self.stderr))
            self.stderr.append(line)
            if "listening on " in line:
                return line.split("listening on ", 1)[1].strip()
        raise TimeoutError("server did not start listening")

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.stderr))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server never became ready:\n" + "".join(self.stderr))

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def sse_events(lines) -> list:
    """Parse `data: ...` SSE lines into JSON objects ("[DONE]" stays a string); comments are skipped."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
