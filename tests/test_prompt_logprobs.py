"""Prompt log-probs (echo + logprobs, prompt_logprobs) equal a teacher-forced float32 forward of the same tiny
checkpoint in transformers, within 1e-4: in one prefill step or chunked, after a prefix-cache hit, and with a
drafter speculating on the same requests."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.engine.prompt_logprobs import CHUNK_ROWS
from outrider.engine.request import Request
from outrider.testing import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(150)], [(11 * i) % 300 + 9 for i in range(37)]]
BLOCK = 16  # KV block size: a prefix hit covers whole blocks, one prompt token always left to compute


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("plp")
    return write_tiny_checkpoint(root / "target", "qwen3", seed=4), write_tiny_checkpoint(root / "draft", "qwen3",
                                                                                          seed=5)


@pytest.fixture(scope="module")
def teacher_forced(checkpoints):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            lps = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
            out.append((lps[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0], lps[:-1]))
    return out


def run(llm: LLM, prompts, top: int) -> list[Request]:
    requests = [Request(list(p), SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=top)) for p in prompts]
    for r in requests:
        llm.engine.add_request(r, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    return requests


def check(req: Request, want) -> None:
    target, full = want
    got = req.prompt_logprobs
    assert got[0] is None and all(e is not None for e in got[1:]) and len(got) == len(req.prompt_ids)
    assert [e.token_id for e in got[1:]] == req.prompt_ids[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in got[1:]]), target, atol=1e-4, rtol=0)
    best = full.topk(2, dim=-1)
    ranks = (full > target[:, None]).sum(dim=-1) + 1
    assert [e.rank for e in got[1:]] == ranks.tolist()
    for pos, e in enumerate(got[1:]):
        assert [t for t, _ in e.top] == best.indices[pos].tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), best.values[pos], atol=1e-4, rtol=0)


@pytest.mark.parametrize("budget", [2048, 48], ids=["one-step", "chunked"])
def test_prompt_logprobs_equal_a_teacher_forced_forward(checkpoints, teacher_forced, budget):
    llm = LLM(str(checkpoints[0]), dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=budget, block_size=BLOCK)
    first = run(llm, PROMPTS, 2)
    for req, want in zip(first, teacher_forced):
        check(req, want)
    assert all(r.timing.cache_n == 0 for r in first)
    # the same prompts again: the prefix cache holds them; the hit is reused (cache_n) and the cached rows' log-probs
    # are recomputed (in more than one recompute chunk for the longer prompt: CHUNK_ROWS)
    again = run(llm, PROMPTS, 2)
    assert [r.timing.cache_n for r in again] == [len(p) - 1 - (len(p) - 1) % BLOCK for p in PROMPTS]
    assert again[0].timing.cache_n > CHUNK_ROWS
    for req, want in zip(again, teacher_forced):
        check(req, want)
    plain = Request(list(PROMPTS[0]), SamplingParams(max_tokens=1, temperature=0))
    llm.engine.add_request(plain, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    assert plain.timing.cache_n > 0 and plain.prompt_logprobs is None  # (only asked for, and the cache is used)


def test_prompt_logprobs_under_speculation(checkpoints, teacher_forced):
    llm = LLM(str(checkpoints[0]), dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=64, draft_model=str(checkpoints[1]), spec_type="draft")
    requests = run(llm, PROMPTS, 2)
    assert sum(r.timing.draft_n for r in requests) > 0
    for req, want in zip(requests, teacher_forced):
        check(req, want)
    again = run(llm, PROMPTS, 2)  # prefix hits, recomputed, under speculation too
    assert all(r.timing.cache_n > 0 for r in again)
    for req, want in zip(again, teacher_forced):
        check(req, want)


def test_prompt_logprobs_on_a_hybrid_target_take_no_prefix_hit_and_equal_a_cold_prompts(tmp_path):
    """A hybrid model cannot recompute cached rows' hidden states (its linear layers' state has moved past them):
    a request asking for prompt log-probs computes its whole prompt, with the same log-probs as the first time, and
    one that does not still takes the hit."""
    path = write_tiny_checkpoint(tmp_path, "qwen3_5", seed=4)
    llm = LLM(str(path), dtype="float32", max_model_len=512, max_num_seqs=4, block_size=BLOCK,
              enable_prefix_caching=True)
    first = run(llm, PROMPTS, 2)
    again = run(llm, PROMPTS, 2)
    assert [r.timing.cache_n for r in again] == [0, 0]
    for cold, warm in zip(first, again):
        assert [(e.token_id, e.rank, e.top) for e in cold.prompt_logprobs[1:]] == \
            [(e.token_id, e.rank, e.top) for e in warm.prompt_logprobs[1:]]
        torch.testing.assert_close(torch.tensor([e.logprob for e in warm.prompt_logprobs[1:]]),
                                   torch.tensor([e.logprob for e in cold.prompt_logprobs[1:]]))
    plain = Request(list(PROMPTS[0]), SamplingParams(max_tokens=1, temperature=0))
    llm.engine.add_request(plain, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    assert plain.timing.cache_n > 0
