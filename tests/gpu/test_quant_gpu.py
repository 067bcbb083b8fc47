"""Quantized-weight kernels (outrider/kernels/quant_*.py) against dequantize-then-matmul in float32: every
format at 1, 5, 16 (fused kernel: decode and verify rows) and 512 rows (dequantized chunks through cuBLAS), packed
parts of different formats with a bias, float32 logits, and CUDA-graph capture.

Tolerance: the kernels round each dequantized weight to x's dtype before the tensor-core product (float32 x:
full-precision products) and round the result once, so |y - ref| stays within TOL[dtype] of max |ref| (float32
accumulation over K <= 1024). 16-bit rows on Q4_K, Q6_K, Q8_0 and INT4, up to INT8_X_ROWS, read x as llama.cpp's
CUDA kernels do, in int8 groups of 32 (quant_int8x.Int8X): their reference takes x quantized so by the torch oracle
below, and a test of its own bounds what that quantization costs against the exact product."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import pytest
import torch

from outrider.quant.formats import GGUF_FORMATS, FP8Format, Int4Format
from outrider.quant.weight import QuantizedWeight
from outrider.quant.writers import random_quantized

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
ROWS = [1, 2, 5, 16, 40, 512]  # 1-2: CUDA-core products; 5-40: tensor cores; 512: dequantized chunks + cuBLAS
INT4 = Int4Format(128, "AWQ")
FORMATS = [*GGUF_FORMATS.values(), FP8Format(128, 128), FP8Format(1, 0), INT4]
# Format name -> the 16-bit rows up to which its products read x as int8 groups (quant_int8x.INT8_X_KERNELS)
INT8_X_ROWS = {"Q4_K": 4, "Q6_K": 64, "Q8_0": 16, INT4.name: 2}
_BY_NAME = {f.name: f for f in FORMATS}


def _k(fmt) -> int:
    """A K with a partial last loop step: 20 blocks of 32 (steps of 8), 3 of 256, 5 groups of 128."""
    return {32: 640, 256: 768}.get(getattr(fmt, "block", 0), 640)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().t()


def _x_as_read(x: torch.Tensor, part) -> torch.Tensor:
    """x as the kernels read it against the part: 16-bit rows that take an Int8X in int8 groups of 32, each scaled by
    max |x| / 127 and rounded half away from zero (llama.cpp's q8_1); FP8 prefill rows on the FP8 tensor cores
    (takes_fp8_mm) in FP8 per token and group (fp8_gemm), fewer rows where the wide tiles read them so
    (reads_x_in_fp8) per row and 128 columns; float32 otherwise."""
    from outrider.kernels.fp8_gemm import GROUP, takes_fp8_mm
    from outrider.kernels.quant_blocks import FUSED_MAX_ROWS
    from outrider.kernels.quant_gemm import takes_int8_x
    from outrider.kernels.quant_wide import reads_x_in_fp8

    if x.shape[0] > FUSED_MAX_ROWS and takes_fp8_mm(x, part):
        return _fp8_as_read(x, GROUP if part.format.block_k else x.shape[1])
    if x.shape[0] <= FUSED_MAX_ROWS and reads_x_in_fp8(x, part):
        return _fp8_as_read(x, GROUP)
    if not takes_int8_x(x, part):
        return x.float()
    groups = x.float().view(-1, 32)
    amax = groups.abs().amax(dim=1, keepdim=True)
    y = groups * torch.where(amax > 0, 127.0 / amax, 0.0)
    return (y.sign() * (y.abs() + 0.5).floor() * (amax / 127.0)).view_as(x)


def _fp8_as_read(x: torch.Tensor, group: int) -> torch.Tensor:
    """x in float8_e4m3fn per row and `group` columns, each scaled by max |x| / 448 (rounded to nearest even)."""
    groups = x.float().view(x.shape[0], -1, group)
    scale = (groups.abs().amax(dim=2, keepdim=True) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view_as(x)


def _assert_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (y.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.replace(" ", "_"))
def test_quantized_linear_matches_dequantize_then_matmul(fmt, rows, model_dtype, device):
    from outrider.kernels.quant_gemm import quantized_linear

    k = _k(fmt)
    part, _ = random_quantized(fmt, 96, k, seed=rows)
    weight = QuantizedWeight([part], model_dtype).to(device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(device, model_dtype)
    y = quantized_linear(x, list(weight.parts))
    assert y.dtype == model_dtype and y.shape == (rows, 96)
    _assert_close(y, _reference(_x_as_read(x, weight.parts[0]), weight.parts[0].dequantize()), model_dtype)


@pytest.mark.parametrize("count", [1, 300, 5000])
def test_quantizing_x_zeroes_the_split_k_tickets_it_is_given(count, device):
    """quantized_linear hands quantize_x its parts' tickets uninitialised (no memset node in the graphs): every one
    must be zero afterwards, however many there are against the kernel's programs."""
    from outrider.kernels.quant_int8x import quantize_x

    tickets = torch.full((count,), 7, dtype=torch.int32, device=device)
    quantize_x(torch.randn(2, 640).to(device, torch.float16), tickets)
    assert int(tickets.abs().sum()) == 0


def test_each_format_reads_x_as_int8_groups_up_to_the_rows_these_tests_take_for_it():
    """INT8_X_ROWS (the rows the tests below exercise each format's Int8X kernels at, fixed at collection, where the
    kernels' module may not import) is the routing the kernels run: a 16-bit x of those rows takes an Int8X, one
    more row does not."""
    from outrider.kernels.quant_gemm import takes_int8_x

    for kind, most in INT8_X_ROWS.items():
        part, _ = random_quantized(_BY_NAME[kind], 32, 256, seed=0)
        assert takes_int8_x(torch.zeros(most, 256, dtype=torch.float16), part), kind
        assert not takes_int8_x(torch.zeros(most + 1, 256, dtype=torch.float16), part), kind


@pytest.mark.parametrize(("kind", "rows"), [(kind, rows) for kind, most in INT8_X_ROWS.items() for rows in {1, most}])
def test_16_bit_rows_on_k_quants_read_x_in_int8_groups_within_a_percent_of_the_exact_product(kind, rows, half,
                                                                                             device):
    """What reading x as int8 groups costs (the other tests check the kernels against that reading exactly)."""
    from outrider.kernels.quant_gemm import quantized_linear

    part, _ = random_quantized(_BY_NAME[kind], 96, 1024, seed=3)
    weight = QuantizedWeight([part], half).to(device)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(4)).to(device, half)
    ref = _reference(x, weight.parts[0].dequantize())
    err = (quantized_linear(x, list(weight.parts)).float() - ref).abs().max().item()
    assert 0 < err <= 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize(("kind", "rows"), [(kind, rows) for kind, most in INT8_X_ROWS.items()
                                            for rows in sorted({1, min(5, most), min(16, most)})])
