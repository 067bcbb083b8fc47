"""/metrics counts the requests of the newer routes (/v1/responses, /v1/messages, /infill, /v1/embeddings) as it
counts /completion's: each finished request moves llama-server's counters by its own `timings`, where the route
reports them."""

from __future__ import annotations

import re

import httpx
import pytest

from e2e_harness import ServerProcess
from outrider.testing import write_tiny_checkpoint
from test_infill import QWEN_CODER_FIM, add_specials


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("metrics") / "coder", "qwen3", vocab_size=600, seed=3)
    add_specials(ckpt, QWEN_CODER_FIM)
    with ServerProcess(["-m", str(ckpt), "-c", "512", "-np", "2", "--metrics", "--embedding", "--no-cache-prompt",
                        "--chat-template", "chatml"]) as srv:
        yield srv


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^llamacpp:(\w+) (\S+)$", text, re.M)}


ROUTES = {
    "/v1/responses": {"model": "m", "input": "hello there", "max_output_tokens": 5, "temperature": 0},
    "/v1/messages": {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hello there"}]},
    "/infill": {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 5, "temperature": 0},
    "/v1/embeddings": {"model": "m", "input": ["hello there", "a second input"]},
}


@pytest.mark.parametrize("path", list(ROUTES))
def test_each_route_moves_the_metrics_counters(server, path):
    before = counters(server.url)
    r = httpx.post(server.url + path, json=ROUTES[path], timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    after = counters(server.url)
    moved = {k: after[k] - before[k] for k in ("prompt_tokens_total", "tokens_predicted_total")}
    if path == "/v1/embeddings":  # every input's tokens are prompt work; nothing is generated for the client
        assert moved["prompt_tokens_total"] == out["usage"]["prompt_tokens"] > 0, moved
        assert moved["tokens_predicted_total"] == 0, moved
        return
    timings = {"/v1/responses": lambda: out["timings"], "/infill": lambda: out["timings"]}.get(path)
    if timings is not None:  # the counters move by exactly the request's timings
        t = timings()
        assert moved == {"prompt_tokens_total": t["prompt_n"], "tokens_predicted_total": t["predicted_n"]}
    else:  # Anthropic's format has no timings (as llama-server's); its usage says the same counts
        assert moved == {"prompt_tokens_total": out["usage"]["input_tokens"],
                         "tokens_predicted_total": out["usage"]["output_tokens"]}
    assert moved["tokens_predicted_total"] > 0
