"""Liveness, end to end: `outrider serve` with faults injected into the target's forward (outrider/testing/faults.py,
switched on through OUTRIDER_TEST_FAULTS), and /health telling the truth in each case:

- a request-local fault fails that request alone (500, or an error frame); a request batched with it carries on
  and produces exactly what it produces alone; /health stays 200;
- a stalled engine loop turns /health 503 (the watchdog) until it moves again;
- an engine-fatal fault fails every running and queued request at once, /health and new requests get 503 with
  the reason, and the process exits with status 1.
The module's server also runs with LLAMA_SERVER_SLOTS_DEBUG=1, the one way /slots shows what requests said.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from e2e_harness import ServerProcess, Stream
from outrider.testing import write_tiny_checkpoint
from outrider.testing.faults import ENV

REQUEST_FAULT, FATAL, STALL = 7, 8, 9  # token ids: a prompt holding one triggers that fault
STALL_S, STALL_TIMEOUT = 3.0, 1.0
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("liveness") / "target", "qwen3", seed=3,
                                 max_position_embeddings=4096)


def start(ckpt, faults: dict, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(["-m", str(ckpt), "-np", "4", "-c", "4096", "--metrics", *args],
                         env={ENV: json.dumps(faults), **(env or {})})


@pytest.fixture(scope="module")
def server(ckpt):
    srv = start(ckpt, {"request_fault_token": REQUEST_FAULT, "stall_token": STALL, "stall_s": STALL_S,
                       "step_delay_s": 0.002}, "--engine-stall-timeout", str(STALL_TIMEOUT),
                env={"LLAMA_SERVER_SLOTS_DEBUG": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_idle(client) -> None:
    """Every slot free and every KV block back in the pool."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = client.get("/metrics").text
        m = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("outrider_kv_blocks_"))
        busy = [s for s in client.get("/slots").json() if s["is_processing"]]
        if not busy and m["outrider_kv_blocks_free"] == m["outrider_kv_blocks_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {m}")


def test_a_request_local_fault_fails_only_that_request(server, client):
    healthy = {"prompt": [20, 21, 22], "n_predict": 300, "stream": True, **GREEDY}
    stream = Stream(server.url, "/completion", healthy)
    assert stream.first.wait(60)
    before = "".join(server.stderr).count("running each alone to find the one at fault")
    # Arriving while the healthy stream decodes, each faulty prompt shares its step with it.
    r = client.post("/completion", json={"prompt": [30, REQUEST_FAULT, 31], "n_predict": 4})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "injected fault" in r.json()["error"]["message"]
    faulty = Stream(server.url, "/completion", {"prompt": [40, REQUEST_FAULT], "n_predict": 4, "stream": True})
    events = faulty.result()
    assert faulty.status == 200 and len(events) == 1 and "injected fault" in events[0]["error"]["message"]
    assert client.get("/health").status_code == 200
    final = stream.result()[-1]
    assert final["stop"] is True and final["stop_type"] == "limit" and "error" not in final
    assert final["tokens_predicted"] == 300
    # The failed steps advanced nothing: the healthy stream's tokens are exactly those of the same request alone.
    streamed = [t for e in stream.events[:-1] for t in e["tokens"]]
    alone = client.post("/completion", json={**healthy, "stream": False, "return_tokens": True}).json()
    assert streamed == alone["tokens"]
    # Both faulty requests shared a step with the healthy stream (so the isolation was exercised), then failed alone.
    assert "".join(server.stderr).count("running each alone to find the one at fault") - before == 2
    assert_idle(client)


def test_a_stalled_engine_loop_turns_health_503_until_it_moves_again(server, client):
    assert client.get("/health").status_code == 200
    result = {}
    stalled = threading.Thread(target=lambda: result.update(r=client.post(
        "/completion", json={"prompt": [50, STALL, 51], "n_predict": 3, **GREEDY})))
    t0 = time.monotonic()
    stalled.start()
    seen = []
    while stalled.is_alive():
        r = client.get("/health")
        seen.append((round(time.monotonic() - t0, 2), r.status_code, r.json()))
        time.sleep(0.1)
    unhealthy = [(t, body) for t, status, body in seen if status == 503]
    assert unhealthy, seen
    assert all(t >= STALL_TIMEOUT for t, _ in unhealthy)
    assert all("Engine stalled: no progress for" in body["error"]["message"] for _, body in unhealthy)
    assert result["r"].status_code == 200 and result["r"].json()["tokens_predicted"] == 3
    assert client.get("/health").json() == {"status": "ok"}


def test_an_engine_fatal_fault_fails_everything_and_exits_nonzero(ckpt):
    # The fatal prompt also stalls its step, so requests sent meanwhile are still queued when the engine fails.
    srv = start(ckpt, {"fatal_fault_token": FATAL, "stall_token": STALL, "stall_s": 2.0})
    try:
        running = Stream(srv.url, "/completion", {"prompt": [60, 61], "n_predict": 3000, "stream": True, **GREEDY})
        assert running.first.wait(60)
        results = {}

        def post(name: str, body: dict) -> None:
            results[name] = httpx.post(srv.url + "/completion", json=body, timeout=60)

        fatal = threading.Thread(target=post, args=("fatal", {"prompt": [70, STALL, FATAL], "n_predict": 4}))
        fatal.start()
        time.sleep(0.5)  # the engine is inside the fatal step now
        queued = threading.Thread(target=post, args=("queued", {"prompt": [80, 81], "n_predict": 4}))
        queued.start()
        queued_stream = Stream(srv.url, "/v1/completions", {"prompt": "q", "max_tokens": 4, "stream": True})
        fatal.join(60)
        queued.join(60)
        t_failed = time.monotonic()
        for name in ("fatal", "queued"):
            r = results[name]
            assert r.status_code == 500, (name, r.text)
            assert r.json()["error"]["message"].startswith("engine failed: AcceleratorError: injected fault")
        for s in (running, queued_stream):
            (last,) = [e for e in s.result() if isinstance(e, dict) and "error" in e]
            assert last["error"]["code"] == 500 and "injected fault" in last["error"]["message"]
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and "injected fault" in health.json()["error"]["message"]
        late = httpx.post(srv.url + "/completion", json={"prompt": [90], "n_predict": 1}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["type"] == "unavailable_error"
        assert srv.proc.wait(timeout=30) == 1
        assert time.monotonic() - t_failed < 15
    finally:
        srv.stop()


def test_slots_show_request_text_only_with_slots_debug(client):
    body = {"prompt": "a secret prompt", "n_predict": 3, "stop": ["never"], **GREEDY}
    out = client.post("/completion", json=body).json()
    (slot,) = [s for s in client.get("/slots").json() if s["id"] == out["id_slot"]]
    assert slot["prompt"].endswith("a secret prompt") and slot["generated"] == out["content"]
    assert slot["params"]["stop"] == ["never"]
