"""Products with quantized weights on CUDA: y = x @ W.T for a QuantizedWeight W (outrider/quant), W never
dequantized to memory at decode.

Up to FUSED_MAX_ROWS rows (decode, verify, small batches) one Triton kernel reads the quantized blocks and
dequantizes them in registers: each program owns BLOCK_N rows of W and walks K a few blocks at a time. A block's
values split into two planes of half a block each (low and high nibbles for the 4/5-bit formats, the two halves
for Q8_0 and FP8), and each plane is multiplied by the columns of x it meets (gathered from x, which is small and
cached), so the quantized bytes are read once, contiguously, and no value is moved to its place in the row:
y^T [BLOCK_N, BLOCK_M] += plane [BLOCK_N, k'] @ x[:, plane's columns]^T, on the tensor cores, or for one or two
rows (FMA_MAX_M) as products on the CUDA cores summed over K once after the loop. Scales are loaded once per block
(or sub-block), not per value. More rows on Q4_K and Q5_K make each block's values in K order instead
(_kquant_values: Q4_K and Q5_K quants read once, as words) for one product with x's contiguous columns.

16-bit rows on Q4_K, Q6_K, Q8_0 or INT4 read x as llama.cpp's CUDA kernels do: quantized once per product to int8 groups
of 32 (Int8X, one small launch, which also makes a pre-norm projection's normed input or the down projection's
SiLU·mul: takes_prologue), and the scales meet integer sums once a group (_INT8_X_KERNELS). One row (decode):
four quants meet four x values in one byte-wise dot (dp4a); nothing crosses threads inside the loops. A few rows:
the same dp4a products, W read once for all of them. More rows (verify, batches; Q6_K and Q8_0 up to their
max_rows): each group's quants, as int8, meet x's int8 columns on the tensor cores; past a format's Int8X rows,
its wide tiles (_wide_rows_kernel: the quants made exactly in x's 16-bit type, _WIDE_PAST). Both split K over
several programs where a weight has few output tiles (split_k), the last of them adding the partial sums in a
fixed order. Q6_K's and Q8_0's blocks are 2-byte aligned, so they come as two planes
(quant/formats.py): the blocks without d, read in wide aligned loads, and the d's. Float32 rows keep their precision
on the path above.

Configs are explicit (default_config, row_config, rows_config); `bench quant --kernels --tune` times others.

Past FUSED_MAX_ROWS (prefill) the product is compute-bound: chunks of W's rows are dequantized by the same tile
code (K-quants: _kquant_values) into one scratch buffer per device and dtype (SCRATCH_MB, reused by every layer)
and multiplied by cuBLAS; FP8 weights of 128 x 128 block or per-channel scales take the FP8 tensor cores instead,
x quantized to FP8 per token (and 128 columns) as vLLM does (fp8_gemm.py).

No host syncs; what a call allocates (x as an Int8X, split-K partials) has fixed sizes for its shapes, and the
scratch buffer is made once: safe in CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from outrider.kernels.fp8_gemm import fp8_mm, takes_fp8_mm
from outrider.kernels.fused import pdl_enter, rms_normed_tile, silu_mul_tile
from outrider.kernels.gemm import RowNorm
from outrider.kernels.launch import is_power_of_two, pdl_args, use_pdl
from outrider.quant.formats import FP8Format, GGUFFormat, Int4Format
from outrider.quant.tensor import QuantizedTensor

# Rows up to which the kernels that read the quantized blocks run (decode and verify steps, small batches);
# beyond, a chunk of the weight is dequantized into a scratch buffer and multiplied by cuBLAS (prefill), whose
# tensor-core GEMM outruns the fused kernels once the product is compute-bound.
FUSED_MAX_ROWS = 64

# Bytes of the per-device dequantization buffer of the prefill path: OUTRIDER_QUANT_SCRATCH_MB.
SCRATCH_MB = float(os.environ.get("OUTRIDER_QUANT_SCRATCH_MB", "256"))
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Format codes of the kernels (constexpr globals: a kernel may read no other kind).
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, INT4, FP8 = (tl.constexpr(code) for code in range(10))
_GGUF_CODES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q5_K": Q5_K,
               "Q6_K": Q6_K}
FP8_TILE = tl.constexpr(128)  # FP8 is walked in blocks of 128 columns (a scale block's width divides by it)
FMA_MAX_M = tl.constexpr(2)  # rows up to which the products run on the CUDA cores


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
WIDE_Q8_0_STEP = 128  # Q8_0's values a wide tile's loop step takes (four blocks side by side: one product)


def _split_k(k: int, tiles: int, most: int = 8) -> int:
    """K split over up to `most` programs (a 256-value block each at least) where a product has fewer output tiles
    than ROW_PROGRAMS, so that small projections (o, down, k, v) still keep enough loads in flight."""
    return max(1, min(most, k // 256, ROW_PROGRAMS // tiles))


def row_config(n: int, k: int) -> QuantGemmConfig:
    """One row as an Int8X: 32 rows of W a program, K split by _split_k."""
    return QuantGemmConfig(block_n=32, block_m=1, blocks=1, split_k=_split_k(k, triton.cdiv(n, 32)))


def grouped_row_config(n: int, k: int) -> QuantGemmConfig:
    """One row on INT4's kernel (bench quant --kernels --tune at Qwen3-8B's shapes): a long row (down_proj) 64 rows
    of W a program, a group a step, K split by _split_k; a weight whose 16-row tiles are a half to a whole
    ROW_PROGRAMS (qkv, o) 16 rows a program on 8 warps, 4 groups a step, whole rows; others (gate_up, and weights
    too small to fill the GPU that way) 32 rows, 2 groups a step, K split by _split_k."""
    if k > 4096:
        return QuantGemmConfig(block_n=64, block_m=1, blocks=1, split_k=_split_k(k, triton.cdiv(n, 64)))
    if ROW_PROGRAMS // 2 <= triton.cdiv(n, 16) <= ROW_PROGRAMS:
        return QuantGemmConfig(block_n=16, block_m=1, blocks=4, num_warps=8)
    return QuantGemmConfig(block_n=32, block_m=1, blocks=2, split_k=_split_k(k, triton.cdiv(n, 32)))


def rows_config(m: int, n: int, k: int, block_n: int = 64, most: int = 8) -> QuantGemmConfig:
    """More rows on an Int8X (_Int8Kernels.rows): block_n rows of W and 16 of x a program (past 16 rows of x, 64
    and 32), K split by _split_k over `most` programs at most."""
    block_m, block_n = (16, block_n) if m <= 16 else (32, 64)
    return QuantGemmConfig(block_n=block_n, block_m=block_m, blocks=1,
                           split_k=_split_k(k, triton.cdiv(n, block_n) * triton.cdiv(m, block_m), most))


def few_rows_config(m: int, n: int, k: int) -> QuantGemmConfig:
    """2 to few_rows rows on a dp4a kernel (_Int8Kernels.few): all of x's rows in one tile (each program reads its
    rows of W once), 32 rows of W a program as for one row, K split by _split_k."""
    return QuantGemmConfig(block_n=32, block_m=max(2, triton.next_power_of_2(m)), blocks=1,
                           split_k=_split_k(k, triton.cdiv(n, 32)))


def int8_x_config(m: int, part: QuantizedTensor) -> QuantGemmConfig:
    """The default config of an Int8X product of m rows with `part` (one where takes_int8_x)."""
    n, k = part.shape
    kernels = _INT8_X_KERNELS[_layout(part).code]
    if m == 1:
        return grouped_row_config(n, k) if kernels.grouped else row_config(n, k)
    if kernels.takes_few(m):
        return few_rows_config(m, n, k)
    return rows_config(m, n, k, kernels.rows_block_n, WIDE_SPLIT if m > 16 and _k_quant(part) else 8)


def _k_quant(part: QuantizedTensor) -> bool:
    return _layout(part).code in (Q4_K.value, Q5_K.value, Q6_K.value)


def wide_rows_config(m: int, part: QuantizedTensor) -> QuantGemmConfig:
    """_wide_rows_kernel's for m rows of x: 64 rows of W a program, against x's rows in one tile where they fit 64
    (each program then reads its W once), K split by _split_k; three loads in flight for FP8 and INT4, two and
    K split over WIDE_SPLIT programs at most for the K-quants, whose values tile takes more registers."""
    n, k = part.shape
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    k_quant = _k_quant(part)
    return QuantGemmConfig(block_n=64, block_m=block_m, blocks=1, num_warps=8 if block_m == 64 else 4,
                           num_stages=2 if k_quant else 3,
                           split_k=_split_k(k, triton.cdiv(n, 64) * triton.cdiv(m, block_m),
                                            WIDE_SPLIT if k_quant else 8))


def default_config(m: int, block: int, n: int, k: int = 0) -> QuantGemmConfig:
    """Small tiles at decode (enough programs to fill the GPU from one weight), wider ones for more rows; about
    128-256 values of K per loop step. Up to FMA_MAX_M rows the products run on the CUDA cores (no padding of x to
    a 16-row MMA tile, no layout change of the dequantized tile), beyond on the tensor cores; there K (k values;
    0: unknown) is split by _split_k where the weight has few rows (a [4096, 12288] down_proj: 256 programs, each
    walking all of K)."""
    if m <= FMA_MAX_M.value:  # 256 values a step for one row, 128 for two (the accumulator doubles)
        return QuantGemmConfig(block_n=16, block_m=m, blocks=max(1, (256 if m == 1 else 128) // block),
                               split_k=_split_k(k, triton.cdiv(n, 16)))
    if m <= 16:  # verify rows: 16-row tiles on 4 warps (32/64-row tiles on 8 warps, 4 stages read 15 % slower)
        return QuantGemmConfig(block_n=16, block_m=16, blocks=max(1, 128 // block))
    # Past that, 128 values a step (one 256-value K-quant block): ptxas for sm_90 then keeps every format's
    # tiles in registers (no spills), but Q6_K's at 32 rows (80 bytes); 64-row tiles spilled 0.5-1.5 KB. Past 16
    # rows, 32 rows of W a program: twice the programs of 64 (a 4096-row weight fills only 64 SMs at 64).
    return QuantGemmConfig(block_n=32, block_m=32, blocks=max(1, 128 // block), num_warps=8)


@dataclass(frozen=True)
class _Layout:
    """A part's kernel view: format code, block (values along K per block) and the tensors/strides to pass."""

    code: int
    block: int
    type_size: int  # GGUF bytes a block keeps in the data plane (0 otherwise)
    fp8_block_n: int
    fp8_block_k: int


def _layout(part: QuantizedTensor) -> _Layout:
    fmt = part.format
    if isinstance(fmt, GGUFFormat):
        return _Layout(_GGUF_CODES[fmt.name].value, fmt.block, fmt.stored_block, 1, 1)
    if isinstance(fmt, Int4Format):
        return _Layout(INT4.value, fmt.group, 0, 1, 1)
    assert isinstance(fmt, FP8Format)
    return _Layout(FP8.value, FP8_TILE.value, 0, fmt.block_n, fmt.block_k or part.shape[1])


