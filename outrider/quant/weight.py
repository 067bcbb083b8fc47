"""Quantized weights kept quantized in memory: QuantizedWeight (a whole weight [N, K], the rows of one or several
QuantizedTensor parts (quant/tensor.py): a packed projection whose parts the file
quantized differently, e.g. Q4_K_M's Q4_K q/k and Q6_K v, keeps a part per format).

A QuantizedWeight stands where a projection's weight tensor stood: outrider.kernels.ops dispatches on it to
`linear`, which runs the fused Triton kernels on CUDA (kernels/quant_gemm.py) and dequantizes on the fly elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from outrider.quant.tensor import QuantizedTensor

if TYPE_CHECKING:
    from outrider.kernels.gemm import RowNorm


class QuantizedWeight(nn.Module):
    """A weight [N, K] as quantized parts stacked by rows (one part unless formats differ), served in `dtype`."""

    def __init__(self, parts: list[QuantizedTensor], dtype: torch.dtype) -> None:
        super().__init__()
        merged = [parts[0]]
        for p in parts[1:]:
            if merged[-1].can_stack(p):
                merged[-1] = merged[-1].stack(p)
            else:
                merged.append(p)
        self.parts = nn.ModuleList(merged)
        self.sizes = [p.shape[0] for p in merged]
        self.shape = (sum(self.sizes), parts[0].shape[1])
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].data.device

    def format_names(self) -> list[str]:
        return [p.format.name for p in self.parts]

    def dequantize(self) -> torch.Tensor:
        """The whole weight [N, K] in `dtype`."""
        return torch.cat([p.dequantize() for p in self.parts]).to(self.dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] -> [T, K] in `dtype` (the weight is an embedding table)."""
        if len(self.parts) != 1:
            raise ValueError("a quantized embedding is stored in one format")
        if ids.is_cuda:  # one kernel, no temporaries per block field (a decode step's lookup runs in its graph)
            from outrider.kernels import quant_gemm

            out = torch.empty(ids.shape[0], self.shape[1], dtype=self.dtype, device=ids.device)
            return quant_gemm.dequantize_rows(self.parts[0], ids, out)
        return self.parts[0].rows(ids).to(self.dtype)

    def takes_prologue(self, x: torch.Tensor) -> bool:
        """Can `linear` make its input from x (a norm, SwiGLU's activation) in the launch that reads x?"""
        if not (x.is_cuda and x.dim() == 2):
            return False
        from outrider.kernels import quant_gemm

        return quant_gemm.takes_prologue(x, list(self.parts))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               out: torch.Tensor | None = None, norm: RowNorm | None = None, silu_mul: bool = False) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias), as ops.linear (out_dtype, out) computes it for a dense W; where takes_prologue,
        of RMSNorm(x [+ residual]) (`norm`) or of silu(gate) * up for x = [gate | up] (`silu_mul`)."""
        from outrider.kernels import ops

        if x.is_cuda and x.dim() == 2:
            from outrider.kernels import quant_gemm

            return quant_gemm.quantized_linear(x, list(self.parts), bias, out_dtype, out, norm, silu_mul)
        if norm is not None or silu_mul:
            raise ValueError("QuantizedWeight.linear folds a norm or activation only on CUDA (takes_prologue)")
        # Elsewhere the dense weight on the fly, one product as for a dense layer: the same numbers.
        return ops.linear(x, self.dequantize(), bias, out_dtype=out_dtype, out=out)
