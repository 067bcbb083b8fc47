"""Qwen3.5 (dense): the hybrid decoder (models/hybrid.py) with Qwen3.5's separate linear projections (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a) and a dense SwiGLU. Released as `Qwen3_5ForConditionalGeneration` (a vision
tower beside the text model, whose weights sit under `model.language_model.` and keys under `text_config`):
served as text only, the vision tower not loaded. A text-only `Qwen3_5ForCausalLM` checkpoint loads too. Text
positions are the same on mRoPE's three axes, where mRoPE is plain RoPE. The MTP head (`mtp.*`) is left to the
MTP drafter. GGUF: llama.cpp's `qwen35` (models/hybrid_gguf.py)."""

from __future__ import annotations

import functools

from outrider.layers.gated_deltanet import QWEN3_5_PROJECTIONS
from outrider.models.hybrid import HybridCausalLM, hybrid_config_fields, hybrid_layer, one_centered_norms
from outrider.models.hybrid_gguf import LINEAR_GGUF_TENSORS, hybrid_to_gguf, linear_from_gguf, linear_gguf_config
from outrider.models.registry import Architecture, register

QWEN3_5 = register(Architecture(
    name="qwen3_5", hf_names=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), model_type="qwen3_5_text",
    model=HybridCausalLM, decoder_layer=functools.partial(hybrid_layer, projections=QWEN3_5_PROJECTIONS),
    config=hybrid_config_fields, text_config=True, tensor_renames=(("model.language_model.", "model."),),
    ignored_prefixes=("model.visual.",), from_checkpoint=one_centered_norms, gguf_names=("qwen35",),
    gguf_config=linear_gguf_config, gguf_layer_tensors=LINEAR_GGUF_TENSORS,
    gguf_tensor=functools.partial(linear_from_gguf, tiled_value_heads=True),
    gguf_write=functools.partial(hybrid_to_gguf, tiled_value_heads=True),
    tiny_config={"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                 "attention_bias": False},
))
