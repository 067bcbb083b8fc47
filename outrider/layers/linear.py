"""Projections: nn.Linear through ops.linear (skinny Triton GEMM at decode), and packed projections: sibling
checkpoint matrices that read the same input, stacked so one GEMM does them all."""

from __future__ import annotations

import torch
from torch import nn

from outrider.kernels import ops


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose forward goes through ops.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Output rows of several checkpoint projections in one weight, e.g. qkv_proj = [q_proj; k_proj; v_proj].

    `parts` maps each checkpoint module name (a sibling of this module) to its rows, in packing order."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts
        self.sizes = list(parts.values())  # for Tensor.split, built once rather than per forward


def stack_merged_parts(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_) -> None:
    """load_state_dict pre-hook for the parent of MergedLinears: checkpoint-named parts become packed tensors."""
    # On the parent, not the MergedLinear: load_state_dict hands a child only the keys under its own name.
    for name, child in module.named_children():
        if isinstance(child, MergedLinear):
            for kind in ("weight", "bias"):
                keys = [f"{prefix}{part}.{kind}" for part in child.parts]
                if all(k in state_dict for k in keys):
                    state_dict[f"{prefix}{name}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])
