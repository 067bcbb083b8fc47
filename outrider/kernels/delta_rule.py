"""Triton kernels for Gated DeltaNet's short queries (decode and speculative verify), reading and writing the
state pool's slots in place: no gather or scatter of states, no host loop, every shape fixed by the batch, so a
decode or verify step captures into a CUDA graph.

- `causal_conv_step`: the depthwise causal conv + SiLU over each sequence's query tokens from its slot's conv
  window; advances the slot, or (verify) writes the window after each position to the verify rows.
- `recurrent_step`: the gated delta rule over each sequence's query tokens from its slot's recurrent state; the
  same two modes. One program per (sequence, value head, block of value dims): the [Dk, BV] state block stays in
  registers across the positions.

A sequence's positions are walked up to MAX_POS (the longest query a step has: 1 at decode, k + 1 at verify).
fla has no kernel that keeps every position's state, which the rollback needs (docs/architecture.md, "Hybrid models").
Semantics: layers/gated_deltanet.causal_conv and recurrent_delta_rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step(x_ptr, w_ptr, out_ptr, state_ptr, verify_ptr, qsl_ptr, slots_ptr, C, stride_x, stride_out,
               stride_ss, stride_vr, stride_vp, MAX_POS: tl.constexpr, VERIFY: tl.constexpr, BLOCK_C: tl.constexpr):
    """Kernel width 4 (every released Qwen3-Next / Qwen3.5): the window is four [BLOCK_C] columns, oldest first."""
    b, cb = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(qsl_ptr + b), tl.load(qsl_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    offs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < C
    s_base = state_ptr + slot * stride_ss + offs * 4
    c0 = tl.load(s_base + 0, mask=ok, other=0.0)
    c1 = tl.load(s_base + 1, mask=ok, other=0.0)
    c2 = tl.load(s_base + 2, mask=ok, other=0.0)
    c3 = tl.load(s_base + 3, mask=ok, other=0.0)
    w0 = tl.load(w_ptr + offs * 4 + 0, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs * 4 + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + offs * 4 + 2, mask=ok, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + offs * 4 + 3, mask=ok, other=0.0).to(tl.float32)
    for i in range(MAX_POS):
        t = start + i
        if t < end:
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
            c0, c1, c2, c3 = c1, c2, c3, x
            y = c0 * w0 + c1 * w1 + c2 * w2 + c3 * w3
            y = y * tl.sigmoid(y)
            tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=ok)
            if VERIFY:
                v_base = verify_ptr + b * stride_vr + i * stride_vp + offs * 4
                tl.store(v_base + 0, c0, mask=ok)
                tl.store(v_base + 1, c1, mask=ok)
                tl.store(v_base + 2, c2, mask=ok)
                tl.store(v_base + 3, c3, mask=ok)
    if not VERIFY:
        tl.store(s_base + 0, c0, mask=ok)
        tl.store(s_base + 1, c1, mask=ok)
        tl.store(s_base + 2, c2, mask=ok)
        tl.store(s_base + 3, c3, mask=ok)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, qsl: torch.Tensor,
                     slots: torch.Tensor, max_pos: int, verify_conv: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] (rows may be strided), weight [C, 4], conv_state [S, C, 4] float32 (the pool's), qsl [B + 1] and
    slots [B] on the device -> conv + SiLU output [T, C] in x's dtype. verify_conv [R, P, C, 4]: verify mode."""
    t, c = x.shape
    if weight.shape[1] != 4:
        raise ValueError(f"the conv kernel handles kernel width 4, not {weight.shape[1]}")
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    verify = verify_conv is not None
    target = verify_conv if verify else conv_state
    block_c = 256
    grid = (slots.numel(), triton.cdiv(c, block_c))
    _conv_step[grid](x, weight.contiguous(), out, conv_state, target, qsl, slots, c, x.stride(0), out.stride(0),
                     conv_state.stride(0), target.stride(0) if verify else 0, target.stride(1) if verify else 0,
                     MAX_POS=max_pos, VERIFY=verify, BLOCK_C=block_c)
    return out


@triton.jit
def _recurrent_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, verify_ptr, qsl_ptr, slots_ptr,
                    stride_ss, stride_vr, stride_vp, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BLOCK_V: tl.constexpr, MAX_POS: tl.constexpr, VERIFY: tl.constexpr):
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(qsl_ptr + b), tl.load(qsl_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    offs_k = tl.arange(0, DK)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    block = h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]  # this head's [DK, BLOCK_V] block of a state
    s = tl.load(state_ptr + slot * stride_ss + block)
    for i in range(MAX_POS):
        t = start + i
        if t < end:
            row = t.to(tl.int64) * HV + h
            kt = tl.load(k_ptr + row * DK + offs_k)
            qt = tl.load(q_ptr + row * DK + offs_k)
            vt = tl.load(v_ptr + row * DV + offs_v)
            s = s * tl.exp(tl.load(g_ptr + row))
            u = tl.load(beta_ptr + row) * (vt - tl.sum(s * kt[:, None], axis=0))
            s = s + kt[:, None] * u[None, :]
            tl.store(out_ptr + row * DV + offs_v, tl.sum(s * qt[:, None], axis=0))
            if VERIFY:
                tl.store(verify_ptr + b * stride_vr + i * stride_vp + block, s)
    if not VERIFY:
        tl.store(state_ptr + slot * stride_ss + block, s)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, qsl: torch.Tensor, slots: torch.Tensor, max_pos: int,
                   verify_state: torch.Tensor | None = None) -> torch.Tensor:
    """q, k [T, Hv, Dk] (normalised, q scaled), v [T, Hv, Dv], g, beta [T, Hv], all float32; state [S, Hv, Dk, Dv]
    float32 (the pool's) -> o [T, Hv, Dv] float32. verify_state [R, P, Hv, Dk, Dv]: verify mode."""
    t, hv, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=q.device)
    verify = verify_state is not None
    target = verify_state if verify else state
    block_v = min(dv, 32)
    grid = (slots.numel(), hv, triton.cdiv(dv, block_v))
    _recurrent_step[grid](q, k, v, g, beta, out, state, target, qsl, slots, state.stride(0),
                          target.stride(0) if verify else 0, target.stride(1) if verify else 0, HV=hv, DK=dk, DV=dv,
                          BLOCK_V=block_v, MAX_POS=max_pos, VERIFY=verify)
    return out