def test_a_norm_or_swiglu_made_as_x_is_quantized_gives_the_products_of_the_unfolded_path(kind, rows, half, device):
    """A pre-norm projection and SwiGLU's down projection on parts that read x as int8 groups make their input in
    the launch that quantizes x (quantize_x's prologue): the products of ops' norm / activation followed by the
    product, to the half dtype's tolerance (a normed value's rounding may fall the other way at a tie), and the
    residual sum exactly."""
    from outrider.kernels import ops
    from outrider.kernels.gemm import RowNorm
    from outrider.kernels.quant_gemm import quantized_linear, takes_prologue

    part, _ = random_quantized(_BY_NAME[kind], 80, 768, seed=rows)
    parts = list(QuantizedWeight([part], half).to(device).parts)
    gen = torch.Generator().manual_seed(8)
    x, residual = (torch.randn(rows, 768, generator=gen).to(device, half) for _ in range(2))
    norm_weight = (1 + 0.2 * torch.randn(768, generator=gen)).to(device, half)
    assert takes_prologue(x, parts)
    summed = torch.empty_like(x)
    y = quantized_linear(x, parts, norm=RowNorm(norm_weight, 1e-6, residual, summed))
    normed, expected_sum = ops.torch_rms_norm(x, norm_weight, 1e-6, residual)
    assert torch.equal(summed, expected_sum)
    _assert_close(y, quantized_linear(normed, parts).float(), half)
    y = quantized_linear(x, parts, norm=RowNorm(norm_weight, 1e-6))
    _assert_close(y, quantized_linear(ops.torch_rms_norm(x, norm_weight, 1e-6)[0], parts).float(), half)
    gate_up = torch.randn(rows, 2 * 768, generator=gen).to(device, half)
    y = quantized_linear(gate_up, parts, silu_mul=True)
    _assert_close(y, quantized_linear(ops.torch_silu_mul(*gate_up.chunk(2, dim=-1)), parts).float(), half)


