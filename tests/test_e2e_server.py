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
    srv = ServerProcess(["-m", str(ckpt), "-c", str(N_CTX), "-np", str(N_SLOTS), "-kvu", "--max-queue", str(MAX_QUEUE),
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
    plural = client.post("/completions", json={"prompt": text, "n_predict": 6, **GREEDY}).json()  # native too
    assert list(plural) == NATIVE_KEYS and plural["content"] == by_text["content"]
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
    assert all(f["stop"] is False and "timings" not in f and f["id_slot"] >= 0 for f in frames)
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
    assert banned["generation_settings"]["logit_bias"][0] == {"bias": None, "token": first}  # then EOG (ignore_eos)


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
    ({"prompt": "x", "grammar": "root ::= \"a\" undefined"}, "grammar"),
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
        lines = r.iter_lines()  # held: a dropped iterator closes the connection (and aborts the request)
        next(line for line in lines if line.startswith("data: "))
        busy = poll(lambda: [s for s in client.get("/slots").json() if s["is_processing"]])
        assert len(busy) == 1
        (slot,) = busy
        assert slot["n_prompt_tokens"] == len(tokenize(client, "a long one"))
        assert slot["params"]["n_predict"] == 400 and slot["next_token"][0]["n_decoded"] >= 1
        # What the request said stays private without LLAMA_SERVER_SLOTS_DEBUG (as in llama-server).
        assert not {"prompt", "generated"} & set(slot) and not {"stop", "logit_bias"} & set(slot["params"])
    wait_idle(client)
    # Idle again, the slot still shows its last task (as llama-server does), with no next token coming.
    (last,) = [s for s in client.get("/slots").json() if s["id"] == slot["id"]]
    assert not last["is_processing"] and last["id_task"] == slot["id_task"] and last["params"]["n_predict"] == 400
    assert last["next_token"][0]["has_next_token"] is False


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


# --- OpenAI routes ---
def test_openai_completions(oai, client):
    r = oai.completions.create(model="anything", prompt="Hello there", max_tokens=6, temperature=0, seed=3)
    assert r.object == "text_completion" and r.model == "tiny-a" and r.system_fingerprint.startswith("b")
    assert r.id.startswith("cmpl-") and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(tokenize(client, "Hello there"))
    native = complete(client, prompt="Hello there", n_predict=6, temperature=0)
    assert r.choices[0].text == native["content"]
    assert list(r.model_extra["timings"]) == TIMING_KEYS
    chunks = list(oai.completions.create(model="x", prompt="Hello there", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == native["content"]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 6 and list(chunks[-1].model_extra["timings"]) == TIMING_KEYS


def test_openai_completions_logprobs_n_and_stop(oai, client):
    r = oai.completions.create(model="x", prompt="logprobs", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    two = oai.completions.create(model="x", prompt=["one", "two"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text and two.usage.completion_tokens == 12
    text = oai.completions.create(model="x", prompt="stop here", max_tokens=20, temperature=0).choices[0].text
    stopped = oai.completions.create(model="x", prompt="stop here", max_tokens=20, temperature=0, stop=[text[4:6]])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.find(text[4:6])]
    # echo gives the prompt as sent: without the BOS the server added
    plain = oai.completions.create(model="x", prompt="echo me", max_tokens=2, temperature=0).choices[0].text
    echo = oai.completions.create(model="x", prompt="echo me", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text == "echo me" + plain
    ids = client.post("/tokenize", json={"content": "echo me"}).json()["tokens"]
    echo_ids = oai.completions.create(model="x", prompt=[ids, ids], max_tokens=2, temperature=0, echo=True)
    assert all(c.text.startswith("echo me") for c in echo_ids.choices)  # (token ids: no BOS added)


def test_openai_chat(oai, client):
    messages = [{"role": "user", "content": "Say something"}]
    r = oai.chat.completions.create(model="x", messages=messages, max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", r.id)
    assert r.model == "tiny-a" and r.system_fingerprint.startswith("b")
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert r.usage.prompt_tokens == len(tokenize(client, prompt)) and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["timings"]["cache_n"]
    assert msg.content == complete(client, prompt=prompt, n_predict=5, temperature=0)["content"]
    assert list(r.model_extra["timings"]) == TIMING_KEYS
    chunks = list(oai.chat.completions.create(model="x", messages=messages, max_tokens=5, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length" and "timings" in chunks[-1].model_extra
    assert len({c.id for c in chunks}) == 1


def test_openai_chat_stream_usage_and_done(client):
    body = {"messages": [{"role": "user", "content": "usage"}], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = stream(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert list(usage_chunk["timings"]) == TIMING_KEYS
    assert chunks[-1]["choices"][0] == {"finish_reason": "length", "index": 0, "delta": {}}
    assert all("timings" not in c for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_openai_chat_logprobs_seed_n(oai):
    messages = [{"role": "user", "content": "numbers"}]
    # Both calls prefill the whole prompt: a prefix-cache hit would compute only the prompt's tail, in a smaller
    # matmul whose float32 rounding differs in the last bits (exactly as prefilling in chunks does), and the
    # streamed and whole bodies must then carry bit-identical log-probs.
    uncached = {"extra_body": {"cache_prompt": False}}
    r = oai.chat.completions.create(model="x", messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                    top_logprobs=2, **uncached)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    chunks = list(oai.chat.completions.create(model="x", messages=messages, max_tokens=3, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True, **uncached))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    kw = dict(model="x", messages=messages, max_tokens=12, temperature=1.0, top_p=1.0,
              extra_body={"ignore_eos": True})
    a = oai.chat.completions.create(seed=99, **kw).choices[0].message.content
    b = oai.chat.completions.create(seed=99, **kw).choices[0].message.content
    assert a == b
    n = oai.chat.completions.create(n=3, seed=5, **kw)
    assert [c.index for c in n.choices] == [0, 1, 2] and n.usage.completion_tokens == 36
    assert len({c.message.content for c in n.choices}) > 1  # seeded choices use seed, seed + 1, ...


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "add_generation_prompt"),
])
def test_openai_chat_errors(oai, extra, field):
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**{"model": "x", "messages": [], "max_tokens": 2}, extra_body=body)
    assert f"'{field}'" in e.value.body["message"] and e.value.status_code == 400


def test_chat_input_tokens_and_timings_per_token(client):
    body = {"messages": [{"role": "user", "content": "count me"}]}
    prompt = client.post("/apply-template", json=body).json()["prompt"]
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        assert client.post(path, json=body).json() == {"input_tokens": len(tokenize(client, prompt))}
    events = stream(client, "/chat/completions", {**body, "max_tokens": 4, "temperature": 0, "stream": True,
                                                  "timings_per_token": True})
    content = [e for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content and all(list(e["timings"]) == TIMING_KEYS for e in content)


def test_routes_we_lack_are_501(client):
    for path in ("/v1/embeddings", "/rerank", "/slots/0"):  # (embeddings: not started with --embedding)
        r = client.post(path, json={})
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error", path


def test_sse_keep_alive_comments(client):
    body = {"prompt": random_prompt(1000, seed=5), "n_predict": 1, "stream": True, "sse_ping_interval": 0.005}
    with client.stream("POST", "/completion", json=body) as r:
        lines = list(r.iter_lines())
    assert ":" in lines[: lines.index(next(x for x in lines if x.startswith("data: ")))]


def test_chat_continue_final_message(client):
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}],
            "continue_final_message": True}
    prompt = client.post("/apply-template", json=body).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nWell,")


# --- timings ---
def test_timings_formulas(client):
    t = complete(client, prompt=random_prompt(64, seed=2), n_predict=16, **GREEDY)["timings"]
    assert all(math.isfinite(v) and v >= 0 for v in t.values())
    n = t["predicted_n"]
    assert n == 16
    assert t["predicted_per_second"] == pytest.approx((n - 1) / t["predicted_ms"] * 1e3, rel=1e-9)
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / (n - 1), rel=1e-9)
    assert t["prompt_per_second"] == pytest.approx(1e3 * t["prompt_n"] / t["prompt_ms"], rel=1e-9)
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"], rel=1e-9)


def test_timings_match_client_measurements(client):
    """prompt_ms ~ client time to first token, predicted_ms ~ client first-to-last token time (within 10 %)."""
    complete(client, prompt=random_prompt(64, seed=30), n_predict=2, **GREEDY)  # warm: first-request costs
    body = {"prompt": random_prompt(N_CTX - 100, seed=3), "n_predict": 48, "stream": True, **GREEDY}
    arrivals = []
    start = time.perf_counter()
    with client.stream("POST", "/completion", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.perf_counter(), line))
    *token_frames, (_, final_line) = arrivals
    final = sse_events([final_line])[0]["timings"]
    ttft = (token_frames[0][0] - start) * 1e3
    first_to_last = (token_frames[-1][0] - token_frames[0][0]) * 1e3
    assert final["predicted_n"] == 48 and len(token_frames) == 48
    assert final["prompt_ms"] == pytest.approx(ttft, rel=0.10), (final, ttft)
    assert final["predicted_ms"] == pytest.approx(first_to_last, rel=0.10), (final, first_to_last)


def test_prefix_cache_on_repeated_prompt(client):
    prompt = random_prompt(100, seed=4)
    first = complete(client, prompt=prompt, n_predict=2, **GREEDY)["timings"]
    again = stream(client, "/completion", {"prompt": prompt, "n_predict": 2, "stream": True,
                                           "timings_per_token": True, **GREEDY})
    assert first["cache_n"] == 0 and first["prompt_n"] == 100
    second = again[-1]["timings"]
    assert second["cache_n"] > 0 and second["prompt_n"] == 100 - second["cache_n"]
    assert again[0]["timings"]["cache_n"] == second["cache_n"]


# --- concurrency, back-pressure and disconnects ---
async def _stream_async(ac: httpx.AsyncClient, body: dict, leave_after: int | None = None) -> dict | None:
    """Read a native stream; with leave_after, disconnect after that many frames (returns None)."""
    frames = 0
    async with ac.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames += 1
                if frames == leave_after:
                    return None  # leaving the block closes the connection mid-stream
                last = line
    return sse_events([last])[0]


def test_32_concurrent_streams_with_a_quarter_disconnecting(server, client):
    before = metrics(client)

    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as ac:
            jobs = []
            for i in range(32):
                leaves = i % 4 == 0
                body = {"prompt": random_prompt(16, seed=100 + i), "n_predict": 400 if leaves else 8, "stream": True,
                        **GREEDY}
                jobs.append(_stream_async(ac, body, leave_after=3 if leaves else None))
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    finals = [r for r in results if r is not None]
    assert len(finals) == 24
    assert all(f["stop"] and f["stop_type"] == "limit" and f["tokens_predicted"] == 8 for f in finals)
    wait_idle(client)
    assert_reconciled(before, metrics(client), [f["timings"] for f in finals])


def test_full_queue_is_503_and_disconnects_free_everything(server, client):
    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as ac:
            body = {"prompt": "busy busy", "n_predict": 1000, "stream": True, **GREEDY}
            streams = [ac.stream("POST", "/completion", json=body) for _ in range(N_SLOTS + MAX_QUEUE)]
            responses = await asyncio.gather(*(s.__aenter__() for s in streams))  # headers = admitted
            assert all(r.status_code == 200 for r in responses)
            extra = await ac.post("/completion", json=body)
            deadline = time.monotonic() + 10  # /slots is the engine's snapshot after its latest step
            while (no_slot := await ac.get("/slots", params={"fail_on_no_slot": 1})).status_code == 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            for s in streams:
                await s.__aexit__(None, None, None)  # disconnect every stream
            return extra, no_slot

    extra, no_slot = asyncio.run(run())
    assert extra.status_code == 503
    assert extra.json()["error"] == {"code": 503, "message": "All slots are busy, try again later",
                                     "type": "unavailable_error"}
    assert no_slot.json()["error"]["message"] == "no slot available"
    wait_idle(client, timeout=5)


def test_non_streamed_request_is_cancelled_when_the_client_leaves(server, client):
    body = httpx.Request("POST", server.url + "/completion",
                         json={"prompt": "leaving early", "n_predict": 1000, **GREEDY})
    host, port = body.url.host, body.url.port
    payload = body.read()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /completion HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        assert poll(lambda: any(s["is_processing"] for s in client.get("/slots").json()))
    wait_idle(client, timeout=3)  # 1000 tokens would take far longer: the request was aborted


# --- offline parity ---
def test_greedy_http_equals_outrider_generate(ckpt, client):
    prompt = "The meaning of life is"
    proc = subprocess.run([sys.executable, "-m", "outrider.cli", "generate", "-m", str(ckpt), "-p", prompt,
                           "-n", "32", "--temp", "0", "--ignore-eos"], cwd=REPO, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    offline = proc.stdout.decode("utf-8")
    assert offline.endswith("\n")
    assert complete(client, prompt=prompt, n_predict=32, **GREEDY)["content"] == offline[:-1]
    assert "predicted: 32 tokens" in proc.stderr.decode()


@pytest.mark.parametrize("stream_mode", [False, True], ids=["body", "stream"])
def test_a_call_of_several_choices_reports_choice_0s_timings(client, stream_mode):
    """A prompt array makes one call of several requests: streamed or not, `timings` is choice 0's (its prompt
    is the short one; choice 1 finishes last in the same step)."""
    short, long = random_prompt(5, 901), random_prompt(40, 902)
    body = {"prompt": [short, long], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if stream_mode:
        events = stream(client, "/v1/completions", {**body, "stream": True})
        timings = next(e["timings"] for e in events if isinstance(e, dict) and "timings" in e)
    else:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        timings = r.json()["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == len(short)
    assert timings["predicted_n"] == 4
