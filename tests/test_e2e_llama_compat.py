"""End to end: what a user replacing llama-server keeps. One server (`-c 512 -np 2`: two slots of 256 tokens,
`-b 64`: prompts prefill in chunks) checks the context per slot, progress frames, `__verbose`, slots, props,
models tags, refused and honoured request fields, the CORS allow-list and chat prefill."""

from __future__ import annotations

import random

import httpx
import pytest

from e2e_harness import ServerProcess, sse_events
from outrider.testing import write_tiny_checkpoint

N_CTX, N_SLOTS = 512, 2
PER_SLOT = N_CTX // N_SLOTS
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("compat") / "tiny", "qwen3", hidden_size=64, layers=2,
                                 seed=3, max_position_embeddings=4096)
    with ServerProcess(["-m", str(ckpt), "-c", str(N_CTX), "-np", str(N_SLOTS), "-b", "64", "--props",
                        "--cors-origins", "localhost,https://app.example", "--tags", "chat,tiny"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 400) for _ in range(n)]


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events_of(client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def test_context_is_split_across_the_slots(client):
    props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == PER_SLOT and props["total_slots"] == N_SLOTS
    assert all(s["n_ctx"] == PER_SLOT for s in client.get("/slots").json())
    assert client.get("/v1/models").json()["data"][0]["meta"]["n_ctx"] == PER_SLOT
    r = client.post("/completion", json={"prompt": prompt_of(PER_SLOT, 1)})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
    assert r.json()["error"]["n_ctx"] == PER_SLOT


def test_a_full_context_truncates(client):
    out = post(client, "/completion", {"prompt": prompt_of(PER_SLOT - 6, 2), "n_predict": -1, **GREEDY})
    assert out["tokens_predicted"] == 6 and out["stop_type"] == "limit" and out["truncated"] is True
    short = post(client, "/completion", {"prompt": prompt_of(10, 3), "n_predict": 4, **GREEDY})
    assert short["stop_type"] == "limit" and short["truncated"] is False  # n_predict, not the context


def test_return_progress_reports_the_prefill_chunks(client):
    prompt = prompt_of(200, 4)  # four chunks of the 64-token step budget
    events = events_of(client, "/completion", {"prompt": prompt, "n_predict": 3, "stream": True,
                                               "return_progress": True, "timings_per_token": True, **GREEDY})
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress[0]["processed"] == progress[0]["cache"] == 0  # before any prompt work
    assert progress[-1]["processed"] == 200 and all(p["total"] == 200 for p in progress)
    done = [p["processed"] for p in progress]
    assert len(progress) >= 4 and done == sorted(done)
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times) and times[-1] > 0
    # each report's timings are the prompt work done by then: none at first, as llama-server
    timings = [e["timings"] for e in events if "prompt_progress" in e]
    assert timings[0]["prompt_n"] == 0 and timings[0]["prompt_ms"] == 0
    assert [t["prompt_n"] for t in timings] == [p["processed"] - p["cache"] for p in progress]
    assert [t["prompt_ms"] for t in timings] == sorted(t["prompt_ms"] for t in timings)
    assert timings[-1]["prompt_ms"] <= events[-1]["timings"]["prompt_ms"] and events[-1]["timings"]["prompt_n"] == 200
    first_token = next(i for i, e in enumerate(events) if e.get("tokens"))
    assert all("prompt_progress" in e for e in events[:first_token])  # progress comes first
    assert all(e["content"] == "" and e["tokens"] == [] for e in events[:first_token])
    # Not streamed, there are no frames to carry progress: accepted, as llama-server does.
    assert post(client, "/completion", {"prompt": prompt, "n_predict": 1, "return_progress": True})["stop"]


