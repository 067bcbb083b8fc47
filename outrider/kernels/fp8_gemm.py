"""FP8 weights past FUSED_MAX_ROWS (prefill) on the FP8 tensor cores, as vLLM and SGLang serve FP8 checkpoints:
x quantized to float8_e4m3fn in one Triton launch, per token and 128 columns against 128 x 128 block scales
(DeepSeek-V3's and Qwen3-FP8's layout) or per token against per-channel scales (`--quantization fp8`), then
torch's `scaled_mm` (cuBLAS) with both sides' scales. Rows up to FUSED_MAX_ROWS (decode, verify) keep 16-bit x on
the fused kernels (quant_gemm.py). Where this torch, cuBLAS or card lacks the scaling (checked once per device and
recipe on a small product, never inside graph capture), the product keeps quant_gemm's dequantize-then-cuBLAS
path and the log says so once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from outrider.kernels.launch import cuda_properties
from outrider.quant.formats import FP8_MAX, FP8Format
from outrider.quant.tensor import QuantizedTensor, quantize_fp8

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
GROUP = 128  # x's values a scale (block-wise recipe): W's scale blocks' width
ROW_ALIGN = 16  # x's rows are padded to this: its scales lie with M's stride 1, 16-byte aligned per column
SCALE_ALIGN = 4  # cuBLAS wants W's block scales [K / 128, N / 128] (K's stride 1) with K / 128 a multiple of this
X_SCALE_TINY = torch.finfo(torch.float32).tiny  # x's scale where a group is all zeros


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Compute capability 8.9+ (Ada, Hopper and later): FP8 operands on the tensor cores."""
    props = cuda_properties(device)
    return (props.major, props.minor) >= (8, 9)

_works: dict[tuple[int, bool], bool] = {}


@triton.jit
def _fp8_x_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_sm, stride_sg, FP8_MAX, TINY, GROUP,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Rows [pid_m * BLOCK_M, +BLOCK_M) of x, group pid_g of GROUP columns (K for a scale per row) -> float8 q
    (x / s, rounded to nearest even) and s = max |x| / FP8_MAX (the smallest positive float for a zero group).
    Rows past M read as zeros. Two passes over the group, CHUNK columns at a time: max, then quantize."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, CHUNK)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    inside = (offs_m < M)[:, None]
    start = tl.program_id(1) * GROUP
    amax = tl.zeros((BLOCK_M,), tl.float32)
    for c in range(start, start + GROUP, CHUNK):
        x = tl.load(x_ptr + rows * stride_xm + c + cols, mask=inside, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = tl.maximum(amax / FP8_MAX, TINY)
    tl.store(s_ptr + offs_m * stride_sm + tl.program_id(1) * stride_sg, scale)
    for c in range(start, start + GROUP, CHUNK):
        x = tl.load(x_ptr + rows * stride_xm + c + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(q_ptr + rows * K + c + cols, (x / scale[:, None]).to(q_ptr.dtype.element_ty))


def _recipe(fmt: FP8Format) -> bool | None:
    """True: 128 x 128 block scales; False: a scale per output channel; None: neither (no FP8 GEMM)."""
    return {(GROUP, GROUP): True, (1, 0): False}.get((fmt.block_n, fmt.block_k))


def quantize_x_fp8(x: torch.Tensor, block_wise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit) -> (q float8 [M', K], scales float32 [M', K / 128] or [M', 1], M's stride 1), M' = M
    rounded up to ROW_ALIGN (those rows zero)."""
    m, k = x.shape
    rows = triton.cdiv(m, ROW_ALIGN) * ROW_ALIGN
    groups = k // GROUP if block_wise else 1
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty_strided((rows, groups), (1, rows), dtype=torch.float32, device=x.device)
    _fp8_x_kernel[(rows // ROW_ALIGN, groups)](x, q, scale, m, k, x.stride(0), scale.stride(0), scale.stride(1),
                                               FP8_MAX, X_SCALE_TINY, GROUP if block_wise else k,
                                               BLOCK_M=ROW_ALIGN, CHUNK=GROUP)
    return q, scale


def _scaled_mm(q: torch.Tensor, x_scale: torch.Tensor, part: QuantizedTensor, block_wise: bool) -> torch.Tensor:
    """bf16 [M', N] = (q x_scale) @ (W w_scale).T."""
    from torch.nn.functional import ScalingType

    w_scale = part.scale.t() if block_wise else part.scale.reshape(1, -1)
    recipe_x, recipe_w = ((ScalingType.BlockWise1x128, ScalingType.BlockWise128x128) if block_wise
                          else (ScalingType.RowWise, ScalingType.RowWise))
    return F.scaled_mm(q, part.data.t(), x_scale, recipe_x, w_scale, recipe_w, output_dtype=torch.bfloat16)


def _fp8_mm_works(device: torch.device, block_wise: bool) -> bool:
    """Whether scaled_mm takes this recipe on the device: tried once on a small product against its dequantized
    reference (not inside graph capture, where an unchecked recipe counts as missing)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), block_wise)
    if key not in _works:
        if torch.cuda.is_current_stream_capturing():
            return False
        _works[key] = _try_recipe(device, block_wise)
    return _works[key]


def _try_recipe(device: torch.device, block_wise: bool) -> bool:
    fmt = FP8Format(GROUP, GROUP) if block_wise else FP8Format(1, 0)
    gen = torch.Generator().manual_seed(0)
    part = quantize_fp8(torch.randn(256, 512, generator=gen), fmt).to(device)
    x = torch.randn(20, 512, generator=gen).to(device, torch.bfloat16)
    try:
        q, s = quantize_x_fp8(x, block_wise)
        y = _scaled_mm(q, s, part, block_wise)[:20].float()
    except (RuntimeError, NotImplementedError, ValueError) as e:
        log.warning("FP8 prefill products keep dequantized weights on %s (%s scales): scaled_mm refused: %s",
                    torch.cuda.get_device_name(device), fmt.name, e)
        return False
    ref = x.float() @ part.dequantize().t()
    if (y - ref).abs().max() > 0.1 * ref.abs().max():
        log.warning("FP8 prefill products keep dequantized weights on %s (%s scales): scaled_mm's result is off",
                    torch.cuda.get_device_name(device), fmt.name)
        return False
    return True


def takes_fp8_mm(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether x's product with the part runs on the FP8 tensor cores: bf16 x on CUDA, compute capability 8.9+,
    an FP8 part of 128 x 128 block scales (N a multiple of 128, K of 512) or per-channel ones (N a multiple of 16),
    a recipe that works here."""
    fmt = part.format
    if not (isinstance(fmt, FP8Format) and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    block_wise = _recipe(fmt)
    n, k = part.shape
    if block_wise is None or n % (GROUP if block_wise else 16) or block_wise and k % (SCALE_ALIGN * GROUP):
        return False
    return has_fp8_tensor_cores(x.device) and _fp8_mm_works(x.device, block_wise)


def fp8_mm(x: torch.Tensor, part: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 [M, N] = x @ part.T (+ bias), where takes_fp8_mm (the first M rows of scaled_mm's padded output: a
    contiguous view)."""
    block_wise = bool(_recipe(part.format))
    q, scale = quantize_x_fp8(x, block_wise)
    y = _scaled_mm(q, scale, part, block_wise)[:x.shape[0]]
    return y if bias is None else y.add_(bias)
