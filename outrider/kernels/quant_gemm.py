"""Products with quantized weights on CUDA: y = x @ W.T for a QuantizedWeight W (outrider/quant), W never
dequantized to memory at decode. This module is the entry point: it routes each product to its kernels, and holds
the float-tile kernel and the dequantization of the prefill path.

Up to FUSED_MAX_ROWS rows (decode, verify, small batches) one Triton kernel reads the quantized blocks and
dequantizes them in registers: each program owns BLOCK_N rows of W and walks K a few blocks at a time. A block's
values split into two planes of half a block each (low and high nibbles for the 4/5-bit formats, the two halves
for Q8_0 and FP8), and each plane is multiplied by the columns of x it meets (gathered from x, which is small and
cached), so the quantized bytes are read once, contiguously, and no value is moved to its place in the row:
y^T [BLOCK_N, BLOCK_M] += plane [BLOCK_N, k'] @ x[:, plane's columns]^T, on the tensor cores, or for one or two
rows (FMA_MAX_M) as products on the CUDA cores summed over K once after the loop. Scales are loaded once per block
(or sub-block), not per value. More rows on Q4_K and Q5_K make each block's values in K order instead
(kquant_values: Q4_K and Q5_K quants read once, as words) for one product with x's contiguous columns.

16-bit rows on Q4_K, Q6_K, Q8_0 or INT4 read x as int8 groups of 32 up to a format's rows (quant_int8x.py:
takes_int8_x); past them, and past _WIDE_PAST's rows on FP8 and Q5_K, the wide tiles (quant_wide.py:
takes_wide_rows). Float32 rows keep their precision on the path above. What the families share (format codes,
block decoding, the split-K epilogue) is in quant_blocks.py.

Configs are explicit (default_config; quant_int8x's and quant_wide's); `bench quant --kernels --tune` times others.

Past FUSED_MAX_ROWS (prefill) the product is compute-bound: chunks of W's rows are dequantized by the same tile
code (K-quants: kquant_values) into one scratch buffer per device and dtype (SCRATCH_MB, reused by every layer)
and multiplied by cuBLAS; FP8 weights of 128 x 128 block or per-channel scales take the FP8 tensor cores instead,
x quantized to FP8 per token (and 128 columns) as vLLM does (fp8_gemm.py).

No host syncs; what a call allocates (x as an Int8X, split-K partials) has fixed sizes for its shapes, and the
scratch buffer is made once: safe in CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from outrider.kernels.fp8_gemm import fp8_mm, takes_fp8_mm
from outrider.kernels.fused import pdl_enter
from outrider.kernels.gemm import RowNorm
from outrider.kernels.launch import is_power_of_two, pdl_args, use_pdl
from outrider.kernels.quant_blocks import (FP8, FUSED_MAX_ROWS, INT4, INTERPRET, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K,
                                           Q6_K, Q8_0, Layout, QuantGemmConfig, fp8_bits_to_f32, k_run, k_splits,
                                           kquant_values, layout_of, load_f16, load_k_scale_min, output_tiles,
                                           rows_result, split_k_buffers, tensors_of)
from outrider.kernels.quant_int8x import INT8_X_KERNELS, Int8X, int8_x_config, int8_x_product, quantize_x
from outrider.kernels.quant_wide import wide_linear
from outrider.quant.tensor import QuantizedTensor

# Bytes of the per-device dequantization buffer of the prefill path: OUTRIDER_QUANT_SCRATCH_MB.
SCRATCH_MB = float(os.environ.get("OUTRIDER_QUANT_SCRATCH_MB", "256"))

FMA_MAX_M = tl.constexpr(2)  # rows up to which the products run on the CUDA cores


def default_config(m: int, block: int, n: int, k: int = 0) -> QuantGemmConfig:
    """Small tiles at decode (enough programs to fill the GPU from one weight), wider ones for more rows; about
    128-256 values of K per loop step. Up to FMA_MAX_M rows the products run on the CUDA cores (no padding of x to
    a 16-row MMA tile, no layout change of the dequantized tile), beyond on the tensor cores; there K (k values;
    0: unknown) is split by k_splits where the weight has few rows (a [4096, 12288] down_proj: 256 programs, each
    walking all of K)."""
    if m <= FMA_MAX_M.value:  # 256 values a step for one row, 128 for two (the accumulator doubles)
        return QuantGemmConfig(block_n=16, block_m=m, blocks=max(1, (256 if m == 1 else 128) // block),
                               split_k=k_splits(k, triton.cdiv(n, 16)))
    if m <= 16:  # verify rows: 16-row tiles on 4 warps (32/64-row tiles on 8 warps, 4 stages read 15 % slower)
        return QuantGemmConfig(block_n=16, block_m=16, blocks=max(1, 128 // block))
    # Past that, 128 values a step (one 256-value K-quant block): ptxas for sm_90 then keeps every format's
    # tiles in registers (no spills), but Q6_K's at 32 rows (80 bytes); 64-row tiles spilled 0.5-1.5 KB. Past 16
    # rows, 32 rows of W a program: twice the programs of 64 (a 4096-row weight fills only 64 SMs at 64).
    return QuantGemmConfig(block_n=32, block_m=32, blocks=max(1, 128 // block), num_warps=8)


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
            d = load_f16(w16_ptr, base)
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
                m = load_f16(w16_ptr, base + 2)
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
            d = load_f16(w16_ptr, base)
            dmin = load_f16(w16_ptr, base + 2)
            sc_lo, m_lo = load_k_scale_min(w32_ptr, base, 2 * c)
            sc_hi, m_hi = load_k_scale_min(w32_ptr, base, 2 * c + 1)
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
            lo = fp8_bits_to_f32(tl.load(ptrs))
            hi = fp8_bits_to_f32(tl.load(ptrs + H))
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


@triton.jit
def _in_order(lo, hi, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """_tile's two planes of a 32-value-block, INT4 or FP8 format -> the tile [BLOCK_N, NB * BLOCK] in K order, so
    that a store of it is contiguous (value l of a block's low plane at l, the high plane BLOCK / 2 further)."""
    t = tl.join(tl.reshape(lo, (BLOCK_N, NB, BLOCK // 2)), tl.reshape(hi, (BLOCK_N, NB, BLOCK // 2)))
    return tl.reshape(tl.permute(t, (0, 1, 3, 2)), (BLOCK_N, NB * BLOCK))


@triton.jit(do_not_specialize=["M"])
def _qgemm_kernel(x_ptr, w_ptr, w16_ptr, w32_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
                  stride_wn, stride_sn, stride_ym, FP8_BN, FP8_BK, FMT: tl.constexpr, BLOCK: tl.constexpr,
                  TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, FP8_BITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """y [M, N] = x @ W.T on a float tile of W's dequantized values; K's steps split over program axis 2
    (rows_result)."""
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
    # More rows on Q4_K and Q5_K (one block a step): the block's values made in K order (kquant_values) and one
    # product with x's contiguous 256 columns, not two planes against gathered columns (Q6_K's planes stay cheaper)
    KQ_DOT: tl.constexpr = not FMA and (FMT == Q4_K or FMT == Q5_K)
    first, last = k_run(tl.cdiv(K, NB * BLOCK), tl.program_id(2), SPLIT)
    for step in tl.range(first, last):
        k0 = step * (NB * BLOCK)
        kb0 = k0 // BLOCK
        kb = kb0 + tl.arange(0, NB)[None, :, None]
        if KQ_DOT:
            tl.static_assert(NB == 1)
            base = rows.to(tl.int64) * stride_wn + kb0 * TYPE_SIZE  # (NB 1: every step a whole block)
            w = tl.reshape(kquant_values(w_ptr, w16_ptr, w32_ptr, base, s_ptr, FMT), (BLOCK_N, BLOCK))
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
    rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)


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
                        q = fp8_bits_to_f32(q) if FP8_BITS else q.to(tl.float32)
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
                values = kquant_values(w_ptr, w16_ptr, w32_ptr, row_off + kb * TYPE_SIZE,
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


def takes_int8_x(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether x's product with the part reads x as an Int8X: 16-bit rows on Q4_K, Q6_K, Q8_0 or INT4 (groups of a
    power of two from 64 values), up to the format's max_rows (float32 rows keep their full precision)."""
    lay = layout_of(part)
    kernels = INT8_X_KERNELS.get(lay.code)
    if kernels is None or x.shape[0] > kernels.max_rows or x.dtype == torch.float32:
        return False
    return not kernels.grouped or (lay.block >= 64 and is_power_of_two(lay.block))


def takes_few_rows(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether x's product with the part runs a format's dp4a kernel of 2 to few_rows rows (_Int8Kernels.few)."""
    return takes_int8_x(x, part) and INT8_X_KERNELS[layout_of(part).code].takes_few(x.shape[0])


def takes_wide_rows(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether x's product with the part runs on _wide_rows_kernel: past _WIDE_PAST's rows of its format."""
    return _wide_format(layout_of(part), x.shape[0]) and not takes_int8_x(x, part)


def _wide_format(lay: Layout, m: int) -> bool:
    """takes_wide_rows for a product that does not take an Int8X x."""
    return lay.code in _WIDE_PAST and m > _WIDE_PAST[lay.code]


def has_wide_tiles(part: QuantizedTensor) -> bool:
    """Whether _wide_rows_kernel reads the part's format (wide_linear), at whatever rows its products take it."""
    return layout_of(part).code in _WIDE_PAST


def fused_linear(x: torch.Tensor, part: QuantizedTensor, bias: torch.Tensor | None, y: torch.Tensor,
                 config: QuantGemmConfig | None = None, x8: Int8X | None = None,
                 tickets: torch.Tensor | None = None) -> None:
    """y [M, rows] (a column slice of the output is fine) = x @ part.T (+ bias), on the fused kernel. x8: x as an
    Int8X where takes_int8_x (made here if not given: a caller with several parts makes it once, zeroing their
    split-K `tickets` on the way: ticket_count of each)."""
    m = x.shape[0]
    n, k = part.shape  # (x8 may hold a product's input made from x: quantize_x's norm or silu_mul)
    lay = layout_of(part)
    t = tensors_of(part)
    pdl = pdl_args(use_pdl(x))
    if takes_int8_x(x, part):
        int8_x_product(x8 or quantize_x(x), t, INT8_X_KERNELS[lay.code], lay.block, bias, y, m, n, k,
                       config or int8_x_config(m, part), tickets, pdl)
        return
    if _wide_format(lay, m):
        wide_linear(x, part, bias, y, config, tickets)
        return
    cfg = config or default_config(m, lay.block, n, k)
    tiles = output_tiles(cfg, m, n)
    partials, tickets = split_k_buffers(cfg.split_k, tiles, m, n, y, tickets)
    _qgemm_kernel[(*tiles, cfg.split_k)](
        x, t.w, t.w16, t.w32, t.scale, t.zero, bias if bias is not None else t.scale, y, partials, tickets, m, n, k,
        x.stride(0), t.stride_wn, t.stride_sn, y.stride(0), lay.fp8_block_n, lay.fp8_block_k, FMT=lay.code,
        BLOCK=lay.block, TYPE_SIZE=lay.type_size, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        FP8_BITS=INTERPRET, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NB=cfg.blocks, SPLIT=cfg.split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)


def ticket_count(m: int, part: QuantizedTensor, config: QuantGemmConfig) -> int:
    """The split-K tickets an Int8X product of m rows with the part takes at `config` (0 without a split)."""
    if config.split_k == 1:
        return 0
    tiles = output_tiles(config, m, part.shape[0])
    return tiles[0] * tiles[1]


# Rows past which a format's products run on the wide tiles: FP8 past one (x in FP8 on the FP8 tensor cores:
# reads_x_in_fp8; at one row the float tile reads the widest projection faster); Q5_K past a verify step's 16
# (below, its float tile); the Int8X formats that have them past their max_rows.
_WIDE_PAST = {FP8.value: 1, Q5_K.value: 16, **{code: kernels.max_rows for code, kernels in INT8_X_KERNELS.items()
                                               if kernels.max_rows < FUSED_MAX_ROWS}}


def dequantize_rows(part: QuantizedTensor, rows: int | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of the part dequantized into out [R, K] (row-major): rows rows .. rows + R (an int), or the rows a
    tensor of R ids names (an embedding lookup)."""
    n, k = out.shape
    lay = layout_of(part)
    cfg = default_config(1, lay.block, n)
    t = tensors_of(part)
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
