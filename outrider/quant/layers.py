"""Modules holding quantized weights, in place of Linear / MergedLinear / nn.Embedding: the same attributes the
model reads (weight, bias, parts, sizes), the weight a QuantizedWeight that ops dispatches on."""

from __future__ import annotations

import torch
from torch import nn

from outrider.kernels import ops
from outrider.quant.weight import QuantizedWeight


class QuantizedLinear(nn.Module):
    """A projection (or a packed one: `parts` maps checkpoint module names to rows, as MergedLinear's)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 parts: dict[str, int] | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.parts = parts
        self.sizes = list(parts.values()) if parts else [self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.embedding(ids.flatten()).view(*ids.shape, self.embedding_dim)
