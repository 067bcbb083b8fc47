"""Phi-3 / Phi-3.5 (dense): the shared decoder over checkpoints that store qkv_proj and gate_up_proj packed, with
LongRoPE (`longrope`, formerly `su`) for the long-context releases and a sliding window on every layer where the
config sets one (Phi-3-mini: 2047)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from outrider.layers.rotary import rope_attention_factor
from outrider.models.architectures.mistral import every_layer_slides
from outrider.config import ModelConfig
from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.models.registry import Architecture, register


def config(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"Phi-3 with partial_rotary_factor {raw['partial_rotary_factor']} (RoPE on part of each "
                         "head, Phi-4-mini) is not supported")
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("su", "yarn", "longrope"):  # (transformers reads all three as LongRoPE for Phi-3)
        original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings",
                                                                                4096)
        scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}
        return {**every_layer_slides(raw, default=None), "rope_scaling": scaling}
    return every_layer_slides(raw, default=None)


def gguf_config(hparam: Callable[..., Any], values: Callable[[str], list[float] | None]) -> dict[str, Any]:
    """llama.cpp's converter writes LongRoPE as rope_factors_long/short tensors and the original context; a window
    of 0 means none (Phi-4)."""
    out: dict[str, Any] = {"sliding_window": hparam("attention.sliding_window", 0) or None}
    long, short = values("rope_factors_long.weight"), values("rope_factors_short.weight")
    if long is not None and short is not None:
        original = hparam("rope.scaling.original_context_length")
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                               "original_max_position_embeddings": original}
    return out


def gguf_write(writer: Any, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As llama.cpp's converter: the window (0: none), and LongRoPE's factors as tensors with its attention factor;
    the weights as they are."""
    import numpy as np

    writer.add_sliding_window(cfg.sliding_window or 0)
    writer.add_rope_dimension_count(cfg.head_dim)
    if cfg.rope_scaling:
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(rope_attention_factor(cfg.rope_scaling, cfg.max_position_embeddings))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(cfg.rope_scaling[f"{kind}_factor"],
                                                                        dtype=np.float32))
    return tensors


PHI3 = register(Architecture(
    name="phi3", hf_names=("Phi3ForCausalLM",), model_type="phi3", model=CausalLM, decoder_layer=DecoderLayer,
    config=config, packed_projections=True, gguf_names=("phi3",), gguf_config=gguf_config, gguf_write=gguf_write,
    gguf_layer_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    tiny_config={"sliding_window": None, "pad_token_id": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
))
