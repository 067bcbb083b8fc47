"""Products that read x as an Int8X: 16-bit rows on Q4_K, Q6_K, Q8_0 or INT4 read x as llama.cpp's CUDA kernels
do, quantized once per product to int8 groups of 32 (Int8X, one small launch, which also makes a pre-norm
projection's normed input or the down projection's SiLU·mul: quant_gemm.takes_prologue), and the scales meet
integer sums once a group (INT8_X_KERNELS). One row (decode): four quants meet four x values in one byte-wise dot
(dp4a); nothing crosses threads inside the loops. A few rows: the same dp4a products, W read once for all of them.
More rows (verify, batches; Q6_K and Q8_0 up to their max_rows): each group's quants, as int8, meet x's int8
columns on the tensor cores; past a format's Int8X rows, its wide tiles (quant_wide.py).

quant_gemm.py routes a product here (takes_int8_x); the configs are explicit (row_config, rows_config, ...).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from outrider.kernels.fused import pdl_enter, rms_normed_tile, silu_mul_tile
from outrider.kernels.gemm import RowNorm
from outrider.kernels.launch import pdl_args, use_pdl
from outrider.kernels.quant_blocks import (FUSED_MAX_ROWS, INT4, INTERPRET, Q4_K, Q6_K, Q8_0, ROW_PROGRAMS, WIDE_SPLIT,
                                           PartTensors, QuantGemmConfig, is_k_quant, k_run, k_scale_min_of, k_splits,
                                           layout_of, output_tiles, rows_result, rows_tile, split_k_buffers)
from outrider.quant.tensor import QuantizedTensor


def row_config(n: int, k: int) -> QuantGemmConfig:
    """One row as an Int8X: 32 rows of W a program, K split by k_splits."""
    return QuantGemmConfig(block_n=32, block_m=1, blocks=1, split_k=k_splits(k, triton.cdiv(n, 32)))


def grouped_row_config(n: int, k: int) -> QuantGemmConfig:
    """One row on INT4's kernel (bench quant --kernels --tune at Qwen3-8B's shapes): a long row (down_proj) 64 rows
    of W a program, a group a step, K split by k_splits; a weight whose 16-row tiles are a half to a whole
    ROW_PROGRAMS (qkv, o) 16 rows a program on 8 warps, 4 groups a step, whole rows; others (gate_up, and weights
    too small to fill the GPU that way) 32 rows, 2 groups a step, K split by k_splits."""
    if k > 4096:
        return QuantGemmConfig(block_n=64, block_m=1, blocks=1, split_k=k_splits(k, triton.cdiv(n, 64)))
    if ROW_PROGRAMS // 2 <= triton.cdiv(n, 16) <= ROW_PROGRAMS:
        return QuantGemmConfig(block_n=16, block_m=1, blocks=4, num_warps=8)
    return QuantGemmConfig(block_n=32, block_m=1, blocks=2, split_k=k_splits(k, triton.cdiv(n, 32)))


def rows_config(m: int, n: int, k: int, block_n: int = 64, most: int = 8) -> QuantGemmConfig:
    """More rows on an Int8X (_Int8Kernels.rows): block_n rows of W and 16 of x a program (past 16 rows of x, 64
    and 32), K split by k_splits over `most` programs at most."""
    block_m, block_n = (16, block_n) if m <= 16 else (32, 64)
    return QuantGemmConfig(block_n=block_n, block_m=block_m, blocks=1,
                           split_k=k_splits(k, triton.cdiv(n, block_n) * triton.cdiv(m, block_m), most))


def few_rows_config(m: int, n: int, k: int) -> QuantGemmConfig:
    """2 to few_rows rows on a dp4a kernel (_Int8Kernels.few): all of x's rows in one tile (each program reads its
    rows of W once), 32 rows of W a program as for one row, K split by k_splits."""
    return QuantGemmConfig(block_n=32, block_m=max(2, triton.next_power_of_2(m)), blocks=1,
                           split_k=k_splits(k, triton.cdiv(n, 32)))


def int8_x_config(m: int, part: QuantizedTensor) -> QuantGemmConfig:
    """The default config of an Int8X product of m rows with `part` (one where takes_int8_x)."""
    n, k = part.shape
    kernels = INT8_X_KERNELS[layout_of(part).code]
    if m == 1:
        return grouped_row_config(n, k) if kernels.grouped else row_config(n, k)
    if kernels.takes_few(m):
        return few_rows_config(m, n, k)
    return rows_config(m, n, k, kernels.rows_block_n, WIDE_SPLIT if m > 16 and is_k_quant(part) else 8)


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
def _f16_bits_to_f32(bits):
    """The float16 in the low 16 bits of int32 bits -> float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8(ptr):
    return tl.load(ptr).to(tl.int8, bitcast=True).to(tl.float32)


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
    first, last = k_run(n_blocks, pid_k, SPLIT)
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
        sc_lo, m_lo = k_scale_min_of(h1, h2, h3, 2 * chunk)
        sc_hi, m_hi = k_scale_min_of(h1, h2, h3, 2 * chunk + 1)
        dx_lo = tl.load(xd_ptr + kb * 8 + 2 * chunk)
        dx_hi = tl.load(xd_ptr + kb * 8 + 2 * chunk + 1)
        xs_lo = tl.load(xs_ptr + kb * 16 + 4 * chunk + quarter % 2)
        xs_hi = tl.load(xs_ptr + kb * 16 + 4 * chunk + 2 + quarter % 2)
        acc += d * (sc_lo * dx_lo * lo + sc_hi * dx_hi * hi) - dmin * (m_lo * xs_lo + m_hi * xs_hi)
        words, h0, h1, h2, h3 = nxt, n0, n1, n2, n3
    rows_result(tl.sum(acc, axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n, tl.arange(0, 1), 1, N, 0,
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
    first, last = k_run(n_blocks, pid_k, SPLIT)
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
    rows_result(tl.sum(acc, axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n, tl.arange(0, 1), 1, N, 0,
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
    first, last = k_run(tl.cdiv(K, 256), pid_k, SPLIT)
    acc = tl.zeros((BLOCK_N, 8), tl.float32)
    for kb in tl.range(first, last):
        inside = 8 * kb + g < K // 32
        w = tl.load(w32_ptr + row + 64 * kb + words, mask=inside[:, :, None], other=0)
        s = tl.sum(_dp4a(w, tl.load(xq_ptr + 64 * kb + words, mask=inside[:, :, None], other=0), ASM, True), axis=2)
        d = tl.load(d_ptr + rows * stride_d + 8 * kb + g, mask=inside, other=0.0).to(tl.float32)
        acc += d * (tl.load(xd_ptr + 8 * kb + g, mask=inside, other=0.0) * s.to(tl.float32))
    rows_result(tl.sum(acc, axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n, tl.arange(0, 1), 1, N, 0,
                HAS_BIAS, SPLIT)


@triton.jit
def _q4k_few_rows_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M,
                         N, K, stride_wn, stride_d, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """y [M, N] = x @ W.T on Q4_K for an Int8X x of 2 to few_rows rows (_Int8Kernels): _q4k_row_q8_kernel's dp4a
    products, W's block (read once, the next in flight) meeting x's rows one after another, each row's sum placed in
    the output tile [BLOCK_N, BLOCK_M]; no tile changes layout (int8 tensor-core tiles of a sub-block's 32 columns
    each do, eight a block)."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = rows_tile(M, N, BLOCK_N, BLOCK_M)
    row = rows * (stride_wn // 4)  # [BN, 1] word offsets of the rows
    xw_ptr = xq_ptr.to(tl.pointer_type(tl.int32))  # x's rows as words, K / 4 a row
    w = tl.arange(0, 32)[None, :]
    xw = 16 * (w // 8) + w % 8  # x word of a quant word's low nibbles
    quarter = tl.arange(0, 8)[None, :]  # four words of a chunk: sums xs 2 (2 chunk) + quarter % 2 (+ 2: high)
    chunk = quarter // 2
    column = tl.arange(0, BLOCK_M)[None, :]
    n_blocks = K // 256
    first, last = k_run(n_blocks, tl.program_id(2), SPLIT)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    words, h0, h1, h2, h3 = _q4k_block(w32_ptr, row, tl.minimum(first, n_blocks - 1), w)
    for kb in tl.range(first, last):
        nxt, n0, n1, n2, n3 = _q4k_block(w32_ptr, row, tl.minimum(kb + 1, last - 1), w)  # in flight meanwhile
        q_lo = words & 0x0F0F0F0F
        q_hi = (words >> 4) & 0x0F0F0F0F
        d = _f16_bits_to_f32(h0)
        dmin = _f16_bits_to_f32(h0 >> 16)
        sc_lo, m_lo = k_scale_min_of(h1, h2, h3, 2 * chunk)  # [BN, 8]
        sc_hi, m_hi = k_scale_min_of(h1, h2, h3, 2 * chunk + 1)
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
    rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _q6k_few_rows_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, w32_ptr, d_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M,
                         N, K, stride_wn, stride_d, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """_q6k_row_q8_kernel's dp4a products for an Int8X x of 2 to few_rows rows, as _q4k_few_rows_kernel: a block's
    quants and scales made once, then met by x's rows one after another, each row's sum placed in the output tile."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = rows_tile(M, N, BLOCK_N, BLOCK_M)
    row = rows * stride_wn  # [BN, 1] byte offsets of the rows
    xw_ptr = xq_ptr.to(tl.pointer_type(tl.int32))  # x's rows as words, K / 4 a row
    gn, gi, word_a, word_h, word_x = _q6k_words()
    column = tl.arange(0, BLOCK_M)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = k_run(K // 256, tl.program_id(2), SPLIT)
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
    rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


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
    offs_n, rows, offs_m, xm = rows_tile(M, N, BLOCK_N, BLOCK_M)
    row = rows * stride_wn
    j = tl.arange(0, 32)
    lower = (j < 16)[:, None]  # a scale group's half of x's 32 columns
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = k_run(K // 256, tl.program_id(2), SPLIT)
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
    rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


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
    offs_n, rows, offs_m, xm = rows_tile(M, N, BLOCK_N, BLOCK_M)
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = k_run(K // 32, tl.program_id(2), SPLIT)
    for g in tl.range(first, last):
        q = tl.load(w_ptr + rows * stride_wn + 32 * g + j[None, :]).to(tl.int8, bitcast=True)
        dot = tl.dot(q, tl.load(xq_ptr + xm * K + 32 * g + j[:, None]), out_dtype=tl.int32)
        d = tl.load(d_ptr + rows * stride_d + g).to(tl.float32)
        acc += d * (tl.load(xd_ptr + xm * (K // 32) + g) * dot.to(tl.float32))
    rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


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
    first, last = k_run(tl.cdiv(n_groups, NB), pid_k, SPLIT)
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
    rows_result(tl.sum(tl.sum(acc, axis=2), axis=1)[:, None], b_ptr, y_ptr, part_ptr, count_ptr, offs_n,
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
    offs_n, rows, offs_m, xm = rows_tile(M, N, BLOCK_N, BLOCK_M)
    xw_ptr = xq_ptr.to(tl.pointer_type(tl.int32))  # x's rows as words, K / 4 a row
    w = tl.arange(0, W)[None, :]
    quarter = tl.arange(0, W // 4)[None, :]  # 16 values: four words of a half
    column = tl.arange(0, BLOCK_M)[None, :]
    n_groups = K // GROUP
    first, last = k_run(n_groups, tl.program_id(2), SPLIT)
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
    rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


class _Int8Kernels(NamedTuple):
    """A format's kernels on an Int8X x (each takes the same arguments as the others of its kind, reading the views
    of W it needs)."""

    row: triton.JITFunction  # one row (dp4a)
    row_stride_unit: int  # bytes of the unit `row` takes W's row stride in
    max_rows: int  # 16-bit rows up to which x is read as an Int8X (past them its wide tiles: quant_gemm._WIDE_PAST)
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
# which Q4_K and INT4 therefore have none of. Q8_0's int8 tiles outrun its wide ones at 5 rows and trail them by
# about 4 % at 16 (where between they cross is not measured, so they keep 16); Q6_K's (which has no wide tiles:
# made the same way, per 16 values, they read 1.2x slower at 32 rows) up to FUSED_MAX_ROWS. Q8_0 up to 16 rows reads
# faster at 128 rows of W a program than at 64, Q6_K not.
INT8_X_KERNELS = {Q4_K.value: _Int8Kernels(_q4k_row_q8_kernel, 4, 4, few=_q4k_few_rows_kernel, few_rows=4),
                  Q6_K.value: _Int8Kernels(_q6k_row_q8_kernel, 1, FUSED_MAX_ROWS, _q6k_rows_q8_kernel,
                                           few=_q6k_few_rows_kernel, few_rows=2),
                  Q8_0.value: _Int8Kernels(_q80_row_q8_kernel, 4, 16, _q80_rows_q8_kernel, 128),
                  INT4.value: _Int8Kernels(_int4_row_q8_kernel, 4, 2, grouped=True, few=_int4_few_rows_kernel,
                                           few_rows=2)}


def int8_x_product(x8: Int8X, t: PartTensors, kernels: _Int8Kernels, block: int, bias: torch.Tensor | None,
                   y: torch.Tensor, m: int, n: int, k: int, cfg: QuantGemmConfig, tickets: torch.Tensor | None,
                   pdl: dict) -> None:
    """y = x8 @ W.T (+ bias) on the format's Int8X kernels: one row's (dp4a) or more rows' (int8 tensor cores). A
    split K writes partial sums to a buffer of this call and takes tickets from a counter per output tile, zeroed
    (`tickets`: by quantize_x; else here), all graph-safe: fixed sizes; without a split neither is made."""
    tiles = output_tiles(cfg, m, n)
    partials, tickets = split_k_buffers(cfg.split_k, tiles, m, n, y, tickets)
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
