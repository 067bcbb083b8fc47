"""Fused MoE experts, two ways:
- a few tokens (decode, short verify rows: PAIR_TOKENS or fewer): one GEMV program a (token, expert) pair and
  column tile for gate_up with SiLU-mul (-> [T*k, I]), then one a token and column tile for down, which weighs and
  sums the token's k experts itself (-> [T, H]). Two launches, no layout: at one token each block of the sorted
  path holds one real row, and sorting, scaling and summing were three launches that computed little;
- more tokens: the (token, expert) pairs sorted by expert into blocks of BLOCK_M rows, each block padded to one
  expert, and two grouped GEMMs over all blocks, one launch each: gate_up with SiLU-mul (-> [T*k, I]) and down
  scaled by the routing weight (-> [T*k, H]), summed over each token's k experts at the end.

Every shape depends only on T, k and E (the block list is sized for the worst case, and blocks past the last
expert's exit at once), and nothing reads back to the host, so a decode step with MoE layers captures into one
CUDA graph. The expert weights are read as stored ([E, 2I, H] and [E, H, I], row-major), no transposed copies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from outrider.kernels.fused import pdl_enter
from outrider.kernels.launch import pdl_args, use_pdl


class BlockLayout(NamedTuple):
    """The pairs (index t * k + j into the flattened routing) in expert order, BLOCK_M per block.

    sorted_pairs [blocks * BLOCK_M]: a pair index, or T*k for padding; block_expert [blocks]: each block's expert,
    -1 past the last."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the layout needs at most: every expert hit pads its pairs up to a multiple of block_m."""
    return -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)