@pytest.mark.cuda_only
@pytest.mark.parametrize("kind", INT8_X_ROWS)
def test_ops_fold_the_norm_and_activation_into_the_quantized_products_where_their_parts_read_int8_x(kind):
    """ops.rms_norm_linear and ops.silu_mul_linear on a QuantizedWeight take the folded path at decode rows (one
    launch fewer each: no rms_norm or silu_mul kernel) and give the unfolded path's products."""
    from outrider.kernels import ops

    part, _ = random_quantized(_BY_NAME[kind], 80, 768, seed=9)
    weight = QuantizedWeight([part], torch.bfloat16).to("cuda")
    gen = torch.Generator().manual_seed(10)
    x, residual = (torch.randn(2, 768, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    norm_weight = (1 + 0.2 * torch.randn(768, generator=gen)).to("cuda", torch.bfloat16)
    assert weight.takes_prologue(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y, summed = ops.rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
        z = ops.silu_mul_linear(torch.cat([x, residual], dim=1), weight)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("quantize_x" in name for name in kernels) == 2, kernels  # (the profiler saw the launches)
    assert not any("rms_norm" in name or "silu_mul" in name for name in kernels), kernels
    normed, expected_sum = ops.rms_norm(x, norm_weight, 1e-6, residual)
    assert torch.equal(summed, expected_sum)
    _assert_close(y, weight.linear(normed).float(), torch.bfloat16)
    _assert_close(z, weight.linear(ops.silu_mul(x, residual)).float(), torch.bfloat16)


def _halves(r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A register's two 16-bit lanes (int64 words [W]) as float32 values of dtype [W, 2]."""
    return torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(dtype).float()


def _run_ptx(asm: str, regs: dict, dtype: torch.dtype) -> dict:
    """Run straight-line PTX (the instructions the wide tiles' inline asm uses) on int64 words [W] of 32 bits, each
    operand a register or an immediate; the 16-bit pair fma in dtype, rounded to nearest. Returns the registers."""

    def pair_fma(a, b, c):
        bits = (_halves(a, dtype) * _halves(b, dtype) + _halves(c, dtype)).to(dtype).view(torch.int16).long() & 0xFFFF
        return bits[..., 0] | (bits[..., 1] << 16)

    def prmt(a, b, sel):  # (the selector an immediate)
        pool = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
        return sum(pool[(int(sel[0]) >> (4 * i)) & 7] << (8 * i) for i in range(4))

    fma = "fma.rn.bf16x2" if dtype == torch.bfloat16 else "fma.rn.f16x2"
    ops = {"shr.u32": lambda a, b: a >> b, "shl.b32": lambda a, b: (a << b) & 0xFFFFFFFF,
           "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "xor.b32": lambda a, b: a ^ b,
           "prmt.b32": prmt, fma: pair_fma}
    word = next(iter(regs.values()))
    for instruction in asm.strip("{}").split(";"):
        op, _, args = instruction.strip().partition(" ")
        if not op or op == ".reg":
            continue
        dst, *srcs = (arg.strip() for arg in args.split(","))
        values = [regs[a] if a in regs else torch.full_like(word, int(a, 0)) for a in srcs]
        regs[dst] = values[0] if op == "mov.b32" else ops[op](*values)
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_ptx_makes_each_nibble_less_its_zero_point_exactly_in_16_bits(dtype):
    """The PTX that makes INT4's q - z for the wide tiles (run only on a GPU; the interpreter takes the torch-level
    expression), executed instruction by instruction on random bytes and zero points: four bytes in, their low
    nibbles less their zero points as two 16-bit pairs, then their high nibbles."""
    from outrider.kernels.quant_wide import _nibbles_less_zero_asm

    magic = 0x4300 if dtype == torch.bfloat16 else 0x6400
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (4096, 4), generator=gen)  # a word's four bytes
    z = torch.randint(0, 16, (4096, 4), generator=gen)  # each value's zero point
    word = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    nz = z | (magic | 0x8000)  # -(magic + z)
    regs = _run_ptx(_nibbles_less_zero_asm(dtype == torch.bfloat16),
                    {"$4": word, "$5": nz[:, 0] | (nz[:, 1] << 16), "$6": nz[:, 2] | (nz[:, 3] << 16)}, dtype)
    got = torch.stack([_halves(regs[f"${i}"], dtype) for i in range(4)], 1).flatten(1)  # [low 0..3, high 0..3]
    expected = torch.cat([(q & 15) - z, (q >> 4) - z], 1).float()
    assert torch.equal(got, expected)


def _pairs(values: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Values [W, 4] as two registers of 16-bit pairs in dtype (lanes 0-1, 2-3)."""
    bits = values.to(dtype).view(torch.int16).long() & 0xFFFF
    return [bits[:, 2 * i] | (bits[:, 2 * i + 1] << 16) for i in range(2)]


def _scales(gen: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random scales [n, 4] (one a value: a register mixed up shows), exact in dtype, over a wide range of
    magnitudes and both signs."""
    return (torch.randn(n, 4, generator=gen) * 2.0 ** torch.randint(-12, 4, (n, 4), generator=gen)).to(dtype).float()


def _scaled(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * s + m).to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_signed_bytes_ptx_makes_every_int8_value_times_its_scale_rounded_once(dtype):
    """The PTX that makes Q8_0's values for the wide tiles (run only on a GPU), executed instruction by instruction
    on every byte in each of a word's four places with random scales: each int8 value times its scale rounded
    once, as two 16-bit pairs."""
    from outrider.kernels.quant_wide import _signed_bytes_asm

    q = torch.arange(256).repeat_interleave(4).view(-1, 4).roll(1, 0)  # bytes 0..255, in every place
    q[:, 1:] = q[:, 1:].roll(17, 0)  # (places not all equal)
    word = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    s = _scales(torch.Generator().manual_seed(3), q.shape[0], dtype)
    s_01, s_23 = _pairs(s, dtype)
    regs = _run_ptx(_signed_bytes_asm(dtype == torch.bfloat16), {"$2": word, "$3": s_01, "$4": s_23}, dtype)
    got = torch.cat([_halves(regs["$0"], dtype), _halves(regs["$1"], dtype)], 1)
    assert torch.equal(got, _scaled(q.to(torch.uint8).view(torch.int8), s, torch.zeros_like(s), dtype))


@pytest.mark.parametrize("quarter", range(4))
def test_q6k_signed_quants_ptx_computes_the_quants_less_32(quarter):
    """The PTX that makes Q6_K's signed quants four bytes at a time (run only on a GPU; the interpreter takes the
    torch-level expression), executed instruction by instruction on random words, gives each byte's 6-bit value
    (a nibble of ql with two bits of qh on top) less 32."""
    from outrider.kernels.quant_int8x import _q6k_signed_asm

    gen = torch.Generator().manual_seed(quarter)
    ql, qh = (torch.randint(0, 256, (4096, 4), generator=gen, dtype=torch.uint8) for _ in range(2))
    regs = _run_ptx(_q6k_signed_asm(quarter), {"$1": ql.view(torch.int32).long() & 0xFFFFFFFF,
                                               "$2": qh.view(torch.int32).long() & 0xFFFFFFFF}, torch.bfloat16)
    got = regs["$0"].to(torch.int32).view(torch.int8).view(-1, 4)
    q = ((ql.int() >> (4 * (quarter // 2))) & 15) | (((qh.int() >> (2 * quarter)) & 3) << 4)
    assert torch.equal(got, (q - 32).to(torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q4k_nibbles_ptx_makes_each_value_times_its_scale_plus_its_min_rounded_once(dtype):
    """The PTX that makes Q4_K's values for the wide tiles (run only on a GPU), executed instruction by instruction
    on random bytes with random scales and mins for the low and the high nibbles: q s + m rounded once, the low
    nibbles as two 16-bit pairs, then the high ones."""
    from outrider.kernels.quant_wide import _nibbles_scaled_asm

    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 256, (4096, 4), generator=gen)
    word = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    s_lo, m_lo, s_hi, m_hi = (_scales(gen, 4096, dtype) for _ in range(4))
    regs = {"$4": word}
    for first, t in zip((5, 7, 9, 11), (s_lo, m_lo, s_hi, m_hi)):
        regs[f"${first}"], regs[f"${first + 1}"] = _pairs(t, dtype)
    regs = _run_ptx(_nibbles_scaled_asm(dtype == torch.bfloat16), regs, dtype)
    got = torch.stack([_halves(regs[f"${i}"], dtype) for i in range(4)], 1).flatten(1)  # [low 0..3, high 0..3]
    assert torch.equal(got, torch.cat([_scaled(q & 15, s_lo, m_lo, dtype), _scaled(q >> 4, s_hi, m_hi, dtype)], 1))


@pytest.mark.parametrize("split", [1, 2, 4, 7])
@pytest.mark.parametrize(("kind", "rows"), [(kind, rows) for kind in INT8_X_ROWS for rows in (1, 2, 4, 12, 20)
                                            if rows <= INT8_X_ROWS[kind]])
def test_int8_x_kernels_with_k_split_over_programs_match_dequantize_then_matmul(kind, rows, split, half, device):
    """The kernels of 16-bit rows on an Int8X (quant_int8x.INT8_X_KERNELS: one row; 2 and 4 rows on the dp4a
    kernels where a format takes them there; 12 rows as a tile of 16 and 20 as two) over 5 blocks of 256 columns of
    K split 1, 2, 4 and 7 ways (runs of unequal length, programs with none), with a bias: the last program of each
    output tile adds the partials."""
    from dataclasses import replace

    from outrider.kernels.quant_gemm import fused_linear
    from outrider.kernels.quant_int8x import int8_x_config

    part, _ = random_quantized(_BY_NAME[kind], 80, 1280, seed=split)
    weight = QuantizedWeight([part], half).to(device)
    x = torch.randn(rows, 1280, generator=torch.Generator().manual_seed(5)).to(device, half)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(6)).to(device, half)
    y = torch.empty(rows, 80, device=device, dtype=half)
    config = replace(int8_x_config(rows, weight.parts[0]), block_n=32, split_k=split)
    config = replace(config, block_m=16) if rows > 4 else config  # 20 rows: two tiles of x's rows
    fused_linear(x, weight.parts[0], bias, y, config)
    _assert_close(y, _reference(_x_as_read(x, weight.parts[0]), weight.parts[0].dequantize()) + bias.float(), half)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_int4_one_row_reading_several_groups_a_step_masks_the_groups_past_k(groups, split, half, device):
    """INT4's one-row kernel at 1, 2 and 4 groups a loop step over 5 groups of K (a last step of 1 or 3 groups
    past K, read as the last group with a zero scale), K split 1 and 2 ways, with a bias."""
    from dataclasses import replace

    from outrider.kernels.quant_gemm import fused_linear
    from outrider.kernels.quant_int8x import int8_x_config

    part, _ = random_quantized(INT4, 96, 640, seed=groups)
    weight = QuantizedWeight([part], half).to(device)
    x = torch.randn(1, 640, generator=torch.Generator().manual_seed(7)).to(device, half)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(8)).to(device, half)
    y = torch.empty(1, 96, device=device, dtype=half)
    fused_linear(x, weight.parts[0], bias, y, replace(int8_x_config(1, weight.parts[0]), blocks=groups, split_k=split))
    _assert_close(y, _reference(_x_as_read(x, weight.parts[0]), weight.parts[0].dequantize()) + bias.float(), half)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize(("kind", "rows"), [("FP8 (128x128 blocks)", 1), ("Q4_1", 1), ("Q4_1", 2), ("Q5_K", 1),
                                            ("Q5_K", 2)])
def test_rows_on_the_cuda_cores_with_k_split_over_programs_match_dequantize_then_matmul(kind, rows, split, half,
                                                                                     device):
    """The float tile's one and two rows (products on the CUDA cores; FP8 past one row takes the wide tiles) over
    1,280 columns of K split 1 and 3 ways (runs of unequal length), with a bias."""
    import dataclasses

    from outrider.kernels.quant_gemm import default_config, fused_linear

    fmt = _BY_NAME[kind]
    part, _ = random_quantized(fmt, 80, 1280, seed=split)
    weight = QuantizedWeight([part], half).to(device)
    x = torch.randn(rows, 1280, generator=torch.Generator().manual_seed(9)).to(device, half)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(10)).to(device, half)
    y = torch.empty(rows, 80, device=device, dtype=half)
    config = default_config(rows, fmt.block if hasattr(fmt, "block") else 128, 80)
    fused_linear(x, weight.parts[0], bias, y, dataclasses.replace(config, split_k=split))
    _assert_close(y, _reference(x.float(), weight.parts[0].dequantize()) + bias.float(), half)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("kind", ["FP8 (128x128 blocks)", INT4.name, "Q4_K", "Q5_K", "Q8_0"])
def test_wide_tiles_of_w_with_k_split_over_programs_match_dequantize_then_matmul(kind, split, half, device):
    """_wide_rows_kernel (wide_linear: FP8, INT4, Q4_K, Q5_K, Q8_0) at 20 rows of x, 5 blocks of 256 columns (Q8_0:
    41 blocks of 32, the last of its steps of four blocks partial) split 1 and 3 ways, with a bias."""
    from outrider.kernels.quant_blocks import QuantGemmConfig
    from outrider.kernels.quant_gemm import has_wide_tiles
    from outrider.kernels.quant_wide import wide_linear

    k = 1312 if kind == "Q8_0" else 1280
    part, _ = random_quantized(_BY_NAME[kind], 80, k, seed=split)
    weight = QuantizedWeight([part], half).to(device)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(7)).to(device, half)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(8)).to(device, half)
    y = torch.empty(20, 80, device=device, dtype=half)
    assert has_wide_tiles(weight.parts[0])
    wide_linear(x, weight.parts[0], bias, y, QuantGemmConfig(block_n=64, block_m=32, blocks=1, split_k=split))
    _assert_close(y, _reference(_x_as_read(x, weight.parts[0]), weight.parts[0].dequantize()) + bias.float(), half)


@pytest.mark.cuda_only
@pytest.mark.parametrize("rows", [65, 200])
@pytest.mark.parametrize("fmt", [FP8Format(128, 128), FP8Format(1, 0)], ids=lambda f: f.name.replace(" ", "_"))
def test_fp8_prefill_rows_run_on_the_fp8_tensor_cores_with_x_in_fp8_per_token_group(fmt, rows):
    """Past FUSED_MAX_ROWS on Hopper, bf16 rows on FP8 weights of 128 x 128 block or per-channel scales take
    scaled_mm: x in FP8 per token and 128 columns (per token against per-channel scales), rows not a multiple of
    the padding, with a bias; the same x quantized here gives the reference."""
    from outrider.kernels.fp8_gemm import takes_fp8_mm
    from outrider.kernels.quant_gemm import quantized_linear

    part, _ = random_quantized(fmt, 384, 1024, seed=rows)
    weight = QuantizedWeight([part], torch.bfloat16).to("cuda")
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(11)).to("cuda", torch.bfloat16)
    bias = torch.randn(384, generator=torch.Generator().manual_seed(12)).to("cuda", torch.bfloat16)
    assert takes_fp8_mm(x, weight.parts[0]) == (torch.cuda.get_device_capability() >= (9, 0))
    y = quantized_linear(x, list(weight.parts), bias)
    ref = _reference(_x_as_read(x, weight.parts[0]), weight.parts[0].dequantize()) + bias.float()
    _assert_close(y, ref, torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.replace(" ", "_"))
def test_dequantize_kernel_equals_the_torch_dequantizer(fmt, device):
    from outrider.kernels.quant_gemm import dequantize_rows

    k = _k(fmt)
    part, _ = random_quantized(fmt, 40, k, seed=3)
    part = part.to(device)
    out = torch.empty(24, k, dtype=torch.float32, device=device)
    want = part.dequantize()[8:32]
    torch.testing.assert_close(dequantize_rows(part, 8, out), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name.replace(" ", "_"))
def test_embedding_rows_gathered_by_the_kernel_equal_the_torch_dequantizer(fmt, device):
    from outrider.kernels.quant_gemm import dequantize_rows

    k = _k(fmt)
    part, _ = random_quantized(fmt, 40, k, seed=4)
    part = part.to(device)
    ids = torch.tensor([3, 39, 0, 3, 17], device=device)
    out = torch.empty(5, k, dtype=torch.float32, device=device)
    want = part.dequantize()[ids]
    torch.testing.assert_close(dequantize_rows(part, ids, out), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


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
    ref = torch.cat([_reference(_x_as_read(x, part), part.dequantize()) for part in weight.parts], 1)
    ref += bias.float()
    y = quantized_linear(x, list(weight.parts), bias, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    _assert_close(y, ref, half)


@pytest.mark.cuda_only
@pytest.mark.parametrize("rows", [1, 16])
def test_quantized_linear_replays_in_a_cuda_graph(rows):
    from outrider.kernels.quant_gemm import quantized_linear

    part, _ = random_quantized(GGUF_FORMATS["Q4_K"], 256, 1024)
    weight = QuantizedWeight([part], torch.bfloat16).cuda()
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    quantized_linear(x, list(weight.parts))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = quantized_linear(x, list(weight.parts))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, quantized_linear(x, list(weight.parts)), rtol=0, atol=0)


@pytest.mark.cuda_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_q4_1_served_quantized_on_the_gpu_answers_as_the_dequantized_path(dtype):
    """The real Q4_1 file through the engine (CUDA graphs, the fused kernels at decode, dequantized chunks at
    prefill) gives the chat prompts of tests/test_smollm2.py the answers the file dequantized at load gives."""
    from outrider import LLM, SamplingParams
    from outrider.demo.smollm2 import smollm2_path
    from outrider.quant.layers import QuantizedLinear

    chats = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
             [{"role": "system", "content": "You answer in one sentence."},
              {"role": "user", "content": "What is the capital of France?"}]]
    answers = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(smollm2_path()), dtype=dtype, max_model_len=512, max_num_seqs=4, quantization=quantization)
        assert isinstance(llm.engine.model.model.layers[0].mlp.gate_up_proj, QuantizedLinear) == (
            quantization == "auto")
        tok = llm.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(m)) for m in chats]
        answers[quantization] = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=24,
                                                                                           temperature=0.0))]
        del llm
        torch.cuda.empty_cache()
    assert answers["auto"] == answers["none"]


