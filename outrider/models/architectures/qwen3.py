"""Qwen3 (dense): the shared decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.models.registry import Architecture, register


QWEN3 = register(Architecture(
    name="qwen3", hf_names=("Qwen3ForCausalLM",), model_type="qwen3", model=CausalLM, decoder_layer=DecoderLayer,
    config=lambda raw: {"qk_norm": True}, gguf_names=("qwen3",),
    tiny_config={"use_sliding_window": False, "sliding_window": None, "attention_bias": False},
))
