"""Qwen3.5-MoE: the Qwen3.5 hybrid decoder (models/hybrid.py, Qwen3.5's linear projections) with a MoE block and
gated shared expert in every layer (top-k weights always renormalised), experts stored fused per layer
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) as the release has them. Served as text
only, like Qwen3.5 (architectures/qwen3_5.py). GGUF: llama.cpp's `qwen35moe` (models/hybrid_gguf.py), experts kept
fused (`ffn_gate_up_exps`)."""

from __future__ import annotations

import functools

from outrider.layers.gated_deltanet import QWEN3_5_PROJECTIONS
from outrider.models.hybrid import HybridCausalLM, hybrid_config_fields, hybrid_layer, one_centered_norms
from outrider.models.hybrid_gguf import LINEAR_GGUF_TENSORS, hybrid_to_gguf, linear_from_gguf, linear_gguf_config
from outrider.models.moe_gguf import FUSED_MOE_GGUF_TENSORS, SHARED_EXPERT_GGUF_TENSORS, moe_gguf_config
from outrider.models.registry import Architecture, register

QWEN3_5_MOE = register(Architecture(
    name="qwen3_5_moe", hf_names=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    model_type="qwen3_5_moe_text", model=HybridCausalLM,
    decoder_layer=functools.partial(hybrid_layer, projections=QWEN3_5_PROJECTIONS, fused_experts=True),
    config=hybrid_config_fields, text_config=True, tensor_renames=(("model.language_model.", "model."),),
    ignored_prefixes=("model.visual.",), from_checkpoint=one_centered_norms, gguf_names=("qwen35moe",),
    gguf_config=lambda hparam, tensors: {**linear_gguf_config(hparam, tensors), **moe_gguf_config(hparam, tensors)},
    gguf_layer_tensors={**LINEAR_GGUF_TENSORS, **FUSED_MOE_GGUF_TENSORS, **SHARED_EXPERT_GGUF_TENSORS},
    gguf_tensor=functools.partial(linear_from_gguf, tiled_value_heads=True),
    gguf_write=functools.partial(hybrid_to_gguf, tiled_value_heads=True),
    tiny_config={"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                 "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 32, "attention_bias": False, "router_aux_loss_coef": 0.0},
))