@pytest.mark.cuda_only
@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_a_quantized_model_decodes_in_cuda_graphs_as_it_does_eagerly(tmp_path, mix):
    """A GGUF in llama.cpp's mix (packed parts of two formats) on the engine: greedy tokens with CUDA graphs (the
    fused kernels captured, decode and verify-sized batches) equal eager ones but at near-ties (a random model's
    repeated prompt has them, and the two paths round differently), and its weights take no more GPU memory than
    the file's tensors."""
    import json

    from outrider import LLM, SamplingParams
    from outrider.models import load_model
    from outrider.models.gguf import open_gguf
    from outrider.quant.writers import write_random_gguf
    from outrider.testing.checkpoints import write_tiny_checkpoint

    ck = write_tiny_checkpoint(tmp_path / "ck", "qwen3", hidden_size=512, intermediate_size=1024, layers=8,
                               heads=8, kv_heads=4)
    path = write_random_gguf(tmp_path / "m.gguf", json.loads((ck / "config.json").read_text()), mix)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model, _ = load_model(path, dtype="bfloat16", device="cuda")
    assert torch.cuda.memory_allocated() - before <= 1.05 * sum(
        int(t.n_bytes) for t in open_gguf(path).tensors.values())
    del model
    prompts = [[1, 17, 99, 200, 7], list(range(30, 53)), [5] * 70, list(range(100, 103))]
    runs = {}
    for eager in (False, True):
        llm = LLM(str(path), tokenizer=str(ck), dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                  enforce_eager=eager)
        runs[eager] = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                           n_probs=2))
        del llm
        torch.cuda.empty_cache()
    for graphed, eager in zip(runs[False], runs[True]):
        assert_greedy_paths_agree(graphed, eager)