def block_layout(ids: torch.Tensor, num_experts: int, block_m: int) -> BlockLayout:
    """Sort the flattened expert ids [T, k] into per-expert blocks, with device ops of fixed shapes only: one
    launch for decode-sized routings (SMALL_PAIRS pairs or fewer), a dozen torch ops otherwise."""
    flat = ids.flatten()
    n = flat.numel()
    blocks = max_blocks(n, num_experts, block_m)
    if n <= SMALL_PAIRS:
        sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int64, device=flat.device)
        block_expert = torch.empty(blocks, dtype=torch.int64, device=flat.device)
        _small_layout[(blocks,)](flat.contiguous(), sorted_pairs, block_expert, n, num_experts,
                                 NP=max(16, triton.next_power_of_2(n)), BLOCK_M=block_m)
        return BlockLayout(sorted_pairs, block_expert)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    dest = (padded_end - padded)[expert_of] + torch.arange(n, device=flat.device) - first[expert_of]
    sorted_pairs = torch.full((blocks * block_m,), n, dtype=torch.int64, device=flat.device)
    sorted_pairs.scatter_(0, dest, order)
    starts = torch.arange(0, blocks * block_m, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    return BlockLayout(sorted_pairs, torch.where(block_expert < num_experts, block_expert, -1))


SMALL_PAIRS = 64  # routings up to this many pairs get their layout from one launch of _small_layout


@triton.jit
def _small_layout(ids_ptr, pairs_ptr, block_expert_ptr, n, num_experts, NP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block b of block_layout's result for n <= NP pairs. Every program ranks all pairs itself (an NP x NP
    comparison, cheaper than a second launch): a pair's rank among the earlier pairs of its expert, each expert's
    padded block count, and the padded start of each expert (the experts below it, in id order)."""
    b = tl.program_id(0)
    i = tl.arange(0, NP)
    valid = i < n
    f = tl.load(ids_ptr + i, mask=valid, other=num_experts)
    same = (f[:, None] == f[None, :]) & valid[:, None] & valid[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int64), 1)
    padded = (tl.sum(same.to(tl.int64), 1) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first = valid & (rank == 0)
    below = (f[None, :] < f[:, None]) & first[None, :]
    start = tl.sum(tl.where(below, padded[None, :], 0), 1)
    block_start = b * BLOCK_M
    mine = first & (start <= block_start) & (block_start < start + padded)  # at most one expert's
    owner = tl.max(tl.where(mine, f, -1), 0)
    owner_start = tl.max(tl.where(mine, start, -1), 0)
    tl.store(block_expert_ptr + b, owner)
    r = tl.arange(0, BLOCK_M)
    hit = (f[None, :] == owner) & valid[None, :] & (rank[None, :] == (block_start - owner_start + r)[:, None])
    tl.store(pairs_ptr + block_start + r, tl.min(tl.where(hit, i[None, :], n), 1))


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers.moe.route in one launch: (ids [T, k] int64, weights [T, k] float32)."""
    t, num_experts = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        _route[(t,)](logits, ids, weights, num_experts, logits.stride(0), TOP_K=top_k,
                     KP=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
                     NORMALIZE=normalize, **pdl_args(use_pdl(logits)))
    return ids, weights


@triton.jit
def _route(logits_ptr, ids_ptr, weights_ptr, num_experts, stride, TOP_K: tl.constexpr, KP: tl.constexpr,
           BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    """One token: softmax over its expert logits in float32, then TOP_K rounds of taking the largest left (the
    lowest id among equals). Like the per-pair GEMVs below, a programmatic dependent launch in CUDA graphs
    (fused.pdl_enter): at decode these three launches a layer would otherwise each wait out a launch gap."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(e < num_experts, p, -1.0)
    j = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int64)
    weights = tl.zeros((KP,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        pick = tl.min(tl.where(left == best, e, BLOCK_E), 0)
        ids = tl.where(j == slot, pick, ids)
        weights = tl.where(j == slot, best, weights)
        left = tl.where(e == pick, -1.0, left)
    if NORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(ids_ptr + t * TOP_K + j, ids, mask=j < TOP_K)
    tl.store(weights_ptr + t * TOP_K + j, weights, mask=j < TOP_K)


@triton.jit
def _grouped_gemm(a_ptr, w_ptr, out_ptr, scale_ptr, pairs_ptr, block_expert_ptr, num_pairs, N,
                  stride_am, stride_we, stride_wn, stride_om, K: tl.constexpr,
                  A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, SCALED: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = (a[pair // A_ROW_DIV] @ w[e, n, :]) for the pairs of one block of expert e; GATED: w's rows
    N..2N are the up projection and the result is silu(gate) * up; SCALED: times scale[pair]. K (the model's
    hidden or expert size) is a compile-time constant, which also lets Triton's interpreter run the loop."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // A_ROW_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + offs_k)[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        w_off = offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None]
        w_mask = n_ok[None, :] & k_ok[:, None]
        acc += tl.dot(a, tl.load(w_base + w_off, mask=w_mask, other=0.0), input_precision=PRECISION)
        if GATED:
            acc_up += tl.dot(a, tl.load(w_base + N * stride_wn + w_off, mask=w_mask, other=0.0),
                             input_precision=PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if SCALED:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


def _block_m(num_pairs: int) -> int:
    # Decode routes one token to k experts: each block holds one real row, so keep blocks at tl.dot's minimum.
    return 16 if num_pairs <= SMALL_PAIRS else 64


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, layout: BlockLayout, block_m: int, num_pairs: int,
                 a_row_div: int, gated: bool, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[num_pairs, N] rows of one launch of _grouped_gemm (see there); w [E, N or 2N, K] row-major."""
    k_dim = a.shape[1]
    n = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 64 if k_dim >= 64 else max(16, triton.next_power_of_2(k_dim))
    grid = (layout.block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](a, w, out, scale if scale is not None else out, layout.sorted_pairs, layout.block_expert,
                        num_pairs, n, a.stride(0), w.stride(0), w.stride(1), out.stride(0), K=k_dim,
                        A_ROW_DIV=a_row_div, GATED=gated, SCALED=scale is not None,
                        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
                        BLOCK_K=block_k)
    return out


# Routings of up to this many tokens take the per-pair GEMVs (each pair reads its expert's rows): at the 30B-A3B
# and 35B-A3B expert shapes they read faster than the sorted path at 1, 2, 4 and 8 tokens (docs/benchmarks.md).
PAIR_TOKENS = 8


class GemvTiles(NamedTuple):
    """Column and reduction tiles of the per-pair GEMVs (gate_up, then down), and the warps of each program."""

    gate_up_n: int
    down_n: int
    block_k: int
    warps: int = 4


def pair_tiles(inter: int) -> GemvTiles:
    """The per-pair GEMVs' tiles for experts of intermediate size `inter`: 512 values of K a step where they divide
    down's K (35B-A3B's 512), else 256, with 8 of down's columns a program (30B-A3B's 768): the fastest of the swept
    tiles at every token count at each shape."""
    return GemvTiles(16, 16, 512) if inter % 512 == 0 else GemvTiles(16, 8, 256)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """layers.moe.torch_experts on the GPU: x [T, H], gate_up [E, 2I, H], down [E, H, I], each token's experts
    `ids` [T, k] and their `weights` [T, k] -> [T, H]."""
    if ids.numel() == 0:  # (an empty grid is no launch)
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    weights = weights.to(torch.float32).contiguous()
    if ids.shape[0] <= PAIR_TOKENS:
        return pair_experts(x, gate_up, down, ids.contiguous(), weights)
    return sorted_experts(x, gate_up, down, ids, weights)


def pair_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, tiles: GemvTiles | None = None) -> torch.Tensor:
    """fused_experts through the per-pair GEMVs (contiguous operands, float32 weights; tiles: pair_tiles')."""
    t, top_k = ids.shape
    inter, hidden = down.shape[2], x.shape[1]
    tiles = tiles or pair_tiles(inter)
    act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = pdl_args(use_pdl(x))
    _pair_gate_up[(t * top_k, triton.cdiv(inter, tiles.gate_up_n))](
        x, gate_up, act, ids, inter, K=hidden, TOP_K=top_k, BLOCK_N=tiles.gate_up_n,
        BLOCK_K=min(tiles.block_k, triton.next_power_of_2(hidden)), num_warps=tiles.warps, **pdl)
    out = torch.empty_like(x)
    _pair_down[(t, triton.cdiv(hidden, tiles.down_n))](
        act, down, out, ids, weights, hidden, K=inter, TOP_K=top_k, BLOCK_N=tiles.down_n,
        BLOCK_K=min(tiles.block_k, triton.next_power_of_2(inter)), num_warps=tiles.warps, **pdl)
    return out


@triton.jit
def _pair_gate_up(x_ptr, w_ptr, act_ptr, ids_ptr, N, K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """act[p, n] = silu(w[e, n] . x[t]) * (w[e, N + n] . x[t]) for pair p = t * TOP_K + j of expert e = ids[p]:
    products summed per lane across the K loop, reduced across lanes once at the end."""
    pdl_enter(USE_PDL)
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + p)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    gate_rows = w_ptr + e * (2 * N * K) + offs_n[:, None] * K
    x_row = x_ptr + (p // TOP_K) * K
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        xk = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        acc_gate += tl.load(gate_rows + k0 + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * xk
        acc_up += tl.load(gate_rows + N * K + k0 + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * xk
    gate, up = tl.sum(acc_gate, 1), tl.sum(acc_up, 1)
    tl.store(act_ptr + p * N + offs_n, (gate * tl.sigmoid(gate) * up).to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _pair_down(act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, N, K: tl.constexpr, TOP_K: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, n] = sum_j weights[t, j] * (w[e_j, n] . act[t * TOP_K + j]) over token t's experts e_j = ids[t, j]."""
    pdl_enter(USE_PDL)
    t, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for j in range(TOP_K):
        p = t * TOP_K + j
        e = tl.load(ids_ptr + p)
        scale = tl.load(weights_ptr + p)
        rows = w_ptr + e * (N * K) + offs_n[:, None] * K
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(act_ptr + p * K + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32) * scale
            w = tl.load(rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
    tl.store(out_ptr + t * N + offs_n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=n_ok)


def sorted_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """fused_experts through the block layout and the grouped GEMMs (contiguous operands, float32 weights)."""
    t, top_k = ids.shape
    num_pairs = t * top_k
    block_m = _block_m(num_pairs)
    layout = block_layout(ids, gate_up.shape[0], block_m)
    act = grouped_gemm(x, gate_up, layout, block_m, num_pairs, a_row_div=top_k, gated=True)
    y = grouped_gemm(act, down, layout, block_m, num_pairs, a_row_div=1, gated=False, scale=weights.flatten())
    return y.view(t, top_k, -1).sum(dim=1)  # (torch accumulates half precision in float32)
