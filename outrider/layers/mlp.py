"""The gated feed-forward block (SwiGLU of Llama-family models, GeGLU of Gemma), gate and up packed into one
projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outrider.kernels import ops
from outrider.layers.linear import Linear, MergedLinear, stack_merged_parts
from outrider.layers.norm import RMSNorm


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # HF's hidden_act names


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.register_load_state_dict_pre_hook(stack_merged_parts)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm SwiGLU of the stream x + residual (residual None: x alone) -> (down_proj's output, x +
        residual). The residual add and `norm` go into gate_up_proj's GEMM, the activation into down_proj's
        (two kernels at decode)."""
        gate_up, residual = norm.forward_linear(x, residual, self.gate_up_proj)
        if self.activation == "silu":
            return ops.silu_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias), residual
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up), residual
