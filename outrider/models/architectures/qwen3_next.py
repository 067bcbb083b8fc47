"""Qwen3-Next (Qwen3-Next-80B-A3B): the hybrid decoder (models/hybrid.py) with Qwen3-Next's interleaved linear
projections (in_proj_qkvz, in_proj_ba) and a MoE block with a gated shared expert in every sparse layer. Its MTP
head (`mtp.*`) ships in the checkpoint and is left to the MTP drafter. GGUF: llama.cpp's `qwen3next`
(models/hybrid_gguf.py), whose split projections the layer reads as they are."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from outrider.layers.gated_deltanet import QWEN3_NEXT_GGUF_PROJECTIONS, QWEN3_NEXT_PROJECTIONS
from outrider.models.hybrid import HybridCausalLM, hybrid_config_fields, hybrid_layer, one_centered_norms
from outrider.models.hybrid_gguf import LINEAR_GGUF_TENSORS, hybrid_to_gguf, linear_from_gguf, linear_gguf_config
from outrider.models.moe_gguf import MOE_GGUF_TENSORS, SHARED_EXPERT_GGUF_TENSORS, moe_gguf_config
from outrider.models.registry import Architecture, register


def qwen3_next_gguf_config(hparam: Callable[..., Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    return {**linear_gguf_config(hparam, tensors), **moe_gguf_config(hparam, tensors),
            "linear_projections": list(QWEN3_NEXT_GGUF_PROJECTIONS)}


QWEN3_NEXT = register(Architecture(
    name="qwen3_next", hf_names=("Qwen3NextForCausalLM",), model_type="qwen3_next", model=HybridCausalLM,
    decoder_layer=functools.partial(hybrid_layer, projections=QWEN3_NEXT_PROJECTIONS), config=hybrid_config_fields,
    from_checkpoint=one_centered_norms, gguf_names=("qwen3next",), gguf_config=qwen3_next_gguf_config,
    gguf_layer_tensors={**LINEAR_GGUF_TENSORS, **MOE_GGUF_TENSORS, **SHARED_EXPERT_GGUF_TENSORS},
    gguf_tensor=functools.partial(linear_from_gguf, tiled_value_heads=False),
    gguf_write=functools.partial(hybrid_to_gguf, tiled_value_heads=False),
    tiny_config={"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                 "partial_rotary_factor": 0.25, "num_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
                 "router_aux_loss_coef": 0.0},
))
