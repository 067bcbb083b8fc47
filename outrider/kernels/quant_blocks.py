"""What the quantized-weight kernel families share (quant_gemm.py's float tiles, quant_int8x.py's Int8X kernels,
quant_wide.py's wide tiles), so that each family's module holds only its own kernels: the format codes and a
part's kernel view (layout_of, tensors_of), the configs' type and K split (QuantGemmConfig, k_splits), the block
decoders more than one family calls (kquant_values: K-quant blocks in K order), and the output tiles' epilogue.

Where a weight has few output tiles, K is split over several programs (split_k), the last of them adding the
partial sums in a fixed order (rows_result). Q6_K's and Q8_0's blocks are 2-byte aligned, so they come as two
planes (quant/formats.py): the blocks without d, read in wide aligned loads, and the d's.

This module imports none of the kernel modules (they import it): a constant two of them need is declared here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from outrider.quant.formats import FP8Format, GGUFFormat, Int4Format
from outrider.quant.tensor import QuantizedTensor

# Rows up to which the kernels that read the quantized blocks run (decode and verify steps, small batches);
# beyond, a chunk of the weight is dequantized into a scratch buffer and multiplied by cuBLAS (prefill), whose
# tensor-core GEMM outruns the fused kernels once the product is compute-bound.
FUSED_MAX_ROWS = 64

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Format codes of the kernels (constexpr globals: a kernel may read no other kind).
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, INT4, FP8 = (tl.constexpr(code) for code in range(10))
_GGUF_CODES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q5_K": Q5_K,
               "Q6_K": Q6_K}
FP8_TILE = tl.constexpr(128)  # FP8 is walked in blocks of 128 columns (a scale block's width divides by it)


@dataclass(frozen=True)
class QuantGemmConfig:
    block_n: int  # rows of W per program (>= 16: a tl.dot side)
    block_m: int  # rows of x per program (>= 16 on the tensor cores; 1 or 2 on the CUDA cores)
    blocks: int  # quant blocks per loop step
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1  # programs an output tile's K is split over (the Int8X kernels)


ROW_PROGRAMS = 512  # programs the Int8X kernels aim at: 3-4 a streaming multiprocessor
# Past a verify step's 16 rows of x, the K-quants' K is split over at most this many programs: each split's
# partial tile (x's rows by the program's rows of W, float32) is written and summed by the last program, and with
# their register-heavy value tiles that outweighed the loads a further split keeps in flight (bench quant --kernels
# --tune at 32 rows; Q8_0 and FP8 read best at up to 8).
WIDE_SPLIT = 4


def k_splits(k: int, tiles: int, most: int = 8) -> int:
    """K split over up to `most` programs (a 256-value block each at least) where a product has fewer output tiles
    than ROW_PROGRAMS, so that small projections (o, down, k, v) still keep enough loads in flight."""
    return max(1, min(most, k // 256, ROW_PROGRAMS // tiles))


def output_tiles(cfg: QuantGemmConfig, m: int, n: int) -> tuple[int, int]:
    """A product's output tiles along W's rows and x's rows (program axes 0 and 1)."""
    return triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)


