"""The benchmark presets at published shapes (bench/shapes.py, bench/drafter_shapes.py): each parses, has its
release's parameter count (counted on the meta device: nothing is allocated), builds with random weights at a
reduced size, and the decode roofline counts a MoE's active weights."""

from __future__ import annotations

import json

import pytest
import torch

from outrider.bench.drafter_shapes import PRESETS, write_preset
from outrider.bench.shapes import (RANDOM_MODELS, _meta_model, config_weight_bytes, kv_bytes_per_token,
                                   random_model_of, state_bytes_per_sequence, write_stub_checkpoint)
from outrider.config import ModelConfig
from outrider.models import registry
from outrider.speculative.dflash import DFlashConfig

# Published sizes: (total parameters, active parameters per token), embedding and LM head counted once each.
PUBLISHED = {
    "qwen3.5-4b": (4.2e9, None, 0.06),  # the text model of the 4B (its vision tower is not served)
    "qwen3.5-27b": (27e9, None, 0.03),
    "qwen3.5-35b-a3b": (35e9, 3.4e9, 0.03),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 0.02),  # model card: 30.5B total, 3.3B activated
    "smollm2-135m": (134.5e6, None, 0.01),  # its embedding tied to the LM head: counted once
}


def _params(cfg: ModelConfig) -> int:
    model = _meta_model(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_its_release_parameter_count(name):
    total, active, rel = PUBLISHED[name]
    cfg = registry.model_config(RANDOM_MODELS[name])
    assert _params(cfg) == pytest.approx(total, rel=rel)
    if active is not None:  # the active count reads one embedding row, where the published one counts it all
        read = config_weight_bytes(cfg, 1) + cfg.vocab_size * cfg.hidden_size - cfg.hidden_size
        assert read == pytest.approx(active, rel=rel)


def _reduced(config: dict) -> dict:
    """A preset cut to build on the CPU in a moment: one hybrid period of layers, a small vocabulary and width,
    eight experts; every other key as published."""
    cut = {**config, "num_hidden_layers": 4, "vocab_size": 512, "hidden_size": 64, "head_dim": 32,
           "intermediate_size": 96}
    if "linear_num_value_heads" in config:
        cut.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    if "num_experts" in config:
        cut.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") and 32)
    return cut


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_builds_with_every_weight_drawn_at_a_reduced_size(name):
    model, cfg = random_model_of(_reduced(RANDOM_MODELS[name]), torch.device("cpu"), torch.float32, seed=1)
    assert cfg.architecture == RANDOM_MODELS[name]["architectures"][0]
    for pname, p in model.named_parameters():
        assert torch.isfinite(p).all(), pname
        assert p.dim() == 1 or p.std() > 0, pname  # stacked experts included: drawn, not left as allocated


def _tiny_moe(**over) -> ModelConfig:
    return registry.model_config({**RANDOM_MODELS["tiny-qwen3"], "architectures": ["Qwen3MoeForCausalLM"],
                                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], **over})


def test_moe_decode_reads_attention_router_top_k_experts_embedding_row_and_lm_head():
    """Counted by hand for tiny-qwen3 with 8 experts of 16, top 2: batch 1 reads 2 of 8 experts per layer."""
    cfg = _tiny_moe()
    h, d, v, n = 64, 16, 512, 4
    attention = h * d * (2 * 4 + 2 * 2) + 2 * d  # q, o (4 heads), k, v (2 heads), q/k norms
    router, expert = 8 * h, 3 * h * 16
    per_layer = attention + router + 2 * h  # + the two layer norms
    fixed = n * per_layer + h + v * h + h  # + one embedding row, the LM head, the final norm
    assert config_weight_bytes(cfg, 2) == 2 * (fixed + n * 2 * expert)
    # batch 4: each expert is skipped by all four tokens with probability (6/8)^4
    assert config_weight_bytes(cfg, 1, batch=4) == fixed + n * round(8 * expert * (1 - (6 / 8) ** 4))
    # every expert once the batch is large; a dense model reads everything at any batch
    assert config_weight_bytes(cfg, 1, batch=10_000) == fixed + n * 8 * expert
    dense = registry.model_config(RANDOM_MODELS["tiny-qwen3"])
    assert config_weight_bytes(dense, 1, batch=1) == config_weight_bytes(dense, 1, batch=64)


