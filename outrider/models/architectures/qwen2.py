"""Qwen2 / Qwen2.5: the shared decoder with biases on q/k/v (not on o), always."""

from __future__ import annotations

from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.models.registry import Architecture, register

QWEN2 = register(Architecture(
    name="qwen2", hf_names=("Qwen2ForCausalLM",), model_type="qwen2", model=CausalLM, decoder_layer=DecoderLayer,
    config=lambda raw: {"attention_bias": True, "o_proj_bias": False}, gguf_names=("qwen2",),
    tiny_config={"use_sliding_window": False, "sliding_window": None},
))