def test_verbose_returns_the_rendered_prompt_and_raw_result(client):
    messages = [{"role": "user", "content": "Tell me"}]
    body = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "verbose": True, **GREEDY})
    verbose = body["__verbose"]
    rendered = post(client, "/apply-template", {"messages": messages})["prompt"]
    assert verbose["prompt"].endswith(rendered) and verbose["content"] == body["choices"][0]["message"]["content"]
    assert verbose["tokens_predicted"] == 5 and verbose["timings"] == body["timings"]
    plain = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, **GREEDY})
    assert "__verbose" not in plain
    chunks = events_of(client, "/v1/completions", {"prompt": "Once", "max_tokens": 4, "stream": True,
                                                   "verbose": True, **GREEDY})
    final = [c for c in chunks if isinstance(c, dict) and "__verbose" in c]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    assert final[0]["__verbose"]["content"] == "".join(c["choices"][0]["text"] for c in chunks[:-1]
                                                       if isinstance(c, dict) and c["choices"])


def test_idle_slots_reset_their_next_token(client):
    post(client, "/completion", {"prompt": prompt_of(12, 5), "n_predict": 7, "id_slot": 1, **GREEDY})
    (slot,) = [s for s in client.get("/slots").json() if s["id"] == 1]
    assert not slot["is_processing"] and slot["params"]["n_predict"] == 7  # the last task, kept
    assert slot["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]


def test_id_slot_is_honoured(client):
    for slot in (1, 0, 1):
        assert post(client, "/completion", {"prompt": prompt_of(8, slot), "n_predict": 2, "id_slot": slot})[
            "id_slot"] == slot
    r = client.post("/completion", json={"prompt": "x", "id_slot": N_SLOTS})
    assert r.status_code == 400 and "'id_slot'" in r.json()["error"]["message"]


def test_ignore_eos_lists_the_end_of_generation_ids_in_logit_bias(client):
    out = post(client, "/completion", {"prompt": "a", "n_predict": 1, "ignore_eos": True, "logit_bias": [[5, 1.5]]})
    bias = out["generation_settings"]["logit_bias"]
    eos = post(client, "/tokenize", {"content": "<|im_end|>"})["tokens"]
    assert bias[0] == {"bias": 1.5, "token": 5}
    assert {"bias": None, "token": eos[0]} in bias[1:] and all(b["bias"] is None for b in bias[1:])
    plain = post(client, "/completion", {"prompt": "a", "n_predict": 1})["generation_settings"]["logit_bias"]
    assert plain == []


def test_models_list_the_tags(client):
    model = client.get("/models").json()
    assert model["data"][0]["tags"] == ["chat", "tiny"] and model["models"][0]["tags"] == ["chat", "tiny"]


def test_post_props_changes_nothing_and_says_so(client):
    before = client.get("/props").json()
    assert post(client, "/props", {}) == {"success": True}
    r = client.post("/props", json={"n_ctx": 64})
    assert r.status_code == 400 and "'n_ctx'" in r.json()["error"]["message"]
    assert client.get("/props").json() == before


@pytest.mark.parametrize("field, value", [("n_cache_reuse", 256), ("image_data", [{"id": 1}]),
                                          ("best_of", 2), ("functions", [{"name": "f"}]),
                                          ("prediction", {"content": "x"})])
def test_fields_we_cannot_honour_are_refused_by_name(client, field, value):
    for path, body in (("/completion", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        r = client.post(path, json={**body, "max_tokens": 1, field: value})
        assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"], r.text


def test_fields_at_their_neutral_values_and_unknown_keys_are_accepted(client, server):
    out = post(client, "/completion", {"prompt": "a", "n_predict": 1, "n_keep": -1, "n_cache_reuse": 0,
                                       "best_of": 1, "parallel_tool_calls": False, "no_such_field": 1})
    assert out["stop"] is True
    assert any("'no_such_field'" in line for line in server.stderr)  # ignored as llama-server does, but named


def test_samplers_choose_which_samplers_run(client):
    greedy = post(client, "/completion", {"prompt": "Hello", "n_predict": 6, "top_k": 1, "temperature": 1.5})
    # top_k left out of the chain: it no longer pins the draw to the best token.
    outs = {post(client, "/completion", {"prompt": "Hello", "n_predict": 6, "top_k": 1, "temperature": 1.5,
                                         "seed": seed, "samplers": ["temperature"]})["content"] for seed in range(6)}
    assert outs - {greedy["content"]}
    settings = post(client, "/completion", {"prompt": "a", "n_predict": 1, "samplers": "kt"})["generation_settings"]
    assert settings["samplers"] == ["top_k", "temperature"] and settings["top_p"] == 1.0 and settings["min_p"] == 0
    for bad in (["temperature", "top_k"], ["mirostat"], "kz", 7):
        r = client.post("/completion", json={"prompt": "a", "samplers": bad})
        assert r.status_code == 400 and "'samplers'" in r.json()["error"]["message"]


def test_dry_and_xtc_run_and_show_in_generation_settings(client):
    prompt = prompt_of(6, 4) * 4  # a repeated stretch: greedy decoding tends to continue it
    plain = post(client, "/completion", {"prompt": prompt, "n_predict": 12, "return_tokens": True, **GREEDY})
    dry = {"dry_multiplier": 4.0, "dry_base": 2.0, "dry_allowed_length": 1, "dry_penalty_last_n": 64,
           "dry_sequence_breakers": ["\n"]}
    out = post(client, "/completion", {"prompt": prompt, "n_predict": 12, "return_tokens": True, **GREEDY, **dry})
    assert out["tokens"] != plain["tokens"]
    assert {k: out["generation_settings"][k] for k in dry} == {**dry, "dry_sequence_breakers": ["\n"]}
    # left out of `samplers`, DRY is off: the plain output again
    off = post(client, "/completion", {"prompt": prompt, "n_predict": 12, "return_tokens": True, **GREEDY, **dry,
                                       "samplers": ["penalties", "top_k", "temperature"]})
    assert off["tokens"] == plain["tokens"] and off["generation_settings"]["dry_multiplier"] == 0
    # XTC at threshold 0 over top-2 always removes the best one: every seed draws the second
    xtc = {"prompt": "Hello", "n_predict": 6, "return_tokens": True, "top_k": 2, "temperature": 1.0,
           "xtc_probability": 1.0, "xtc_threshold": 0.0, "ignore_eos": True}
    seconds = {tuple(post(client, "/completion", {**xtc, "seed": seed})["tokens"]) for seed in range(4)}
    best = post(client, "/completion", {**xtc, "top_k": 1})["tokens"]
    assert len(seconds) == 1 and list(seconds.pop()) != best
    for field, value in [("dry_multiplier", -1), ("dry_base", 0.5), ("dry_sequence_breakers", "\n"),
                         ("xtc_probability", 1.5), ("xtc_threshold", "x")]:
        r = client.post("/completion", json={"prompt": "a", field: value})
        assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"], (field, r.text)


@pytest.mark.parametrize("origin, allowed", [
    ("http://localhost:5173", True), ("http://127.0.0.1:9", True), ("http://[::1]:8080", True),
    ("https://localhost", True), ("https://app.example", True), ("https://evil.example", False),
    ("http://localhost.evil.example", False), ("https://app.example:444", False)])
def test_cors_allows_only_the_listed_origins(client, origin, allowed):
    pre = client.options("/v1/chat/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    get = client.get("/props", headers={"Origin": origin})
    for r in (pre, get):
        assert r.status_code == 200
        assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)


def test_a_final_assistant_message_is_continued(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Well,"}, {"type": "text", "text": "then"}]}]
    prompt = post(client, "/apply-template", {"messages": messages})["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nWell,\n\nthen")  # parts joined by a blank line, turn left open
    out = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "verbose": True, **GREEDY})
    assert out["__verbose"]["prompt"].endswith("Well,\n\nthen")
    two = [*messages, {"role": "assistant", "content": "more"}]
    r = client.post("/v1/chat/completions", json={"messages": two})
    assert r.status_code == 400 and "2 or more assistant messages" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 42}]})
    assert r.status_code == 400 and "'messages[0].content'" in r.json()["error"]["message"]
