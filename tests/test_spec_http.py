"""Speculative decoding over HTTP, with the real app and uvicorn on loopback in this process (so the tests can
reach the engine's step hook and its loader):

- timings: with steps made to last P (prefill) and R (every later step), `prompt_ms` is P and `predicted_ms` the
  total of the steps after the first token, for the first request after start and later ones, one at a time
  and four at once, streamed and not; a drafter that is slow to load keeps /health at 503 and shows in no
  request's timings;
- counters: `timings` carries draft_n, draft_n_accepted and draft_rounds (and `draft_kind` sits beside it, since
  `timings` holds numbers only) exactly for the requests
  that drafted, and the /metrics `llamacpp:spec_decode_*` counters, the per-position accepted counter and the
  accepted-length histogram add up to the per-request counters, for every drafter kind;
- /props and /slots report the drafter kind.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import httpx
import pytest
import uvicorn

import outrider.engine.builder as builder_mod
from e2e_harness import sse_events
from outrider.config import EngineConfig
from outrider.engine.async_engine import AsyncEngine
from outrider.server.app import create_app
from outrider.server.run import bind
from outrider.server.settings import ServerConfig
from spec_helpers import LLAMA_SPEC_TYPES, SETUPS, StepClock, write_families

DRAFT_KEYS = ("draft_n", "draft_n_accepted", "draft_rounds")
GREEDY = {"temperature": 0, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "ignore_eos": True}
P_S, R_S = 0.30, 0.06  # the step clock: a step that prefills lasts P, any other R
JITTER_MS = 10.0  # what the clock cannot place: the token stamp after the hook, the prompt start in the step
LOAD_S = 1.5  # how slow the slow drafter loader is


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_families(tmp_path_factory.mktemp("spec_http"))


class LoopbackServer:
    """AsyncEngine + create_app + uvicorn on 127.0.0.1 (a port the OS picks) in a thread of this process. The
    socket listens before the engine is ready, as `outrider serve` does."""

    def __init__(self, engine_config: EngineConfig):
        self.engine = AsyncEngine(engine_config)
        self.engine.start()
        app = create_app(self.engine, ServerConfig(model_name="tiny", endpoint_metrics=True, endpoint_props=True))
        sock = bind("127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


def engine_config(families, kind: str, **kwargs) -> EngineConfig:
    arch, served, extra, _ = SETUPS[kind]
    return EngineConfig(model=str(families[arch][served]), max_num_seqs=4, max_model_len=256, spec_draft_n_max=3,
                        **extra(families[arch]), **kwargs)


async def _post(ac: httpx.AsyncClient, path: str, body: dict) -> tuple[dict, list]:
    """(the final object with `timings`, every SSE event) for a streamed or plain request."""
    if not body.get("stream"):
        r = await ac.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json(), []
    async with ac.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = sse_events([line async for line in r.aiter_lines()])
    finals = [e for e in events if isinstance(e, dict) and "timings" in e and e.get("stop", True)]
    return finals[-1], events


def post_all(url: str, requests: list[tuple[str, dict]]) -> list[tuple[dict, list]]:
    """Send the requests at once (each on its own connection) and wait for all of them."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
            return await asyncio.gather(*(_post(ac, path, body) for path, body in requests))

    return asyncio.run(run())


