"""RMSNorm through outrider.kernels.ops: one Triton kernel on CUDA (or none: folded into the next projection),
the HF float32 rounding elsewhere."""

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

    def forward_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                       linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual): a pre-norm projection, the residual add and the norm
        fused into one kernel (the projection's, at decode). residual None: norm(x), and x is returned."""
        return ops.rms_norm_linear(x, residual, self.weight, self.eps, linear.weight, linear.bias)
