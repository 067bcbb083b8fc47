"""Shutdown, end to end: SIGTERM to `outrider serve` with streams in flight. Every forward is slowed to a known
pace (outrider/testing/faults.py: step_delay_s), so which requests can finish within --shutdown-timeout is known.

- at once: new requests and /health get 503 "Server is shutting down" (the socket still listens);
- a stream that can finish within the timeout finishes normally;
- the rest are ended at the timeout: native streams with a final frame (stop, stop_type "none", `error`),
  OpenAI streams with finish_reason "abort", `error` and [DONE], non-streamed requests with a 503;
- the process exits 0 after the timeout; a second SIGINT exits at once.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from e2e_harness import ServerProcess, Stream
from outrider.testing import write_tiny_checkpoint
from outrider.testing.faults import ENV

DELAY_S = 0.02  # every forward: a token per 20 ms at most
TIMEOUT_S = 3.0
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("shutdown") / "target", "qwen3", seed=4,
                                 max_position_embeddings=4096)


def start(ckpt, *args: str) -> ServerProcess:
    return ServerProcess(["-m", str(ckpt), "-np", "4", "-c", "4096", *args],
                         env={ENV: json.dumps({"step_delay_s": DELAY_S})})


def wait_busy(client: httpx.Client, n: int) -> None:
    deadline = time.monotonic() + 30
    while sum(s["is_processing"] for s in client.get("/slots").json()) < n:
        assert time.monotonic() < deadline, "the requests never all started"
        time.sleep(0.02)


def test_sigterm_drains_streams_then_ends_the_rest_and_exits_0(ckpt):
    srv = start(ckpt, "--shutdown-timeout", str(TIMEOUT_S))
    try:
        client = httpx.Client(base_url=srv.url, timeout=60)
        long = 3000  # tokens: a minute at the forced pace, far past the timeout
        short = Stream(srv.url, "/completion", {"prompt": [10, 11], "n_predict": 40, "stream": True, **GREEDY})
        native = Stream(srv.url, "/completion", {"prompt": [12, 13], "n_predict": long, "stream": True, **GREEDY})
        chat = Stream(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": long, "stream": True, **GREEDY})
        plain = {}
        plain_thread = threading.Thread(target=lambda: plain.update(r=httpx.post(
            srv.url + "/completion", json={"prompt": [14, 15], "n_predict": long, **GREEDY}, timeout=60)))
        plain_thread.start()
        wait_busy(client, 4)
        srv.proc.send_signal(signal.SIGTERM)
        t_signal = time.monotonic()
        time.sleep(0.3)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == "Server is shutting down"
        late = client.post("/completion", json={"prompt": [16], "n_predict": 1})
        assert late.status_code == 503 and late.json()["error"]["type"] == "unavailable_error"

        final = short.result()[-1]  # 40 tokens take under a second: it finishes as usual
        assert final["stop"] is True and final["stop_type"] == "limit" and final["tokens_predicted"] == 40
        assert "error" not in final

        final = native.result()[-1]
        assert final["stop"] is True and final["stop_type"] == "none" and 0 < final["tokens_predicted"] < long
        assert final["error"]["code"] == 503 and "shutting down" in final["error"]["message"]
        assert final["timings"]["predicted_n"] == final["tokens_predicted"]

        events = chat.result()
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["choices"][0]["finish_reason"] == "abort" and "shutting down" in last["error"]["message"]
        assert 0 < last["timings"]["predicted_n"] < long

        plain_thread.join(30)
        assert plain["r"].status_code == 503 and "shutting down" in plain["r"].json()["error"]["message"]

        assert srv.proc.wait(timeout=30) == 0
        took = time.monotonic() - t_signal
        assert TIMEOUT_S <= took < TIMEOUT_S + 10, took
        log = "".join(srv.stderr)
        assert "SIGTERM: shutting down" in log and "ending 3 request(s) still running" in log
    finally:
        srv.stop()


def test_a_second_sigint_exits_at_once(ckpt):
    srv = start(ckpt, "--shutdown-timeout", "60")
    try:
        stream = Stream(srv.url, "/completion", {"prompt": [20, 21], "n_predict": 3000, "stream": True, **GREEDY})
        assert stream.first.wait(60)
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503  # draining, for up to a minute
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=10) == 130
        assert time.monotonic() - t0 < 5
        stream.join(10)
        assert stream.cut and not any(e.get("stop") for e in stream.events)  # no time for a final frame
    finally:
        srv.stop()