def assert_greedy_paths_agree(a, b, near_tie: float = 0.05) -> None:
    """Two greedy runs of one prompt through differently rounded paths (here, CUDA graphs and eager kernels) give
    the same tokens, unless they part at a near-tie: there, each run's token is the other's second choice, within
    `near_tie` nats of its first (after that the runs continue different texts, so nothing more is compared)."""
    part = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    if part is None:
        assert a.token_ids == b.token_ids
        return
    for run, other in ((a, b), (b, a)):
        top = dict(run.logprobs[part].top)
        token = other.token_ids[part]
        assert token in top, f"at {part}: {token} is not among {top}"
        assert top[run.token_ids[part]] - top[token] <= near_tie, f"at {part}: {top} is no near-tie"


# Kernel format -> (block, bytes per block, scale, zero and weight pointer types), for compiling without a GPU.
_SIGNATURES = {**{name: (f.block, f.type_size, "*u8", "*u8", "*u8") for name, f in GGUF_FORMATS.items()},
               "INT4": (128, 0, "*fp16", "*u8", "*u8"), "FP8": (128, 0, "*fp32", "*fp8e4nv", "*fp8e4nv")}


# quantize_x's kernel with each prologue (NORM, ADD, SILU): none, RMSNorm with the residual add, SwiGLU's activation
FP8_X = "x to fp8"  # fp8_gemm's quantization of x
_PROLOGUES = {"x": (False, False, False), "x+norm": (True, True, False), "x+silu": (False, False, True)}