def test_shared_expert_is_read_every_step():
    without = config_weight_bytes(_tiny_moe(), 1)
    assert config_weight_bytes(_tiny_moe(shared_expert_intermediate_size=24), 1) == without + 3 * 64 * 24 * 4 + 64 * 4


def test_hybrid_kv_covers_its_full_attention_layers_and_its_state_is_per_sequence():
    cfg = registry.model_config(RANDOM_MODELS["qwen3.5-4b"])
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 8 * 2 * 4 * 256 * 2  # 8 of 32 layers keep K and V
    # 24 linear layers: conv state (q, k, v channels x the kernel's 4 columns) and delta-rule state (32 value heads
    # x 128 x 128), float32, read and written
    per_layer = (2 * 16 * 128 + 32 * 128) * 4 + 32 * 128 * 128
    assert state_bytes_per_sequence(cfg) == 2 * 24 * per_layer * 4
    assert state_bytes_per_sequence(registry.model_config(RANDOM_MODELS["qwen3-8b"])) == 0


def test_qwen3_5_4b_drafter_presets_write_the_released_shapes(tmp_path):
    """The MTP preset's stub target carries the 4B's own head (15 tensors, 11 in its gated-attention layer); the
    DFlash preset's config reads as z-lab/Qwen3.5-4B-DFlash's. Written at a reduced width: the shapes' keys are
    what is checked, and the writers are the preset's own."""
    from outrider.bench import drafter_shapes, shapes

    small = {**_reduced(RANDOM_MODELS["qwen3.5-4b"]), "num_hidden_layers": 32}  # (the taps reach layer 29)
    original = shapes.RANDOM_MODELS["qwen3.5-4b"]
    try:
        shapes.RANDOM_MODELS["qwen3.5-4b"] = small  # (the module-level dict the writers read)
        mtp = write_preset("qwen3.5-4b", PRESETS[("qwen3.5-4b", "mtp")], tmp_path / "mtp", torch.float32, 0)
        dflash = write_preset("qwen3.5-4b", PRESETS[("qwen3.5-4b", "dflash")], tmp_path / "dflash", torch.float32, 0)
    finally:
        shapes.RANDOM_MODELS["qwen3.5-4b"] = original
    from safetensors import safe_open

    with safe_open(mtp.target / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert len(names) == 15 and {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                                 "mtp.norm.weight"} < names
    assert json.loads((mtp.target / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    raw = json.loads((dflash.draft / "config.json").read_text())
    config = DFlashConfig.from_dict(raw, 32)
    assert (config.block_size, config.mask_token_id) == (16, 248077)
    assert config.target_layer_ids == (1, 5, 9, 13, 17, 21, 25, 29)
    assert config.layers.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.layers.sliding_window == 4096
    layers = config.layers
    assert (layers.num_attention_heads, layers.num_key_value_heads, layers.head_dim) == (32, 8, 128)
    assert drafter_shapes.preset("qwen3.5-4b", "dflash").layers == 6


@pytest.mark.parametrize("tie", [False, True])
def test_fix_successors_makes_greedy_decoding_decisive(tie):
    """Untied: each token's greedy successor is a fixed random permutation's; tied (Qwen3.5-4B): the token itself."""
    from outrider.bench.shapes import fix_successors
    from tests.test_models_parity import Runner

    model, cfg = random_model_of({**RANDOM_MODELS["tiny-qwen3"], "tie_word_embeddings": tie}, torch.device("cpu"),
                                 torch.float32, seed=3)
    model.tie_weights()
    fix_successors(model, seed=4)
    tokens = [3, 77, 150, 401]
    logits = Runner(model, cfg, len(tokens)).step([[t] for t in tokens])
    got = [int(lg[-1].argmax()) for lg in logits]
    if tie:
        assert got == tokens
    else:
        successor = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(4))
        assert got == [int(successor[t]) for t in tokens]


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_stub_checkpoint_ends_generation_on_a_token_its_tokenizer_has(name, tmp_path):
    from transformers import AutoTokenizer

    stub = write_stub_checkpoint(name, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(stub)
    for config in (registry.load_config(stub), registry.model_config(RANDOM_MODELS[name])):  # stub, random weights
        assert all(token < len(tokenizer) for token in config.eos_token_id)
