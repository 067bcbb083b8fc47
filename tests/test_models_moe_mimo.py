"""Qwen3-MoE and MiMo through the real engine against transformers on tiny random fp32 checkpoints: greedy
tokens of a batch of mixed prompt lengths, unchanged by chunked prefill, prefix hits and preemption (MiMo with
its MTP head drafting, as it serves by default); and their GGUF files load to the same model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.engine.request import Request
from outrider.models import load_model
from outrider.testing import write_tiny_checkpoint
from outrider.testing.drafters import write_mtp_checkpoint
from outrider.testing.gguf import write_gguf

transformers = pytest.importorskip("transformers")

N_NEW = 64
PROMPTS = [[1, 17, 99, 200, 7], [1] + list(range(30, 70)), [42], [1, 300, 301, 302, 5, 6, 7, 8, 9, 10, 11],
           list(range(100, 123))]
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
CASES = {
    "qwen3_moe": dict(arch="qwen3_moe", layers=2),
    # a dense layer among sparse ones, top-k weights not renormalised, more experts than a block holds
    "qwen3_moe-mixed-unnormed": dict(arch="qwen3_moe", layers=3, tie=True, extra_config={
        "mlp_only_layers": [1], "norm_topk_prob": False, "num_experts": 20, "num_experts_per_tok": 4}),
}


@pytest.fixture(scope="module", params=[*CASES, "mimo-mtp"])
def case(request, tmp_path_factory):
    """(checkpoint, transformers model) for one architecture."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "mimo-mtp":
        ckpt = write_mtp_checkpoint(path / "ckpt", "mimo", arch="mimo", layers=2)
        # transformers has no MiMo class (the release ships remote code): its body is Qwen2, the oracle.
        oracle = shutil.copytree(ckpt, path / "as_qwen2")
        config = json.loads((oracle / "config.json").read_text())
        config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        (oracle / "config.json").write_text(json.dumps(config))
    else:
        ckpt = oracle = write_tiny_checkpoint(path / "ckpt", **CASES[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    return ckpt, hf


@pytest.fixture(scope="module")
def hf_tokens(case):
    _, hf = case
    out = []
    for ids in PROMPTS:
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, eos_token_id=None)
        out.append(ref[0, len(ids):].tolist())
    assert len(set(out[0])) > 4, "random tiny model degenerated into repeating one token"
    return out


def test_batched_greedy_tokens_match_transformers(case, hf_tokens):
    ckpt, _ = case
    llm = LLM(str(ckpt), max_num_seqs=8, dtype="float32")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_tokens


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(case, hf_tokens):
    ckpt, _ = case
    llm = LLM(str(ckpt), max_num_seqs=5, dtype="float32", block_size=4, max_num_batched_tokens=8,
              num_kv_blocks=48)
    for _ in range(2):  # the second time, the prompts' blocks are cached
        reqs = [Request(list(p), GREEDY) for p in PROMPTS]
        for r in reqs:
            llm.engine.add_request(r, lambda out: None)
        while llm.engine.has_work():
            llm.engine.step()
        assert [r.output_ids for r in reqs] == hf_tokens
        assert sum(r.num_preemptions for r in reqs) > 0, "the small pool should force preemption"
    assert sum(r.timing.cache_n for r in reqs) > 0


def test_mimo_serves_with_its_mtp_head_detected(tmp_path):
    ckpt = write_mtp_checkpoint(tmp_path / "mimo", "mimo", arch="mimo", layers=2)
    llm = LLM(str(ckpt), dtype="float32")
    assert llm.engine.model_config.mtp_num_hidden_layers == 1
    assert llm.engine.speculation is not None and llm.engine.drafter_kind == "mtp"


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_qwen3_moe_gguf_loads_the_same_experts(tmp_path, quant):
    ckpt = write_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", layers=2, hidden_size=64)
    gguf_path = write_gguf(ckpt, tmp_path / "moe.gguf", quant=quant)
    ours, cfg = load_model(ckpt)
    from_gguf, gcfg = load_model(gguf_path)
    assert (gcfg.raw["num_experts"], gcfg.raw["num_experts_per_tok"], gcfg.raw["moe_intermediate_size"]) == (
        cfg.raw["num_experts"], cfg.raw["num_experts_per_tok"], cfg.raw["moe_intermediate_size"])
    tol = 0 if quant == "F32" else 0.02
    a, b = dict(ours.named_parameters()), dict(from_gguf.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=tol * a[name].abs().max().item(), rtol=0, msg=name)
