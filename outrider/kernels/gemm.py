"""Skinny GEMM for decode: y = x @ W.T (+ bias) for one or two rows of x and an nn.Linear weight W [N, K].

At batch 1-2 a projection is one pass over its weight, so all that matters is streaming W at full bandwidth,
and cuBLAS's heuristics pick badly for several decode shapes (tiles that leave SMs idle, or split-K with a
second reduce kernel): on an H200, Qwen3-0.6B's o_proj takes 12.6 us in cuBLAS and 3.4 us here, Qwen3-8B's
down_proj 30.5 vs 24.7 us (docs/benchmarks.md). Each program owns BLOCK_N output columns (rows of W) and walks K
in BLOCK_K steps: 16-byte loads along W's rows, `num_stages` steps in flight (software-pipelined through shared
memory), and an fp32 [M, BLOCK_N, BLOCK_K] accumulator of elementwise products on the CUDA cores, reduced over K
once after the loop, so the loop is loads and FMAs only. All M rows share the program, so W is read once. No
split-K: a small BLOCK_N gives enough programs to fill the GPU without a second kernel.

A pre-norm projection folds its RMSNorm (and the residual add before it) into the same pass: each program walks
all of K anyway, so it sums x's squares as it goes and scales its result by 1/RMS at the end; at decode that is
one launch instead of two, at no extra latency (a separate pre-pass over x to find the RMS first cost the 8B 0.4
ms a step).

Beyond two rows (FMA_MAX_M) the accumulator outgrows the registers, and 3-16 rows (a verify step's, MAX_M) run a
tensor-core kernel with the operands swapped: y^T = W @ x^T, so BLOCK_N rows of W fill the MMA's wide side (64, a
Hopper warpgroup MMA) and x's few rows, padded to 16, its narrow side. No folds there: a norm or SiLU applied to x
inside the loop (the earlier `x @ W^T` kernel, d788c28) kept its loads from pipelining and ran 3-10x slower than
cuBLAS (H200, Qwen3-8B at M = 5: gate_up 50 -> 145 us normed, 272 with the residual add; down 31 -> 289 with SiLU),
so ops runs the norm and the activation as their own (PDL) kernels before it. Unfolded, it runs the 8B's
projections 2-8 % faster than cuBLAS with no split-K (docs/benchmarks.md, "Kernels").

Configs are explicit rather than autotuned (autotune benchmarks inside the first call, which may be a CUDA-graph
capture): DEFAULT_TABLE picks one per shape class (DOT_CONFIG past two rows), and `bench kernels` times the
candidates against cuBLAS to re-tune them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from outrider.kernels.fused import PREFETCH_LINE_BYTES, pdl_enter, pdl_release, prefetch_l2, silu_mul_tile
from outrider.kernels.launch import FOLD_MAX_ROWS as FMA_MAX_M  # rows of the CUDA-core kernel (its register budget)
from outrider.kernels.launch import SKINNY_MAX_ROWS as MAX_M  # rows of the tensor-core kernel (one MMA tile's side)
from outrider.kernels.launch import pdl_args

# Under PDL, a skinny GEMM prefetches its whole weight into L2 before waiting on the previous kernel when the
# weight is at most this big, else its first K tile. 16 MB measured best of 16/40 on an H200.
GEMM_PREFETCH_BYTES = 16 * 2**20
# Under PDL, a GEMM whose weight is bigger than this lets the next kernel's blocks be scheduled only after its
# main loop, not at its start. Released early, the next big GEMM's blocks take the SMs this one's blocks vacate
# first, unevenly, and then stream their weight from fewer SMs (H200, Qwen3-8B: down_proj after gate_up 25 -> 30
# us). Late release above 16 MB took the 8B at batch 1 from 221 to 233 tok/s (PDL off: 229) on an H200 and left
# the 0.6B as it was.
GEMM_LATE_RELEASE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class GemmConfig:
    block_n: int  # output columns (rows of W) per program: the grid is cdiv(N, block_n)
    block_k: int  # K elements per loop step
    num_warps: int = 4
    num_stages: int = 3  # pipeline depth: loop steps whose loads are in flight at once (1: plain loads)

    def __str__(self) -> str:
        return f"n{self.block_n}-k{self.block_k}-w{self.num_warps}-s{self.num_stages}"


_ANY = 1 << 62
# (max N, config): the first row covering N wins. Measured on an H200 (bench kernels, gemm section): these were
# the fastest or within 0.2 us of it for every Qwen3-0.6B / Qwen3-8B decode projection at M = 1.
DEFAULT_TABLE: tuple[tuple[int, GemmConfig], ...] = (
    (2048, GemmConfig(block_n=4, block_k=1024)),
    (_ANY, GemmConfig(block_n=8, block_k=512)),
)

# What `bench kernels` tries per shape (those that fit() at its M).
CANDIDATES: tuple[GemmConfig, ...] = (
    GemmConfig(block_n=2, block_k=1024),
    GemmConfig(block_n=4, block_k=1024),
    GemmConfig(block_n=4, block_k=512, num_stages=1),
    GemmConfig(block_n=8, block_k=512),
    GemmConfig(block_n=8, block_k=1024, num_warps=8),
    GemmConfig(block_n=16, block_k=256),
    GemmConfig(block_n=4, block_k=256, num_warps=8),
    GemmConfig(block_n=4, block_k=512),
    GemmConfig(block_n=2, block_k=2048),
    GemmConfig(block_n=8, block_k=256, num_stages=4),
    GemmConfig(block_n=16, block_k=512, num_warps=8),
    GemmConfig(block_n=8, block_k=512, num_warps=8, num_stages=4),
)


# The tensor-core kernel's config (block_n: W rows per program, at least 64 for a warpgroup MMA): fastest or within
# 0.5 us of it for every Qwen3-8B projection at M = 5 and 16 of those tried, split-K ones too (H200, `bench
# kernels`, gemm section).
DOT_CONFIG = GemmConfig(block_n=64, block_k=128, num_stages=6)
DOT_CANDIDATES: tuple[GemmConfig, ...] = (
    DOT_CONFIG,
    GemmConfig(block_n=64, block_k=128, num_stages=4),
    GemmConfig(block_n=64, block_k=256),
    GemmConfig(block_n=128, block_k=128, num_stages=4),
    GemmConfig(block_n=128, block_k=128, num_warps=8),
    GemmConfig(block_n=64, block_k=64, num_stages=8),
)
DOT_BLOCK_M = 16  # x's rows padded to tl.dot's smallest side


@dataclass(frozen=True)
class RowNorm:
    """An RMSNorm applied to x inside the GEMM: x + residual (when given; stored to `summed`) is normed.

    The normed row is not rounded to the model dtype before the product, unlike ops.torch_rms_norm + a GEMM: the
    results differ by that rounding (float32 models: not at all)."""

    weight: torch.Tensor  # [K]
    eps: float
    residual: torch.Tensor | None = None  # [M, K] contiguous
    summed: torch.Tensor | None = None  # [M, K] contiguous output: x + residual


def default_config(n: int, m: int = 1) -> GemmConfig:
    return DOT_CONFIG if m > FMA_MAX_M else next(cfg for max_n, cfg in DEFAULT_TABLE if n <= max_n)


def candidates(m: int) -> tuple[GemmConfig, ...]:
    """What `bench kernels` times at M = m."""
    return DOT_CANDIDATES if m > FMA_MAX_M else tuple(c for c in CANDIDATES if fits(c, m))


def fits(config: GemmConfig, m: int) -> bool:
    """CUDA-core kernel (m <= FMA_MAX_M): whether the accumulator (BLOCK_M * BLOCK_N * BLOCK_K fp32) stays within
    ~64 registers a thread."""
    return _block_m(m) * config.block_n * config.block_k <= 64 * 32 * config.num_warps


def _block_m(m: int) -> int:
    return triton.next_power_of_2(m)


@triton.jit
def _store(acc, b_ptr, y_ptr, pid, M, N, stride_ym, dt: tl.constexpr, HAS_BIAS: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 (+ bias) -> y, rounded once to dt like cuBLAS's epilogue. A float32 y (an LM
    head's logits) keeps the float32 accumulator, as ops.linear's cuBLAS path does for verify rows: rounded to
    bfloat16 first (logits of 8-32 lie 0.06-0.125 apart there), a decode row broke near-ties that a verify row of
    the same position resolves, and greedy speculative output left plain decoding's for no reason."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if y_ptr.dtype.element_ty != tl.float32:
        acc = acc.to(dt)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _enter(w_ptr, pid, N, K, stride_wn, BLOCK_N: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
           USE_PDL: tl.constexpr, LATE_RELEASE: tl.constexpr):
    """A program's start under PDL: W is never written during a step, so bring the first PREFETCH_LINES lines of
    each of its rows into L2 while the previous kernel still runs (indices clamped into W: a prefetch must be
    valid), then wait for that kernel."""
    if USE_PDL and PREFETCH_LINES > 0:
        w_rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        w_cols = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE, K - 1)
        prefetch_l2(w_ptr + w_rows[:, None] * stride_wn + w_cols[None, :])
    pdl_enter(USE_PDL, RELEASE=not LATE_RELEASE)


# M is not specialised: Triton would otherwise compile M == 1 as a separate variant.
@triton.jit(do_not_specialize=["M"])
def _fma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_ym, eps,
                HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, USE_PDL: tl.constexpr,
                LATE_RELEASE: tl.constexpr):
    pid = tl.program_id(0)
    _enter(w_ptr, pid, N, K, stride_wn, BLOCK_N, PREFETCH_LINES, LINE, USE_PDL, LATE_RELEASE)
    offs_m = tl.arange(0, BLOCK_M)[:, None, None]
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]
    x_ptrs = x_ptr + offs_m * stride_xm + offs_k
    w_ptrs = w_ptr + offs_n.to(tl.int64) * stride_wn + offs_k  # int64: N * K can pass 2**31 (LM heads)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, 1, BLOCK_K), dtype=tl.float32)  # NORM: sum of squares of x's rows
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < K - k0
        w = tl.load(w_ptrs, mask=(offs_n < N) & k_mask, other=0.0)
        x_mask = (offs_m < M) & k_mask
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if SILU_MUL:  # x's rows are [gate | up] (K each): x = silu(gate) * up, rounded as the unfused op stores it
            x = silu_mul_tile(x, tl.load(x_ptrs + K, mask=x_mask, other=0.0), dt)
        if NORM:
            if ADD:  # the residual stream x + r, rounded like torch's add (stored after the loop)
                x = x + tl.load(r_ptr + offs_m * K + k0 + offs_k, mask=x_mask, other=0.0)
            xf = x.to(tl.float32)
            sq += xf * xf
            x = xf * tl.load(nw_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc += x.to(tl.float32) * w.to(tl.float32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if LATE_RELEASE:
        pdl_release(USE_PDL)
    y = tl.sum(acc, axis=2)
    if NORM:  # every program walked all of K, so it has the rows' whole sums of squares
        y *= tl.math.rsqrt(tl.sum(sq, axis=2) / K + eps)
    _store(y, b_ptr, y_ptr, pid, M, N, stride_ym, dt, HAS_BIAS, BLOCK_M, BLOCK_N)
    if ADD:  # the sum x + r goes out once, K chunk c by program c (mod the grid), after the loop: one program
        # storing it all inside the loop cost 0.5-1 us (H200: Qwen3-8B qkv 16.4 -> 15.6 us, 0.6B gate_up 6.6 -> 6.1)
        rows = tl.arange(0, BLOCK_M)[:, None]
        for c in range(pid, tl.cdiv(K, BLOCK_K), tl.num_programs(0)):
            cols = c * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            mask = (rows < M) & (cols < K)
            x = tl.load(x_ptr + rows * stride_xm + cols, mask=mask, other=0.0)
            tl.store(s_ptr + rows * K + cols, x + tl.load(r_ptr + rows * K + cols, mask=mask, other=0.0), mask=mask)


# M is not specialised, as above.
@triton.jit(do_not_specialize=["M"])
def _dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
                USE_PDL: tl.constexpr, LATE_RELEASE: tl.constexpr):
    """The product on the tensor cores, operands swapped: acc [BLOCK_N, BLOCK_M] = W's rows @ x^T. W's loads are
    unmasked where the shape allows (EVEN_N, EVEN_K), which keeps them plain pipelined copies."""
    pid = tl.program_id(0)
    _enter(w_ptr, pid, N, K, stride_wn, BLOCK_N, PREFETCH_LINES, LINE, USE_PDL, LATE_RELEASE)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    offs_m = tl.arange(0, BLOCK_M)[None, :]
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m * stride_xm + offs_k[:, None]  # x^T [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(offs_n < N) & (offs_k[None, :] < K - k0), other=0.0)
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=offs_m < M, other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=(offs_m < M) & (offs_k[:, None] < K - k0), other=0.0)
        acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if LATE_RELEASE:
        pdl_release(USE_PDL)
    _store(tl.trans(acc), b_ptr, y_ptr, pid, M, N, stride_ym, x_ptr.dtype.element_ty, HAS_BIAS, BLOCK_M, BLOCK_N)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None, silu_mul: bool = False, norm: RowNorm | None = None,
                out_dtype: torch.dtype | None = None, pdl: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x's); M <= MAX_M, row-major x and
    weight; past FMA_MAX_M rows 16-bit only (tl.dot would round float32 to TF32).

    silu_mul: x is a packed [M, 2K] = [gate | up] and the product uses silu(gate) * up as x (ops.silu_mul_linear).
    norm: the product uses RMSNorm(x [+ norm.residual]) * norm.weight as x, and stores x + residual to norm.summed
    (ops.rms_norm_linear). Both only up to FMA_MAX_M rows. config: None picks from DEFAULT_TABLE, or DOT_CONFIG past
    FMA_MAX_M rows (benchmarks pass their own). pdl: launch as a programmatic dependent launch (launch.use_pdl). out: a
    row-major [M, N] tensor of out_dtype to write y into. No host syncs: safe in CUDA graphs."""
    m = x.shape[0]
    n, k = weight.shape
    on_dot = m > FMA_MAX_M
    assert 0 < m <= MAX_M and x.shape[1] == (2 * k if silu_mul else k) and weight.dtype == x.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1 and not (silu_mul and norm)
    assert not on_dot or (x.dtype in (torch.float16, torch.bfloat16) and not silu_mul and norm is None)
    cfg = config or default_config(n, m)
    if out is not None:
        assert out.shape == (m, n) and out.dtype == (out_dtype or x.dtype) and out.stride(1) == 1
    y = out if out is not None else torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n),)
    b = bias if bias is not None else weight  # any pointer: unread without HAS_BIAS (nor r/nw/s without NORM)
    line = PREFETCH_LINE_BYTES // weight.element_size()  # elements per prefetched line
    w_bytes = n * k * weight.element_size()
    # A weight that fits the budget is prefetched whole, a larger one its first BLOCK_K columns (what the
    # pipeline's first step loads): the budget is L2 space, shared with the previous kernel's working set. The
    # tensor-core kernel's programs own 64 rows each, too many to hold a whole row's addresses: first tile only.
    k_prefetch = k if w_bytes <= GEMM_PREFETCH_BYTES and not on_dot else min(k, cfg.block_k)
    launch = dict(HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
                  PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(k_prefetch, line)) if pdl else 0,
                  LINE=line, LATE_RELEASE=GEMM_LATE_RELEASE_BYTES < w_bytes, num_warps=cfg.num_warps,
                  **pdl_args(pdl))
    if on_dot:
        _dot_kernel[grid](x, weight, b, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                          EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0, BLOCK_M=DOT_BLOCK_M, **launch)
        return y
    add = norm is not None and norm.residual is not None
    if add:
        assert norm.residual.is_contiguous() and norm.summed.is_contiguous() and norm.residual.shape == x.shape
    r, s = (norm.residual, norm.summed) if add else (weight, weight)
    nw, eps = (norm.weight, norm.eps) if norm is not None else (weight, 0.0)
    _fma_kernel[grid](x, weight, b, y, r, nw, s, m, n, k, x.stride(0), weight.stride(0), y.stride(0), eps,
                      SILU_MUL=silu_mul, NORM=norm is not None, ADD=add, BLOCK_M=_block_m(m), **launch)
    return y