class Ptxas(NamedTuple):
    """What ptxas reports of a kernel compiled for sm_90: bytes spilled, and whether it serialized the wgmmas
    (warning C7515: a non-wgmma instruction writes an accumulator between a wgmma's start and end); and the
    barriers (bar.sync) in the PTX of its inner loops, each a wait of the whole thread block every step (None: no
    loop laid out header first, which _loop_barriers reads)."""

    spilled: int
    serialized: bool
    loop_barriers: int | None


def _loop_barriers(ptx: str) -> int | None:
    """bar.sync instructions between an inner loop's header label and the branch back to it; None where no loop
    closes so (a rotated loop branches back before its header), so that a check of none cannot pass unread."""
    import re

    count, header = None, None
    for line in ptx.splitlines():
        if "Inner Loop Header" in line:
            header, inside = line.split(":")[0].strip(), 0
        elif header is not None:
            inside += "bar.sync" in line
            if re.search(rf"bra(\.uni)?\s+{re.escape(header)};", line):
                count, header = (count or 0) + inside, None
    return count


def _ptxas_findings(kind: str, rows: int, n: int, x: str = "bf16") -> Ptxas:
    """Compile `kind`'s kernel at its default config for `rows` (0: the dequantization kernel) of an `n`-row
    weight for sm_90 (Triton's own ptxas: no GPU needed), as CUDA graphs launch it (with PDL), and return what
    ptxas reports. x: x's Triton type (fp32 rows never read x as an Int8X). A kind of _PROLOGUES: quantize_x's
    kernel for rows of n values."""
    from types import SimpleNamespace

    from outrider.kernels import quant_blocks, quant_int8x, quant_wide
    from outrider.kernels import quant_gemm as q

    if kind in _PROLOGUES:
        signature = {"x_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16", "sum_ptr": "*bf16", "q_ptr": "*i8",
                     "scale_ptr": "*fp32", "sums_ptr": "*fp32", "tickets_ptr": "*i32", "K": "i32", "stride_xm": "i32",
                     "stride_rm": "i32", "N_TICKETS": "i32", "eps": "fp32",
                     **dict.fromkeys(["NORM", "ADD", "SILU", "ROW", "USE_PDL"], "constexpr")}
        norm, add, silu = _PROLOGUES[kind]
        constants = {"NORM": norm, "ADD": add, "SILU": silu, "ROW": n if norm else 1, "USE_PDL": True}
        return _ptxas(quant_int8x._quantize_x_kernel, signature, constants, SimpleNamespace(num_warps=4, num_stages=3))
    if kind == FP8_X:
        from outrider.kernels import fp8_gemm

        signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32",
                     "stride_xm": "i32", "stride_sm": "i32", "stride_sg": "i32", "FP8_MAX": "fp32", "TINY": "fp32",
                     "GROUP": "i32", "BLOCK_M": "constexpr", "CHUNK": "constexpr"}
        constants = {"BLOCK_M": fp8_gemm.ROW_ALIGN, "CHUNK": fp8_gemm.GROUP}
        return _ptxas(fp8_gemm._fp8_x_kernel, signature, constants, SimpleNamespace(num_warps=4, num_stages=2))
    block, type_size, s, z, w = _SIGNATURES[kind]
    code = getattr(quant_blocks, kind).value  # the format's FMT
    cfg = q.default_config(max(rows, 1), block, n, 4096)
    views = {"w_ptr": w, "w16_ptr": "*fp16" if w == "*u8" else w, "w32_ptr": "*i32" if w == "*u8" else w}
    if rows == 0:
        signature = {**views, "s_ptr": s, "z_ptr": z, "out_ptr": "*bf16",
                     "ids_ptr": "*i64", "row0": "i32", "N": "i32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32",
                     "stride_on": "i32", "FP8_BN": "i32", "FP8_BK": "i32",
                     **dict.fromkeys(["FMT", "BLOCK", "TYPE_SIZE", "FP8_BITS", "GATHER", "BLOCK_N", "NB", "USE_PDL"],
                                     "constexpr")}
        constants = {"FMT": code, "BLOCK": block, "TYPE_SIZE": type_size, "FP8_BITS": False,
                     "GATHER": False, "BLOCK_N": cfg.block_n, "NB": cfg.blocks, "USE_PDL": True}
        return _ptxas(q._dequant_kernel, signature, constants, cfg)
    ieee = x == "fp32"
    kernels = None if ieee else quant_int8x.INT8_X_KERNELS.get(code)
    fmt = {"INT4": INT4, "FP8": FP8Format(128, 128)}.get(kind) or GGUF_FORMATS[kind]
    part = SimpleNamespace(shape=(n, 4096), format=fmt)  # as the configs read a part
    grouped = ({"z_ptr": "*u8", "GROUP": "constexpr"}, {"GROUP": block}) if kernels and kernels.grouped else ({}, {})
    if kernels and rows == 1:  # a 16-bit row: read as an Int8X (dp4a in the PTX)
        cfg = quant_int8x.int8_x_config(1, part)
        steps = ({"NB": "constexpr"}, {"NB": cfg.blocks}) if kernels.grouped else ({}, {})  # groups a step
        signature = {"xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32", **views, "d_ptr": "*fp16",
                     "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "N": "i32",
                     "K": "i32", "stride_row": "i32", "stride_d": "i32", **grouped[0], **steps[0],
                     **dict.fromkeys(["HAS_BIAS", "BLOCK_N", "SPLIT", "ASM", "USE_PDL"], "constexpr")}
        constants = {"HAS_BIAS": True, "BLOCK_N": cfg.block_n, "SPLIT": cfg.split_k, "ASM": True, "USE_PDL": True,
                     **grouped[1], **steps[1]}
        return _ptxas(kernels.row, signature, constants, cfg)
    if kernels and 0 < rows <= kernels.max_rows:  # 16-bit rows as an Int8X (dp4a to few_rows, then int8 tensor cores)
        few = kernels.takes_few(rows)
        cfg = quant_int8x.int8_x_config(rows, part)
        signature = {"xq_ptr": "*i8", "xd_ptr": "*fp32", "xs_ptr": "*fp32", **views, "d_ptr": "*fp16",
                     "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32",
                     "N": "i32", "K": "i32", "stride_wn": "i32", "stride_d": "i32", "stride_ym": "i32",
                     **grouped[0],
                     **dict.fromkeys(["HAS_BIAS", "BLOCK_N", "BLOCK_M", "SPLIT", "ASM", "USE_PDL"], "constexpr")}
        constants = {"HAS_BIAS": True, "BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "SPLIT": cfg.split_k,
                     "ASM": True, "USE_PDL": True, **grouped[1]}
        return _ptxas(kernels.few if few else kernels.rows, signature, constants, cfg)
    if q._wide_format(SimpleNamespace(code=code), rows):  # (the Int8X rows returned above)
        cfg = quant_wide.wide_rows_config(rows, part)
        signature = {"x_ptr": f"*{x}", **views, "s_ptr": s, "z_ptr": z, "b_ptr": "*bf16", "y_ptr": "*bf16",
                     "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                     "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32", "FP8_BN": "i32", "FP8_BK": "i32",
                     **dict.fromkeys(["FMT", "BLOCK", "TYPE_SIZE", "HAS_BIAS", "IEEE", "FP8_BITS", "BLOCK_N",
                                      "BLOCK_M", "SPLIT", "ASM", "X_FP8", "USE_PDL"], "constexpr")}
        constants = {"FMT": code, "BLOCK": quant_wide.wide_step(SimpleNamespace(code=code, block=block)),
                     "TYPE_SIZE": type_size, "HAS_BIAS": True,
                     "IEEE": ieee, "FP8_BITS": False, "BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m,
                     "SPLIT": cfg.split_k, "ASM": True, "X_FP8": kind == "FP8" and not ieee, "USE_PDL": True}
        return _ptxas(quant_wide._wide_rows_kernel, signature, constants, cfg)
    signature = {"x_ptr": f"*{x}", **views, "s_ptr": s, "z_ptr": z, "b_ptr": "*bf16", "y_ptr": "*bf16",
                 "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                 "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32", "FP8_BN": "i32", "FP8_BK": "i32",
                 **dict.fromkeys(["FMT", "BLOCK", "TYPE_SIZE", "HAS_BIAS", "IEEE", "FP8_BITS", "BLOCK_M", "BLOCK_N",
                                  "NB", "SPLIT", "USE_PDL"], "constexpr")}
    constants = {"FMT": code, "BLOCK": block, "TYPE_SIZE": type_size, "HAS_BIAS": True,
                 "IEEE": ieee, "FP8_BITS": False, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "NB": cfg.blocks,
                 "SPLIT": cfg.split_k, "USE_PDL": True}
    return _ptxas(q._qgemm_kernel, signature, constants, cfg)


