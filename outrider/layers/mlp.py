"""The SwiGLU feed-forward block of Llama-family models, gate and up packed into one projection."""

from __future__ import annotations

import torch
from torch import nn

from outrider.kernels import ops
from outrider.layers.linear import Linear, MergedLinear, stack_merged_parts


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.register_load_state_dict_pre_hook(stack_merged_parts)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up) from gate_up_proj's output: the decoder layer runs gate_up_proj itself, with
        its norm fused into that GEMM."""
        # The activation goes into down_proj's GEMM (one launch fewer at decode); weight and bias stay down_proj's.
        return ops.silu_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias)
