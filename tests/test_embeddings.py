"""Embeddings pooled from the prefill equal transformers' pooling of the same tiny checkpoint's last hidden state
(after the final norm) within 1e-4: mean, cls, last and none, in one step and chunked."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.engine.request import Request
from outrider.testing import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[(5 * i + 2) % 400 + 5 for i in range(90)], [(13 * i) % 300 + 7 for i in range(11)]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("emb") / "tiny", "qwen3", seed=8)


@pytest.fixture(scope="module")
def hidden(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def pooled(llm: LLM, mode: str) -> list[torch.Tensor]:
    requests = [Request(list(p), SamplingParams(max_tokens=1, temperature=0, pooling=mode)) for p in PROMPTS]
    for r in requests:
        llm.engine.add_request(r, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    return [r.pooled.result() for r in requests]


@pytest.mark.parametrize("budget", [2048, 32], ids=["one-step", "chunked"])
def test_pooled_embeddings_equal_transformers(checkpoint, hidden, budget):
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=2,
              max_num_batched_tokens=budget)
    want = {"mean": [h.mean(0) for h in hidden], "cls": [h[0] for h in hidden], "last": [h[-1] for h in hidden],
            "none": hidden}
    for mode, expected in want.items():
        for got, exp in zip(pooled(llm, mode), expected):
            torch.testing.assert_close(got, exp, atol=1e-4, rtol=0)
    # twice: no cached prefix is reused, so the second pooling sees every row again
    torch.testing.assert_close(pooled(llm, "mean")[0], want["mean"][0], atol=1e-4, rtol=0)