def split_k_buffers(split_k: int, tiles: tuple[int, int], m: int, n: int, y: torch.Tensor,
                    tickets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K product's partial sums and its zeroed ticket per output tile (rows_result): `tickets` where the
    caller had them zeroed, else zeros made here; without a split, y twice (unread)."""
    if split_k == 1:
        return y, y
    if tickets is None:
        tickets = torch.zeros(tiles[0] * tiles[1], dtype=torch.int32, device=y.device)
    return torch.empty((split_k, m, n), dtype=torch.float32, device=y.device), tickets


@dataclass(frozen=True)
class Layout:
    """A part's kernel view: format code, block (values along K per block) and the tensors/strides to pass."""

    code: int
    block: int
    type_size: int  # GGUF bytes a block keeps in the data plane (0 otherwise)
    fp8_block_n: int
    fp8_block_k: int


def layout_of(part: QuantizedTensor) -> Layout:
    fmt = part.format
    if isinstance(fmt, GGUFFormat):
        return Layout(_GGUF_CODES[fmt.name].value, fmt.block, fmt.stored_block, 1, 1)
    if isinstance(fmt, Int4Format):
        return Layout(INT4.value, fmt.group, 0, 1, 1)
    assert isinstance(fmt, FP8Format)
    return Layout(FP8.value, FP8_TILE.value, 0, fmt.block_n, fmt.block_k or part.shape[1])


def is_k_quant(part: QuantizedTensor) -> bool:
    return layout_of(part).code in (Q4_K.value, Q5_K.value, Q6_K.value)


class PartTensors(NamedTuple):
    """What a kernel reads of a part: its data (and, for GGUF, as float16 for the scales and as int32 words for
    the K-quants' quants), scale and zero (the data where the format has none) and the row strides."""

    w: torch.Tensor
    w16: torch.Tensor
    w32: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    stride_wn: int  # in w's elements (bytes for GGUF)
    stride_sn: int


def tensors_of(part: QuantizedTensor) -> PartTensors:
    data = part.data
    if isinstance(part.format, FP8Format) and INTERPRET:
        data = data.view(torch.uint8)
    gguf = isinstance(part.format, GGUFFormat)
    words = (gguf and part.format.name in ("Q8_0", "Q4_K", "Q5_K", "Q6_K")) or isinstance(part.format, Int4Format)
    scale = part.scale if part.scale is not None else data
    flat = data.reshape(-1)
    return PartTensors(data, data.view(torch.float16) if gguf else data,
                       flat[:flat.numel() // 4 * 4].view(torch.int32) if words else data,
                       scale, part.zero if part.zero is not None else data, data.stride(0),
                       scale.stride(0) if scale.dim() == 2 else 0)


@triton.jit
def load_f16(w16_ptr, byte_off):
    return tl.load(w16_ptr + byte_off // 2).to(tl.float32)


@triton.jit
def fp8_bits_to_f32(u):
    """float8_e4m3fn bits (uint8) -> float32, for Triton's interpreter (numpy has no fp8)."""
    u = u.to(tl.int32)
    e = (u >> 3) & 15
    m = (u & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((u & 128) != 0, -mag, mag)


@triton.jit
def load_k_scale_min(w32_ptr, base, s):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block s (broadcasting with base, a block's byte offset) ->
    float32. The 12 scale bytes (offset 4) are read as three words; byte t = s % 4 of each holds sub-block s's
    low bits (s < 4) or the high ones beside the next word's."""
    word = base // 4 + 1
    return k_scale_min_of(tl.load(w32_ptr + word), tl.load(w32_ptr + word + 1), tl.load(w32_ptr + word + 2), s)


@triton.jit
def k_scale_min_of(w0, w1, w2, s):
    """load_k_scale_min from the three scale words."""
    t = 8 * (s % 4)
    b0 = (w0 >> t) & 255
    b1 = (w1 >> t) & 255
    b2 = (w2 >> t) & 255
    low = s < 4
    sc = tl.where(low, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def kquant_values(w_ptr, w16_ptr, w32_ptr, base, d_ptrs, FMT: tl.constexpr, S0: tl.constexpr = 0,
                  NS: tl.constexpr = 8):
    """K-quant blocks at byte offsets base [BN, 1, 1] -> the values of their sub-blocks S0 .. S0 + NS (NS even;
    by default all 256) as [BN, NS, 32] float32, already in K order (sub-block s, value j at 32 s + j), so no
    planes to interleave. Q6_K (d at d_ptrs [BN, 1, 1]): each
    value's bytes read where they lie; sub-block s = half s // 4, quarter q = s % 4; ql byte 64 half + 32 (q % 2) +
    j, its nibble q // 2, and bits 2q of qh byte 32 half + j. Q4_K/Q5_K: the quants read once, as words (4-byte aligned
    blocks): word 8 c + i holds in byte t the values 64 c + 4 i + t (low nibble, sub-block 2 c) and 32 further
    (high nibble); Q5_K adds bit s of qh byte j, byte t of qh word i for j = 4 i + t."""
    if FMT == Q6_K:
        s = S0 + tl.arange(0, NS)[None, :, None]
        j = tl.arange(0, 32)[None, None, :]
        half, q = s // 4, s % 4
        ql = tl.load(w_ptr + base + 64 * half + 32 * (q % 2) + j).to(tl.int32)
        qh = tl.load(w_ptr + base + 128 + 32 * half + j).to(tl.int32)
        v = (((ql >> (4 * (q // 2))) & 15) | (((qh >> (2 * q)) & 3) << 4)) - 32
        sc = tl.load(w_ptr + base + 192 + 2 * s + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
        return (tl.load(d_ptrs).to(tl.float32) * sc) * v.to(tl.float32)
    b5 = base[:, :, :, None, None]  # [BN, c 4, h 2, i 8, t 4]: value 64 c + 32 h + 4 i + t = 32 s + j
    c = S0 // 2 + tl.arange(0, NS // 2)[None, :, None, None, None]
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 8)[None, None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, None, :]
    QS: tl.constexpr = 16 if FMT == Q4_K else 48
    q = (tl.load(w32_ptr + (b5 + QS) // 4 + 8 * c + i) >> (8 * t + 4 * h)) & 15
    if FMT == Q5_K:
        q |= ((tl.load(w32_ptr + (b5 + 16) // 4 + i) >> (8 * t + 2 * c + h)) & 1) << 4
    sc, mn = load_k_scale_min(w32_ptr, b5, 2 * c + h)
    v = (load_f16(w16_ptr, b5) * sc) * q.to(tl.float32) - load_f16(w16_ptr, b5 + 2) * mn
    return tl.reshape(v, (base.shape[0], NS, 32))


@triton.jit
def k_run(n_blocks, pid_k, SPLIT: tl.constexpr):
    """The blocks [first, last) of K that program pid_k of SPLIT walks (none for the last ones of an uneven split)."""
    per = tl.cdiv(n_blocks, SPLIT)
    first = pid_k * per
    return first, tl.minimum(first + per, n_blocks)


@triton.jit
def rows_tile(M, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """A rows kernel's output tile (program axes 0 and 1): its rows of W offs_n and of x offs_m, and those clamped
    for loads, as int64 rows [BLOCK_N, 1] and xm [1, BLOCK_M] (rows past N or M read the last one; their stores are
    masked)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return (offs_n, tl.minimum(offs_n, N - 1).to(tl.int64)[:, None], offs_m,
            tl.minimum(offs_m, M - 1).to(tl.int64)[None, :])


@triton.jit
def rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                SPLIT: tl.constexpr):
    """Store an Int8X kernel's output tile acc [BLOCK_N, BLOCK_M] (_store_rows; one row: BLOCK_M 1); with K split
    (program axis 2), the last program of the tile to finish adds the partial tiles instead, in order
    (deterministic)."""
    if SPLIT == 1:
        _store_rows(acc, b_ptr, y_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS)
    else:
        at = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        tl.store(part_ptr + tl.program_id(2) * M * N + at, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        if tl.atomic_add(count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), 1) == SPLIT - 1:
            total = tl.zeros(acc.shape, tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
            _store_rows(total, b_ptr, y_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS)


@triton.jit
def _store_rows(acc, b_ptr, y_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """y^T tile acc [BLOCK_N, BLOCK_M] (+ bias) -> y, rounded once to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))