def _ptxas(fn, signature: dict, constants: dict, cfg) -> Ptxas:
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    # Every pointer and size but M divisible by 16, as the runtime specialises them at the Qwen3-8B shapes
    sixteen = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
               if kind != "constexpr" and name not in ("M", "row0", "N_TICKETS", "eps")}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=sixteen),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", "-", "-o", "/dev/null"],
                            input=kernel.asm["ptx"], capture_output=True, text=True, check=True).stderr
    return Ptxas(int(re.search(r"(\d+) bytes spill stores", report)[1]), "C7515" in report,
                 _loop_barriers(kernel.asm["ptx"]))


# Q4_0's float tile at 64 rows spills two words (8 bytes, to L1).
SPILLS_ALLOWED = {("Q4_0", 64): 8}


@pytest.mark.parametrize(("rows", "n"), [(0, 4096), (1, 4096), (2, 4096), (4, 4096), (16, 4096), (16, 24576),
                                       (32, 4096), (64, 4096)])
@pytest.mark.parametrize("kind", _SIGNATURES)
def test_kernels_compile_for_hopper_keep_their_tiles_in_registers_and_pipeline_their_wgmmas(kind, rows, n):
    """Each format's kernel at its default config for `rows` of an n-row weight (rows 0: its dequantization
    kernel) compiles for sm_90, and ptxas reports no register spills and no wgmma it had to serialize."""
    found = _ptxas_apart(kind, rows, n)
    assert found.spilled <= SPILLS_ALLOWED.get((kind, rows), 0)
    assert not found.serialized


