"""End to end: API keys, CORS, body limit, disabled endpoints, and the loading state."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from e2e_harness import ServerProcess
from outrider.config import EngineConfig
from outrider.engine.async_engine import AsyncEngine
from outrider.server.app import create_app
from outrider.server.settings import ServerConfig
from outrider.testing import write_tiny_checkpoint

LIMIT = 4096
UNAUTHORIZED = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    ckpt = write_tiny_checkpoint(root / "tiny", "llama", hidden_size=64, layers=2, seed=5)
    keys = root / "keys.txt"
    keys.write_text("# one key per line\nkey-from-file\n")
    srv = ServerProcess(["-m", str(ckpt), "--api-key", "k1,k2", "--api-key-file", str(keys), "--no-slots",
                         "--max-body-size", str(LIMIT), "-np", "2"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def anon(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_missing_and_wrong_keys_get_the_same_401(anon):
    body = {"prompt": "hi", "n_predict": 1}
    answers = [anon.post("/completion", json=body),
               anon.post("/completion", json=body, headers={"Authorization": "Bearer nope"}),
               anon.post("/completion", json=body, headers={"X-Api-Key": "k1x"}),
               anon.get("/v1/models", headers={"Authorization": "Bearer x"})]
    assert all(r.status_code == 401 and r.json() == UNAUTHORIZED for r in answers)
    assert len({r.content for r in answers}) == 1


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"},
                                     {"X-Api-Key": "k2"}, {"Authorization": "Bearer key-from-file"},
                                     {"Authorization": "k1"}])  # like llama-server, "Bearer " is optional
def test_every_configured_key_works(anon, headers):
    r = anon.post("/completion", json={"prompt": "hi", "n_predict": 2, "ignore_eos": True}, headers=headers)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


def test_health_is_public(anon):
    assert anon.get("/health").json() == {"status": "ok"}
    assert anon.get("/v1/health").status_code == 200


def test_openai_client_with_and_without_key(server):
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key="k1", max_retries=0)
    assert ok.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2).usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_cors_preflight_skips_auth_and_responses_echo_the_origin(anon):
    pre = anon.options("/v1/chat/completions", headers={"Origin": "http://ui.example",
                                                          "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://ui.example"
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert pre.headers["access-control-allow-headers"] == "*"
    r = anon.get("/props", headers={"Origin": "http://ui.example", "Authorization": "Bearer k1"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    denied = anon.get("/props", headers={"Origin": "http://ui.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://ui.example"


def test_body_limit(anon):
    auth = {"Authorization": "Bearer k1"}
    big = {"prompt": "x" * LIMIT}
    r = anon.post("/completion", json=big, headers=auth)
    assert r.status_code == 413
    assert r.json() == {"error": {"code": 413, "message": "Request body too large.", "type": "invalid_request_error"}}

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(8):
            yield b" " * 1024

    r = anon.post("/tokenize", content=chunks(), headers=auth)
    assert r.status_code == 413
    assert anon.post("/tokenize", json={"content": "small"}, headers=auth).status_code == 200


def test_disabled_endpoints_are_501(anon):
    auth = {"Authorization": "Bearer k1"}
    for method, path, flag in [("GET", "/slots", "--slots"), ("GET", "/metrics", "--metrics"),
                               ("POST", "/props", "--props")]:
        r = anon.request(method, path, headers=auth, json={} if method == "POST" else None)
        assert r.status_code == 501
        err = r.json()["error"]
        assert err["type"] == "not_supported_error" and f"Start it with `{flag}`" in err["message"]
    assert anon.get("/props", headers=auth).json()["endpoint_slots"] is False


def test_every_route_answers_503_while_the_model_loads():
    engine = AsyncEngine(EngineConfig(model="never-loaded"))  # not started: stays loading
    app = create_app(engine, ServerConfig(model_name="m"))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return [await c.request(m, p, json={}) for m, p in
                    [("GET", "/health"), ("GET", "/v1/health"), ("POST", "/completion"), ("GET", "/v1/models"),
                     ("POST", "/v1/chat/completions"), ("GET", "/metrics")]]

    for r in asyncio.run(run()):
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
