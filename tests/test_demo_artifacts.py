"""The shipped demo family in outrider/demo: formats, sizes, loadability on the CPU and the published metrics."""

from __future__ import annotations

import json

import pytest
import torch

from outrider import demo

pytestmark = pytest.mark.skipif(not demo.is_available(), reason="demo artifacts not installed")

MAX_BYTES = 20_000_000
LAYER_TENSORS = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"}


def config(kind: str) -> dict:
    return json.loads((demo.demo_path(kind) / "config.json").read_text())


def tensors(kind: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(demo.demo_path(kind) / "model.safetensors"))


def test_demo_paths():
    assert demo.demo_path() == demo.DEMO_DIR / "target"
    assert demo.demo_path("mtp") == demo.demo_path("target")
    assert [demo.demo_path(k).name for k in ("draft", "dflash", "eagle3")] == ["draft", "dflash", "eagle3"]
    with pytest.raises(ValueError):
        demo.demo_path("eagle")


def test_everything_shipped_fits_in_20_mb():
    total = sum(f.stat().st_size for f in demo.DEMO_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    assert total <= MAX_BYTES, total


def test_target_is_a_qwen3_checkpoint_with_a_qwen35_mtp_layer():
    cfg = config("target")
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["mtp_num_hidden_layers"] == 1
    t = tensors("target")
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    H = cfg["hidden_size"]
    assert t["model.embed_tokens.weight"].shape == (cfg["vocab_size"], H)
    assert "lm_head.weight" not in t and cfg["tie_word_embeddings"]
    mtp = {k for k in t if k.startswith("mtp.")}
    assert mtp == {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                   "mtp.norm.weight"} | {f"mtp.layers.0.{n}" for n in LAYER_TENSORS}
    assert t["mtp.fc.weight"].shape == (H, 2 * H)
    for n in LAYER_TENSORS:
        assert t[f"mtp.layers.0.{n}"].shape == t[f"model.layers.0.{n}"].shape


def test_dflash_drafter_format_matches_the_target():
    cfg, d = config("target"), config("dflash")
    assert d["architectures"] == ["DFlashDraftModel"] and d["block_size"] >= 2
    assert d["hidden_size"] == cfg["hidden_size"] and d["num_target_layers"] == cfg["num_hidden_layers"]
    taps = d["dflash_config"]["target_layer_ids"]
    assert all(0 <= i < cfg["num_hidden_layers"] - 1 for i in taps)  # block outputs, never the final-norm one
    tok = json.loads((demo.demo_path("target") / "tokenizer.json").read_text())
    assert [a["id"] for a in tok["added_tokens"] if a["content"] == "<|mask|>"] == [
        d["dflash_config"]["mask_token_id"]]
    t = tensors("dflash")
    assert set(t) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(d["num_hidden_layers"]) for n in LAYER_TENSORS}
    assert t["fc.weight"].shape == (d["hidden_size"], len(taps) * cfg["hidden_size"])


def test_eagle3_head_format_matches_the_target():
    """The EAGLE-3 head: outrider's loader reads it against the target, its taps are target blocks before the last,
    and its draft vocabulary is target ids (d2t and t2d agree)."""
    from outrider.config import ModelConfig
    from outrider.speculative.eagle3 import load_eagle3

    cfg, e = config("target"), config("eagle3")
    assert e["architectures"] == ["LlamaForCausalLMEagle3"]
    head, _, taps = load_eagle3(str(demo.demo_path("eagle3")), ModelConfig.from_path(demo.demo_path("target")))
    assert len(taps) == 3 and all(0 <= i < cfg["num_hidden_layers"] - 1 for i in taps)
    t = tensors("eagle3")
    assert t["fc.weight"].shape == (cfg["hidden_size"], 3 * cfg["hidden_size"]) and "embed_tokens.weight" not in t
    ids = torch.arange(e["draft_vocab_size"]) + t["d2t"]
    assert t["t2d"].nonzero().flatten().tolist() == sorted(ids.tolist())


def test_draft_shares_the_target_tokenizer():
    """The same tokenizer (the draft's copy, for the engine's vocabulary check, is stored as compact JSON)."""
    def tokenizer(kind):
        return json.loads((demo.demo_path(kind) / "tokenizer.json").read_text())

    assert tokenizer("draft") == tokenizer("target")
    assert config("draft")["vocab_size"] == config("target")["vocab_size"]
    assert config("draft")["architectures"] == ["Qwen3ForCausalLM"]


def test_transformers_loads_target_and_draft_and_completes_python():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(demo.demo_path("target"))
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    for kind in ("target", "draft"):
        model = transformers.AutoModelForCausalLM.from_pretrained(demo.demo_path(kind), dtype=torch.float32).eval()
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:])
        assert text.startswith("\n    "), (kind, text)  # an indented function body follows the signature


def test_outrider_loader_reads_the_target():
    models = pytest.importorskip("outrider.models")
    model, cfg = models.load_model(str(demo.demo_path("target")), dtype="float32", device="cpu")
    assert cfg.mtp_num_hidden_layers == 1 and cfg.tie_word_embeddings
    assert set(cfg.eos_token_id) == {0, 2}


@torch.no_grad()
def test_target_predicts_held_out_code_far_better_than_its_unigram_statistics():
    """outrider's model, loaded from the shipped target, scores the held-out evaluation prompts (files never trained
    on) at least 2 nats per token below the unigram distribution fitted to those very tokens: the family is a trained
    code model, whatever its metrics.json says."""
    from outrider.attention import KVCache, get_backend
    from outrider.attention.metadata import build_metadata
    from outrider.models import load_model
    from outrider.tokenizer import Tokenizer

    model, cfg = load_model(str(demo.demo_path("target")), dtype="float32", device="cpu")
    tok = Tokenizer.from_pretrained(str(demo.demo_path("target")))
    prompts = [torch.tensor(tok.encode(p["prompt"])) for p in demo.eval_prompts()]
    block, seqs, first = 16, [], 0
    for ids in prompts:
        blocks = -(-len(ids) // block)
        seqs.append((list(range(first, first + blocks)), 0, len(ids)))
        first += blocks
    kv = KVCache.allocate(cfg.num_hidden_layers, first, block, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                          "cpu")
    meta, positions = build_metadata(seqs, block, "cpu")
    logits = model.compute_logits(model(torch.cat(prompts), positions, kv, meta, get_backend("cpu")))
    rows = torch.cat([torch.arange(s, s + len(ids) - 1) for s, ids in
                      zip(torch.tensor([0] + [len(i) for i in prompts]).cumsum(0).tolist(), prompts)])
    labels = torch.cat([ids[1:] for ids in prompts])
    loss = torch.nn.functional.cross_entropy(logits[rows], labels).item()
    freq = torch.bincount(labels, minlength=cfg.vocab_size).double() / len(labels)
    unigram = -(freq[labels]).log().mean().item()
    assert loss < unigram - 2.0, (loss, unigram)


def test_eval_prompts_come_from_held_out_files():
    from outrider_tools.demo.corpus import is_held_out

    prompts = demo.eval_prompts()
    assert len(prompts) >= 32 and {p["kind"] for p in prompts} == {"def", "window"}
    assert all(is_held_out(p["file"]) for p in prompts)
