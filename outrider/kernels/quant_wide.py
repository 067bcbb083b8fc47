"""The wide tiles (_wide_rows_kernel): 2 to FUSED_MAX_ROWS rows of x on FP8, INT4, Q4_K, Q5_K and Q8_0, past a
format's Int8X rows (quant_int8x.py) or past quant_gemm._WIDE_PAST's. Each loop step's quants are made exactly in
x's 16-bit type (the magic-number value makers below: no int-to-float conversion) and multiplied by x's columns on
the tensor cores in wide tiles of W, K split over programs where a weight has few output tiles (wide_rows_config).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.kernels.fused import pdl_enter
from outrider.kernels.fp8_gemm import X_SCALE_TINY, has_fp8_tensor_cores
from outrider.kernels.launch import pdl_args, use_pdl
from outrider.kernels.quant_blocks import (FP8, INT4, INTERPRET, Q4_K, Q8_0, WIDE_SPLIT, Layout, QuantGemmConfig,
                                           fp8_bits_to_f32, is_k_quant, k_run, k_scale_min_of, k_splits, kquant_values,
                                           layout_of, load_f16, output_tiles, rows_result, rows_tile, split_k_buffers,
                                           tensors_of)
from outrider.quant.formats import FP8_MAX, FP8Format
from outrider.quant.tensor import QuantizedTensor

WIDE_Q8_0_STEP = 128  # Q8_0's values a wide tile's loop step takes (four blocks side by side: one product)
FP8_X_MAX = tl.constexpr(FP8_MAX)
FP8_X_TINY = tl.constexpr(X_SCALE_TINY)


def wide_rows_config(m: int, part: QuantizedTensor) -> QuantGemmConfig:
    """_wide_rows_kernel's for m rows of x: 64 rows of W a program, against x's rows in one tile where they fit 64
    (each program then reads its W once), K split by k_splits; three loads in flight for FP8 and INT4, two and
    K split over WIDE_SPLIT programs at most for the K-quants, whose values tile takes more registers."""
    n, k = part.shape
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    k_quant = is_k_quant(part)
    return QuantGemmConfig(block_n=64, block_m=block_m, blocks=1, num_warps=8 if block_m == 64 else 4,
                           num_stages=2 if k_quant else 3,
                           split_k=k_splits(k, triton.cdiv(n, 64) * triton.cdiv(m, block_m),
                                            WIDE_SPLIT if k_quant else 8))


def wide_step(lay: Layout) -> int:
    """The values of K a wide tile's loop step takes (its BLOCK): a block, or WIDE_Q8_0_STEP of Q8_0's."""
    return WIDE_Q8_0_STEP if lay.code == Q8_0.value else lay.block


def wide_linear(x: torch.Tensor, part: QuantizedTensor, bias: torch.Tensor | None, y: torch.Tensor,
                config: QuantGemmConfig | None = None, tickets: torch.Tensor | None = None) -> None:
    """fused_linear on _wide_rows_kernel (a part where has_wide_tiles): what takes_wide_rows products run, and what
    bench quant --tune times beside the Int8X kernels at fewer rows."""
    m = x.shape[0]
    n, k = part.shape
    lay = layout_of(part)
    t = tensors_of(part)
    cfg = config or wide_rows_config(m, part)
    tiles = output_tiles(cfg, m, n)
    partials, tickets = split_k_buffers(cfg.split_k, tiles, m, n, y, tickets)
    _wide_rows_kernel[(*tiles, cfg.split_k)](
        x, t.w, t.w16, t.w32, t.scale, t.zero, bias if bias is not None else y, y, partials, tickets, m, n, k,
        x.stride(0), t.stride_wn, t.stride_sn, y.stride(0), lay.fp8_block_n, lay.fp8_block_k, FMT=lay.code,
        BLOCK=wide_step(lay), TYPE_SIZE=lay.type_size, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        FP8_BITS=INTERPRET, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, SPLIT=cfg.split_k, ASM=not INTERPRET,
        X_FP8=reads_x_in_fp8(x, part), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(use_pdl(x)))


def reads_x_in_fp8(x: torch.Tensor, part: QuantizedTensor) -> bool:
    """Whether the wide tiles multiply an FP8 part by x in FP8 (per row and 128 columns): 16-bit x on a card with
    FP8 tensor cores (compute capability 8.9+), W's values read as stored."""
    return (not INTERPRET and isinstance(part.format, FP8Format) and x.dtype != torch.float32 and x.is_cuda
            and has_fp8_tensor_cores(x.device))


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
    sc_lo, m_lo = k_scale_min_of(w0, w1, w2, 2 * c)
    sc_hi, m_hi = k_scale_min_of(w0, w1, w2, 2 * c + 1)
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
    if IEEE:  # (an if/else: Triton compiles what follows a return inside a constexpr if, for dt float32 too)
        values = qb.to(tl.int8, bitcast=True).to(tl.float32) * d.to(tl.float32)
    else:
        values = _signed_bytes(qb, d.to(dt), dt, ASM)
    return values


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
                      ASM: tl.constexpr, X_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    """y [M, N] = x @ W.T for 2 to FUSED_MAX_ROWS rows of x on FP8 (128 columns a step: W as stored, widened
    exactly to x's dtype, as every float8_e4m3fn value is a bfloat16 and a float16; one tensor-core product, then
    its rows' scale), INT4 (a group a step: its two nibble planes are its two halves, q - z exactly in x's dtype
    (_nibbles_less_zero), side by side in registers (_cat_k): one product with the group's columns of x, then the
    rows' scale), Q4_K (a block a step: each sub-block's values q d sc - dmin m made in x's dtype, rounded once
    (_nibbles_scaled), a product of two chunks' 128 columns accumulated in place), Q8_0 (WIDE_Q8_0_STEP values a
    step: each block's values q d made in x's dtype, rounded once (_signed_bytes), the blocks side by side in one
    product) or another K-quant (a block a step, its values made in K order half a block at a time, in x's dtype:
    a product with x's contiguous 128 columns; float32 x takes this way on Q4_K too). Wide tiles of W, K split
    over program axis 2 (rows_result)."""
    pdl_enter(USE_PDL)
    offs_n, rows, offs_m, xm = rows_tile(M, N, BLOCK_N, BLOCK_M)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first, last = k_run(tl.cdiv(K, BLOCK), tl.program_id(2), SPLIT)
    for kb in tl.range(first, last):
        if FMT == FP8:
            k = tl.arange(0, BLOCK)
            w = tl.load(w_ptr + rows * stride_wn + kb * BLOCK + k[None, :])
            if FP8_BITS:
                w = fp8_bits_to_f32(w)
            x = tl.load(x_ptr + xm * stride_xm + kb * BLOCK + k[:, None])
            s = tl.load(s_ptr + (rows // FP8_BN) * stride_sn + (kb * BLOCK) // FP8_BK)
            if X_FP8:  # x's step in float8_e4m3fn, a scale max |x| / 448 a row (the prefill's scaled_mm recipe)
                x = x.to(tl.float32)
                xs = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_X_MAX, FP8_X_TINY)
                acc += (s * xs[None, :]) * tl.dot(w, (x / xs[None, :]).to(w.dtype))
            elif IEEE:
                acc += s * tl.dot(w.to(tl.float32), x, input_precision="ieee")
            else:
                acc += s * tl.dot(w.to(dt), x)
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
            d = load_f16(w16_ptr, base)
            dmin = -load_f16(w16_ptr, base + 2)
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
                w = kquant_values(w_ptr, w16_ptr, w32_ptr, base, (s_ptr + rows * stride_sn + kb)[:, :, None], FMT,
                                  4 * half, 4)
                w = tl.reshape(w, (BLOCK_N, 128))
                x = tl.load(x_ptr + xm * stride_xm + kb * BLOCK + 128 * half + k[:, None])
                if IEEE:
                    block = tl.dot(w, x, block, input_precision="ieee")
                else:
                    block = tl.dot(w.to(dt), x, block)
            acc += block
    rows_result(acc, b_ptr, y_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_ym, HAS_BIAS, SPLIT)
