"""--context-shift: a request that fills its slot's context discards half of it after the BOS and goes on, its
tokens after the shift those of the shifted context (recomputed); replies say truncated, timings count every token."""

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


def test_a_full_context_shifts_and_generation_goes_on(server):
    bos = httpx.post(server.url + "/tokenize", json={"content": "", "add_special": True}).json()["tokens"]
    prompt = bos + [(7 * i) % 300 + 20 for i in range(99)]  # 100 tokens: 28 fit before the context is full
    body = {"prompt": prompt, "n_predict": 60, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    out = httpx.post(server.url + "/completion", json=body, timeout=120).json()
    assert out["tokens_predicted"] == 60 and out["truncated"] is True and out["stop_type"] == "limit"
    assert out["timings"]["predicted_n"] == 60 and out["timings"]["prompt_n"] == 100
    before = N_CTX - len(prompt)
    whole = prompt + out["tokens"][:before]
    kept = whole[:1] + whole[1 + (len(whole) - 1) // 2:]  # n_keep 1 (the BOS), n_discard half the rest
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
