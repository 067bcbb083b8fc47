"""/v1/completions with `echo` + `logprobs` (OpenAI's legacy log-likelihood request, what lm-eval's
local-completions model sends) and vLLM's `prompt_logprobs`, through the real server: the prompt's log-probs lead
the list (the first one null), match the offline engine's, streamed or not, and score a multiple-choice task."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from e2e_harness import ServerProcess, sse_events
from outrider import LLM, SamplingParams
from outrider.engine.request import Request
from outrider.testing import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("plp") / "tiny", "qwen3", seed=6)


@pytest.fixture(scope="module")
def server(checkpoint):
    with ServerProcess(["-m", str(checkpoint), "-c", "1024", "-np", "2", "-b", "32", "--dtype", "float32"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(str(checkpoint), dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_seqs=2)


def prompt_logprobs(llm: LLM, ids: list[int]) -> list:
    req = Request(list(ids), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    llm.engine.add_request(req, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    return req.prompt_logprobs


def test_echo_with_logprobs_gives_the_prompts_log_probs(server, offline):
    tok = offline.tokenizer
    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 4, add_special=False)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    r = c.completions.create(model="m", prompt=ids, echo=True, logprobs=2, max_tokens=2, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens) == r.choices[0].text
    want = [e.logprob for e in prompt_logprobs(offline, ids)[1:]]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs[1 : len(ids)], want))
    assert all(len(t) <= 2 and max(t.values()) >= lp.token_logprobs[j + 1] - 1e-6
               for j, t in enumerate(lp.top_logprobs[1 : len(ids)]))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # the same prompt again: a prefix-cache hit, whose skipped rows' log-probs are recomputed
    hit = c.completions.create(model="m", prompt=ids, echo=True, logprobs=2, max_tokens=2, temperature=0)
    assert hit.usage.prompt_tokens_details.cached_tokens > len(ids) // 2
    assert all(math.isclose(a, b, abs_tol=1e-4)
               for a, b in zip(hit.choices[0].logprobs.token_logprobs[1 : len(ids)], want))
    # a text prompt: echoed as sent, without the BOS the server added, whose log-prob entry is left out too
    text = c.completions.create(model="m", prompt="the quick brown fox", echo=True, logprobs=1, max_tokens=1,
                                temperature=0).choices[0]
    assert text.text.startswith("the quick brown fox") and "".join(text.logprobs.tokens) == text.text
    assert text.logprobs.token_logprobs[0] is not None  # (it follows the BOS)
    # streamed: the prompt's entries come with the first chunk
    body = {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
        chunks = [e for e in sse_events(s.iter_lines()) if isinstance(e, dict) and e.get("choices")]
    streamed = [v for ch in chunks for v in (ch["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == lp.token_logprobs


def test_vllm_prompt_logprobs(server, offline):
    ids = offline.tokenizer.encode("one two three four five six", add_special=False)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": ids, "prompt_logprobs": 3, "max_tokens": 1, "temperature": 0}).json()
    got = r["choices"][0]["prompt_logprobs"]
    want = prompt_logprobs(offline, ids)
    assert got[0] is None and len(got) == len(ids)
    for tok, entry, w in zip(ids[1:], got[1:], want[1:]):
        mine = entry[str(tok)]
        assert math.isclose(mine["logprob"], w.logprob, abs_tol=1e-4) and mine["rank"] == w.rank
        assert 1 <= len(entry) <= 4 and sorted(e["rank"] for e in entry.values())[0] == 1
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "prompt_logprobs": 21}, timeout=60)
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_a_multiple_choice_task_scores_by_log_likelihood(server, offline):
    """lm-eval's local-completions request and reading (tokenized context + continuation, echo, logprobs=1,
    max_tokens=1; the continuation's log-likelihood is the sum of its tokens' entries): each question's answer is
    the choice the model rates most likely, and the score is the share that match the offline engine's choice."""
    tok = offline.tokenizer
    questions = [("The color of the sky is", [" blue", " green", " loud"]),
                 ("Two plus two equals", [" four", " five", " chair"]),
                 ("Cats like to drink", [" milk", " stones", " rain"])]
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    agree = 0
    for context, choices in questions:
        ctx = tok.encode(context, add_special=False)
        served, local = [], []
        for choice in choices:
            ids = ctx + tok.encode(choice, add_special=False)
            r = c.completions.create(model="m", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
            served.append(sum(r.choices[0].logprobs.token_logprobs[len(ctx):-1]))
            local.append(sum(e.logprob for e in prompt_logprobs(offline, ids)[len(ctx):]))
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(served, local))
        agree += served.index(max(served)) == local.index(max(local))
    assert agree == len(questions)
