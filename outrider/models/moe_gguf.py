"""llama.cpp's MoE tensors and keys (qwen3moe, qwen3next, qwen35moe), read into layers/moe.py's layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# Per-layer MoE tensors; "{e}" marks a tensor holding every expert (one per row of its first axis).
MOE_GGUF_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                    "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj"}
# Checkpoints whose experts are fused per layer (layers/moe.Experts.fused_checkpoint) keep them so in GGUF.
FUSED_MOE_GGUF_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
                          "ffn_down_exps.weight": "mlp.experts.down_proj"}
SHARED_EXPERT_GGUF_TENSORS = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                              "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                              "ffn_up_shexp": "mlp.shared_expert.up_proj",
                              "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def moe_gguf_config(hparam: Callable[..., Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE keys of a llama.cpp MoE file (top-k weights renormalised unless it says otherwise)."""
    return {"num_experts": hparam("expert_count"), "num_experts_per_tok": hparam("expert_used_count"),
            "moe_intermediate_size": hparam("expert_feed_forward_length"),
            "shared_expert_intermediate_size": hparam("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": bool(hparam("expert_weights_norm", True))}
