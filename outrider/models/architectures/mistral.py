"""Mistral: the shared decoder, every layer attending over a sliding window when the config sets `sliding_window`
(Mistral 7B v0.1: 4096; later releases set null). llama.cpp converts Mistral checkpoints as `llama` files, which
carry no window: such a file loads as Llama."""

from __future__ import annotations

from typing import Any

from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.models.registry import Architecture, register


def every_layer_slides(raw: dict[str, Any], default: int | None) -> dict[str, Any]:
    """ModelConfig fields for a config whose `sliding_window` (else `default`) applies to every layer."""
    window = raw.get("sliding_window", default)
    if window is None:
        return {}
    return {"layer_types": ("sliding_attention",) * raw["num_hidden_layers"], "sliding_window": int(window)}


MISTRAL = register(Architecture(
    name="mistral", hf_names=("MistralForCausalLM",), model_type="mistral", model=CausalLM, decoder_layer=DecoderLayer,
    config=lambda raw: every_layer_slides(raw, default=4096),  # (transformers' default when the key is absent)
    gguf_export="llama", gguf_permutes_qk=True, tiny_config={"sliding_window": None},
))
