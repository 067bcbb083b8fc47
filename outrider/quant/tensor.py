"""QuantizedTensor: one format's tensors for some rows of a weight (the part a QuantizedWeight, quant/weight.py,
stacks; what the CUDA kernels, kernels/quant_gemm.py, read), and quantize_fp8, which makes one from a dense weight
(--quantization fp8, test and benchmark checkpoints)."""

from __future__ import annotations

import torch
from torch import nn

from outrider.quant.dequant import dequantize_fp8, dequantize_gguf, dequantize_int4, fp8_scale_per_value
from outrider.quant.formats import FP8_MAX, FP8Format, GGUFFormat, QuantFormat


class QuantizedTensor(nn.Module):
    """Rows [N, K] of a weight in one format: `data` (the blocks, or FP8 / packed INT4 values), and for FP8 and
    INT4 `scale` (and INT4 `zero`) as formats.py describes. GGUF blocks whose format keeps its d's as a plane
    (GGUFFormat.d_at) are given whole as `data` and split here (data and scale given: the planes already)."""

    def __init__(self, fmt: QuantFormat, shape: tuple[int, int], data: torch.Tensor,
                 scale: torch.Tensor | None = None, zero: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = shape
        if not fmt.supports(n, k):
            raise ValueError(f"{fmt.name} cannot store a [{n}, {k}] weight")
        if isinstance(fmt, GGUFFormat) and fmt.d_at is not None and scale is None:
            data, scale = _split_d(fmt, data)
        self.format, self.shape = fmt, (n, k)
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        if isinstance(self.format, GGUFFormat):
            return dequantize_gguf(self.format, self.blocks())
        if isinstance(self.format, FP8Format):
            return dequantize_fp8(self.format, self.data, self.scale)
        return dequantize_int4(self.format, self.data, self.scale, self.zero)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [T, K]: the rows `ids` (an embedding lookup), dequantizing only those (GGUF formats)."""
        if not isinstance(self.format, GGUFFormat):
            return self.dequantize().index_select(0, ids)
        return dequantize_gguf(self.format, self.blocks(ids))

    def blocks(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """GGUF formats: the rows' blocks as the file stores them (all rows, or those of `ids`)."""
        data, d = self.data, self.scale
        if ids is not None:
            data, d = data.index_select(0, ids), None if d is None else d.index_select(0, ids)
        if d is None:
            return data
        fmt = self.format
        body = data.unflatten(-1, (-1, fmt.stored_block))
        at = fmt.d_at
        d = d.contiguous().view(torch.uint8).unflatten(-1, (-1, 2))
        return torch.cat([body[..., :at], d, body[..., at:]], -1).flatten(-2)

    def can_stack(self, other: QuantizedTensor) -> bool:
        """Whether `other`'s rows may follow this one's in a single tensor (same format, scale tiles unbroken)."""
        if other.format != self.format or other.shape[1] != self.shape[1]:
            return False
        return not isinstance(self.format, FP8Format) or self.shape[0] % self.format.block_n == 0

    def stack(self, other: QuantizedTensor) -> QuantizedTensor:
        cat = [None if a is None else torch.cat([a, b]) for a, b in
               ((self.data, other.data), (self.scale, other.scale), (self.zero, other.zero))]
        return QuantizedTensor(self.format, (self.shape[0] + other.shape[0], self.shape[1]), *cat)


def _split_d(fmt: GGUFFormat, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 blocks [N, K / block * type_size] -> (the blocks without d [N, K / block * stored_block], d float16
    [N, K / block])."""
    b = blocks.unflatten(-1, (-1, fmt.type_size))
    at = fmt.d_at
    body = torch.cat([b[..., :at], b[..., at + 2:]], -1).flatten(-2).contiguous()
    return body, b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def quantize_fp8(w: torch.Tensor, fmt: FP8Format = FP8Format(1, 0)) -> QuantizedTensor:
    """A dense weight [N, K] -> FP8 with a float32 scale per fmt's tile (default: per output channel), each tile's
    largest magnitude at FP8_MAX."""
    n, k = w.shape
    rows, cols = fmt.scale_shape(n, k)
    bk = fmt.block_k or k
    tiles = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * fmt.block_n - n)).view(
        rows, fmt.block_n, cols, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    data = (w.float() / fp8_scale_per_value(fmt, scale, n, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedTensor(fmt, (n, k), data, scale)
