"""Quantized-weight kernels (outrider/kernels/quant_gemm.py) against dequantize-then-matmul in float32: every
format at 1, 5, 16 (fused kernel: decode and verify rows) and 512 rows (dequantized chunks through cuBLAS), packed
parts of different formats with a bias, float32 logits, and CUDA-graph capture.

Tolerance: the kernels round each dequantized weight to x's dtype before the tensor-core product and round the
result once, so |y - ref| stays within TOL[dtype] of max |ref| (float32 accumulation over K <= 1024)."""

from __future__ import annotations

import pytest
import torch

from outrider.quant.formats import GGUF_FORMATS, FP8Format, Int4Format
from outrider.quant.weight import QuantizedWeight
from outrider.quant.writers import random_quantized

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
FORMATS = [*GGUF_FORMATS.values(), FP8Format(128, 128), FP8Format(1, 0), Int4Format(128, "AWQ")]
ROWS = [1, 5, 16, 512]


def _k(fmt) -> int:
    """A K with a partial last loop step: 20 blocks of 32 (steps of 8), 3 of 256, 5 groups of 128."""
    return {32: 640, 256: 768}.get(getattr(fmt, "block", 0), 640)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().t()


def _assert_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (y.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.replace(" ", "_"))
def test_quantized_linear_matches_dequantize_then_matmul(fmt, rows, half, device):
    from outrider.kernels.quant_gemm import quantized_linear

    k = _k(fmt)
    part, _ = random_quantized(fmt, 96, k, seed=rows)
    weight = QuantizedWeight([part], half).to(device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(device, half)
    y = quantized_linear(x, weight)
    assert y.dtype == half and y.shape == (rows, 96)
    _assert_close(y, _reference(x, weight.parts[0].dequantize()), half)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.replace(" ", "_"))
def test_dequantize_kernel_equals_the_torch_dequantizer(fmt, device):
    from outrider.kernels.quant_gemm import dequantize_rows

    k = _k(fmt)
    part, _ = random_quantized(fmt, 40, k, seed=3)
    part = part.to(device)
    out = torch.empty(24, k, dtype=torch.float32, device=device)
    want = part.dequantize()[8:32]
    torch.testing.assert_close(dequantize_rows(part, 8, out), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 16, 512])
def test_packed_parts_of_different_formats_with_bias_and_float32_logits(rows, half, device):
    """A Q4_K_M-style qkv: Q4_K q and k, Q6_K v, each part into its columns of one output, with a bias."""
    from outrider.kernels.quant_gemm import quantized_linear

    q4 = GGUF_FORMATS["Q4_K"]
    parts = [random_quantized(f, n, 512, seed=i)[0] for i, (f, n) in
             enumerate([(q4, 64), (q4, 32), (GGUF_FORMATS["Q6_K"], 32)])]
    weight = QuantizedWeight(parts, half).to(device)
    assert weight.sizes == [96, 32]  # q and k stacked into one part
    bias = torch.randn(128, generator=torch.Generator().manual_seed(2)).to(device, half)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).to(device, half)
    ref = _reference(x, weight.dequantize().float()) + bias.float()
    y = quantized_linear(x, weight, bias, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    _assert_close(y, ref, half)


@pytest.mark.cuda_only
@pytest.mark.parametrize("rows", [1, 16])
def test_quantized_linear_replays_in_a_cuda_graph(rows):
    from outrider.kernels.quant_gemm import quantized_linear

    part, _ = random_quantized(GGUF_FORMATS["Q4_K"], 256, 1024)
    weight = QuantizedWeight([part], torch.bfloat16).cuda()
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    quantized_linear(x, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = quantized_linear(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, quantized_linear(x, weight), rtol=0, atol=0)
