"""The shipped demo family in outrider/demo: formats, sizes, loadability on the CPU and the published metrics."""

from __future__ import annotations

import json

import pytest
import torch

from outrider import demo

pytestmark = pytest.mark.skipif(not demo.is_available(), reason="demo artifacts not installed")

MAX_BYTES = 20_000_000


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


def test_outriders_loaders_read_the_target_with_its_mtp_head():
    """The target loads strictly through outrider's loader, and its Qwen3.5-style MTP head (one layer of the
    target's shape, under `mtp.`) through the MTP drafter's."""
    from outrider.models import load_model
    from outrider.speculative.mtp import load_mtp_head

    model, cfg = load_model(str(demo.demo_path("target")), dtype="float32", device="cpu")
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.mtp_num_hidden_layers == 1 and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layout, head = load_mtp_head(str(demo.demo_path("target")), cfg, torch.float32, torch.device("cpu"))
    assert layout == "qwen" and len(head.layers) == 1


def test_dflash_drafter_loads_against_the_target_with_the_tokenizers_mask_token():
    from outrider.tokenizer import Tokenizer
    from outrider_tools.demo.models import load_dflash

    cfg = config("target")
    dflash = load_dflash(demo.demo_path("dflash"))  # strict: every tensor of the DFlash layout, nothing else
    assert dflash.block_size >= 2 and dflash.config["num_target_layers"] == cfg["num_hidden_layers"]
    assert all(0 <= i < cfg["num_hidden_layers"] - 1 for i in dflash.taps)  # block outputs, never the last
    assert dflash.model.fc.in_features == len(dflash.taps) * cfg["hidden_size"]
    tok = Tokenizer.from_pretrained(str(demo.demo_path("target")))
    assert tok.encode("<|mask|>", add_special=False) == [dflash.mask_id]


def test_eagle3_head_format_matches_the_target():
    """The EAGLE-3 head: outrider's loader reads it against the target, its taps are target blocks before the last,
    and its draft vocabulary is target ids (d2t and t2d agree)."""
    from outrider.models import registry
    from outrider.speculative.eagle3 import load_eagle3

    cfg, e = config("target"), config("eagle3")
    assert e["architectures"] == ["LlamaForCausalLMEagle3"]
    head, _, taps = load_eagle3(str(demo.demo_path("eagle3")), registry.load_config(demo.demo_path("target")))
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
    logits = model.compute_logits(model(torch.cat(prompts), positions, kv, meta, get_backend("cpu")).hidden)
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
