"""End to end: the real `outrider serve` on loopback with a tiny checkpoint, driven by httpx and the openai package.

One server for the module (hidden 256, 4 layers: big enough that prompt and decode times are measurable).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from e2e_harness import REPO, ServerProcess, sse_events
from outrider.testing import write_tiny_checkpoint

N_SLOTS = 8
MAX_QUEUE = 24
N_CTX = 2048
TIMING_KEYS = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]
NATIVE_KEYS = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
               "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
               "tokens_cached", "timings"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "target", "qwen3", hidden_size=256, layers=4,
                                 heads=4, kv_heads=2, seed=11, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(ckpt):
    srv = ServerProcess(["-m", str(ckpt), "-c", str(N_CTX), "-np", str(N_SLOTS), "--max-queue", str(MAX_QUEUE),
                         "--metrics", "--props", "--alias", "tiny-b,tiny-a",
                         "-ngl", "99", "-fa", "on", "--mlock"],  # GGML-only flags: accepted with a warning
                        env={"LLAMA_ARG_BATCH": "512"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def complete(client, **body) -> dict:
    r = client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def tokenize(client, text: str, add_special: bool = True) -> list[int]:
    return client.post("/tokenize", json={"content": text, "add_special": add_special}).json()["tokens"]


def random_prompt(n: int, seed: int) -> list[int]:
    """Token ids no other test uses, so the prefix cache cannot help."""
    rng = random.Random(seed)
    return [rng.randrange(10, 400) for _ in range(n)]


def metrics(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r"^([a-z_:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


GREEDY = {"temperature": 0, "ignore_eos": True}


# --- server start-up ---
def test_ggml_only_flags_warn_once_each(server):
    log = "".join(server.stderr)
    for flag in ("-ngl", "-fa", "--mlock"):
        assert log.count(f"warning: {flag} only applies to GGML backends; ignored") == 1


def test_health(client):
    for path in ("/health", "/v1/health"):
        r = client.get(path)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


# --- /completion ---
def test_completion_fields(client):
    prompt = "The quick brown fox"
    out = complete(client, prompt=prompt, n_predict=8, **GREEDY)
    assert list(out) == NATIVE_KEYS
    ids = tokenize(client, prompt)
    assert out["index"] == 0 and out["stop"] is True and out["tokens"] == []
    assert out["model"] == "tiny-a"  # the alphabetically first alias
    assert out["tokens_predicted"] == 8 and out["tokens_evaluated"] == len(ids)
    assert out["tokens_cached"] == len(ids) + 8 - 1
    assert out["stop_type"] == "limit" and out["stopping_word"] == "" and out["truncated"] is False
    assert out["has_new_line"] == ("\n" in out["content"])
    assert out["prompt"] == client.post("/detokenize", json={"tokens": ids}).json()["content"]
    assert isinstance(out["id_slot"], int)
    gs = out["generation_settings"]
    assert gs["n_predict"] == 8 and gs["temperature"] == 0 and gs["ignore_eos"] is True and gs["stream"] is False
    assert list(out["timings"]) == TIMING_KEYS
    assert out["timings"]["predicted_n"] == 8 and out["timings"]["prompt_n"] + out["timings"]["cache_n"] == len(ids)


def test_prompt_forms_agree(client):
    text = "Once upon a time"
    ids = tokenize(client, text)
    by_text = complete(client, prompt=text, n_predict=6, return_tokens=True, **GREEDY)
    by_ids = complete(client, prompt=ids, n_predict=6, return_tokens=True, **GREEDY)
    mixed = complete(client, prompt=[ids[0], *tokenize(client, text, add_special=False)[:2], " time"],
                     n_predict=6, **GREEDY)
    obj = complete(client, prompt={"prompt_string": text}, n_predict=6, **GREEDY)
    assert by_ids["tokens"] == by_text["tokens"] and len(by_text["tokens"]) == 6
    assert by_ids["content"] == by_text["content"] == obj["content"]
    assert mixed["tokens_evaluated"] >= 3


def test_batch_prompts_and_n_cmpl(client):
    batch = client.post("/completion", json={"prompt": ["alpha beta", [5, 6, 7, 8]], "n_predict": 4, **GREEDY}).json()
    assert isinstance(batch, list) and [b["index"] for b in batch] == [0, 1]
    alone = complete(client, prompt=[5, 6, 7, 8], n_predict=4, **GREEDY)
    assert batch[1]["content"] == alone["content"]
    two = client.post("/completion", json={"prompt": "gamma", "n_cmpl": 2, "n_predict": 4, **GREEDY}).json()
    assert [b["index"] for b in two] == [0, 1] and two[0]["content"] == two[1]["content"]


def test_stream_frames_and_final(client):
    body = {"prompt": "Streaming test prompt", "n_predict": 10, "return_tokens": True, **GREEDY}
    whole = complete(client, **body)
    events = stream(client, "/completion", {**body, "stream": True})
    assert "[DONE]" not in events  # the native stream ends with the final object
    *frames, final = events
    assert all(f["stop"] is False and "timings" not in f and f["id_slot"] == -1 for f in frames)
    assert [f["tokens_predicted"] for f in frames] == list(range(1, len(frames) + 1))
    assert [t for f in frames for t in f["tokens"]] == whole["tokens"]
    assert "".join(f["content"] for f in frames) == whole["content"]
    assert list(final) == NATIVE_KEYS and final["stop"] is True
    assert final["content"] == "" and final["tokens"] == [] and final["generation_settings"]["stream"] is True
    assert final["tokens_predicted"] == 10 and final["stop_type"] == "limit"


def test_timings_per_token_frames_agree_with_final(client):
    prompt = random_prompt(300, seed=1)
    events = stream(client, "/completion", {"prompt": prompt, "n_predict": 8, "stream": True,
                                            "timings_per_token": True, **GREEDY})
    *frames, final = events
    assert all(list(f["timings"]) == TIMING_KEYS for f in frames)
    first, last = frames[0]["timings"], final["timings"]
    for key in ("prompt_ms", "prompt_n", "cache_n"):
        assert first[key] == last[key]
    assert last["prompt_n"] == 300 and last["cache_n"] == 0  # a token array gets no BOS


def test_return_tokens_and_response_fields(client):
    out = complete(client, prompt="fields", n_predict=3, return_tokens=True,
                   response_fields=["content", "generation_settings/n_predict", "timings/predicted_n", "nope"],
                   **GREEDY)
    assert set(out) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert out["generation_settings/n_predict"] == 3 and out["timings/predicted_n"] == 3


def test_n_probs(client):
    out = complete(client, prompt="probabilities", n_predict=4, n_probs=3, return_tokens=True, **GREEDY)
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"]
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == p["id"]  # greedy picks the most probable
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(top, top[1:]))
        assert bytes(p["bytes"]).decode("utf-8", errors="replace") == p["token"]
    post = complete(client, prompt="probabilities", n_predict=4, n_probs=2, post_sampling_probs=True, **GREEDY)
    for p in post["completion_probabilities"]:
        assert set(p) == {"id", "token", "bytes", "prob", "top_probs"}
        assert 0 <= p["prob"] <= 1 and len(p["top_probs"]) == 2
    frames = stream(client, "/completion", {"prompt": "probabilities", "n_predict": 4, "n_probs": 2, "stream": True,
                                            **GREEDY})[:-1]
    assert all(len(f["completion_probabilities"]) == 1 for f in frames)
    assert [f["completion_probabilities"][0]["top_logprobs"] for f in frames] == [p["top_logprobs"][:2] for p in probs]


def test_stop_word(client):
    text = complete(client, prompt="stop words", n_predict=24, **GREEDY)["content"]
    word = text[6:9]
    out = complete(client, prompt="stop words", n_predict=24, stop=[word], **GREEDY)
    assert out["stop_type"] == "word" and out["stopping_word"] == word
    assert out["content"] == text[: text.find(word)]
    frames = stream(client, "/completion", {"prompt": "stop words", "n_predict": 24, "stop": [word],
                                            "stream": True, **GREEDY})
    assert "".join(f["content"] for f in frames) == out["content"] and frames[-1]["stop_type"] == "word"


def test_eos_and_single_token_rates(client):
    eos = tokenize(client, "<|im_end|>", add_special=False)
    assert len(eos) == 1
    out = complete(client, prompt="end now", n_predict=16, temperature=0, logit_bias=[[eos[0], 100]])
    assert out["stop_type"] == "eos" and out["tokens_predicted"] == 1 and out["content"] == ""
    t = out["timings"]
    assert t["predicted_n"] == 1 and t["predicted_per_second"] == 0 and t["predicted_per_token_ms"] == 0
    one = complete(client, prompt="one token", n_predict=1, **GREEDY)["timings"]
    assert one["predicted_n"] == 1 and one["predicted_per_second"] == 0 and one["predicted_per_token_ms"] == 0
    zero = complete(client, prompt="zero", n_predict=0, **GREEDY)
    assert zero["tokens_predicted"] == 1  # llama-server samples the first token before checking the limit


def test_logit_bias_bans_and_forms(client):
    first = complete(client, prompt="bias", n_predict=1, return_tokens=True, **GREEDY)["tokens"][0]
    banned = complete(client, prompt="bias", n_predict=1, return_tokens=True, logit_bias=[[first, False]], **GREEDY)
    oai_form = complete(client, prompt="bias", n_predict=1, return_tokens=True, logit_bias={str(first): -1e9},
                        **GREEDY)
    assert banned["tokens"][0] != first and oai_form["tokens"] == banned["tokens"]
    assert banned["generation_settings"]["logit_bias"] == [{"bias": None, "token": first}]


def test_seeded_sampling_is_reproducible(client):
    body = {"prompt": "sampling", "n_predict": 24, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "ignore_eos": True, "return_tokens": True}
    a = complete(client, seed=1234, **body)
    b = complete(client, seed=1234, **body)
    c = complete(client, seed=4321, **body)
    assert a["tokens"] == b["tokens"] and a["tokens"] != c["tokens"]
    assert a["generation_settings"]["seed"] == 1234


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "n_predict": -5}, "n_predict"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "seed": -7}, "seed"),
    ({"prompt": "x", "n_probs": -1}, "n_probs"),
    ({"prompt": "x", "n_cmpl": N_SLOTS + 1}, "n_cmpl"),
    ({"prompt": "x", "id_slot": N_SLOTS}, "id_slot"),
    ({"prompt": "x", "logit_bias": [[100000, 1]]}, "logit_bias"),
    ({"prompt": [1, 2, 999999]}, "prompt"),
    ({"prompt": "x", "grammar": "root ::= \"a\""}, "grammar"),
    ({"prompt": "x", "mirostat": 2}, "mirostat"),
    ({"n_predict": 2}, "prompt"),
])
def test_invalid_fields_are_400_naming_the_field(client, body, field):
    r = client.post("/completion", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and f"'{field}'" in err["message"]


def test_bad_json_and_unknown_route(client):
    r = client.post("/completion", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"] == {"code": 404, "message": "Not Found",
                                                          "type": "not_found_error"}


def test_prompt_longer_than_context(client):
    for body in ({"prompt": [7] * (N_CTX + 5)}, {"prompt": [7] * (N_CTX + 5), "stream": True}):
        r = client.post("/completion", json=body)  # a stream fails before it starts: a plain HTTP error
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error"
        assert err["n_prompt_tokens"] == N_CTX + 5 and err["n_ctx"] == N_CTX
        assert err["message"] == (f"request ({N_CTX + 5} tokens) exceeds the available context size ({N_CTX} "
                                  "tokens), try increasing it")


# --- tokenizer routes ---
def test_tokenize_detokenize(client):
    plain = client.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    special = client.post("/tokenize", json={"content": "hello world", "add_special": True}).json()["tokens"]
    assert special[1:] == plain and len(special) == len(plain) + 1  # BOS
    assert client.post("/detokenize", json={"tokens": plain}).json() == {"content": "hello world"}
    assert client.post("/detokenize", json={}).json() == {"content": ""}
    parsed = client.post("/tokenize", json={"content": "<|im_end|>"}).json()["tokens"]
    literal = client.post("/tokenize", json={"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert len(parsed) == 1 and len(literal) > 1
    pieces = client.post("/tokenize", json={"content": "a 😀 b", "with_pieces": True}).json()["tokens"]
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw == "a 😀 b".encode() and all(set(p) == {"id", "piece"} for p in pieces)
    mixed = client.post("/tokenize", json={"content": [plain[0], " world"]}).json()["tokens"]
    assert mixed[0] == plain[0]
    assert client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_apply_template(client):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    prompt = client.post("/apply-template", json=body).json()["prompt"]
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    r = client.post("/apply-template", json={"messages": []})
    assert r.status_code == 400 and "'messages'" in r.json()["error"]["message"]


# --- server information ---
def test_props(client):
    props = client.get("/props").json()
    assert props["total_slots"] == N_SLOTS and props["model_alias"] == "tiny-a"
    assert props["default_generation_settings"]["n_ctx"] == N_CTX
    assert props["default_generation_settings"]["params"]["n_predict"] == -1
    assert props["endpoint_metrics"] is True and props["endpoint_props"] is True and props["endpoint_slots"] is True
    assert props["build_info"].startswith("b") and props["is_sleeping"] is False
    assert "<|im_start|>" in props["chat_template"] and props["eos_token"] == "<|im_end|>"
    assert client.post("/props", json={}).json() == {"success": True}


def test_models(client):
    for path in ("/models", "/v1/models"):
        body = client.get(path).json()
        assert body["object"] == "list"
        (model,) = body["data"]
        assert model["id"] == "tiny-a" and model["aliases"] == ["tiny-a", "tiny-b"]
        assert model["object"] == "model" and model["owned_by"] == "llamacpp"
        meta = model["meta"]
        assert meta["n_ctx"] == N_CTX and meta["n_embd"] == 256 and meta["n_params"] > 0
        assert body["models"][0]["capabilities"] == ["completion"]


def test_slots_idle_and_busy(client):
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(N_SLOTS))
    assert all(not s["is_processing"] and s["n_ctx"] == N_CTX for s in slots)
    assert client.get("/slots", params={"fail_on_no_slot": 1}).status_code == 200
    body = {"prompt": "a long one", "n_predict": 400, "stream": True, **GREEDY}
    with client.stream("POST", "/completion", json=body) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
        busy = poll(lambda: [s for s in client.get("/slots").json() if s["is_processing"]])
        assert len(busy) == 1
        (slot,) = busy
        assert slot["n_prompt_tokens"] == len(tokenize(client, "a long one"))
        assert slot["params"]["n_predict"] == 400 and slot["next_token"][0]["n_decoded"] >= 1
        assert slot["prompt"].endswith("a long one")
    wait_idle(client)


def poll(probe, timeout: float = 10.0):
    """probe() until it returns something truthy (the engine publishes /slots after each step)."""
    deadline = time.monotonic() + timeout
    while not (value := probe()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def wait_idle(client, timeout: float = 10.0) -> None:
    """Every slot free and no KV block held, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = not any(s["is_processing"] for s in client.get("/slots").json())
        if idle and metrics(client)["outrider_kv_blocks_used"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {client.get('/slots').json()}")


def test_metrics_format(client):
    r = client.get("/metrics")
    assert r.status_code == 200 and int(r.headers["Process-Start-Time-Unix"]) <= time.time()
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_drafts_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
                 "requests_processing", "requests_deferred", "n_busy_slots_per_decode"):
        assert f"# HELP llamacpp:{name} " in r.text and f"# TYPE llamacpp:{name} " in r.text
        assert re.search(rf"^llamacpp:{name} \S+$", r.text, re.M)
    for name in ("outrider_time_to_first_token_seconds", "outrider_queue_wait_seconds",
                 "outrider_decode_tokens_per_second", "outrider_spec_accepted_length"):
        assert f"# TYPE {name} histogram" in r.text
    assert "_created" not in r.text


def test_metrics_reconcile_with_timings(client):
    before = metrics(client)
    timings = [complete(client, prompt=random_prompt(40, seed=s), n_predict=5, **GREEDY)["timings"] for s in range(3)]
    timings += [stream(client, "/completion", {"prompt": "reconcile", "n_predict": 3, "stream": True,
                                               **GREEDY})[-1]["timings"]]
    after = metrics(client)
    assert_reconciled(before, after, timings)


def assert_reconciled(before: dict, after: dict, timings: list[dict]) -> None:
    def delta(name):
        return after[f"llamacpp:{name}"] - before[f"llamacpp:{name}"]

    assert delta("prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert delta("prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings)
    assert delta("tokens_predicted_total") == sum(t["predicted_n"] for t in timings)
    assert delta("prompt_seconds_total") == pytest.approx(sum(t["prompt_ms"] for t in timings) / 1e3, rel=1e-6)
    assert delta("tokens_predicted_seconds_total") == pytest.approx(
        sum(t["predicted_ms"] for t in timings) / 1e3, rel=1e-6)
    assert delta("spec_decode_num_draft_tokens_total") == sum(t.get("draft_n", 0) for t in timings)
    assert delta("n_decode_total") > 0
