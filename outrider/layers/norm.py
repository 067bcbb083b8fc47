"""RMSNorm through outrider.kernels.ops: one Triton kernel on CUDA, the HF float32 rounding elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from outrider.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)[0]

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm's kernel."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