def scrape(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r"^([a-z_:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


# --- criterion 4: timings --------------------------------------------------------------------------------------

def test_http_timings_cover_prefill_and_rounds_and_never_the_drafter_load(families, monkeypatch, caplog):
    loading, release = threading.Event(), threading.Event()
    real_loader = builder_mod.load_drafter

    def slow_loader(*args, **kwargs):
        loading.set()
        assert release.wait(timeout=120)
        time.sleep(LOAD_S)  # the slowness itself
        return real_loader(*args, **kwargs)

    monkeypatch.setattr(builder_mod, "load_drafter", slow_loader)
    caplog.set_level(logging.INFO, logger="outrider.engine")
    srv = LoopbackServer(engine_config(families, "draft"))
    try:
        assert loading.wait(timeout=120)
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            # While the drafter loads the server answers, but only 503: no request can start (and so pay for it).
            assert client.get("/health").status_code == 503
            r = client.post("/completion", json={"prompt": [5, 6, 7], "n_predict": 4, **GREEDY})
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
            release.set()
            assert srv.engine.wait_ready(timeout=120) and srv.engine.drafter_kind == "draft"
            assert client.get("/health").status_code == 200
        loaded = re.search(r"Drafter loaded \(kind=draft, (\d+) ms\)", caplog.text)
        assert loaded and int(loaded.group(1)) >= LOAD_S * 1e3  # the load was slow, and beside the target
        clock = StepClock(P_S, R_S).install(srv.engine.engine)

        def prompt(i: int) -> list[int]:
            return [7 + i, 11, 13 + i, 17, 19, 23 + i]  # every request its own prompt (and no prefix-cache hit)

        n = 0
        for rnd in ("first", "later"):
            for batch in (1, 4):
                for stream in (False, True):
                    requests = []
                    for j in range(batch):
                        # Lengths vary, so the last round is a drafted multi-token one for some requests.
                        body = {"prompt": prompt(n), "n_predict": 8 + n % 4, "stream": stream,
                                "timings_per_token": stream, **GREEDY}
                        if j == 1:
                            body["speculative.n_max"] = 0  # a plain request in the same steps
                        if j == 2:
                            body = {**body, **SAMPLED, "seed": n}
                        if j == 3:
                            body["speculative"] = {"n_max": 1}
                        requests.append(("/completion", body))
                        n += 1
                    results = post_all(srv.url, requests)
                    for (_, body), (final, events) in zip(requests, results):
                        assert final["tokens_predicted"] == body["n_predict"]
                        request = clock.request_with_prompt(body["prompt"])
                        clock.check(final["timings"], request.timing, JITTER_MS)
                        drafted = body.get("speculative.n_max") != 0
                        assert ("draft_n" in final["timings"]) == drafted, (rnd, batch, stream, final["timings"])
                        if stream:  # streamed as it went, and every frame tells the same prompt_ms
                            frames = [e["timings"] for e in events if not e.get("stop", True)]
                            assert len(frames) >= 2
                            assert all(f["prompt_ms"] == final["timings"]["prompt_ms"] for f in frames)
                            assert [f["predicted_ms"] for f in frames] == sorted(f["predicted_ms"] for f in frames)
        assert max(len(s.requests) for s in clock.steps) == 4  # the batches of four did share steps
        # Drafts were accepted, so some rounds committed several tokens: predicted_ms counted rounds, not tokens.
        assert any(len(clock.steps_of(r.timing)) < r.timing.predicted_n for s in clock.steps for r in s.requests)
    finally:
        release.set()
        srv.stop()


# --- criterion 5 and the drafter kind in /props and /slots ------------------------------------------------------

@pytest.fixture(scope="module", params=list(SETUPS))
def spec_server(request, families):
    kind = request.param
    srv = LoopbackServer(engine_config(families, kind))
    assert srv.engine.wait_ready(timeout=120)
    clock = StepClock().install(srv.engine.engine)  # no delays: it records which requests each step ran
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield kind, SETUPS[kind][3], srv, clock, client
    srv.stop()


def test_props_and_slots_report_the_drafter_kind(spec_server):
    _, reported, srv, clock, client = spec_server
    assert srv.engine.drafter_kind == reported
    props = client.get("/props").json()
    # llama-server's spelling: a string, its --spec-type names comma-joined ("none" without a drafter).
    assert props["default_generation_settings"]["params"]["speculative.types"] == LLAMA_SPEC_TYPES[reported]
    assert all(s["speculative"] is True and not s["is_processing"] for s in client.get("/slots").json())
    # Hold the engine in the step after the prefill: /slots then shows the request at work.
    clock.gate.clear()
    try:
        body = {"prompt": [40, 41, 42, 43], "n_predict": 6, "stream": True, **GREEDY}
        with client.stream("POST", "/completion", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # the prefill's token
            assert '"stop":false' in first
            busy = [s for s in client.get("/slots").json() if s["is_processing"]]
            assert len(busy) == 1 and busy[0]["speculative"] is True
            assert busy[0]["params"]["speculative.types"] == LLAMA_SPEC_TYPES[reported]
            assert busy[0]["params"]["speculative.n_max"] == 3
            clock.gate.set()
            final = sse_events(list(lines))[-1]
        assert final["stop"] is True and final["tokens_predicted"] == 6
    finally:
        clock.gate.set()


def test_draft_counters_in_timings_and_metrics(spec_server):
    kind, reported, srv, clock, client = spec_server
    before = scrape(client)
    first_step = len(clock.steps)
    requests = [
        ("/completion", {"prompt": [50, 51, 52, 53], "n_predict": 12, **GREEDY}),
        ("/completion", {"prompt": [60, 61, 62], "n_predict": 12, "stream": True, "timings_per_token": True,
                         "seed": 3, **SAMPLED}),
        ("/completion", {"prompt": [70, 71, 72], "n_predict": 12, "speculative.n_max": 0, **GREEDY}),
        ("/completion", {"prompt": [80, 81, 82], "n_predict": 1, **GREEDY}),  # one token: nothing to draft
    ]
    results = post_all(srv.url, requests)
    requests2 = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                                  "speculative": {"n_max": 2}, "seed": 4, **SAMPLED}),
        ("/v1/completions", {"prompt": [90, 91, 92], "max_tokens": 8, "stream": True, "speculative.n_max": 0,
                             **GREEDY}),
        ("/v1/completions", {"prompt": [95, 96, 97], "max_tokens": 8, "stream": True, **GREEDY}),
    ]
    results += post_all(srv.url, requests2)
    timings = [final["timings"] for final, _ in results]
    drafted = [True, True, False, False, True, False, True]
    for (final, _), t, expect, (path, body) in zip(results, timings, drafted, requests + requests2):
        assert all(isinstance(v, (int, float)) for v in t.values()), t  # clients read a map of numbers
        assert final.get("draft_kind") == (reported if expect else None), (path, body, final)
        if expect:
            assert t["draft_rounds"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"], t
            assert t["draft_n"] <= 3 * t["draft_rounds"]  # k <= --spec-draft-n-max
            # Every round commits its accepted drafts plus one token; the prefill gave the first.
            assert t["predicted_n"] >= 1 + t["draft_rounds"] + t["draft_n_accepted"]
        else:
            assert not set(DRAFT_KEYS) & set(t), (path, body, t)
    # Streamed frames follow the same rule: the keys appear once the request has drafted, never before.
    frames = [e["timings"] for e in results[1][1] if isinstance(e, dict) and "timings" in e]
    assert "draft_n" not in frames[0] and "draft_n" in frames[-1]
    assert sum(t.get("draft_n_accepted", 0) for t in timings) > 0  # so the counters below are not all zero

    after = scrape(client)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == sum(t.get("draft_n", 0) for t in timings)
    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == accepted
    assert delta("llamacpp:spec_decode_num_drafts_total") == sum(t.get("draft_rounds", 0) for t in timings)
    per_pos = {int(re.search(r'position="(\d+)"', k).group(1)): delta(k) for k in after
               if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total{")}
    # Per position: the engine's per-request records of exactly these requests, summed.
    records = {id(r): r.timing for s in clock.steps[first_step:] for r in s.requests}
    assert len(records) == len(requests) + len(requests2)
    assert sorted(t.draft_n for t in records.values()) == sorted(t.get("draft_n", 0) for t in timings)
    expected = {}
    for rec in records.values():
        for i, n in enumerate(rec.accepted_per_position):
            expected[i] = expected.get(i, 0) + n
    assert {i: n for i, n in per_pos.items() if n} == {i: n for i, n in expected.items() if n}
    assert sum(per_pos.values()) == accepted
    # Accepted-length histogram: one observation per round, of (accepted drafts + 1).
    assert delta("outrider_spec_accepted_length_count") == sum(t.get("draft_rounds", 0) for t in timings)
    assert delta("outrider_spec_accepted_length_sum") == sum(t.get("draft_rounds", 0) + t.get("draft_n_accepted", 0)
                                                             for t in timings)


@pytest.mark.parametrize("why", ["spec_type_none", "drafter_fails_to_load"])
def test_server_without_a_drafter(families, monkeypatch, caplog, why):
    """No drafter (switched off, or it failed to load: the server logs why and serves without speculation):
    /props says "none", /slots says not speculative, and no request has draft keys or spec counters."""
    kwargs = {}
    if why == "spec_type_none":
        kwargs["spec_type"] = "none"
    else:
        def broken_loader(*args, **kwargs):
            raise OSError("draft checkpoint unreadable")

        monkeypatch.setattr(builder_mod, "load_drafter", broken_loader)
    srv = LoopbackServer(engine_config(families, "draft", **kwargs))
    try:
        assert srv.engine.wait_ready(timeout=120) and srv.engine.drafter_kind is None
        if why == "drafter_fails_to_load":
            assert "drafter (kind=draft) failed to load" in caplog.text and "draft checkpoint unreadable" in caplog.text
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            assert client.get("/props").json()["default_generation_settings"]["params"]["speculative.types"] == "none"
            assert all(s["speculative"] is False for s in client.get("/slots").json())
            final, _ = post_all(srv.url, [("/completion", {"prompt": [5, 6, 7], "n_predict": 8, **GREEDY})])[0]
            assert final["tokens_predicted"] == 8 and not set(DRAFT_KEYS) & set(final["timings"])
            assert final["generation_settings"]["speculative.types"] == "none"
            m = scrape(client)
            assert m["llamacpp:spec_decode_num_draft_tokens_total"] == 0
            assert m["llamacpp:spec_decode_num_drafts_total"] == 0
            assert not any(k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total") for k in m)
    finally:
        srv.stop()


def test_streams_one_frame_per_token_while_speculating(spec_server):
    """llama-server streams a frame per token; a speculative round commits several, which share its timings."""
    _, _, srv, _, client = spec_server
    body = {"prompt": [52, 53, 54, 55], "n_predict": 16, "n_probs": 2, "return_tokens": True, **GREEDY}
    # Each request meets the policy afresh: the acceptance it learned from earlier requests (the drafts of this
    # module's tiny drafters mostly miss) would otherwise give the two requests different rounds, whose logits
    # round differently (a verify forward of k + 1 rows is not a one-row step).
    srv.engine.engine.speculation.policy.forget_acceptance()
    whole = client.post("/completion", json=body).json()
    srv.engine.engine.speculation.policy.forget_acceptance()
    with client.stream("POST", "/completion", json={**body, "stream": True, "timings_per_token": True}) as r:
        *frames, final = sse_events(r.iter_lines())
    assert [f["tokens_predicted"] for f in frames] == list(range(1, 17)) and final["tokens_predicted"] == 16
    assert [f["tokens"] for f in frames] == [[t] for t in whole["tokens"]]
    assert [f["completion_probabilities"] for f in frames] == [[p] for p in whole["completion_probabilities"]]
    assert "".join(f["content"] for f in frames) == whole["content"]
    assert all(f["timings"]["predicted_n"] >= f["tokens_predicted"] for f in frames)
    # Some round committed several tokens: its first frame already shows the round's count.
    assert any(f["timings"]["predicted_n"] > f["tokens_predicted"] for f in frames)
    assert final["timings"]["draft_n_accepted"] > 0
