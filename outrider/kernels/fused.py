"""Triton kernels for the small per-token ops: RMSNorm (+ residual add), SiLU*mul, q/k-norm + RoPE.

Each rounds exactly where the Hugging Face modules do (intermediate casts to the model dtype), so a fused
model matches the unfused one up to reduction order. Call these through outrider.kernels.ops, which falls
back to torch off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
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
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


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
    )
    return out.view(shape), (summed.view(shape) if summed is not None else None)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] tensors; gate/up may be the two halves of one packed [T, 2I] output."""
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
        g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
    )
    return out.view(gate.shape)


@triton.jit
def _load_halves(x_ptr, t, stride_t, stride_h, N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Row t's heads as their two rotate-half halves, [BLOCK_H, HALF] each, in float32."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < N_HEADS
    base = x_ptr + t * stride_t + h * stride_h + d
    return (tl.load(base, mask=mask, other=0.0).to(tl.float32),
            tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _head_rms_norm(x1, x2, w1, w2, eps, dt: tl.constexpr):
    """Per-head RMSNorm * weight of the halves, rounded to dt where the HF module rounds."""
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * x1.shape[1]) + eps)[:, None]
    x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x1, x2


@triton.jit
def _rope_store(x1, x2, cos, sin, out_ptr, t, N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Rotate-half RoPE [x1, x2] -> [x1*c - x2*s, x2*c + x1*s] (each product rounded as in HF) into row t of
    the contiguous out [T, N_HEADS, 2 * HALF]."""
    dt = out_ptr.dtype.element_ty
    o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < N_HEADS
    base = out_ptr + t * (N_HEADS * 2 * HALF) + h * (2 * HALF) + d
    tl.store(base, o1.to(dt), mask=mask)
    tl.store(base + HALF, o2.to(dt), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, eps,
                         HQ: tl.constexpr, HK: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                         HALF: tl.constexpr, NORM: tl.constexpr):
    # One program per token, every load issued before the first store: the compiler may not move a load past
    # a store that could alias it, so storing q first would cost k's loads a second memory round trip.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + tl.arange(0, HALF))[None, :]
    q1, q2 = _load_halves(q_ptr, t, stride_qt, stride_qh, HQ, BLOCK_HQ, HALF)
    k1, k2 = _load_halves(k_ptr, t, stride_kt, stride_kh, HK, BLOCK_HK, HALF)
    dt = q_ptr.dtype.element_ty
    if NORM:
        qw1, qw2 = _load_halves(qw_ptr, 0, 0, 0, 1, 1, HALF)  # a weight is one "head" of [1, HALF] halves
        kw1, kw2 = _load_halves(kw_ptr, 0, 0, 0, 1, 1, HALF)
        q1, q2 = _head_rms_norm(q1, q2, qw1, qw2, eps, dt)
        k1, k2 = _head_rms_norm(k1, k2, kw1, kw2, eps, dt)
    freqs = pos * inv_freq
    cos = tl.cos(freqs).to(dt).to(tl.float32)  # HF casts cos/sin to the model dtype before use
    sin = tl.sin(freqs).to(dt).to(tl.float32)
    _rope_store(q1, q2, cos, sin, qo_ptr, t, HQ, BLOCK_HQ, HALF)
    _rope_store(k1, k2, cos, sin, ko_ptr, t, HK, BLOCK_HK, HALF)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] -> (RoPE(norm(q)), RoPE(norm(k))), new contiguous tensors."""
    t, hq, head_dim = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, head_dim), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    norm = q_weight is not None
    _qk_norm_rope_kernel[(t,)](
        q, k, q_out, k_out, q_weight if norm else q, k_weight if norm else k, positions, inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps,
        HQ=hq, HK=hk, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        HALF=head_dim // 2, NORM=norm, num_warps=4,
    )
    return q_out, k_out
