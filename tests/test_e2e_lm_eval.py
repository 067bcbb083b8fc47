"""lm-eval 0.4's `local-completions` model runs a multiple-choice task of our own (tests/lm_eval_task/, scored by
log-likelihood) against the served SmolLM2 file, to a score: each choice's log-likelihood and the accuracy equal
what the server's own `/v1/completions` echo + logprobs imply, computed here independently."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
import yaml

from e2e_harness import ServerProcess
from outrider.demo.smollm2 import smollm2_path

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

TASK = Path(__file__).parent / "lm_eval_task" / "outrider_mc.yaml"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["-m", str(smollm2_path()), "-c", "2048", "-np", "2"]) as srv:
        yield srv
        assert srv.proc.poll() is None, "".join(srv.stderr)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The GGUF's tokenizer as a Hugging Face tokenizer directory (lm-eval's tokenizer backend loads one by path)."""
    path = smollm2_path()
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out


def task_config() -> dict:
    config = yaml.safe_load(TASK.read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(TASK.parent / f) for split, f in files.items()}
    return config


def served_loglikelihood(url: str, tok, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, from /v1/completions echo + logprobs, tokenized as
    lm-eval's pair encoding does (the whole string, split where the context's tokens end)."""
    ctx = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": whole, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    entries = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(entries) == len(whole) + 1  # the prompt's, then the one generated token
    return sum(entries[len(ctx) : len(whole)])


def test_lm_eval_local_completions_scores_a_multiple_choice_task(server, tokenizer_dir):
    result = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "smollm2", "base_url": server.url + "/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": str(tokenizer_dir), "max_retries": 1, "num_concurrent": 2},
        tasks=[task_config()], log_samples=True)
    score = result["results"]["outrider_mc"]["acc,none"]
    samples = result["samples"]["outrider_mc"]
    docs = [json.loads(line) for line in (TASK.parent / "outrider_mc.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs) == 8
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    correct = 0
    for sample in samples:
        doc = docs[sample["doc_id"]]
        context = f"Question: {doc['question']}\nAnswer:"
        mine = [served_loglikelihood(server.url, tok, context, " " + choice) for choice in doc["choices"]]
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(mine, theirs)), (mine, theirs)
        assert len(set(round(x, 2) for x in mine)) == len(mine)  # no ties: the argmax is well defined
        correct += mine.index(max(mine)) == doc["answer"]
    assert math.isclose(score, correct / len(docs))
