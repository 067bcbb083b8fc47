"""llama.cpp's GGUF files of the hybrid models (`qwen35`, `qwen3next`), read back into our layout.

The converter stores the linear-attention config under Mamba's ssm.* keys, A as -exp(A_log), dt_bias as
`ssm_dt.bias`, the conv kernel squeezed and RMSNorm weights as (1 + w). For Qwen3.5, where key heads are fewer
than value heads, it also reorders the value heads of every linear tensor from grouped by key head to tiled (v0
of each group, then v1, ...); for Qwen3-Next it splits in_proj_qkvz into attn_qkv and attn_gate, keeping ssm_ba
interleaved (layers/gated_deltanet.QWEN3_NEXT_GGUF_PROJECTIONS). Its MTP layers come as extra blocks, which the
target skips (models/gguf.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from outrider.config import ModelConfig

LINEAR_GGUF_TENSORS = {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
                       "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
                       "ssm_alpha": "linear_attn.in_proj_a", "ssm_ba": "linear_attn.in_proj_ba",
                       "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
                       "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
                       "ssm_out": "linear_attn.out_proj"}


def linear_gguf_config(hparam: Callable[..., Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The hybrid keys of a qwen35 / qwen3next file."""
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


def linear_from_gguf(name: str, t: torch.Tensor, cfg: ModelConfig, tiled_value_heads: bool) -> torch.Tensor:
    """A GGUF tensor of a linear-attention layer -> our parameter's value (the architecture's gguf_tensor)."""
    if ".linear_attn." not in name:
        return t
    raw = cfg.raw
    hk, hv, dk, dv = (raw["linear_num_key_heads"], raw["linear_num_value_heads"], raw["linear_key_head_dim"],
                      raw["linear_value_head_dim"])
    if name.endswith(".A_log"):
        t = torch.log(-t)
    if not tiled_value_heads or hk == hv:
        return t
    qk = 2 * hk * dk
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return torch.cat([t[:qk], grouped_value_heads(t[qk:], 0, hk, dv)])
    if name.endswith(".in_proj_z.weight"):
        return grouped_value_heads(t, 0, hk, dv)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return grouped_value_heads(t, 0, hk, 1)
    if name.endswith(".out_proj.weight"):
        return grouped_value_heads(t, 1, hk, dv)
    return t


def hybrid_to_gguf(writer: Any, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                   tiled_value_heads: bool) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter does to a Qwen3.5 (or Qwen3-Next) checkpoint beyond renaming (the
    architecture's gguf_write, for the test writer, testing/gguf.py): hybrid metadata under ssm.* keys; the MTP head
    dropped; A stored as -exp(A_log), dt_bias as dt_proj.bias, the conv kernel squeezed, (1 + w) norms as 1 + w.
    Qwen3.5 (`tiled_value_heads`): value heads of the linear layers reordered from grouped by key head to tiled.
    Qwen3-Next: in_proj_qkvz split into all-heads q|k|v and z (in_proj_ba kept)."""
    raw = cfg.raw
    hk, hv, dk, dv = (raw["linear_num_key_heads"], raw["linear_num_value_heads"], raw["linear_key_head_dim"],
                      raw["linear_value_head_dim"])
    writer.add_ssm_conv_kernel(raw["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(hk)
    writer.add_ssm_time_step_rank(hv)
    writer.add_ssm_inner_size(hv * dv)
    writer.add_full_attention_interval(raw["full_attention_interval"])
    factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    writer.add_rope_dimension_count(int(cfg.head_dim * factor))
    if tiled_value_heads:
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if raw.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(raw["shared_expert_intermediate_size"])

    def tiled(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:  # [Hk, r, d] -> [r, Hk, d] along dim
        shape = t.shape
        return t.reshape(*shape[:dim], hk, hv // hk, head_dim, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)

    out = {}
    for name, t in tensors.items():
        if name.startswith("mtp."):
            continue
        if name.endswith(".in_proj_qkvz.weight"):  # [Hk, (q, k, v, z)] rows -> q|k|v of all heads, z of all heads
            q, k, v, z = t.reshape(hk, -1, t.shape[-1]).split([dk, dk, dv * hv // hk, dv * hv // hk], dim=1)
            stem = name.removesuffix("qkvz.weight")
            out[stem + "qkv.weight"] = torch.cat([p.reshape(-1, t.shape[-1]) for p in (q, k, v)])
            out[stem + "z.weight"] = z.reshape(-1, t.shape[-1])
            continue
        if ".linear_attn." in name:
            if tiled_value_heads and name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
                t = t.reshape(t.shape[0], -1)
                t = torch.cat([t[:2 * hk * dk], tiled(t[2 * hk * dk:], 0, dv)])
            elif tiled_value_heads and name.endswith(".in_proj_z.weight"):
                t = tiled(t, 0, dv)
            elif tiled_value_heads and name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
                t = tiled(t, 0, 1)
            elif tiled_value_heads and name.endswith(".out_proj.weight"):
                t = tiled(t, 1, dv)
            if name.endswith(".conv1d.weight"):
                t = t.reshape(t.shape[0], -1)
            if name.endswith(".A_log"):
                t = -torch.exp(t)
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif name.endswith("norm.weight"):
            t = t + 1
        out[name] = t
    return out
