"""DFlash drafter configs as z-lab releases them (keys and values copied from the released config.json files; no
weights): the older layout (top-level block_size), the newer one (dflash_config.block_size, sliding-window layers,
rope_parameters), and the keys outrider does not understand, refused by name."""

from __future__ import annotations

import pytest
import torch

from outrider.speculative.dflash import DFlashConfig, DFlashModel

_GENERIC = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "attention_bias": False, "attention_dropout": 0.0, "dtype": "bfloat16", "hidden_act": "silu",
            "initializer_range": 0.02, "model_type": "qwen3", "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
            "transformers_version": "4.57.1", "use_cache": True}
# z-lab/Qwen3-8B-DFlash-b16
QWEN3_8B_B16 = {**_GENERIC, "block_size": 16, "bos_token_id": 151643, "eos_token_id": 151645,
                "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
                "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
                "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "max_window_layers": 5,
                "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
                "num_target_layers": 36, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                "use_sliding_window": False, "vocab_size": 151936}
# z-lab/Qwen3.5-27B-DFlash (top-level block_size, the Qwen3.5 vocabulary, no sliding layers)
QWEN3_5_27B = {**_GENERIC, "block_size": 16, "eos_token_id": 248044, "pad_token_id": 248044,
               "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
               "head_dim": 128, "hidden_size": 5120, "intermediate_size": 17408,
               "layer_types": ["full_attention"] * 5, "max_position_embeddings": 262144, "max_window_layers": 5,
               "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 64,
               "rope_scaling": None, "rope_theta": 10000000, "sliding_window": None, "use_sliding_window": False,
               "vocab_size": 248320}
# z-lab/Qwen3.5-4B-DFlash: block size under dflash_config, five sliding layers and a full one, rope_parameters
QWEN3_5_4B = {**_GENERIC, "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                                            "target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29]},
              "head_dim": 128, "hidden_size": 2560, "intermediate_size": 9216,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "max_position_embeddings": 262144,
              "num_attention_heads": 32, "num_hidden_layers": 6, "num_key_value_heads": 8, "num_target_layers": 32,
              "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"}, "sliding_window": 4096,
              "use_sliding_window": True, "vocab_size": 248320}


def _small(raw: dict, **shape) -> dict:
    """The config at a size the CPU builds in a moment: layer count, taps and vocabulary kept."""
    return {**raw, "hidden_size": 64, "intermediate_size": 96, "head_dim": 16, "num_attention_heads": 4,
            "num_key_value_heads": 2, **shape}


@pytest.mark.parametrize(("raw", "target_layers", "block", "mask", "taps"), [
    (QWEN3_8B_B16, 36, 16, 151669, (1, 9, 17, 25, 33)),
    (QWEN3_5_27B, 64, 16, 248070, (1, 16, 31, 46, 61)),
    (QWEN3_5_4B, 32, 16, 248077, (1, 5, 9, 13, 17, 21, 25, 29)),
])
def test_released_configs_parse_to_their_block_mask_and_taps(raw, target_layers, block, mask, taps):
    config = DFlashConfig.from_dict(raw, target_layers)
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (block, mask, taps)
    assert config.layers.rope_theta == raw.get("rope_theta", 10000000)
    assert config.layers.num_hidden_layers == raw["num_hidden_layers"]


def test_the_newer_releases_sliding_layers_attend_within_their_window():
    config = DFlashConfig.from_dict(_small(QWEN3_5_4B), 32)
    with torch.device("meta"):
        model = DFlashModel(config.layers, 8 * 64)
    assert [layer.self_attn.window for layer in model.layers] == [4096] * 5 + [0]
    assert model.fc.in_features == 8 * 64  # the eight taps, fused


def test_use_sliding_window_false_makes_every_layer_full_attention():
    raw = _small({**QWEN3_5_4B, "use_sliding_window": False})
    with torch.device("meta"):
        model = DFlashModel(DFlashConfig.from_dict(raw, 32).layers, 8 * 64)
    assert [layer.self_attn.window for layer in model.layers] == [0] * 6


@pytest.mark.parametrize(("change", "message"), [
    ({"resolution_scale": 1.0}, "does not understand: resolution_scale"),
    ({"dflash_config": {**QWEN3_5_4B["dflash_config"], "conv_group_size": 16, "selector_top_k": 16}},
     "dflash_config.conv_group_size, dflash_config.selector_top_k"),
    ({"block_size": 8}, r"one block size .*\[8, 16\]"),
    ({"dflash_config": {"mask_token_id": 248077}}, "one block size .*none"),
    ({"dflash_config": {"block_size": 16}}, "needs dflash_config.mask_token_id"),
    ({"is_causal": True}, "is_causal"),
    ({"dflash_config": {**QWEN3_5_4B["dflash_config"], "target_layer_ids": [1, 32]}}, "outside the target's 32"),
])
def test_a_key_or_value_outrider_does_not_understand_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_dict({**QWEN3_5_4B, **change}, 32)
