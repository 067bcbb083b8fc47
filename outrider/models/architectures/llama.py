"""Llama (Llama 2 and 3, incl. Llama 3's RoPE rule): the shared decoder as it is."""

from __future__ import annotations

from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.models.registry import Architecture, register


LLAMA = register(Architecture(
    name="llama", hf_names=("LlamaForCausalLM",), model_type="llama", model=CausalLM, decoder_layer=DecoderLayer,
    gguf_names=("llama",), gguf_permutes_qk=True,
    tiny_config={"mlp_bias": False, "pretraining_tp": 1, "attention_bias": False},
))
