"""The built-in web page and the per-token draft provenance it reads, at the HTTP level (the page in a real
browser: test_webui_browser.py).

- the page's files are served at / while the model loads and without an API key, with a policy that lets the
  page reach nothing but this server; they reference nothing elsewhere and stay under 100 KB;
- --no-webui / --no-ui / LLAMA_ARG_UI=false turn the page off: / is a 404 in llama-server's format;
- `return_draft_provenance` (off by default) gives every streamed frame its tokens, each marked accepted draft or
  the target's own; for each drafter kind of the demo model, streamed, 4 requests at once, at T > 0, on the
  native and both OpenAI routes, the accepted drafts over all frames add up to the final `draft_n_accepted`.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from e2e_harness import ServerProcess, sse_events
from outrider import cli
from outrider.config import EngineConfig
from outrider.engine.async_engine import AsyncEngine
from outrider.server import webui
from outrider.server.app import create_app
from outrider.server.settings import ServerConfig

WEBUI_DIR = Path(webui.__file__).parent
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "ignore_eos": True}
N_TOKENS = 40
BATCH = 4


def asgi_get(app, *paths: str) -> list[httpx.Response]:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get(p) for p in paths]

    return asyncio.run(run())


# --- the page's files ---

def test_page_is_served_while_the_model_loads_and_without_an_api_key(tiny_checkpoint):
    loading = AsyncEngine(EngineConfig(model=str(tiny_checkpoint())))  # never started: loading for ever
    app = create_app(loading, ServerConfig(model_name="tiny", api_keys=("secret",)))
    index, script, style, props, health = asgi_get(app, "/", "/webui/app.js", "/webui/style.css", "/props",
                                                   "/health")
    assert index.status_code == script.status_code == style.status_code == 200
    assert index.headers["content-type"].startswith("text/html")
    assert script.headers["content-type"].startswith("text/javascript")
    assert style.headers["content-type"].startswith("text/css")
    assert index.content == (WEBUI_DIR / "index.html").read_bytes()
    policy = index.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    # everything else still waits for the model
    assert props.status_code == health.status_code == 503


def test_page_files_reference_nothing_outside_the_server_and_stay_small():
    files = {name: (WEBUI_DIR / name).read_text(encoding="utf-8") for name, _ in webui.FILES.values()}
    assert sum(len(text.encode()) for text in files.values()) < 100_000
    for name, text in files.items():
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), f"{name} names another host"
        assert "@import" not in text and "url(" not in text, name
    refs = re.findall(r'(?:src|href)="([^"]*)"', files["index.html"])
    assert refs and all(r in webui.PATHS or r.startswith("data:") for r in refs), refs


@pytest.mark.parametrize("argv, env", [(["--no-webui"], {}), (["--no-ui"], {}), ([], {"LLAMA_ARG_UI": "false"})])
def test_no_webui_answers_404_at_root(tiny_checkpoint, monkeypatch, argv, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ns = cli.parse(cli.SERVE_GROUPS, ["-m", str(tiny_checkpoint()), *argv])
    config = cli.server_config(ns, ns.model)
    assert config.webui is False
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint()), max_num_seqs=1))
    engine.start()
    try:
        assert engine.wait_ready(timeout=120)
        root, script, health = asgi_get(create_app(engine, config), "/", "/webui/app.js", "/health")
    finally:
        engine.shutdown()
    assert root.status_code == script.status_code == 404
    assert root.json()["error"]["type"] == "not_found_error"
    assert health.status_code == 200


def test_webui_is_on_by_default_and_takes_llama_server_spellings(monkeypatch):
    monkeypatch.delenv("LLAMA_ARG_UI", raising=False)
    assert cli.parse(cli.SERVE_GROUPS, ["-m", "/m"]).webui is True
    assert cli.parse(cli.SERVE_GROUPS, ["-m", "/m", "--webui"]).webui is True
    monkeypatch.setenv("LLAMA_ARG_UI", "false")
    assert cli.parse(cli.SERVE_GROUPS, ["-m", "/m", "--ui"]).webui is True  # the flag wins over the variable


# --- per-token draft provenance ---

@pytest.fixture(scope="module", params=["draft", "mtp", "dflash"])
def demo_server(request):
    srv = ServerProcess(["--demo-draft", request.param, "-np", str(BATCH), "-c", "512"])
    yield request.param, srv
    srv.stop()


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> list:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        return sse_events([line async for line in r.aiter_lines()])


def _post_all(url: str, requests: list[tuple[str, dict]]) -> list[list]:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, path, body) for path, body in requests))

    return asyncio.run(run())


def _check_frame(entries: list[dict]) -> int:
    """A frame's entries: its accepted drafts first, then at most one token of the target's own (a round's
    correction or bonus token). Returns how many were accepted drafts."""
    flags = [e["accepted_draft"] for e in entries]
    accepted = flags.index(False) if False in flags else len(flags)
    assert flags == [True] * accepted + [False] * (len(flags) - accepted), flags
    assert len(flags) - accepted <= 1, flags
    assert all(isinstance(e["id"], int) and isinstance(e["text"], str) for e in entries)
    return accepted


def _prompts(kind: str) -> list[str]:
    return [f"def {name}_{kind}(" for name in ("parse", "merge", "split", "render")]


def test_native_frames_say_which_tokens_were_accepted_drafts(demo_server):
    kind, srv = demo_server
    (events,) = _post_all(srv.url, [("/completion", {"prompt": _prompts(kind), "n_predict": N_TOKENS,
                                                    "return_draft_provenance": True, **SAMPLED})])
    finals = {e["index"]: e for e in events if e["stop"]}
    assert sorted(finals) == list(range(BATCH))
    total = 0
    for index, final in finals.items():
        frames = [e for e in events if e["index"] == index and not e["stop"]]
        entries = [x for f in frames for x in f["draft_provenance"]]
        assert sum(_check_frame(f["draft_provenance"]) for f in frames) == final["timings"].get("draft_n_accepted", 0)
        # a frame per token, carrying that token's entry: its id and the text the frame shows
        assert all([x["id"] for x in f["draft_provenance"]] == f["tokens"] and len(f["tokens"]) == 1 for f in frames)
        assert all(f["draft_provenance"][0]["text"] == f["content"] for f in frames)
        assert len(entries) == final["tokens_predicted"] == final["timings"]["predicted_n"] == N_TOKENS
        assert "".join(x["text"] for x in entries) == "".join(f["content"] for f in frames)  # no stop: all shown
        assert "draft_provenance" not in final  # the tokens were all in the frames
        total += final["timings"].get("draft_n_accepted", 0)
    assert total > 0  # the drafter drafted and the target accepted some: the sums above are not all 0 = 0


def test_chat_chunks_say_which_tokens_were_accepted_drafts(demo_server):
    kind, srv = demo_server
    requests = [("/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": N_TOKENS,
                                          "return_draft_provenance": True, **SAMPLED}) for p in _prompts(kind)]
    total = 0
    for events in _post_all(srv.url, requests):
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"] and "draft_provenance" in e["choices"][0]]
        accepted = sum(_check_frame(c["choices"][0]["draft_provenance"]) for c in chunks)
        timings = events[-2]["timings"]
        assert accepted == timings.get("draft_n_accepted", 0)
        assert sum(len(c["choices"][0]["draft_provenance"]) for c in chunks) == timings["predicted_n"] == N_TOKENS
        total += accepted
    assert total > 0


def test_completions_chunks_say_which_tokens_were_accepted_drafts(demo_server):
    kind, srv = demo_server
    requests = [("/v1/completions", {"prompt": p, "max_tokens": N_TOKENS, "return_draft_provenance": True,
                                     **SAMPLED}) for p in _prompts(kind)]
    total = 0
    for events in _post_all(srv.url, requests):
        chunks = events[:-1]
        accepted = sum(_check_frame(c["choices"][0]["draft_provenance"]) for c in chunks)
        assert accepted == chunks[-1]["timings"].get("draft_n_accepted", 0)
        assert sum(len(c["choices"][0]["draft_provenance"]) for c in chunks) == N_TOKENS
        total += accepted
    assert total > 0


def test_draft_provenance_is_off_by_default_and_checked(demo_server):
    _, srv = demo_server
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        plain = client.post("/completion", json={"prompt": "import os", "n_predict": 8}).json()
        assert "draft_provenance" not in plain
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 8, "stream": True})
        assert "draft_provenance" not in chat.text
        # non-streamed: the whole list in the body (native) or the choice (OpenAI)
        body = client.post("/completion", json={"prompt": "import os", "n_predict": 8, **SAMPLED,
                                                "return_tokens": True, "return_draft_provenance": True}).json()
        entries = body["draft_provenance"]
        assert [e["id"] for e in entries] == body["tokens"] and len(entries) == 8
        assert sum(e["accepted_draft"] for e in entries) == body["timings"].get("draft_n_accepted", 0)
        choice = client.post("/v1/completions", json={"prompt": "import os", "max_tokens": 8, **SAMPLED,
                                                      "return_draft_provenance": True}).json()["choices"][0]
        assert "".join(e["text"] for e in choice["draft_provenance"]) == choice["text"]
        bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "return_draft_provenance": "yes"})
        assert bad.status_code == 400 and "return_draft_provenance" in bad.json()["error"]["message"]
    assert not any("'return_draft_provenance'" in line for line in srv.stderr)  # a field this server knows


def test_draft_provenance_texts_join_to_the_content_when_a_stop_string_cuts_it(demo_server):
    """Tokens of a stop string, and of text held back while one might follow, add nothing to the content: their
    entries' texts are "" so the entries still join to exactly what was shown."""
    _, srv = demo_server
    greedy = {"prompt": "def merge(a, b):", "n_predict": 24, "temperature": 0.0, "return_draft_provenance": True}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        full = client.post("/completion", json=greedy).json()["content"]
        stop = full[len(full) // 2:][:4]
        assert stop.strip(), full
        cut = client.post("/completion", json={**greedy, "stop": [stop]}).json()
        assert cut["stop_type"] == "word" and cut["content"] == full[:full.index(stop)]
        assert "".join(e["text"] for e in cut["draft_provenance"]) == cut["content"]
        assert len(cut["draft_provenance"]) == cut["tokens_predicted"]
    (events,) = _post_all(srv.url, [("/completion", {**greedy, "stop": [stop]})])
    frames = [e for e in events if not e["stop"]]
    assert "".join(x["text"] for f in frames for x in f["draft_provenance"]) == cut["content"]
    assert len(frames) == cut["tokens_predicted"]