@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("kind", _SIGNATURES)
def test_float32_rows_compile_for_hopper_on_the_kernel_each_format_routes_them_to(kind, rows):
    """float32 x (a float32 model's rows) is never read as an Int8X: the float tile or the wide tiles take it, with
    float32 products, and must compile for it (Q8_0's wide step once built its values in x's type, and float32
    failed there)."""
    assert not _ptxas_apart(kind, rows, 4096, "fp32").serialized


@pytest.mark.parametrize(("kind", "rows"), [("Q4_K", 1), ("INT4", 1), ("Q4_K", 2), ("Q4_K", 4), ("INT4", 2)])
def test_dp4a_loops_keep_their_sums_in_one_layout_and_never_wait_at_a_barrier(kind, rows):
    """The decode row's dp4a loop (and Q4_K's and INT4's few rows') meets each step's sums with scales loaded in
    the sums' own layout: a tile moved between layouts goes through shared memory, and the whole thread block then
    waits at a barrier every step. (Q6_K's one-row loop keeps its eight a step: loading its scales a row at a time
    removed them but read 5 % slower on the H100, docs/benchmarks.md.)"""
    assert _ptxas_apart(kind, rows, 4096).loop_barriers == 0


@pytest.mark.parametrize("kind", _PROLOGUES)
def test_x_quantization_compiles_for_hopper_with_each_prologue_and_spills_nothing(kind):
    """quantize_x's kernel for Qwen3-8B's rows (4,096 values; a norm sums the squares of the whole row in each
    program), plain, with RMSNorm and the residual add, and with SwiGLU's activation."""
    assert _ptxas_apart(kind, 1, 4096).spilled == 0


def test_fp8_x_quantization_compiles_for_hopper_and_spills_nothing():
    """fp8_gemm's x quantization (bf16 in, float8_e4m3fn out, float32 scales) for sm_90; its GROUP is a runtime
    value (128, or the whole row against per-channel scales), so one compile serves both recipes."""
    assert _ptxas_apart(FP8_X, 1, 4096).spilled == 0


def _ptxas_apart(kind: str, rows: int, n: int, x: str = "bf16") -> Ptxas:
    """_ptxas_findings in a process of its own: compiling needs Triton's compiler, which TRITON_INTERPRET=1
    replaces."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, kind, str(rows), str(n), x], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    spilled, serialized, loop_barriers = done.stdout.split()[-3:]
    return Ptxas(int(spilled), serialized == "True", None if loop_barriers == "None" else int(loop_barriers))


if __name__ == "__main__":  # python test_quant_gpu.py KIND ROWS N [X]: what ptxas reports of its kernel (see above)
    print(*_ptxas_findings(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5]))

