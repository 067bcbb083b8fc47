"""--context-shift: a request that fills its slot's context keeps its first `n_keep` tokens (after the BOS), discards
`n_discard` (default half of the rest) and goes on, by llama-server's rule; its tokens after each shift are those of
the shifted context (recomputed); replies say truncated, timings count every token."""

from __future__ import annotations

import httpx
import pytest

from e2e_harness import ServerProcess, sse_events
from outrider.testing import write_tiny_checkpoint

N_CTX = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("shift") / "tiny", "qwen3", seed=9,
                                 max_position_embeddings=1024)
    with ServerProcess(["-m", str(ckpt), "-c", str(N_CTX), "-np", "1", "--context-shift"]) as srv:
        yield srv


def shift(tokens: list[int], n_prompt: int, n_bos: int, n_keep: int, n_discard: int) -> list[int]:
    """llama-server's context shift of a slot whose cache holds all of `tokens` but the last sampled one: keep
    n_keep tokens (-1: the prompt) plus the BOS, at most n_ctx - 4; discard n_discard (0: half the cached rest)."""
    keep = min(N_CTX - 4, (n_prompt if n_keep < 0 else n_keep) + n_bos)
    left = len(tokens) - 1 - keep
    return tokens[:keep] + tokens[keep + (n_discard or left // 2):]


def test_a_full_context_shifts_and_generation_goes_on(server):
    bos = httpx.post(server.url + "/tokenize", json={"content": "", "add_special": True}).json()["tokens"]
    prompt = bos + [(7 * i) % 300 + 20 for i in range(99)]  # 100 tokens: 28 fit before the context is full
    body = {"prompt": prompt, "n_predict": 60, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    out = httpx.post(server.url + "/completion", json=body, timeout=120).json()
    assert out["tokens_predicted"] == 60 and out["truncated"] is True and out["stop_type"] == "limit"
    assert out["timings"]["predicted_n"] == 60 and out["timings"]["prompt_n"] == 100
    before = N_CTX - len(prompt)
    whole = prompt + out["tokens"][:before]
    kept = shift(whole, len(prompt), len(bos), 0, 0)
    after = httpx.post(server.url + "/completion", timeout=120, json={
        "prompt": kept, "n_predict": 60 - before, "temperature": 0, "ignore_eos": True, "return_tokens": True}).json()
    assert out["tokens"][before:] == after["tokens"]
    # streamed, and through the OpenAI route
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as r:
        frames = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict)]
    assert [t for f in frames[:-1] for t in f["tokens"]] == out["tokens"] and frames[-1]["truncated"] is True
    chat = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 60 and chat["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("n_keep, n_discard", [(5, 0), (5, 40), (-1, 0)])
def test_n_keep_and_n_discard_shift_as_llama_server_does(server, n_keep, n_discard):
    """Each shift keeps and drops what llama-server's rule says: the tokens after it are the greedy continuation
    of the shifted context, however many shifts the request takes."""
    bos = httpx.post(server.url + "/tokenize", json={"content": "", "add_special": True}).json()["tokens"]
    prompt = bos + [(5 * i) % 200 + 30 for i in range(89)]
    n_predict = 80
    out = httpx.post(server.url + "/completion", timeout=120, json={
        "prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "return_tokens": True,
        "n_keep": n_keep, "n_discard": n_discard}).json()
    assert out["tokens_predicted"] == n_predict and out["truncated"] is True
    assert out["generation_settings"]["n_keep"] == n_keep and out["generation_settings"]["n_discard"] == n_discard
    context, done, shifts = list(prompt), 0, 0
    while done < n_predict:
        room = N_CTX - len(context)
        part = httpx.post(server.url + "/completion", timeout=120, json={
            "prompt": context, "n_predict": min(room, n_predict - done), "temperature": 0, "ignore_eos": True,
            "return_tokens": True}).json()["tokens"]
        assert out["tokens"][done : done + len(part)] == part, f"after {shifts} shifts"
        context, done = context + part, done + len(part)
        if done < n_predict:
            context, shifts = shift(context, len(prompt), len(bos), n_keep, n_discard), shifts + 1
    assert shifts >= 1 + (n_keep == -1)  # (keeping the prompt leaves little to discard: several shifts)


@pytest.mark.parametrize("field, value", [("n_keep", -2), ("n_discard", -1), ("n_keep", "all")])
def test_bad_n_keep_or_n_discard_is_a_400(server, field, value):
    r = httpx.post(server.url + "/completion", json={"prompt": "a", "n_predict": 1, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"]