@triton.jit
def _f16(w16_ptr, byte_off):
    return tl.load(w16_ptr + byte_off // 2).to(tl.float32)


@triton.jit
def _f16_bits_to_f32(bits):
    """The float16 in the low 16 bits of int32 bits -> float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_bits_to_f32(u):
    """float8_e4m3fn bits (uint8) -> float32, for Triton's interpreter (numpy has no fp8)."""
    u = u.to(tl.int32)
    e = (u >> 3) & 15
    m = (u & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((u & 128) != 0, -mag, mag)


@triton.jit
def _k_scale_min(w32_ptr, base, s):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block s (broadcasting with base, a block's byte offset) ->
    float32. The 12 scale bytes (offset 4) are read as three words; byte t = s % 4 of each holds sub-block s's
    low bits (s < 4) or the high ones beside the next word's."""
    word = base // 4 + 1
    return _k_scale_min_of(tl.load(w32_ptr + word), tl.load(w32_ptr + word + 1), tl.load(w32_ptr + word + 2), s)


@triton.jit
def _k_scale_min_of(w0, w1, w2, s):
    """_k_scale_min from the three scale words."""
    t = 8 * (s % 4)
    b0 = (w0 >> t) & 255
    b1 = (w1 >> t) & 255
    b2 = (w2 >> t) & 255
    low = s < 4
    sc = tl.where(low, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _bytes_of(words, BLOCK_N: tl.constexpr, NB: tl.constexpr, C: tl.constexpr):
    """int32 words [BLOCK_N, NB, C, 8] -> their bytes [BLOCK_N, NB, C, 32] in memory order (int32, 0..255)."""
    shifts = 8 * tl.arange(0, 4)[None, None, None, None, :]
    return tl.reshape((words[:, :, :, :, None] >> shifts) & 255, (BLOCK_N, NB, C, 32))


@triton.jit
def _k_quants(w_ptr, w32_ptr, base, c, FMT: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """A K-quant block's quants as [BLOCK_N, NB, 4 chunks, 32] int32 planes (low, high), for block byte offsets
    base [BLOCK_N, NB, 1, 1] and chunks c [1, 1, 4, 1]. Q6_K: chunk c = half c // 2, quarter c % 2, its high plane
    64 values on, values minus 32. Q4_K/Q5_K: chunk c's low nibbles are sub-block 2c, its high ones 2c + 1; blocks
    (144, 176 bytes) and rows start on 4-byte boundaries, so the quants are read as words."""
    if FMT == Q6_K:
        j = tl.arange(0, 32)[None, None, None, :]
        a = c % 2
        ql = tl.load(w_ptr + base + 32 * c + j).to(tl.int32)
        qh = tl.load(w_ptr + base + 128 + 32 * (c // 2) + j).to(tl.int32)
        q_lo = ((ql & 15) | (((qh >> (2 * a)) & 3) << 4)) - 32
        q_hi = ((ql >> 4) | (((qh >> (4 + 2 * a)) & 3) << 4)) - 32
    else:
        QS: tl.constexpr = 16 if FMT == Q4_K else 48
        i = tl.arange(0, 8)[None, None, None, :]
        qs = _bytes_of(tl.load(w32_ptr + (base + QS) // 4 + 8 * c + i), BLOCK_N, NB, 4)
        q_lo = qs & 15
        q_hi = qs >> 4
        if FMT == Q5_K:
            qh = _bytes_of(tl.load(w32_ptr + (base + 16) // 4 + i), BLOCK_N, NB, 1)
            q_lo |= ((qh >> (2 * c)) & 1) << 4
            q_hi |= ((qh >> (2 * c + 1)) & 1) << 4
    return q_lo, q_hi


@triton.jit
def _tile(w_ptr, w16_ptr, w32_ptr, s_ptr, z_ptr, rows, kb, stride_wn, stride_sn, FP8_BN, FP8_BK,
          FMT: tl.constexpr, BLOCK: tl.constexpr, TYPE_SIZE: tl.constexpr, NB: tl.constexpr,
          BLOCK_N: tl.constexpr, FP8_BITS: tl.constexpr):
    """W's rows `rows` [BLOCK_N, 1, 1], blocks kb [1, NB, 1] -> two planes [BLOCK_N, NB * BLOCK / 2] float32 and
    the K positions of their columns [NB * BLOCK / 2] (column i of a plane comes from block kb[i // (BLOCK / 2)])."""
    H: tl.constexpr = BLOCK // 2
    row_off = rows.to(tl.int64) * stride_wn
    if FMT <= Q5_1:  # 32-value blocks: planes are values 0-15 and 16-31
        l = tl.arange(0, 16)[None, None, :]
        base = row_off + kb * TYPE_SIZE
        if FMT == Q8_0:  # (its d's a plane of their own)
            d = tl.load(s_ptr + rows.to(tl.int64) * stride_sn + kb).to(tl.float32)
            lo = tl.load(w_ptr + base + l).to(tl.int8, bitcast=True).to(tl.float32) * d
            hi = tl.load(w_ptr + base + 16 + l).to(tl.int8, bitcast=True).to(tl.float32) * d
        else:
            d = _f16(w16_ptr, base)
            QS: tl.constexpr = 2 if FMT == Q4_0 else 4 if FMT == Q4_1 else 6 if FMT == Q5_0 else 8
            qs = tl.load(w_ptr + base + QS + l).to(tl.int32)
            q_lo = qs & 15
            q_hi = qs >> 4
            if FMT == Q5_0 or FMT == Q5_1:
                QH: tl.constexpr = 2 if FMT == Q5_0 else 4
                bit = l % 8
                q_lo |= ((tl.load(w_ptr + base + QH + l // 8).to(tl.int32) >> bit) & 1) << 4
                q_hi |= ((tl.load(w_ptr + base + QH + 2 + l // 8).to(tl.int32) >> bit) & 1) << 4
            if FMT == Q4_0 or FMT == Q5_0:
                OFF: tl.constexpr = 8 if FMT == Q4_0 else 16
                lo = d * (q_lo - OFF).to(tl.float32)
                hi = d * (q_hi - OFF).to(tl.float32)
            else:
                m = _f16(w16_ptr, base + 2)
                lo = d * q_lo.to(tl.float32) + m
                hi = d * q_hi.to(tl.float32) + m
        p_lo = kb * 32 + l
        p_hi = p_lo + 16
    elif FMT <= Q6_K:  # 256-value blocks as [4 chunks, 32]: 128 bytes of low/high nibbles
        base = (row_off + kb * TYPE_SIZE)[:, :, :, None]  # [BN, NB, 1, 1]
        c = tl.arange(0, 4)[None, None, :, None]
        j = tl.arange(0, 32)[None, None, None, :]
        kb4 = kb[:, :, :, None]
        q_lo, q_hi = _k_quants(w_ptr, w32_ptr, base, c, FMT, BLOCK_N, NB)
        if FMT == Q6_K:  # chunk c = half h (c // 2), quarter a (c % 2); its d's a plane of their own
            d = tl.load(s_ptr + (rows.to(tl.int64) * stride_sn + kb)[:, :, :, None]).to(tl.float32)
            pos_lo = 128 * (c // 2) + 32 * (c % 2) + j
            sc_lo = tl.load(w_ptr + base + 192 + pos_lo // 16).to(tl.int8, bitcast=True).to(tl.float32)
            sc_hi = tl.load(w_ptr + base + 196 + pos_lo // 16).to(tl.int8, bitcast=True).to(tl.float32)
            lo = (d * sc_lo) * q_lo.to(tl.float32)
            hi = (d * sc_hi) * q_hi.to(tl.float32)
            p_lo = kb4 * 256 + pos_lo
            p_hi = p_lo + 64
        else:  # Q4_K, Q5_K: chunk c's low nibbles are sub-block 2c, its high ones 2c + 1
            d = _f16(w16_ptr, base)
            dmin = _f16(w16_ptr, base + 2)
            sc_lo, m_lo = _k_scale_min(w32_ptr, base, 2 * c)
            sc_hi, m_hi = _k_scale_min(w32_ptr, base, 2 * c + 1)
            lo = (d * sc_lo) * q_lo.to(tl.float32) - dmin * m_lo
            hi = (d * sc_hi) * q_hi.to(tl.float32) - dmin * m_hi
            p_lo = kb4 * 256 + 64 * c + j
            p_hi = p_lo + 32
    elif FMT == INT4:  # byte l of a group: values l (low nibble) and l + BLOCK / 2 (high)
        l = tl.arange(0, H)[None, None, :]
        q = tl.load(w_ptr + row_off + kb * H + l).to(tl.int32)
        s = tl.load(s_ptr + rows.to(tl.int64) * stride_sn + kb).to(tl.float32)
        z = tl.load(z_ptr + rows.to(tl.int64) * stride_sn + kb).to(tl.float32)
        lo = ((q & 15).to(tl.float32) - z) * s
        hi = ((q >> 4).to(tl.float32) - z) * s
        p_lo = kb * BLOCK + l
        p_hi = p_lo + H
    else:  # FP8: 128-column blocks, halves as planes, a scale per FP8_BN x FP8_BK tile
        l = tl.arange(0, H)[None, None, :]
        ptrs = w_ptr + row_off + kb * BLOCK + l
        if FP8_BITS:
            lo = _fp8_bits_to_f32(tl.load(ptrs))
            hi = _fp8_bits_to_f32(tl.load(ptrs + H))
        else:
            lo = tl.load(ptrs).to(tl.float32)
            hi = tl.load(ptrs + H).to(tl.float32)
        s = tl.load(s_ptr + (rows // FP8_BN).to(tl.int64) * stride_sn + (kb * BLOCK) // FP8_BK)
        lo = lo * s
        hi = hi * s
        p_lo = kb * BLOCK + l
        p_hi = p_lo + H
    lo = tl.reshape(lo, (BLOCK_N, NB * H))
    hi = tl.reshape(hi, (BLOCK_N, NB * H))
    return lo, hi, tl.reshape(p_lo, (NB * H,)), tl.reshape(p_hi, (NB * H,))


class Int8X(NamedTuple):
    """x [M, K] quantized per row as llama.cpp's CUDA kernels take it (its q8_1 blocks): int8 values in groups of
    32 with a float32 scale each (max |x| / 127), and each 16 values' sum of the int8 values times their scale, for
    the min terms. A quantized product then multiplies bytes: four weights a dp4a (one row) or int8 tensor-core
    tiles (more rows)."""

    q: torch.Tensor  # [M, K] int8
    scale: torch.Tensor  # [M, K / 32] float32
    sums: torch.Tensor  # [M, K / 16] float32


@triton.jit
def _quantize_x_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, q_ptr, scale_ptr, sums_ptr, tickets_ptr, K, stride_xm,
                       stride_rm, N_TICKETS, eps, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr,
                       ROW: tl.constexpr, USE_PDL: tl.constexpr):
    """Row m, values 256 kb .. 256 kb + 255 of x (programs m, kb; those past K masked) -> their int8 values (rounded
    half away from zero), 8 scales, 16 sums; and the programs zero the N_TICKETS tickets of the split-K products
    that will read this x (a memset node between the two kernels would break their chain of dependent launches).
    The values quantized may first be made from x as ops makes a projection's input, rounded where it rounds:
    NORM, RMSNorm(x [+ residual (ADD), stored to sum_ptr]) * nw, each program summing the squares of the whole row
    (ROW values, from L2) for its own 256; SILU, silu(gate) * up of x = [gate | up] (2 K columns)."""
    pdl_enter(USE_PDL)
    m = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    share = tl.arange(0, 256)
    programs = tl.num_programs(0) * tl.num_programs(1)
    for t in tl.range(tl.program_id(0) * tl.num_programs(1) + kb, tl.cdiv(N_TICKETS, 256), programs):
        tl.store(tickets_ptr + 256 * t + share, 0, mask=256 * t + share < N_TICKETS)
    offs = tl.reshape(kb * 256 + tl.arange(0, 256), (8, 32))
    dt = x_ptr.dtype.element_ty
    x_row = x_ptr + m * stride_xm
    if NORM:
        cols = tl.arange(0, ROW)
        row = tl.load(x_row + cols, mask=cols < K, other=0.0)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        if ADD:
            row = row + tl.load(r_ptr + m * stride_rm + cols, mask=cols < K, other=0.0)  # (rounds as torch's add)
            x = x + tl.load(r_ptr + m * stride_rm + offs, mask=offs < K, other=0.0)
            tl.store(sum_ptr + m * K + offs, x, mask=offs < K)
        rf = row.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(rf * rf, 0) / K + eps)
        w = tl.load(nw_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        x = rms_normed_tile(x.to(tl.float32), w, rstd, dt).to(tl.float32)
    elif SILU:
        g = tl.load(x_row + offs, mask=offs < K, other=0.0)
        x = silu_mul_tile(g, tl.load(x_row + K + offs, mask=offs < K, other=0.0), dt).to(tl.float32)
    else:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    y = x * tl.where(amax > 0, 127.0 / amax, 0.0)[:, None]
    q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
    scale = amax / 127.0
    g = kb * 8 + tl.arange(0, 8)
    tl.store(scale_ptr + m * (K // 32) + g, scale, mask=g < K // 32)
    sums = tl.sum(tl.reshape(q, (8, 2, 16)), axis=2) * scale[:, None]
    h = kb * 16 + tl.reshape(tl.arange(0, 16), (8, 2))
    tl.store(sums_ptr + m * (K // 16) + h, sums, mask=h < K // 16)
    tl.store(q_ptr + m * K + offs, q.to(tl.int8), mask=offs < K)


def quantize_x(x: torch.Tensor, tickets: torch.Tensor | None = None, norm: RowNorm | None = None,
               silu_mul: bool = False) -> Int8X:
    """x [M, K] (K a multiple of 32) -> Int8X; `tickets` (int32) zeroed on the way. What is quantized may be
    RMSNorm(x [+ residual]) * weight (`norm`: the sum stored to norm.summed) or, for x = [gate | up] [M, 2 K],
    silu(gate) * up (`silu_mul`): the values ops.rms_norm / ops.silu_mul would hand the product, in the same
    launch. Fixed-size buffers of this call: safe in CUDA graphs."""
    m, k = x.shape
    if silu_mul:
        k //= 2
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, k // 32), dtype=torch.float32, device=x.device)
    sums = torch.empty((m, k // 16), dtype=torch.float32, device=x.device)
    add = norm is not None and norm.residual is not None
    residual = norm.residual if add else x
    _quantize_x_kernel[(m, triton.cdiv(k, 256))](
        x, residual, x if norm is None else norm.weight, norm.summed if add else x, q, scale, sums,
        q if tickets is None else tickets, k, x.stride(0), residual.stride(0),
        0 if tickets is None else tickets.numel(), 0.0 if norm is None else norm.eps, NORM=norm is not None, ADD=add,
        SILU=silu_mul, ROW=triton.next_power_of_2(k) if norm is not None else 1, **pdl_args(use_pdl(x)))
    return Int8X(q, scale, sums)


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr, SIGNED: tl.constexpr = False):
    """Sum over the four bytes of each int32: a's unsigned (SIGNED: signed) times b's signed (PTX dp4a; the
    interpreter spells it out)."""
    if ASM:
        op: tl.constexpr = "dp4a.s32.s32 $0, $1, $2, 0;" if SIGNED else "dp4a.u32.s32 $0, $1, $2, 0;"
        return tl.inline_asm_elementwise(op, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)
    total = tl.zeros(a.shape, tl.int32)
    for t in tl.static_range(4):
        wa = (a << (24 - 8 * t)) >> 24 if SIGNED else (a >> (8 * t)) & 255
        total += wa * ((b << (24 - 8 * t)) >> 24)
    return total


@triton.jit
def _q4k_block(w32_ptr, row, kb, w):
    """What _q4k_row_q8_kernel reads of W's block kb (rows at word offsets row [BN, 1]): its quant words [BN, 32]
    and header words [BN, 1] (d and dmin, then the three scale words)."""
    at = w32_ptr + row + 36 * kb
    return tl.load(at + 4 + w), tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3)


@triton.jit
def _q4k_row_q8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N,
                       K, stride_row, stride_d, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """y [1, N] = x [1, K] @ W.T on Q4_K for an Int8X x of one row, program (pid_n, pid_k) owning W's rows from
    pid_n * BLOCK_N and the pid_k-th of SPLIT runs of K's blocks. Quant word w of a block, masked to its low (high)
    nibbles, holds four unsigned int8 weights whose x values are xq word 16 (w // 8) + w % 8 (+ 8): one dp4a each.
    A sub-block's product is d sc dx sum(q xq) - dmin m sum(x); the scales meet the sums of a thread's four words
    (a quarter of a chunk) once a block. The next block (quants and header) is in flight while a block is summed."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)  # (axis 1: the row tiles of x, one here)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_row  # [BN, 1] word offsets of the rows
    w = tl.arange(0, 32)[None, :]
    xw = 16 * (w // 8) + w % 8  # x word of a quant word's low nibbles
    quarter = tl.arange(0, 8)[None, :]  # four words of a chunk: sums xs 2 (2 chunk) + quarter % 2 (+ 2: high)
    chunk = quarter // 2
    n_blocks = K // 256
    first, last = _k_run(n_blocks, pid_k, SPLIT)
    acc = tl.zeros((BLOCK_N, 8), tl.float32)
    words, h0, h1, h2, h3 = _q4k_block(w32_ptr, row, tl.minimum(first, n_blocks - 1), w)
    for kb in tl.range(first, last):
        nxt, n0, n1, n2, n3 = _q4k_block(w32_ptr, row, tl.minimum(kb + 1, last - 1), w)  # in flight meanwhile
        lo = _dp4a(words & 0x0F0F0F0F, tl.load(xq_ptr + kb * 64 + xw), ASM)
        hi = _dp4a((words >> 4) & 0x0F0F0F0F, tl.load(xq_ptr + kb * 64 + xw + 8), ASM)
        lo = tl.sum(tl.reshape(lo, (BLOCK_N, 8, 4)), axis=2).to(tl.float32)  # [BN, 8 quarters]: within a thread
        hi = tl.sum(tl.reshape(hi, (BLOCK_N, 8, 4)), axis=2).to(tl.float32)
        d = _f16_bits_to_f32(h0)
        dmin = _f16_bits_to_f32(h0 >> 16)
        sc_lo, m_lo = _k_scale_min_of(h1, h2, h3, 2 * chunk)
        sc_hi, m_hi = _k_scale_min_of(h1, h2, h3, 2 * chunk + 1)
        dx_lo = tl.load(xd_ptr + kb * 8 + 2 * chunk)
        dx_hi = tl.load(xd_ptr + kb * 8 + 2 * chunk + 1)
        xs_lo = tl.load(xs_ptr + kb * 16 + 4 * chunk + quarter % 2)
        xs_hi = tl.load(xs_ptr + kb * 16 + 4 * chunk + 2 + quarter % 2)
        acc += d * (sc_lo * dx_lo * lo + sc_hi * dx_hi * hi) - dmin * (m_lo * xs_lo + m_hi * xs_hi)
        words, h0, h1, h2, h3 = nxt, n0, n1, n2, n3
    _rows_result(tl.sum(acc, axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n, tl.arange(0, 1), 1, N, 0,
                 HAS_BIAS, SPLIT)


@triton.jit
def _q6k_quants(src, h, R: tl.constexpr):
    """Q6_K's quants of r = R as four unsigned bytes (0..63): src's nibbles (low for r 0 and 1, high for 2 and 3)
    with bits 2 r of h on top."""
    return ((src >> (4 * (R // 2))) & 0x0F0F0F0F) | (((h >> (2 * R)) & 0x03030303) << 4)


@triton.jit
def _q6k_words():
    """The Q6_K dp4a kernels' group indices [1, 4] (half gn, i // 4 gi of the groups (n, i // 4)) and word offsets
    [1, 4, 4] in a block: ql words A (B = A + 8), qh words H, and x's words (+ 8 r)."""
    g = tl.arange(0, 4)[None, :]
    gn = g // 2
    gi = g % 2
    i = (4 * gi)[:, :, None] + tl.arange(0, 4)[None, None, :]
    return gn, gi, 16 * gn[:, :, None] + i, 32 + 8 * gn[:, :, None] + i, 32 * gn[:, :, None] + i


@triton.jit
def _q6k_block(w_ptr, w32_ptr, blk, word_a, word_h, gn, gi):
    """The Q6_K blocks at byte offsets blk [BN, 1]: their ql words A and B (= A + 8) and qh words H ([BN, 4, 4], as
    _q6k_words places them), and the pointers to the int8 scales of the groups (gn, gi) (+ 2 r for quarter r)."""
    word = (blk // 4)[:, :, None]
    return (tl.load(w32_ptr + word + word_a), tl.load(w32_ptr + word + word_a + 8), tl.load(w32_ptr + word + word_h),
            w_ptr + blk + 192 + 8 * gn + gi)


@triton.jit
def _q6k_row_q8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N,
                       K, stride_row, stride_d, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """_q4k_row_q8_kernel for Q6_K (blocks of 208 bytes: ql 0-127, qh 128-191, 16 int8 scales; d in its plane).
    For half n and i < 8, ql words A = 16 n + i and B = A + 8 and qh word H = 32 + 8 n + i hold in byte t the quants
    of values 128 n + 32 r + 4 i + t, r = 0..3 (_q6k_quants): unsigned 0..63, so a scale group's (16 values: n, r,
    i // 4) product is d sc (dx sum(q xq) - 32 sum(x)). A program's tensors are [BLOCK_N, 4 groups (n, i // 4), 4
    words], so a thread reads a group's four words at once and no sum crosses threads."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)  # (axis 1: the row tiles of x, one here)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
    row = rows * stride_row  # [BN, 1] byte offsets of the rows
    gn, gi, word_a, word_h, word_x = _q6k_words()
    n_blocks = K // 256
    first, last = _k_run(n_blocks, pid_k, SPLIT)
    acc = tl.zeros((BLOCK_N, 4), tl.float32)
    for kb in tl.range(first, last):
        a, b, h, sc = _q6k_block(w_ptr, w32_ptr, row + 208 * kb, word_a, word_h, gn, gi)
        xw = xq_ptr + kb * 64 + word_x
        s0 = tl.sum(_dp4a(_q6k_quants(a, h, 0), tl.load(xw), ASM), axis=2)
        s1 = tl.sum(_dp4a(_q6k_quants(b, h, 1), tl.load(xw + 8), ASM), axis=2)
        s2 = tl.sum(_dp4a(_q6k_quants(a, h, 2), tl.load(xw + 16), ASM), axis=2)
        s3 = tl.sum(_dp4a(_q6k_quants(b, h, 3), tl.load(xw + 24), ASM), axis=2)
        dx = xd_ptr + kb * 8 + 4 * gn  # + r
        xs = xs_ptr + kb * 16 + 8 * gn + gi  # + 2 r
        part = (_i8(sc) * (tl.load(dx) * s0.to(tl.float32) - 32.0 * tl.load(xs))
                + _i8(sc + 2) * (tl.load(dx + 1) * s1.to(tl.float32) - 32.0 * tl.load(xs + 2))
                + _i8(sc + 4) * (tl.load(dx + 2) * s2.to(tl.float32) - 32.0 * tl.load(xs + 4))
                + _i8(sc + 6) * (tl.load(dx + 3) * s3.to(tl.float32) - 32.0 * tl.load(xs + 6)))
        acc += tl.load(d_ptr + rows * stride_d + kb).to(tl.float32) * part
    _rows_result(tl.sum(acc, axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n, tl.arange(0, 1), 1, N, 0,
                 HAS_BIAS, SPLIT)


@triton.jit
def _q80_row_q8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N,
                       K, stride_row, stride_d, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """_q4k_row_q8_kernel for Q8_0 (blocks of 32 int8 quants; d in its plane): a step is 256 values, [BLOCK_N, 8
    groups, 8 words], each word four signed quants against four of x in one dp4a; a group's sum meets d dx once.
    K need only be a multiple of 32: the groups of a last partial step past K are masked."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)  # (axis 1: the row tiles of x, one here)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
    g = tl.arange(0, 8)[None, :]
    words = (8 * g)[:, :, None] + tl.arange(0, 8)[None, None, :]  # [1, 8, 8]
    row = (rows * stride_row)[:, :, None]  # word offsets of the rows
    first, last = _k_run(tl.cdiv(K, 256), pid_k, SPLIT)
    acc = tl.zeros((BLOCK_N, 8), tl.float32)
    for kb in tl.range(first, last):
        inside = 8 * kb + g < K // 32
        w = tl.load(w32_ptr + row + 64 * kb + words, mask=inside[:, :, None], other=0)
        s = tl.sum(_dp4a(w, tl.load(xq_ptr + 64 * kb + words, mask=inside[:, :, None], other=0), ASM, True), axis=2)
        d = tl.load(d_ptr + rows * stride_d + 8 * kb + g, mask=inside, other=0.0).to(tl.float32)
        acc += d * (tl.load(xd_ptr + 8 * kb + g, mask=inside, other=0.0) * s.to(tl.float32))
    _rows_result(tl.sum(acc, axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n, tl.arange(0, 1), 1, N, 0,
                 HAS_BIAS, SPLIT)


@triton.jit
def _rows_tile(M, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """A rows kernel's output tile (program axes 0 and 1): its rows of W offs_n and of x offs_m, and those clamped
    for loads, as int64 rows [BLOCK_N, 1] and xm [1, BLOCK_M] (rows past N or M read the last one; their stores are
    masked)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return (offs_n, tl.minimum(offs_n, N - 1).to(tl.int64)[:, None], offs_m,
            tl.minimum(offs_m, M - 1).to(tl.int64)[None, :])


@triton.jit
def _q4k_few_rows_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M,
                        N, K, stride_wn, stride_d, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """y [M, N] = x @ W.T on Q4_K for an Int8X x of 2 to few_rows rows (_Int8Kernels): _q4k_row_q8_kernel's dp4a
    products, W's block (read once, the next in flight) meeting x's rows one after another, each row's sum placed in
    the output tile [BLOCK_N, BLOCK_M]; no tile changes layout (int8 tensor-core tiles of a sub-block's 32 columns
    each do, eight a block)."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = _rows_tile(M, N, BLOCK_N, BLOCK_M)
    row = rows * (stride_wn // 4)  # [BN, 1] word offsets of the rows
    xw_ptr = xq_ptr.to(tl.pointer_type(tl.int32))  # x's rows as words, K / 4 a row
    w = tl.arange(0, 32)[None, :]
    xw = 16 * (w // 8) + w % 8  # x word of a quant word's low nibbles
    quarter = tl.arange(0, 8)[None, :]  # four words of a chunk: sums xs 2 (2 chunk) + quarter % 2 (+ 2: high)
    chunk = quarter // 2
    column = tl.arange(0, BLOCK_M)[None, :]
    n_blocks = K // 256
    first, last = _k_run(n_blocks, tl.program_id(2), SPLIT)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    words, h0, h1, h2, h3 = _q4k_block(w32_ptr, row, tl.minimum(first, n_blocks - 1), w)
    for kb in tl.range(first, last):
        nxt, n0, n1, n2, n3 = _q4k_block(w32_ptr, row, tl.minimum(kb + 1, last - 1), w)  # in flight meanwhile
        q_lo = words & 0x0F0F0F0F
        q_hi = (words >> 4) & 0x0F0F0F0F
        d = _f16_bits_to_f32(h0)
        dmin = _f16_bits_to_f32(h0 >> 16)
        sc_lo, m_lo = _k_scale_min_of(h1, h2, h3, 2 * chunk)  # [BN, 8]
        sc_hi, m_hi = _k_scale_min_of(h1, h2, h3, 2 * chunk + 1)
        for i in tl.static_range(BLOCK_M):
            xr = tl.minimum(tl.program_id(1) * BLOCK_M + i, M - 1).to(tl.int64)
            x = xw_ptr + xr * (K // 4) + kb * 64 + xw
            lo = tl.sum(tl.reshape(_dp4a(q_lo, tl.load(x), ASM), (BLOCK_N, 8, 4)), axis=2).to(tl.float32)
            hi = tl.sum(tl.reshape(_dp4a(q_hi, tl.load(x + 8), ASM), (BLOCK_N, 8, 4)), axis=2).to(tl.float32)
            xd = xd_ptr + xr * (K // 32) + kb * 8 + 2 * chunk
            xs = xs_ptr + xr * (K // 16) + kb * 16 + 4 * chunk + quarter % 2
            part = (d * (sc_lo * tl.load(xd) * lo + sc_hi * tl.load(xd + 1) * hi)
                    - dmin * (m_lo * tl.load(xs) + m_hi * tl.load(xs + 2)))
            acc += tl.where(column == i, tl.sum(part, axis=1)[:, None], 0.0)
        words, h0, h1, h2, h3 = nxt, n0, n1, n2, n3
    _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _q6k_few_rows_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M,
                         N, K, stride_wn, stride_d, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """_q6k_row_q8_kernel's dp4a products for an Int8X x of 2 to few_rows rows, as _q4k_few_rows_kernel: a block's
    quants and scales made once, then met by x's rows one after another, each row's sum placed in the output tile."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = _rows_tile(M, N, BLOCK_N, BLOCK_M)
    row = rows * stride_wn  # [BN, 1] byte offsets of the rows
    xw_ptr = xq_ptr.to(tl.pointer_type(tl.int32))  # x's rows as words, K / 4 a row
    gn, gi, word_a, word_h, word_x = _q6k_words()
    column = tl.arange(0, BLOCK_M)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = _k_run(K // 256, tl.program_id(2), SPLIT)
    for kb in tl.range(first, last):
        a, b, h, sc = _q6k_block(w_ptr, w32_ptr, row + 208 * kb, word_a, word_h, gn, gi)
        q0 = _q6k_quants(a, h, 0)
        q1 = _q6k_quants(b, h, 1)
        q2 = _q6k_quants(a, h, 2)
        q3 = _q6k_quants(b, h, 3)
        sc0, sc1, sc2, sc3 = _i8(sc), _i8(sc + 2), _i8(sc + 4), _i8(sc + 6)
        d = tl.load(d_ptr + rows * stride_d + kb).to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            xr = tl.minimum(tl.program_id(1) * BLOCK_M + i, M - 1).to(tl.int64)
            xw = xw_ptr + xr * (K // 4) + kb * 64 + word_x
            dx = xd_ptr + xr * (K // 32) + kb * 8 + 4 * gn  # + r
            xs = xs_ptr + xr * (K // 16) + kb * 16 + 8 * gn + gi  # + 2 r
            part = (sc0 * (tl.load(dx) * tl.sum(_dp4a(q0, tl.load(xw), ASM), axis=2).to(tl.float32)
                           - 32.0 * tl.load(xs))
                    + sc1 * (tl.load(dx + 1) * tl.sum(_dp4a(q1, tl.load(xw + 8), ASM), axis=2).to(tl.float32)
                             - 32.0 * tl.load(xs + 2))
                    + sc2 * (tl.load(dx + 2) * tl.sum(_dp4a(q2, tl.load(xw + 16), ASM), axis=2).to(tl.float32)
                             - 32.0 * tl.load(xs + 4))
                    + sc3 * (tl.load(dx + 3) * tl.sum(_dp4a(q3, tl.load(xw + 24), ASM), axis=2).to(tl.float32)
                             - 32.0 * tl.load(xs + 6)))
            acc += tl.where(column == i, tl.sum(d * part, axis=1)[:, None], 0.0)
    _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _q6k_rows_q8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M,
                        N, K, stride_wn, stride_d, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """y [M, N] = x @ W.T on Q6_K (blocks of 208 bytes, d in its plane) for an Int8X x of 2 to max_rows rows, on
    the int8 tensor cores: int32 tiles [BLOCK_N, BLOCK_M] = quants @ xq's columns, scaled in float32. Values
    128 n + 32 r + l (half n, quarter r): ql byte 64 n + 32 (r % 2) + l, its nibble r // 2, with bits 2 r of qh
    byte 128 + 32 n + l on top, less 32 (signed int8, so no min term); the scale of 16 values is int8 byte
    192 + 8 n + 2 r + l // 16, so each 32 columns of xq meet the quants twice, as their two halves (the other half
    zeroed): d dx (sc_lo tile_lo + sc_hi tile_hi)."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = _rows_tile(M, N, BLOCK_N, BLOCK_M)
    row = rows * stride_wn
    j = tl.arange(0, 32)
    lower = (j < 16)[:, None]  # a scale group's half of x's 32 columns
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = _k_run(K // 256, tl.program_id(2), SPLIT)
    for kb in tl.range(first, last):
        base = row + 208 * kb
        d = tl.load(d_ptr + rows * stride_d + kb).to(tl.float32)
        for n in tl.static_range(2):
            qh = tl.load(w_ptr + base + 128 + 32 * n + j[None, :])
            for a in tl.static_range(2):
                ql = tl.load(w_ptr + base + 64 * n + 32 * a + j[None, :])
                for hi in tl.static_range(2):
                    q = _q6k_signed(ql, qh, a + 2 * hi, ASM)  # (not via a local: Triton 3.6 makes it a tensor)
                    g = kb * 8 + 4 * n + a + 2 * hi
                    x = xq_ptr + xm * K + 32 * g + j[:, None]
                    dx = tl.load(xd_ptr + xm * (K // 32) + g)
                    scales = w_ptr + base + 192 + 8 * n + 2 * (a + 2 * hi)
                    dot = tl.dot(q, tl.load(x, mask=lower, other=0), out_dtype=tl.int32)
                    acc += (d * _i8(scales)) * (dx * dot.to(tl.float32))
                    dot = tl.dot(q, tl.load(x, mask=~lower, other=0), out_dtype=tl.int32)
                    acc += (d * _i8(scales + 1)) * (dx * dot.to(tl.float32))
    _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.constexpr_function
def _q6k_signed_asm(r: int) -> str:
    """PTX for four bytes of _q6k_signed's quarter r: a nibble of ql (low for r 0 and 1) with bits 2 r of qh on top
    (0..63), then bit 5 flipped and copied into bits 6 and 7: the 6-bit value less 32, as int8."""
    low = f"shr.u32 a, $1, {4 * (r // 2)}; and.b32 a, a, 0x0F0F0F0F;" if r // 2 else "and.b32 a, $1, 0x0F0F0F0F;"
    top = f"shr.u32 b, $2, {2 * r}; and.b32 b, b, 0x03030303;" if r else "and.b32 b, $2, 0x03030303;"
    return ("{.reg .b32 a, b, t; " + low + " " + top + " shl.b32 b, b, 4; or.b32 t, a, b; xor.b32 t, t, 0x20202020;"
            " and.b32 a, t, 0x20202020; shl.b32 b, a, 1; or.b32 t, t, b; shl.b32 b, a, 2; or.b32 $0, t, b;}")


@triton.jit
def _q6k_signed(ql, qh, R: tl.constexpr, ASM: tl.constexpr):
    """Q6_K's quants of quarter R less 32 (int8, -32..31) from their ql and qh bytes [BLOCK_N, 32]: four bytes an
    instruction sequence in the PTX."""
    if ASM:
        return tl.inline_asm_elementwise(_q6k_signed_asm(R), "=r,r,r", [ql, qh], dtype=tl.int8, is_pure=True, pack=4)
    q = ((ql >> (4 * (R // 2))) & 15) | (((qh >> (2 * R)) & 3) << 4)
    return (q.to(tl.int16) - 32).to(tl.int8)


@triton.jit
def _q80_rows_q8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M,
                        N, K, stride_wn, stride_d, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """_q6k_rows_q8_kernel for Q8_0 (blocks of 32 int8 quants, d in its plane): a block's quants are the int8 tile
    as stored; d dx meets its int32 tile."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = _rows_tile(M, N, BLOCK_N, BLOCK_M)
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = _k_run(K // 32, tl.program_id(2), SPLIT)
    for g in tl.range(first, last):
        q = tl.load(w_ptr + rows * stride_wn + 32 * g + j[None, :]).to(tl.int8, bitcast=True)
        dot = tl.dot(q, tl.load(xq_ptr + xm * K + 32 * g + j[:, None]), out_dtype=tl.int32)
        d = tl.load(d_ptr + rows * stride_d + g).to(tl.float32)
        acc += d * (tl.load(xd_ptr + xm * (K // 32) + g) * dot.to(tl.float32))
    _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _int4_group(w32_ptr, d_ptr, z_ptr, rows, stride_row, stride_d, g, n_groups, W: tl.constexpr):
    """What _int4_few_rows_kernel reads of W's group g (_int4_groups' one group): its words [BN, W], scales and zero
    points [BN, 1]."""
    words, scale, zero = _int4_groups(w32_ptr, d_ptr, z_ptr, rows, stride_row, stride_d, g, n_groups,
                                      tl.arange(0, 1)[None, :, None], tl.arange(0, W)[None, None, :])
    return tl.reshape(words, (rows.shape[0], W)), tl.reshape(scale, rows.shape), tl.reshape(zero, rows.shape)


@triton.jit
def _int4_groups(w32_ptr, d_ptr, z_ptr, rows, stride_row, stride_d, g0, n_groups, gi, w):
    """What _int4_row_q8_kernel reads of W's groups g0 .. g0 + NB - 1 (gi [1, NB, 1]; those from n_groups on read
    as the last with a zero scale): their words [BN, NB, GROUP / 8], contiguous in a row, scales and zero points
    [BN, NB, 1]."""
    g = g0 + gi
    inside = g < n_groups
    g = tl.minimum(g, n_groups - 1)
    at = rows[:, :, None] * stride_d + g
    return (tl.load(w32_ptr + rows[:, :, None] * stride_row + w.shape[2] * g + w),
            tl.load(d_ptr + at, mask=inside, other=0.0).to(tl.float32), tl.load(z_ptr + at).to(tl.float32))


@triton.jit
def _int4_row_q8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N,
                        K, stride_row, stride_d, z_ptr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLIT: tl.constexpr, ASM: tl.constexpr, GROUP: tl.constexpr, NB: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """y [1, N] = x [1, K] @ W.T on INT4 (byte l of a group holds its values l and l + GROUP / 2; d_ptr: the scales,
    z_ptr: the zero points) for an Int8X x of one row, NB groups a step (a row's NB GROUP / 2 bytes in one load).
    Word w of a group, masked to its low (high) nibbles, holds the four unsigned weights of values 4 w (GROUP / 2 +
    4 w) on, whose x word follows: one dp4a each. A group's product is s (the sum over its 16-value quarters of dx
    q.xq) - s z sum(x). The next step's words, scales and zero points are in flight while a step is summed."""
    pdl_enter(USE_PDL)
    W: tl.constexpr = GROUP // 8  # words of a group's bytes
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)  # (axis 1: the row tiles of x, one here)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
    gi = tl.arange(0, NB)[None, :, None]
    w = tl.arange(0, W)[None, None, :]
    quarter = tl.arange(0, W // 4)[None, None, :]  # 16 values: four words of a half
    n_groups = K // GROUP
    first, last = _k_run(tl.cdiv(n_groups, NB), pid_k, SPLIT)
    acc = tl.zeros((BLOCK_N, NB, W // 4), tl.float32)
    words, scale, zero = _int4_groups(w32_ptr, d_ptr, z_ptr, rows, stride_row, stride_d, first * NB, n_groups, gi,
                                      w)
    for step in tl.range(first, last):
        nxt, n_scale, n_zero = _int4_groups(w32_ptr, d_ptr, z_ptr, rows, stride_row, stride_d,
                                            tl.minimum(step + 1, last - 1) * NB, n_groups, gi, w)  # in flight
        g = tl.minimum(step * NB + gi, n_groups - 1)
        xw = g * (GROUP // 4) + w  # x word of the low nibbles' values
        lo = _dp4a(words & 0x0F0F0F0F, tl.load(xq_ptr + xw), ASM)
        hi = _dp4a((words >> 4) & 0x0F0F0F0F, tl.load(xq_ptr + xw + W), ASM)
        lo = tl.sum(tl.reshape(lo, (BLOCK_N, NB, W // 4, 4)), axis=3).to(tl.float32)  # [BN, NB, quarters]
        hi = tl.sum(tl.reshape(hi, (BLOCK_N, NB, W // 4, 4)), axis=3).to(tl.float32)
        dx = xd_ptr + g * (GROUP // 32) + quarter // 2
        sums = xs_ptr + g * (GROUP // 16) + quarter
        acc += scale * (tl.load(dx) * lo + tl.load(dx + GROUP // 64) * hi
                        - zero * (tl.load(sums) + tl.load(sums + GROUP // 32)))
        words, scale, zero = nxt, n_scale, n_zero
    _rows_result(tl.sum(tl.sum(acc, axis=2), axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n,
                 tl.arange(0, 1), 1, N, 0, HAS_BIAS, SPLIT)


@triton.jit
def _int4_few_rows_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                         M, N, K, stride_wn, stride_d, stride_ym, z_ptr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                         GROUP: tl.constexpr, USE_PDL: tl.constexpr):
    """_int4_row_q8_kernel's dp4a products for an Int8X x of 2 to few_rows rows, as _q4k_few_rows_kernel: a group of
    W (read once, the next in flight) met by x's rows one after another, each row's sum placed in the output
    tile."""
    pdl_enter(USE_PDL)
    W: tl.constexpr = GROUP // 8  # words of a group's bytes
    offs_n, rows, offs_m, xm = _rows_tile(M, N, BLOCK_N, BLOCK_M)
    xw_ptr = xq_ptr.to(tl.pointer_type(tl.int32))  # x's rows as words, K / 4 a row
    w = tl.arange(0, W)[None, :]
    quarter = tl.arange(0, W // 4)[None, :]  # 16 values: four words of a half
    column = tl.arange(0, BLOCK_M)[None, :]
    n_groups = K // GROUP
    first, last = _k_run(n_groups, tl.program_id(2), SPLIT)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    words, scale, zero = _int4_group(w32_ptr, d_ptr, z_ptr, rows, stride_wn // 4, stride_d,
                                     tl.minimum(first, n_groups - 1), n_groups, W)
    for g in tl.range(first, last):
        nxt, n_scale, n_zero = _int4_group(w32_ptr, d_ptr, z_ptr, rows, stride_wn // 4, stride_d,
                                           tl.minimum(g + 1, last - 1), n_groups, W)  # in flight meanwhile
        q_lo = words & 0x0F0F0F0F
        q_hi = (words >> 4) & 0x0F0F0F0F
        for i in tl.static_range(BLOCK_M):
            xr = tl.minimum(tl.program_id(1) * BLOCK_M + i, M - 1).to(tl.int64)
            x = xw_ptr + xr * (K // 4) + g * (GROUP // 4) + w  # x word of the low nibbles' values
            lo = tl.sum(tl.reshape(_dp4a(q_lo, tl.load(x), ASM), (BLOCK_N, W // 4, 4)), axis=2).to(tl.float32)
            hi = tl.sum(tl.reshape(_dp4a(q_hi, tl.load(x + W), ASM), (BLOCK_N, W // 4, 4)), axis=2).to(tl.float32)
            dx = xd_ptr + xr * (K // 32) + g * (GROUP // 32) + quarter // 2
            sums = xs_ptr + xr * (K // 16) + g * (GROUP // 16) + quarter
            part = scale * (tl.load(dx) * lo + tl.load(dx + GROUP // 64) * hi
                            - zero * (tl.load(sums) + tl.load(sums + GROUP // 32)))
            acc += tl.where(column == i, tl.sum(part, axis=1)[:, None], 0.0)
        words, scale, zero = nxt, n_scale, n_zero
    _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


# The wide tiles' quants: each made exactly in the 16-bit type from a magic number (a power of two whose mantissa's
# last bit is worth 1: OR-ing a small integer into it adds the integer; one fma.rn a pair then takes the magic away,
# exactly, or less a zero point: INT4), and for Q4_K then scaled in a second fma.rn a pair, q s + m rounded once, as
# no int-to-float conversion (a quarter of the FMA rate) runs. PTX registers: z = 0, one = 1.0 a pair.
_SEL = ("0x4140", "0x4342")  # prmt selectors: bytes 0 and 1, 2 and 3 of a word into a register's 16-bit lanes


@triton.constexpr_function
def _magic_asm(body: str, bf16: bool) -> str:
    """A magic-number conversion's PTX: its registers, then `body`."""
    one = 0x3F803F80 if bf16 else 0x3C003C00
    return f"{{.reg .b32 u, p, t, n, z, one; mov.b32 z, 0; mov.b32 one, {one:#x}; {body}}}"


@triton.constexpr_function
def _magic_pairs(magic: int, fma: str, nz, scales=None, outs=("$0", "$1")) -> str:
    """PTX steps that put bytes 0-1 and 2-3 of register u (values below 2^7 in bf16's `magic` 2^7, 2^10 in f16's)
    into the low bits of two magic numbers a register (prmt, or) and add nz to each pair (exact, as the results are
    small integers) into outs; nz: 16-bit bits for every value, or the registers of each pair's. With scales ((s, m)
    registers of each of outs), each pair then times s plus m."""
    load, regs = (f"mov.b32 n, {nz * 0x10001:#x}; ", ("n", "n")) if isinstance(nz, int) else ("", tuple(nz))
    return " ".join(f"prmt.b32 p, u, z, {sel}; or.b32 t, p, {magic * 0x10001:#x}; {load}"
                    + (f"{fma} {out}, t, one, {n};" if sm is None
                       else f"{fma} t, t, one, {n}; {fma} {out}, t, {sm[0]}, {sm[1]};")
                    for out, sel, n, sm in zip(outs, _SEL, regs, scales or (None, None)))


@triton.constexpr_function
def _nibbles_less_zero_asm(bf16: bool) -> str:
    """PTX of _nibbles_less_zero: four bytes $4 in; their low nibbles less the zero points' pairs ($5, $6: -(magic
    + z)) out as two 16-bit pairs ($0, $1), then their high nibbles ($2, $3)."""
    magic, fma = (0x4300, "fma.rn.bf16x2") if bf16 else (0x6400, "fma.rn.f16x2")
    return _magic_asm(f"and.b32 u, $4, 0x0F0F0F0F; {_magic_pairs(magic, fma, ('$5', '$6'))} shr.u32 u, $4, 4; "
                      f"and.b32 u, u, 0x0F0F0F0F; {_magic_pairs(magic, fma, ('$5', '$6'), outs=('$2', '$3'))}", bf16)


@triton.constexpr_function
def _nibbles_scaled_asm(bf16: bool) -> str:
    """PTX of _nibbles_scaled: four bytes $4 in; their low nibbles times s_lo ($5, $6) plus m_lo ($7, $8) out as two
    16-bit pairs ($0, $1), then their high nibbles with s_hi ($9, $10) and m_hi ($11, $12) ($2, $3)."""
    magic, fma = (0x4300, "fma.rn.bf16x2") if bf16 else (0x6400, "fma.rn.f16x2")
    pairs = [_magic_pairs(magic, fma, magic | 0x8000, scales, (f"${2 * h}", f"${2 * h + 1}"))
             for h, scales in enumerate([(("$5", "$7"), ("$6", "$8")), (("$9", "$11"), ("$10", "$12"))])]
    return _magic_asm(f"and.b32 u, $4, 0x0F0F0F0F; {pairs[0]} shr.u32 u, $4, 4; and.b32 u, u, 0x0F0F0F0F; "
                      f"{pairs[1]}", bf16)


@triton.constexpr_function
def _signed_bytes_asm(bf16: bool) -> str:
    """PTX of _signed_bytes: four bytes $2 in, their values times the scales' pairs ($3, $4) out as two 16-bit pairs
    ($0, $1). The values exactly first: bf16 (8 significant bits) puts a byte's low 7 bits into 2^7's mantissa
    (128 + r), and its sign bit picks what the fma subtracts, 128 or 256 (its bit 7 is the sum's); f16 (11 bits)
    puts the byte plus 128 into 2^10's mantissa, and the fma subtracts 1,152. A second fma then scales them."""
    if not bf16:
        return _magic_asm("xor.b32 u, $2, 0x80808080; "
                          + _magic_pairs(0x6400, "fma.rn.f16x2", 0xE480, (("$3", "z"), ("$4", "z"))), False)
    steps = [f"prmt.b32 p, $2, z, {sel}; and.b32 t, p, 0x007F007F; or.b32 t, t, 0x43004300; and.b32 n, p, 0x00800080;"
             f" or.b32 n, n, 0xC300C300; fma.rn.bf16x2 t, t, one, n; fma.rn.bf16x2 ${out}, t, ${3 + out}, z;"
             for out, sel in enumerate(_SEL)]
    return _magic_asm(" ".join(steps), True)


@triton.jit
def _nibbles_less_zero(qb, z, dt: tl.constexpr, ASM: tl.constexpr):
    """Bytes qb (uint8 [BN, H]; INT4's group: values l and l + H in byte l's low and high nibbles) and zero points z
    (uint8 [BN, 1]) -> q - z of the low and of the high nibbles, [BN, H] each, exact in
    dt (bf16 or fp16). In the PTX with no conversion instruction: four nibbles go into the low bits of four 16-bit
    magic numbers (prmt, or), and an fma.rn of each pair subtracts magic + z (_nibbles_less_zero_asm), where
    converting every value to float32 and back runs at a quarter of the FMA rate."""
    if ASM:
        if dt == tl.bfloat16:
            nz = (z.to(tl.int32) | 0xC300).to(tl.uint16).to(dt, bitcast=True)  # -(128 + z)
        else:
            nz = (z.to(tl.int32) | 0xE400).to(tl.uint16).to(dt, bitcast=True)  # -(1024 + z)
        return tl.inline_asm_elementwise(_nibbles_less_zero_asm(dt == tl.bfloat16), "=r,=r,=r,=r,r,r,r", [qb, nz],
                                         dtype=(nz.dtype, nz.dtype), is_pure=True, pack=4)
    q = qb.to(tl.int32)
    zf = z.to(tl.float32)
    return ((q & 15).to(tl.float32) - zf).to(dt), ((q >> 4).to(tl.float32) - zf).to(dt)


@triton.jit
def _scaled_values(q, s, m, dt: tl.constexpr):
    """The torch-level form of the scaled quants (the interpreter's; the PTX's fma.rn rounds q s + m once too):
    small integers q times s plus m (each [BN, 1], in dt), rounded to dt."""
    return (q.to(tl.float32) * s.to(tl.float32) + m.to(tl.float32)).to(dt)


@triton.jit
def _nibbles_scaled(qb, s_lo, m_lo, s_hi, m_hi, dt: tl.constexpr, ASM: tl.constexpr):
    """Bytes qb (uint8 [BN, H]) -> their low nibbles times s_lo plus m_lo and their high nibbles times s_hi plus
    m_hi ([BN, H] each in dt, rounded once; the scales [BN, 1] in dt): Q4_K's sub-blocks' values."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_nibbles_scaled_asm(dt == tl.bfloat16), "=r,=r,=r,=r" + ",r" * 9,
                                           [qb, s_lo, m_lo, s_hi, m_hi], dtype=(tl.int16, tl.int16), is_pure=True,
                                           pack=4)
        return lo.to(dt, bitcast=True), hi.to(dt, bitcast=True)
    q = qb.to(tl.int32)
    return _scaled_values(q & 15, s_lo, m_lo, dt), _scaled_values(q >> 4, s_hi, m_hi, dt)


@triton.jit
def _signed_bytes(qb, s, dt: tl.constexpr, ASM: tl.constexpr):
    """Signed bytes qb (their uint8 bits [BN, H]) times s ([BN, 1] in dt) -> in dt (bf16 or fp16), rounded once
    (_signed_bytes_asm)."""
    if ASM:
        return tl.inline_asm_elementwise(_signed_bytes_asm(dt == tl.bfloat16), "=r,=r,r,r,r", [qb, s],
                                         dtype=tl.int16, is_pure=True, pack=4).to(dt, bitcast=True)
    return (qb.to(tl.int8, bitcast=True).to(tl.float32) * s.to(tl.float32)).to(dt)


@triton.jit
def _cat_k(a, b):
    """[BN, H] tiles a and b -> [BN, 2 H], a's columns then b's, without moving data: joined, each pair of values is
    held by one thread, and moving the joined axis ahead of the columns only renames where each value sits."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _q4k_chunk(w_ptr, base, w0, w1, w2, d, dmin, c, dt: tl.constexpr, ASM: tl.constexpr):
    """Chunk c of Q4_K blocks at byte offsets base [BN, 1] (scale words w0-w2, d and -dmin [BN, 1]): its 64
    values q d sc - dmin m in dt [BN, 64], in K order (sub-block 2 c's, in the 32 bytes' low nibbles, then 2 c +
    1's, in their high ones)."""
    sc_lo, m_lo = _k_scale_min_of(w0, w1, w2, 2 * c)
    sc_hi, m_hi = _k_scale_min_of(w0, w1, w2, 2 * c + 1)
    lo, hi = _nibbles_scaled(tl.load(w_ptr + base + 16 + 32 * c + tl.arange(0, 32)[None, :]), (d * sc_lo).to(dt),
                             (dmin * m_lo).to(dt), (d * sc_hi).to(dt), (dmin * m_hi).to(dt), dt, ASM)
    return _cat_k(lo, hi)


@triton.jit
def _q80_values(w_ptr, s_ptr, rows, stride_wn, stride_sn, g, K, dt: tl.constexpr, IEEE: tl.constexpr,
                ASM: tl.constexpr):
    """Q8_0 block g of rows [BN, 1]: its values q d [BN, 32], in dt rounded once (_signed_bytes), or in float32
    (IEEE); zero past K."""
    inside = g < K // 32
    qb = tl.load(w_ptr + rows * stride_wn + 32 * g + tl.arange(0, 32)[None, :], mask=inside, other=0)
    d = tl.load(s_ptr + rows * stride_sn + g, mask=inside, other=0.0)
    if IEEE:
        return qb.to(tl.int8, bitcast=True).to(tl.float32) * d.to(tl.float32)
    return _signed_bytes(qb, d.to(dt), dt, ASM)


@triton.jit
def _q80_pair(w_ptr, s_ptr, rows, stride_wn, stride_sn, g, K, dt: tl.constexpr, IEEE: tl.constexpr,
              ASM: tl.constexpr):
    """Q8_0 blocks g and g + 1 side by side: their values [BN, 64] (_q80_values)."""
    return _cat_k(_q80_values(w_ptr, s_ptr, rows, stride_wn, stride_sn, g, K, dt, IEEE, ASM),
                  _q80_values(w_ptr, s_ptr, rows, stride_wn, stride_sn, g + 1, K, dt, IEEE, ASM))


@triton.jit
def _wide_rows_kernel(x_ptr, w_ptr, w16_ptr, w32_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_ym, FP8_BN, FP8_BK, FMT: tl.constexpr,
                      BLOCK: tl.constexpr, TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                      FP8_BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                      ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """y [M, N] = x @ W.T for 2 to FUSED_MAX_ROWS rows of x on FP8 (128 columns a step: W as stored, widened
    exactly to x's dtype, as every float8_e4m3fn value is a bfloat16 and a float16; one tensor-core product, then
    its rows' scale), INT4 (a group a step: its two nibble planes are its two halves, q - z exactly in x's dtype
    (_nibbles_less_zero), side by side in registers (_cat_k): one product with the group's columns of x, then the
    rows' scale), Q4_K (a block a step: each sub-block's values q d sc - dmin m made in x's dtype, rounded once
    (_nibbles_scaled), a product of two chunks' 128 columns accumulated in place), Q8_0 (WIDE_Q8_0_STEP values a
    step: each block's values q d made in x's dtype, rounded once (_signed_bytes), the blocks side by side in one
    product) or another K-quant (a block a step, its values made in K order half a block at a time, in x's dtype:
    a product with x's contiguous 128 columns; float32 x takes this way on Q4_K too). Wide tiles of W, K split
    over program axis 2 (_rows_result)."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = _rows_tile(M, N, BLOCK_N, BLOCK_M)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = _k_run(tl.cdiv(K, BLOCK), tl.program_id(2), SPLIT)
    for kb in tl.range(first, last):
        if FMT == FP8:
            k = tl.arange(0, BLOCK)
            w = tl.load(w_ptr + rows * stride_wn + kb * BLOCK + k[None, :])
            if FP8_BITS:
                w = _fp8_bits_to_f32(w)
            x = tl.load(x_ptr + xm * stride_xm + kb * BLOCK + k[:, None])
            if IEEE:
                dot = tl.dot(w.to(tl.float32), x, input_precision="ieee")
            else:
                dot = tl.dot(w.to(dt), x)
            acc += tl.load(s_ptr + (rows // FP8_BN) * stride_sn + (kb * BLOCK) // FP8_BK) * dot
        elif FMT == INT4:
            H: tl.constexpr = BLOCK // 2
            k = tl.arange(0, H)
            qb = tl.load(w_ptr + rows * stride_wn + kb * H + k[None, :])
            s = tl.load(s_ptr + rows * stride_sn + kb).to(tl.float32)
            z = tl.load(z_ptr + rows * stride_sn + kb)
            x = x_ptr + xm * stride_xm + kb * BLOCK + tl.arange(0, BLOCK)[:, None]
            if IEEE:
                q = qb.to(tl.int32)
                lo = ((q & 15).to(tl.float32) - z.to(tl.float32)) * s
                hi = ((q >> 4).to(tl.float32) - z.to(tl.float32)) * s
                acc = tl.dot(_cat_k(lo, hi), tl.load(x), acc, input_precision="ieee")
            else:  # q - z exactly in x's dtype, the group's scale on the product
                lo, hi = _nibbles_less_zero(qb, z, dt, ASM)
                acc += s * tl.dot(_cat_k(lo, hi), tl.load(x))
        elif FMT == Q4_K and not IEEE:  # each sub-block's values q d sc - dmin m in x's dtype (_nibbles_scaled)
            base = rows * stride_wn + kb * TYPE_SIZE
            d = _f16(w16_ptr, base)
            dmin = -_f16(w16_ptr, base + 2)
            w0 = tl.load(w32_ptr + base // 4 + 1)
            w1 = tl.load(w32_ptr + base // 4 + 2)
            w2 = tl.load(w32_ptr + base // 4 + 3)
            # Two chunks' values a product of 128 columns (fewer, longer wgmmas, each waited for once), the block's
            # two chained into an accumulator of their own: chained across the loop into acc, ptxas serializes them.
            block = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for p in tl.static_range(2):
                w = _cat_k(_q4k_chunk(w_ptr, base, w0, w1, w2, d, dmin, 2 * p, dt, ASM),
                           _q4k_chunk(w_ptr, base, w0, w1, w2, d, dmin, 2 * p + 1, dt, ASM))
                block = tl.dot(w, tl.load(x_ptr + xm * stride_xm + kb * BLOCK + 128 * p + tl.arange(0, 128)[:, None]),
                               block)
            acc += block
        elif FMT == Q8_0:  # a step of WIDE_Q8_0_STEP // 32 = 4 blocks (those past K masked), one product
            tl.static_assert(BLOCK == 128)
            w = _cat_k(_q80_pair(w_ptr, s_ptr, rows, stride_wn, stride_sn, 4 * kb, K, dt, IEEE, ASM),
                       _q80_pair(w_ptr, s_ptr, rows, stride_wn, stride_sn, 4 * kb + 2, K, dt, IEEE, ASM))
            k = kb * BLOCK + tl.arange(0, BLOCK)[:, None]
            x = tl.load(x_ptr + xm * stride_xm + k, mask=k < K, other=0.0)
            if IEEE:
                acc = tl.dot(w, x, acc, input_precision="ieee")
            else:
                acc += tl.dot(w, x)
        else:  # (half a block of float32 values a thread block holds in registers without spilling, 64 rows of W)
            base = (rows * stride_wn + kb * TYPE_SIZE)[:, :, None]
            k = tl.arange(0, 128)
            block = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # (chained here, not into acc: see Q4_K's)
            for half in tl.static_range(2):
                w = _kquant_values(w_ptr, w16_ptr, w32_ptr, base, (s_ptr + rows * stride_sn + kb)[:, :, None], FMT,
                                   4 * half, 4)
                w = tl.reshape(w, (BLOCK_N, 128))
                x = tl.load(x_ptr + xm * stride_xm + kb * BLOCK + 128 * half + k[:, None])
                if IEEE:
                    block = tl.dot(w, x, block, input_precision="ieee")
                else:
                    block = tl.dot(w.to(dt), x, block)
            acc += block
    _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS: tl.constexpr,
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


@triton.jit
def _k_run(n_blocks, pid_k, SPLIT: tl.constexpr):
    """The blocks [first, last) of K that program pid_k of SPLIT walks (none for the last ones of an uneven split)."""
    per = tl.cdiv(n_blocks, SPLIT)
    first = pid_k * per
    return first, tl.minimum(first + per, n_blocks)


@triton.jit
def _i8(ptr):
    return tl.load(ptr).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _in_order(lo, hi, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """_tile's two planes of a 32-value-block, INT4 or FP8 format -> the tile [BLOCK_N, NB * BLOCK] in K order, so
    that a store of it is contiguous (value l of a block's low plane at l, the high plane BLOCK / 2 further)."""
    t = tl.join(tl.reshape(lo, (BLOCK_N, NB, BLOCK // 2)), tl.reshape(hi, (BLOCK_N, NB, BLOCK // 2)))
    return tl.reshape(tl.permute(t, (0, 1, 3, 2)), (BLOCK_N, NB * BLOCK))


@triton.jit
def _kquant_values(w_ptr, w16_ptr, w32_ptr, base, d_ptrs, FMT: tl.constexpr, S0: tl.constexpr = 0,
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
    sc, mn = _k_scale_min(w32_ptr, b5, 2 * c + h)
    v = (_f16(w16_ptr, b5) * sc) * q.to(tl.float32) - _f16(w16_ptr, b5 + 2) * mn
    return tl.reshape(v, (base.shape[0], NS, 32))


@triton.jit(do_not_specialize=["M"])
def _qgemm_kernel(x_ptr, w_ptr, w16_ptr, w32_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
                  stride_wn, stride_sn, stride_ym, FP8_BN, FP8_BK, FMT: tl.constexpr, BLOCK: tl.constexpr,
                  TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, FP8_BITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """y [M, N] = x @ W.T on a float tile of W's dequantized values; K's steps split over program axis 2
    (_rows_result)."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)[:, None, None]  # clamped: loads stay inside W, stores are masked
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    m_mask = offs_m[None, :] < M
    n_blocks = K // BLOCK
    H: tl.constexpr = BLOCK // 2
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    FMA: tl.constexpr = BLOCK_M <= FMA_MAX_M
    acc3 = tl.zeros((BLOCK_N, NB * H, BLOCK_M) if FMA else (1, 1, 1), dtype=tl.float32)
    # More rows on Q4_K and Q5_K (one block a step): the block's values made in K order (_kquant_values) and one
    # product with x's contiguous 256 columns, not two planes against gathered columns (Q6_K's planes stay cheaper)
    KQ_DOT: tl.constexpr = not FMA and (FMT == Q4_K or FMT == Q5_K)
    first, last = _k_run(tl.cdiv(K, NB * BLOCK), tl.program_id(2), SPLIT)
    for step in tl.range(first, last):
        k0 = step * (NB * BLOCK)
        kb0 = k0 // BLOCK
        kb = kb0 + tl.arange(0, NB)[None, :, None]
        if KQ_DOT:
            tl.static_assert(NB == 1)
            base = rows.to(tl.int64) * stride_wn + kb0 * TYPE_SIZE  # (NB 1: every step a whole block)
            w = tl.reshape(_kquant_values(w_ptr, w16_ptr, w32_ptr, base, s_ptr, FMT), (BLOCK_N, BLOCK))
            x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK))[:, None], mask=m_mask, other=0.0)
            if IEEE:
                acc = tl.dot(w, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(dt), x, acc)
        else:
            lo, hi, p_lo, p_hi = _tile(w_ptr, w16_ptr, w32_ptr, s_ptr, z_ptr, rows, tl.minimum(kb, n_blocks - 1),
                                       stride_wn, stride_sn, FP8_BN, FP8_BK, FMT, BLOCK, TYPE_SIZE, NB, BLOCK_N,
                                       FP8_BITS)
            # Blocks past the row's end (a last partial step) were read as the last block: x is zero against them
            x_mask = m_mask & ((kb0 + tl.arange(0, NB * H) // H) < n_blocks)[:, None]
            x_lo = tl.load(x_rows + p_lo[:, None], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + p_hi[:, None], mask=x_mask, other=0.0)
            if FMA:  # products on the CUDA cores, summed over K once after the loop; the weights rounded to x's
                # dtype first, as on the tensor cores and in the dequantized model
                w_lo = lo.to(dt).to(tl.float32)
                w_hi = hi.to(dt).to(tl.float32)
                acc3 += w_lo[:, :, None] * x_lo.to(tl.float32)[None, :, :]
                acc3 += w_hi[:, :, None] * x_hi.to(tl.float32)[None, :, :]
            elif IEEE:  # float32 x: full-precision products, not TF32
                acc = tl.dot(lo, x_lo, acc, input_precision="ieee")
                acc = tl.dot(hi, x_hi, acc, input_precision="ieee")
            else:
                acc = tl.dot(lo.to(dt), x_lo, acc)
                acc = tl.dot(hi.to(dt), x_hi, acc)
    if FMA:
        acc = tl.sum(acc3, axis=1)
    _rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _dequant_kernel(w_ptr, w16_ptr, w32_ptr, s_ptr, z_ptr, out_ptr, ids_ptr, row0, N, K, stride_wn, stride_sn,
                    stride_on, FP8_BN, FP8_BK, FMT: tl.constexpr, BLOCK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                    FP8_BITS: tl.constexpr, GATHER: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """Rows row0 .. row0 + N of W (GATHER: rows ids[0 .. N], an embedding lookup) -> out [N, K] in out's
    dtype."""
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATHER:
        rows = tl.load(ids_ptr + tl.minimum(offs_n, N - 1))[:, None, None]
    else:
        rows = (row0 + tl.minimum(offs_n, N - 1))[:, None, None]
    n_blocks = K // BLOCK
    if FMT == Q8_0 or FMT == INT4 or FMT == FP8:
        # A block at a time, no mask along K (as the K-quants' below) and no planes to interleave: Q8_0's and
        # FP8's values lie in K order, and INT4's two nibble planes are its block's two contiguous halves.
        H: tl.constexpr = BLOCK // 2
        rows = tl.reshape(rows, (BLOCK_N, 1))
        row_off = rows.to(tl.int64) * stride_wn
        at = out_ptr + offs_n[:, None].to(tl.int64) * stride_on
        keep = (offs_n < N)[:, None]
        for b in tl.static_range(NB):
            kb = tl.program_id(1) * NB + b
            if kb < n_blocks:
                if FMT == INT4:
                    l = tl.arange(0, H)[None, :]
                    q = tl.load(w_ptr + row_off + kb * H + l).to(tl.int32)
                    sz = rows.to(tl.int64) * stride_sn + kb
                    s = tl.load(s_ptr + sz).to(tl.float32)
                    z = tl.load(z_ptr + sz).to(tl.float32)
                    tl.store(at + kb * BLOCK + l, (((q & 15).to(tl.float32) - z) * s).to(out_ptr.dtype.element_ty),
                             mask=keep)
                    tl.store(at + kb * BLOCK + H + l, (((q >> 4).to(tl.float32) - z) * s).to(out_ptr.dtype.element_ty),
                             mask=keep)
                else:
                    l = tl.arange(0, BLOCK)[None, :]
                    if FMT == Q8_0:
                        q = tl.load(w_ptr + row_off + kb * TYPE_SIZE + l).to(tl.int8, bitcast=True).to(tl.float32)
                        s = tl.load(s_ptr + rows.to(tl.int64) * stride_sn + kb).to(tl.float32)
                    else:
                        q = tl.load(w_ptr + row_off + kb * BLOCK + l)
                        q = _fp8_bits_to_f32(q) if FP8_BITS else q.to(tl.float32)
                        s = tl.load(s_ptr + (rows // FP8_BN).to(tl.int64) * stride_sn + (kb * BLOCK) // FP8_BK)
                    tl.store(at + kb * BLOCK + l, (q * s).to(out_ptr.dtype.element_ty), mask=keep)
    elif FMT == Q4_K or FMT == Q5_K or FMT == Q6_K:
        # A block at a time and no mask along K, so loads and stores run 16 bytes wide (a mask of runtime bound
        # on the contiguous axis leaves them a value each).
        row_off = rows.to(tl.int64) * stride_wn
        at = (out_ptr + offs_n[:, None, None].to(tl.int64) * stride_on + 32 * tl.arange(0, 8)[None, :, None]
              + tl.arange(0, 32)[None, None, :])
        keep = (offs_n < N)[:, None, None]
        for b in tl.static_range(NB):
            kb = tl.program_id(1) * NB + b
            if kb < n_blocks:
                values = _kquant_values(w_ptr, w16_ptr, w32_ptr, row_off + kb * TYPE_SIZE,
                                        s_ptr + rows.to(tl.int64) * stride_sn + kb, FMT)
                tl.store(at + kb * 256, values.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        kb = tl.minimum(tl.program_id(1) * NB + tl.arange(0, NB)[None, :, None], n_blocks - 1)
        lo, hi, _, _ = _tile(w_ptr, w16_ptr, w32_ptr, s_ptr, z_ptr, rows, kb, stride_wn, stride_sn, FP8_BN, FP8_BK,
                             FMT, BLOCK, TYPE_SIZE, NB, BLOCK_N, FP8_BITS)
        cols = tl.program_id(1) * (NB * BLOCK) + tl.arange(0, NB * BLOCK)
        mask = (offs_n[:, None] < N) & (cols < n_blocks * BLOCK)[None, :]
        tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + cols[None, :],
                 _in_order(lo, hi, BLOCK, BLOCK_N, NB).to(out_ptr.dtype.element_ty), mask=mask)


class _Tensors(NamedTuple):
    """What a kernel reads of a part: its data (and, for GGUF, as float16 for the scales and as int32 words for
    the K-quants' quants), scale and zero (the data where the format has none) and the row strides."""

    w: torch.Tensor
    w16: torch.Tensor
    w32: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    stride_wn: int  # in w's elements (bytes for GGUF)
    stride_sn: int


def _tensors(part: QuantizedTensor) -> _Tensors:
    data = part.data
    if isinstance(part.format, FP8Format) and INTERPRET:
        data = data.view(torch.uint8)
    gguf = isinstance(part.format, GGUFFormat)
    words = (gguf and part.format.name in ("Q8_0", "Q4_K", "Q5_K", "Q6_K")) or isinstance(part.format, Int4Format)
    scale = part.scale if part.scale is not None else data
    flat = data.reshape(-1)
    return _Tensors(data, data.view(torch.float16) if gguf else data,
                    flat[:flat.numel() // 4 * 4].view(torch.int32) if words else data,
                    scale, part.zero if part.zero is not None else data, data.stride(0),
                    scale.stride(0) if scale.dim() == 2 else 0)


def takes_int8_x(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether x's product with the part reads x as an Int8X: 16-bit rows on Q4_K, Q6_K, Q8_0 or INT4 (groups of a
    power of two from 64 values), up to the format's max_rows (float32 rows keep their full precision)."""
    lay = _layout(part)
    kernels = _INT8_X_KERNELS.get(lay.code)
    if kernels is None or x.shape[0] > kernels.max_rows or x.dtype == torch.float32:
        return False
    return not kernels.grouped or (lay.block >= 64 and is_power_of_two(lay.block))


def takes_few_rows(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether x's product with the part runs a format's dp4a kernel of 2 to few_rows rows (_Int8Kernels.few)."""
    return takes_int8_x(x, part) and _INT8_X_KERNELS[_layout(part).code].takes_few(x.shape[0])


def takes_wide_rows(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether x's product with the part runs on _wide_rows_kernel: past _WIDE_PAST's rows of its format."""
    return _wide_format(_layout(part), x.shape[0]) and not takes_int8_x(x, part)


def _wide_format(lay: _Layout, m: int) -> bool:
    """takes_wide_rows for a product that does not take an Int8X x."""
    return lay.code in _WIDE_PAST and m > _WIDE_PAST[lay.code]


def has_wide_tiles(part: QuantizedTensor) -> bool:
    """Whether _wide_rows_kernel reads the part's format (wide_linear), at whatever rows its products take it."""
    return _layout(part).code in _WIDE_PAST


def fused_linear(x: torch.Tensor, part: QuantizedTensor, bias: torch.Tensor | None, y: torch.Tensor,
                 config: QuantGemmConfig | None = None, x8: Int8X | None = None,
                 tickets: torch.Tensor | None = None) -> None:
    """y [M, rows] (a column slice of the output is fine) = x @ part.T (+ bias), on the fused kernel. x8: x as an
    Int8X where takes_int8_x (made here if not given: a caller with several parts makes it once, zeroing their
    split-K `tickets` on the way: ticket_count of each)."""
    m = x.shape[0]
    n, k = part.shape  # (x8 may hold a product's input made from x: quantize_x's norm or silu_mul)
    lay = _layout(part)
    t = _tensors(part)
    pdl = pdl_args(use_pdl(x))
    if takes_int8_x(x, part):
        _int8_x_product(x8 or quantize_x(x), t, _INT8_X_KERNELS[lay.code], lay.block, bias, y, m, n, k,
                        config or int8_x_config(m, part), tickets, pdl)
        return
    if _wide_format(lay, m):
        wide_linear(x, part, bias, y, config, tickets)
        return
    cfg = config or default_config(m, lay.block, n, k)
    tiles = _tiles(cfg, m, n)
    partials, tickets = _split_k_buffers(cfg.split_k, tiles, m, n, y, tickets)
    _qgemm_kernel[(*tiles, cfg.split_k)](
        x, t.w, t.w16, t.w32, t.scale, t.zero, bias if bias is not None else t.scale, y, partials, tickets, m, n, k,
        x.stride(0), t.stride_wn, t.stride_sn, y.stride(0), lay.fp8_block_n, lay.fp8_block_k, FMT=lay.code,
        BLOCK=lay.block, TYPE_SIZE=lay.type_size, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        FP8_BITS=INTERPRET, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NB=cfg.blocks, SPLIT=cfg.split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)


def wide_linear(x: torch.Tensor, part: QuantizedTensor, bias: torch.Tensor | None, y: torch.Tensor,
                config: QuantGemmConfig | None = None, tickets: torch.Tensor | None = None) -> None:
    """fused_linear on _wide_rows_kernel (a part where has_wide_tiles): what takes_wide_rows products run, and what
    bench quant --tune times beside the Int8X kernels at fewer rows."""
    m = x.shape[0]
    n, k = part.shape
    lay = _layout(part)
    t = _tensors(part)
    cfg = config or wide_rows_config(m, part)
    tiles = _tiles(cfg, m, n)
    partials, tickets = _split_k_buffers(cfg.split_k, tiles, m, n, y, tickets)
    _wide_rows_kernel[(*tiles, cfg.split_k)](
        x, t.w, t.w16, t.w32, t.scale, t.zero, bias if bias is not None else y, y, partials, tickets, m, n, k,
        x.stride(0), t.stride_wn, t.stride_sn, y.stride(0), lay.fp8_block_n, lay.fp8_block_k, FMT=lay.code,
        BLOCK=wide_step(lay), TYPE_SIZE=lay.type_size, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        FP8_BITS=INTERPRET, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, SPLIT=cfg.split_k, ASM=not INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(use_pdl(x)))


def wide_step(lay: _Layout) -> int:
    """The values of K a wide tile's loop step takes (its BLOCK): a block, or WIDE_Q8_0_STEP of Q8_0's."""
    return WIDE_Q8_0_STEP if lay.code == Q8_0.value else lay.block


def _tiles(cfg: QuantGemmConfig, m: int, n: int) -> tuple[int, int]:
    """A product's output tiles along W's rows and x's rows (program axes 0 and 1)."""
    return triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)


def ticket_count(m: int, part: QuantizedTensor, config: QuantGemmConfig) -> int:
    """The split-K tickets an Int8X product of m rows with the part takes at `config` (0 without a split)."""
    if config.split_k == 1:
        return 0
    tiles = _tiles(config, m, part.shape[0])
    return tiles[0] * tiles[1]


def _int8_x_product(x8: Int8X, t: _Tensors, kernels: _Int8Kernels, block: int, bias: torch.Tensor | None,
                    y: torch.Tensor, m: int, n: int, k: int, cfg: QuantGemmConfig, tickets: torch.Tensor | None,
                    pdl: dict) -> None:
    """y = x8 @ W.T (+ bias) on the format's Int8X kernels: one row's (dp4a) or more rows' (int8 tensor cores). A
    split K writes partial sums to a buffer of this call and takes tickets from a counter per output tile, zeroed
    (`tickets`: by quantize_x; else here), all graph-safe: fixed sizes; without a split neither is made."""
    tiles = _tiles(cfg, m, n)
    partials, tickets = _split_k_buffers(cfg.split_k, tiles, m, n, y, tickets)
    b = y if bias is None else bias
    meta = dict(HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, SPLIT=cfg.split_k, ASM=not INTERPRET,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
                **(dict(z_ptr=t.zero, GROUP=block) if kernels.grouped else {}))
    if m == 1:
        kernels.row[(*tiles, cfg.split_k)](x8.q.view(torch.int32), x8.scale, x8.sums, t.w, t.w16, t.w32, t.scale, b,
                                           y, partials, tickets, n, k, t.stride_wn // kernels.row_stride_unit,
                                           t.stride_sn, **meta, **({"NB": cfg.blocks} if kernels.grouped else {}))
    else:
        kernel = kernels.few if kernels.takes_few(m) else kernels.rows
        kernel[(*tiles, cfg.split_k)](x8.q, x8.scale, x8.sums, t.w, t.w16, t.w32, t.scale, b, y, partials, tickets,
                                      m, n, k, t.stride_wn, t.stride_sn, y.stride(0), BLOCK_M=cfg.block_m, **meta)


def _split_k_buffers(split_k: int, tiles: tuple[int, int], m: int, n: int, y: torch.Tensor,
                     tickets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K product's partial sums and its zeroed ticket per output tile (_rows_result): `tickets` where the
    caller had them zeroed, else zeros made here; without a split, y twice (unread)."""
    if split_k == 1:
        return y, y
    if tickets is None:
        tickets = torch.zeros(tiles[0] * tiles[1], dtype=torch.int32, device=y.device)
    return torch.empty((split_k, m, n), dtype=torch.float32, device=y.device), tickets


class _Int8Kernels(NamedTuple):
    """A format's kernels on an Int8X x (each takes the same arguments as the others of its kind, reading the views
    of W it needs)."""

    row: triton.JITFunction  # one row (dp4a)
    row_stride_unit: int  # bytes of the unit `row` takes W's row stride in
    max_rows: int  # 16-bit rows up to which x is read as an Int8X (past them a format's wide tiles: _WIDE_PAST)
    rows: triton.JITFunction | None = None  # past few_rows to max_rows rows (int8 tensor cores)
    rows_block_n: int = 64  # rows of W a `rows` program takes (rows_config)
    grouped: bool = False  # INT4: the kernels also take z_ptr (the zero points) and GROUP (values per scale)
    few: triton.JITFunction | None = None  # 2 to few_rows rows: `row`'s dp4a products, W read once for all of x
    few_rows: int = 0

    def takes_few(self, m: int) -> bool:
        return self.few is not None and 1 < m <= self.few_rows


# Which kernel takes how many rows (bench quant --kernels, which times the wide tiles beside an Int8X product; the
# tables in docs/benchmarks.md). The dp4a kernels (few) compute x's rows one after another: they outrun the int8
# tensor-core tiles, which change layout at every 32 columns, at two rows (Q4_K: four) and fall behind past that;
# past them Q4_K's and INT4's wide tiles (the exact quants, no int-to-float conversion) outrun the int8 tiles,
# which Q4_K and INT4 therefore have none of. Q8_0's int8 tiles outrun its wide ones up to 16 rows, Q6_K's (which
# has no wide tiles: made the same way, per 16 values, they read 1.2x slower at 32 rows) up to FUSED_MAX_ROWS. Q8_0
# up to 16 rows reads faster at 128 rows of W a program than at 64, Q6_K not. (Those wide tiles were timed while
# ptxas serialized their wgmmas, and Q8_0's since became one product a step: the rows are to be timed again.)
_INT8_X_KERNELS = {Q4_K.value: _Int8Kernels(_q4k_row_q8_kernel, 4, 4, few=_q4k_few_rows_kernel, few_rows=4),
                   Q6_K.value: _Int8Kernels(_q6k_row_q8_kernel, 1, FUSED_MAX_ROWS, _q6k_rows_q8_kernel,
                                            few=_q6k_few_rows_kernel, few_rows=2),
                   Q8_0.value: _Int8Kernels(_q80_row_q8_kernel, 4, 16, _q80_rows_q8_kernel, 128),
                   INT4.value: _Int8Kernels(_int4_row_q8_kernel, 4, 2, grouped=True, few=_int4_few_rows_kernel,
                                            few_rows=2)}
# Rows past which a format's products run on the wide tiles: FP8 past one; Q5_K past a verify step's 16 (below,
# its float tile); the Int8X formats that have them past their max_rows.
_WIDE_PAST = {FP8.value: 1, Q5_K.value: 16, **{code: kernels.max_rows for code, kernels in _INT8_X_KERNELS.items()
                                                if kernels.max_rows < FUSED_MAX_ROWS}}


def dequantize_rows(part: QuantizedTensor, rows: int | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of the part dequantized into out [R, K] (row-major): rows rows .. rows + R (an int), or the rows a
    tensor of R ids names (an embedding lookup)."""
    n, k = out.shape
    lay = _layout(part)
    cfg = default_config(1, lay.block, n)
    t = _tensors(part)
    gather = isinstance(rows, torch.Tensor)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(k // lay.block, cfg.blocks))
    _dequant_kernel[grid](t.w, t.w16, t.w32, t.scale, t.zero, out, rows if gather else t.w, 0 if gather else rows, n,
                          k, t.stride_wn, t.stride_sn, out.stride(0), lay.fp8_block_n, lay.fp8_block_k,
                          FMT=lay.code, BLOCK=lay.block, TYPE_SIZE=lay.type_size, FP8_BITS=INTERPRET, GATHER=gather,
                          BLOCK_N=cfg.block_n, NB=cfg.blocks, num_warps=cfg.num_warps, **pdl_args(use_pdl(out)))
    return out


_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scratch(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The prefill path's dequantization buffer of this device and dtype (SCRATCH_MB), made on first use."""
    key = (device, dtype)
    if key not in _scratch:
        elems = int(SCRATCH_MB * 2**20) // torch.empty((), dtype=dtype).element_size()
        _scratch[key] = torch.empty(elems, dtype=dtype, device=device)
    return _scratch[key]


def takes_prologue(x: torch.Tensor, parts: list[QuantizedTensor]) -> bool:
    """Can quantized_linear make its input from x in the launch that quantizes it (a norm, SwiGLU's activation)?
    Where every part reads x as an Int8X."""
    return x.shape[0] <= FUSED_MAX_ROWS and all(takes_int8_x(x, part) for part in parts)


def quantized_linear(x: torch.Tensor, parts: list[QuantizedTensor], bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                     norm: RowNorm | None = None, silu_mul: bool = False) -> torch.Tensor:
    """ops.linear for a QuantizedWeight (its `parts`, W's rows in order) on CUDA: fused kernels up to
    FUSED_MAX_ROWS rows, else FP8 parts on the FP8 tensor cores where takes_fp8_mm and the other parts'
    dequantized chunks of W (scratch) through cuBLAS. Where takes_prologue, the input
    may be RMSNorm(x [+ residual]) * weight (`norm`) or, for x = [gate | up], silu(gate) * up (`silu_mul`), made
    as x is quantized (quantize_x): at decode a pre-norm projection is then two launches, not three."""
    from outrider.kernels import ops

    if (norm is not None or silu_mul) and not takes_prologue(x, parts):
        raise ValueError("a norm or activation folds into the product only where every part reads x as an Int8X")
    x = x.contiguous()
    m, k = x.shape
    if (m > FUSED_MAX_ROWS and out is None and len(parts) == 1 and out_dtype in (None, x.dtype)
            and takes_fp8_mm(x, parts[0])):
        return fp8_mm(x, parts[0], bias)  # (its own output: no copy into one made here)
    n = sum(part.shape[0] for part in parts)
    y = out if out is not None else torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    row = 0
    # The parts read one Int8X x where they take one (quantize_x zeroes their split-K tickets, one buffer)
    configs = [int8_x_config(m, part) if takes_int8_x(x, part) else None for part in parts]
    counts = [0 if cfg is None else ticket_count(m, part, cfg) for part, cfg in zip(parts, configs)]
    tickets = torch.empty(sum(counts), dtype=torch.int32, device=x.device) if sum(counts) else None
    x8 = quantize_x(x, tickets, norm, silu_mul) if any(cfg is not None for cfg in configs) else None
    first = 0
    for part, cfg, count in zip(parts, configs, counts):
        size = part.shape[0]
        part_bias = None if bias is None else bias[row:row + size]
        if m <= FUSED_MAX_ROWS:
            fused_linear(x, part, part_bias, y[:, row:row + size], cfg, x8, None if tickets is None or not count
                         else tickets[first:first + count])
            first += count
        elif takes_fp8_mm(x, part):
            y[:, row:row + size] = fp8_mm(x, part, part_bias)
        else:
            buf = scratch(x.device, x.dtype)
            chunk = max(1, min(size, buf.numel() // k))
            for r in range(0, size, chunk):
                rows = min(chunk, size - r)
                w = dequantize_rows(part, r, buf[:rows * k].view(rows, k))
                ops.linear(x, w, None if part_bias is None else part_bias[r:r + rows], out_dtype=y.dtype,
                           out=y[:, row + r:row + r + rows])
        row += size
    return y
