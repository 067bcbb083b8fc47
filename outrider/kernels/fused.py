"""Triton kernels for the small per-token ops: RMSNorm (+ residual add), SiLU*mul, q/k-norm + RoPE (+ KV store).

Each rounds exactly where the Hugging Face modules do (intermediate casts to the model dtype), so a fused
model matches the unfused one up to reduction order. Call these through outrider.kernels.ops, which falls
back to torch off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.kernels.launch import pdl_args, use_pdl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr, RELEASE: tl.constexpr = True):
    """Where a kernel launched with PDL (launch.use_pdl) waits until the previous kernel has finished and its writes
    are visible (nothing an earlier kernel of the step writes may be read, and nothing written, before), then
    (RELEASE) lets the next kernel's blocks be scheduled early; they wait the same way. A kernel that passes
    RELEASE=False calls pdl_release itself, later."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Lets the next kernel's blocks be scheduled (they still wait for this kernel to finish)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


PREFETCH_LINE_BYTES = 128  # what one prefetch_l2 address brings in: kernels space their addresses by it


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at `ptrs` to be brought into L2, without waiting for them: a hint that cannot
    fault on a valid address and returns nothing useful. GPU only (PTX): kernels issue it before pdl_enter, for
    data no earlier kernel of the step writes, so their memory latency overlaps the previous kernel."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    # The weight is loaded with x, not after the sum's store and the reduction: one memory round trip.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        x = x + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)  # rounds like torch's bf16 add
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = rms_normed_tile(xf, w, rstd, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_normed_tile(xf, w, rstd, dt: tl.constexpr):
    """RMSNorm's output in dt for float32 values xf of rows whose 1 / rms is rstd, float32 weights w: rounded where
    torch rounds (the normed values, then their product with the weight); also used by quantize_x's prologue
    (kernels/quant_int8x.py)."""
    return (w * (xf * rstd).to(dt).to(tl.float32)).to(dt)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., N] -> (norm(x + residual) * weight, x + residual or None). Rows must be last-dim contiguous."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = shape[-1]
    out = torch.empty_like(x2)
    summed = torch.empty_like(x2) if residual is not None else None
    r2 = residual.reshape(-1, n) if residual is not None else x2
    s2 = summed if summed is not None else out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, s2, x2.stride(0), r2.stride(0), out.stride(0), s2.stride(0), eps,
        N=n, BLOCK=block, ADD=residual is not None, num_warps=min(16, max(1, block // 256)),
        **pdl_args(use_pdl(x)),
    )
    return out.view(shape), (summed.view(shape) if summed is not None else None)


@triton.jit
def silu_mul_tile(g, u, dt: tl.constexpr):
    """silu(g) * u in dt, rounded where torch rounds (silu's output, then the product); also used by the skinny
    GEMM's fused variant (kernels/gemm.py)."""
    g = g.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (act * u.to(tl.float32)).to(dt)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, N, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul_tile(g, u, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] tensors; gate/up may be the two halves of one packed [T, 2I] output."""
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
        g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4, **pdl_args(use_pdl(gate)),
    )
    return out.view(gate.shape)


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, stride_gt, HEADS: tl.constexpr, D: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """One token's heads: o * sigmoid(gate), rounded where torch rounds (the sigmoid, then the product)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, D)[None, :]
    dt = out_ptr.dtype.element_ty
    gate = tl.load(g_ptr + t * stride_gt + h * (2 * D) + d).to(tl.float32)
    o = tl.load(o_ptr + (t * HEADS + h) * D + d).to(tl.float32)
    tl.store(out_ptr + (t * HEADS + h) * D + d, (o * tl.sigmoid(gate).to(dt).to(tl.float32)).to(dt))


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [T, H, D] (contiguous) * sigmoid(gate) for the gate halves of a [T, H, 2D] = per head [query | gate]
    projection (gate: its view [..., D:]) -> [T, H, D], in one launch (torch takes two)."""
    t, heads, d = o.shape
    out = torch.empty_like(o)
    if t:
        _sigmoid_gate_kernel[(t,)](o, gate, out, gate.stride(0), HEADS=heads, D=d, num_warps=4,
                                   **pdl_args(use_pdl(o)))
    return out


# Argmax and its softmax probability over a row of logits in two passes: the first splits each row into tiles over
# many programs (one program per row, as torch's softmax runs, left an H200 at 16 busy SMs: 40 us for DFlash's
# 16 x 151,936 logits, plus 11 us for the max), the second folds each row's tiles.
ARGMAX_TILE = 4096


@triton.jit
def _argmax_tiles_kernel(x_ptr, max_ptr, idx_ptr, sum_ptr, stride_x, N, TILE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    out = row * tl.num_programs(1) + tile
    tl.store(max_ptr + out, top)
    tl.store(idx_ptr + out, tile * TILE + tl.argmax(x, 0))  # (the first of equal maxima, as torch's max)
    tl.store(sum_ptr + out, tl.sum(tl.where(x > float("-inf"), tl.exp(x - top), 0.0), 0))


@triton.jit
def _argmax_fold_kernel(max_ptr, idx_ptr, sum_ptr, token_ptr, conf_ptr, TILES, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < TILES
    tops = tl.load(max_ptr + row * TILES + offs, mask=mask, other=float("-inf"))
    top = tl.max(tops, 0)
    first = tl.argmax(tops, 0)  # (the first tile holding the maximum: its first column is the row's first)
    sums = tl.load(sum_ptr + row * TILES + offs, mask=mask, other=0.0)
    total = tl.sum(tl.where(tops > float("-inf"), sums * tl.exp(tops - top), 0.0), 0)
    tl.store(token_ptr + row, tl.load(idx_ptr + row * TILES + first).to(tl.int64))
    tl.store(conf_ptr + row, 1.0 / total)


def argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, N] (rows last-dim contiguous, any float dtype) -> (argmax [T] int64, softmax(logits)[argmax] [T]
    float32)."""
    rows, n = logits.shape
    tiles = triton.cdiv(n, ARGMAX_TILE)
    tops = torch.empty((rows, tiles), dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(tops)
    idx = torch.empty((rows, tiles), dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    conf = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        pdl = pdl_args(use_pdl(logits))
        _argmax_tiles_kernel[(rows, tiles)](logits, tops, idx, sums, logits.stride(0), n, TILE=ARGMAX_TILE,
                                            num_warps=8, **pdl)
        _argmax_fold_kernel[(rows,)](tops, idx, sums, tokens, conf, tiles, BLOCK=triton.next_power_of_2(tiles),
                                     num_warps=1, **pdl)
    return tokens, conf


@triton.jit
def _load_halves(x_ptr, t, stride_t, stride_h, N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, order_ptr=None):
    """Row t's heads as their two rotate-half halves, [BLOCK_H, BLOCK_HALF] each (zero padded), in float32; with
    order_ptr, position p of a head reads its dimension order[p]."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < N_HEADS) & (d < HALF)
    row = x_ptr + t * stride_t + h * stride_h
    if order_ptr is None:
        lo, hi = row + d, row + d + HALF
    else:
        dm = tl.minimum(d, HALF - 1)
        lo, hi = row + tl.load(order_ptr + dm), row + tl.load(order_ptr + dm + HALF)
    return (tl.load(lo, mask=mask, other=0.0).to(tl.float32),
            tl.load(hi, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _store_halves(x1, x2, out_ptr, row, N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Halves from _load_halves into row `row` of a contiguous out [rows, N_HEADS, 2 * HALF]; row -1 stores
    nothing. A paged cache [NB, page, Hkv, D] is such an out, a slot (block * page + offset) one of its rows."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dst = row * (N_HEADS * 2 * HALF) + h * (2 * HALF) + d
    # Over the stored heads and dims, dst < 0 exactly when row is -1 (a per-element test: Triton's interpreter
    # rejects a scalar condition in a block mask).
    mask = (h < N_HEADS) & (d < HALF) & (dst >= 0)
    tl.store(out_ptr + dst, x1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + dst + HALF, x2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_rms_norm(x1, x2, w1, w2, eps, HALF: tl.constexpr, dt: tl.constexpr):
    """Per-head RMSNorm * weight of the halves, rounded to dt where the HF module rounds."""
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x1, x2


@triton.jit
def rope_cos_sin(pos, inv_freq, dt: tl.constexpr):
    """cos and sin of pos * inv_freq, in float32 holding dt values: HF casts them to the model dtype before use."""
    freqs = pos.to(tl.float32) * inv_freq
    return tl.cos(freqs).to(dt).to(tl.float32), tl.sin(freqs).to(dt).to(tl.float32)


@triton.jit
def rope_halves(x1, x2, cos, sin, dt: tl.constexpr):
    """Rotate-half RoPE [x1, x2] -> [x1*c - x2*s, x2*c + x1*s], each product and the result rounded to dt as
    in HF."""
    o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr,
                         slot_ptr, order_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, eps,
                         HQ: tl.constexpr, HK: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, STORE_KV: tl.constexpr,
                         ORDER: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per token, every load issued before the first store: the compiler may not move a load past
    # a store that could alias it, so storing q first would cost k's loads a second memory round trip.
    # STORE_KV: k and v go to the paged caches ko/vo at row slot_mapping[t] (the KV store, fused here to save
    # a launch); otherwise k goes to row t of a [T, HK, D] ko.
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    if STORE_KV:
        kv_row = tl.load(slot_ptr + t)
    else:
        kv_row = t
    pos = tl.load(pos_ptr + t).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + tl.arange(0, BLOCK_HALF), mask=tl.arange(0, BLOCK_HALF) < HALF,
                       other=0.0)[None, :]
    if ORDER:  # (v is read in order: only q, k and their norms are permuted)
        q1, q2 = _load_halves(q_ptr, t, stride_qt, stride_qh, HQ, BLOCK_HQ, HALF, BLOCK_HALF, order_ptr)
        k1, k2 = _load_halves(k_ptr, t, stride_kt, stride_kh, HK, BLOCK_HK, HALF, BLOCK_HALF, order_ptr)
    else:
        q1, q2 = _load_halves(q_ptr, t, stride_qt, stride_qh, HQ, BLOCK_HQ, HALF, BLOCK_HALF)
        k1, k2 = _load_halves(k_ptr, t, stride_kt, stride_kh, HK, BLOCK_HK, HALF, BLOCK_HALF)
    if STORE_KV:
        v1, v2 = _load_halves(v_ptr, t, stride_vt, stride_vh, HK, BLOCK_HK, HALF, BLOCK_HALF)
    dt = q_ptr.dtype.element_ty
    if NORM:
        # A weight is one "head" of [1, HALF] halves.
        if ORDER:
            qw1, qw2 = _load_halves(qw_ptr, 0, 0, 0, 1, 1, HALF, BLOCK_HALF, order_ptr)
            kw1, kw2 = _load_halves(kw_ptr, 0, 0, 0, 1, 1, HALF, BLOCK_HALF, order_ptr)
        else:
            qw1, qw2 = _load_halves(qw_ptr, 0, 0, 0, 1, 1, HALF, BLOCK_HALF)
            kw1, kw2 = _load_halves(kw_ptr, 0, 0, 0, 1, 1, HALF, BLOCK_HALF)
        q1, q2 = head_rms_norm(q1, q2, qw1, qw2, eps, HALF, dt)
        k1, k2 = head_rms_norm(k1, k2, kw1, kw2, eps, HALF, dt)
    cos, sin = rope_cos_sin(pos, inv_freq, dt)
    q1, q2 = rope_halves(q1, q2, cos, sin, dt)
    k1, k2 = rope_halves(k1, k2, cos, sin, dt)
    _store_halves(q1, q2, qo_ptr, t, HQ, BLOCK_HQ, HALF, BLOCK_HALF)
    _store_halves(k1, k2, ko_ptr, kv_row, HK, BLOCK_HK, HALF, BLOCK_HALF)
    if STORE_KV:
        _store_halves(v1, v2, vo_ptr, kv_row, HK, BLOCK_HK, HALF, BLOCK_HALF)


def _launch(q, k, v, q_out, k_out, v_out, slot_mapping, positions, inv_freq, q_weight, k_weight, eps,
            order) -> None:
    """One _qk_norm_rope_kernel program per token; v None: no KV store (k_out is [T, Hkv, D])."""
    t, hq, head_dim = q.shape
    hk = k.shape[1]
    if t == 0:
        return
    norm, store = q_weight is not None, v is not None
    # Pointers a variant never reads are stand-ins (any tensor does).
    v, v_out, slot_mapping = (v, v_out, slot_mapping) if store else (k, k_out, positions)
    q_weight, k_weight = (q_weight, k_weight) if norm else (q, k)
    _qk_norm_rope_kernel[(t,)](
        q, k, v, q_out, k_out, v_out, q_weight, k_weight, positions, inv_freq, slot_mapping,
        order if order is not None else positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), eps,
        HQ=hq, HK=hk, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2), NORM=norm, STORE_KV=store,
        ORDER=order is not None, num_warps=4, **pdl_args(use_pdl(q)),
    )


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] -> (RoPE(norm(q)), RoPE(norm(k))), new contiguous tensors (ops.qk_norm_rope)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, None, q_out, k_out, None, None, positions, inv_freq, q_weight, k_weight, eps, order)
    return q_out, k_out


def qk_norm_rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          inv_freq: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                          eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """qk_norm_rope plus the KV store in one launch: returns RoPE(norm(q)) (new, contiguous) and writes
    RoPE(norm(k)) and v [T, Hkv, D] into the contiguous paged caches [NB, page, Hkv, D] at slot_mapping [T]
    (-1: skip, e.g. CUDA-graph padding rows)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, inv_freq, q_weight, k_weight, eps, order)
    return q_out
