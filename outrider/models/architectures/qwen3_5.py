"""Qwen3.5 (dense): the hybrid decoder (models/hybrid.py) with Qwen3.5's separate linear projections (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a) and a dense SwiGLU. Released as `Qwen3_5ForConditionalGeneration` (a vision
tower beside the text model, whose weights sit under `model.language_model.` and keys under `text_config`):
served as text only, the vision tower not loaded. A text-only `Qwen3_5ForCausalLM` checkpoint loads too. Text
positions are the same on mRoPE's three axes, where mRoPE is plain RoPE. The MTP head (`mtp.*`) is left to the
MTP drafter.

GGUF (llama.cpp's `qwen35`): the converter stores A as -exp(A_log), dt_bias as `ssm_dt.bias`, the conv kernel
squeezed, norms as (1 + w), and, where key heads are fewer than value heads, the value heads of every linear
tensor in tiled order (v0 of each key group, then v1, ...) instead of grouped by key head; all undone on load.
Its MTP layer comes as an extra block, which the target skips."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from outrider.config import ModelConfig
from outrider.layers.gated_deltanet import QWEN3_5_PROJECTIONS
from outrider.models.hybrid import HybridCausalLM, hybrid_config_fields, hybrid_layer, one_centered_norms
from outrider.models.registry import Architecture, register


def linear_gguf_config(hparam: Callable[..., Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The hybrid keys of a llama.cpp qwen35 / qwen3next file (its ssm.* keys name Mamba's quantities)."""
    value_heads = hparam("ssm.time_step_rank")
    return {"linear_conv_kernel_dim": hparam("ssm.conv_kernel"), "linear_key_head_dim": hparam("ssm.state_size"),
            "linear_num_key_heads": hparam("ssm.group_count"), "linear_num_value_heads": value_heads,
            "linear_value_head_dim": hparam("ssm.inner_size") // value_heads,
            "full_attention_interval": hparam("full_attention_interval"),
            "partial_rotary_factor": hparam("rope.dimension_count") / hparam("attention.key_length"),
            "num_hidden_layers": hparam("block_count") - hparam("nextn_predict_layers", 0)}


def grouped_value_heads(t: torch.Tensor, dim: int, key_heads: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from llama.cpp's tiled order [r, Hk, head_dim] back to grouped [Hk, r, head_dim]."""
    shape = t.shape
    t = t.reshape(*shape[:dim], -1, key_heads, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def linear_from_gguf(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A GGUF tensor of a qwen35 linear-attention layer -> our parameter's value (see the module doc)."""
    if ".linear_attn." not in name:
        return t
    raw = cfg.raw
    hk, hv, dk, dv = (raw["linear_num_key_heads"], raw["linear_num_value_heads"], raw["linear_key_head_dim"],
                      raw["linear_value_head_dim"])
    if name.endswith(".A_log"):
        t = torch.log(-t)
    if hk == hv:
        return t
    regroup = functools.partial(grouped_value_heads, key_heads=hk)
    qk = 2 * hk * dk
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return torch.cat([t[:qk], regroup(t[qk:], 0, head_dim=dv)])
    if name.endswith(".in_proj_z.weight"):
        return regroup(t, 0, head_dim=dv)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return regroup(t, 0, head_dim=1)
    if name.endswith(".out_proj.weight"):
        return regroup(t, 1, head_dim=dv)
    return t


LINEAR_GGUF_TENSORS = {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
                       "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
                       "ssm_alpha": "linear_attn.in_proj_a", "ssm_a": "linear_attn.A_log",
                       "ssm_dt.bias": "linear_attn.dt_bias", "ssm_conv1d": "linear_attn.conv1d",
                       "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}

QWEN3_5 = register(Architecture(
    name="qwen3_5", hf_names=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), model_type="qwen3_5_text",
    model=HybridCausalLM, decoder_layer=functools.partial(hybrid_layer, projections=QWEN3_5_PROJECTIONS),
    config=hybrid_config_fields, text_config=True, tensor_renames=(("model.language_model.", "model."),),
    ignored_prefixes=("model.visual.",), from_checkpoint=one_centered_norms, gguf_names=("qwen35",),
    gguf_config=linear_gguf_config, gguf_layer_tensors=LINEAR_GGUF_TENSORS, gguf_tensor=linear_from_gguf,
    tiny_config={"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                 "attention_bias": False},
))
