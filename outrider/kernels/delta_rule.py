"""Triton kernels for Gated DeltaNet's short queries (decode and speculative verify), reading and writing the
state pool's slots in place: no gather or scatter of states, no host loop, every shape fixed by the batch, so a
decode or verify step captures into a CUDA graph.

- `causal_conv_step`: the depthwise causal conv + SiLU over each sequence's query tokens from its slot's conv
  window; advances the slot, or (verify) writes each position's input to the verify rows.
- `recurrent_step`: the gated delta rule over each sequence's query tokens from its slot's recurrent state, with
  the heads' normalisation and gates computed in the kernel (torch's two dozen small ops a layer would each be a
  launch); the same two modes (verify: each position's update of the state, not the state). One program per
  (sequence, value head, block of value dims): the [Dk, BV] state block stays in registers across the positions.
- `gated_norm`: the output's gated RMSNorm in one launch.
The three decode kernels launch as programmatic dependent launches in CUDA graphs (fused.pdl_enter first), as the
projections around them do: a plain launch between them would expose two launch gaps a linear-attention layer.
- `commit_updates`: after a verify, each sequence's slot takes the state after its accepted drafts, replaying the
  updates its verify row kept (k, u, g a position: a rank-one update each, far smaller than a state).

A sequence's positions are walked up to max_pos (the longest query a step has: 1 at decode, k + 1 at verify), a
run-time bound: one compiled kernel serves every draft length.
fla has no kernel that keeps what the rollback needs of every position (docs/architecture.md, "Hybrid models").
Semantics: layers/gated_deltanet.causal_conv and recurrent_delta_rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.kernels.fused import pdl_enter
from outrider.kernels.launch import pdl_args, use_pdl


@triton.jit
def _conv_step(x_ptr, w_ptr, out_ptr, state_ptr, verify_ptr, qsl_ptr, slots_ptr, C, stride_x, stride_out,
               stride_ss, stride_vr, stride_vp, max_pos, VERIFY: tl.constexpr, BLOCK_C: tl.constexpr,
               USE_PDL: tl.constexpr):
    """Kernel width 4 (every released Qwen3-Next / Qwen3.5): the window is four [BLOCK_C] columns, oldest first."""
    pdl_enter(USE_PDL)
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
    for i in range(max_pos):
        t = start + i
        if t < end:
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
            c0, c1, c2, c3 = c1, c2, c3, x
            y = c0 * w0 + c1 * w1 + c2 * w2 + c3 * w3
            y = y * tl.sigmoid(y)
            tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=ok)
            if VERIFY:  # (the window after this position follows from the inputs: StatePool.commit_verify)
                tl.store(verify_ptr + b * stride_vr + i * stride_vp + offs, x, mask=ok)
    if not VERIFY:
        tl.store(s_base + 0, c0, mask=ok)
        tl.store(s_base + 1, c1, mask=ok)
        tl.store(s_base + 2, c2, mask=ok)
        tl.store(s_base + 3, c3, mask=ok)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, qsl: torch.Tensor,
                     slots: torch.Tensor, max_pos: int, verify_inputs: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] (rows may be strided), weight [C, 4], conv_state [S, C, 4] float32 (the pool's), qsl [B + 1] and
    slots [B] on the device -> conv + SiLU output [T, C] in x's dtype. verify_inputs [R, P, C]: verify mode, each
    position's input written there (float32)."""
    t, c = x.shape
    if weight.shape[1] != 4:
        raise ValueError(f"the conv kernel handles kernel width 4, not {weight.shape[1]}")
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    verify = verify_inputs is not None
    target = verify_inputs if verify else conv_state
    block_c = 256
    grid = (slots.numel(), triton.cdiv(c, block_c))
    _conv_step[grid](x, weight.contiguous(), out, conv_state, target, qsl, slots, c, x.stride(0), out.stride(0),
                     conv_state.stride(0), target.stride(0) if verify else 0, target.stride(1) if verify else 0,
                     max_pos=max_pos, VERIFY=verify, BLOCK_C=block_c, **pdl_args(use_pdl(x)))
    return out


@triton.jit
def _unit(x, scale):
    """GatedDeltaNet's q/k head normalisation (l2_normalize), times scale."""
    return x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6) * scale


@triton.jit
def _softplus(z):
    return tl.where(z > 20.0, z, tl.where(z < -15.0, tl.exp(z), tl.log(1.0 + tl.exp(z))))  # (torch's thresholds)


@triton.jit
def _head_inputs(x_row, a_row, b_row, h, kh, offs_k, scale, neg_rate, dt_bias, HK: tl.constexpr, DK: tl.constexpr):
    """GatedDeltaNet.heads for one token (its conv output row and a, b rows) and value head h of key head kh:
    q, k normalised (q scaled), the log decay g = -exp(A_log) softplus(a + dt_bias) (neg_rate = -exp(A_log)) and
    beta = sigmoid(b)."""
    q = _unit(tl.load(x_row + kh * DK + offs_k).to(tl.float32), scale)
    k = _unit(tl.load(x_row + (HK + kh) * DK + offs_k).to(tl.float32), 1.0)
    g = neg_rate * _softplus(tl.load(a_row + h).to(tl.float32) + dt_bias)
    return q, k, g, tl.sigmoid(tl.load(b_row + h).to(tl.float32))


@triton.jit
def _heads(x_ptr, b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, q_ptr, k_ptr, g_ptr, beta_ptr, stride_x, stride_b, stride_a,
           scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr):
    """GatedDeltaNet.heads for token t and value head h (a prompt's, for fla's chunked kernels): q, k of the head's
    key head normalised (q scaled) into [T, HV, DK] in q's dtype, g = -exp(A_log) softplus(a + dt_bias) and
    beta = sigmoid(b) into [T, HV] float32."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, DK)
    q, k, g, beta = _head_inputs(x_ptr + t * stride_x, a_ptr + t * stride_a, b_ptr + t * stride_b, h, h // (HV // HK),
                                 offs, scale, -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)),
                                 tl.load(dt_bias_ptr + h).to(tl.float32), HK, DK)
    out = (t * HV + h) * DK + offs
    tl.store(q_ptr + out, q.to(q_ptr.dtype.element_ty))
    tl.store(k_ptr + out, k.to(k_ptr.dtype.element_ty))
    tl.store(g_ptr + t * HV + h, g)
    tl.store(beta_ptr + t * HV + h, beta)


def heads(conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
          head_k_dim: int, head_v_dim: int) -> tuple[torch.Tensor, ...]:
    """GatedDeltaNet.heads in one launch: the conv output [T, C] (q | k | v channels), b and a [T, Hv] (rows may be
    strided) -> q, k [T, Hv, Dk] and v [T, Hv, Dv] (a view of conv_out) in conv_out's dtype, g, beta [T, Hv]
    float32."""
    t, hv = a.shape
    dk = head_k_dim
    hk = _key_heads(conv_out, b, a, hv, dk, head_v_dim)
    q = torch.empty(t, hv, dk, dtype=conv_out.dtype, device=conv_out.device)
    k = torch.empty_like(q)
    g = torch.empty(t, hv, dtype=torch.float32, device=conv_out.device)
    beta = torch.empty_like(g)
    if t:
        _heads[(t, hv)](conv_out, b, a, a_log, dt_bias, q, k, g, beta, conv_out.stride(0), b.stride(0), a.stride(0),
                        dk ** -0.5, HK=hk, HV=hv, DK=dk)
    return q, k, conv_out[:, 2 * hk * dk:].view(t, hv, -1), g, beta


def _key_heads(conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor, hv: int, dk: int, dv: int) -> int:
    """The key heads of a conv output [T, 2 Hk Dk + Hv Dv]; its rows and b's and a's must have unit column stride
    (the kernels read rows)."""
    if conv_out.stride(1) != 1 or b.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("the Gated DeltaNet kernels read rows of unit column stride")
    return (conv_out.shape[1] - hv * dv) // (2 * dk)


@triton.jit
def _recurrent_step(x_ptr, b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, out_ptr, state_ptr, verify_ptr, qsl_ptr, slots_ptr,
                    stride_x, stride_b, stride_a, stride_ss, stride_vr, stride_vp, scale, HK: tl.constexpr,
                    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                    max_pos, VERIFY: tl.constexpr, USE_PDL: tl.constexpr):
    """GatedDeltaNet.heads fused in: q, k L2-normalised (q scaled) from the conv output's channels of this value
    head's key head, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    pdl_enter(USE_PDL)
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(qsl_ptr + seq), tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    kh = h // (HV // HK)
    offs_k = tl.arange(0, DK)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    neg_rate = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    block = h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]  # this head's [DK, BLOCK_V] block of a state
    s = tl.load(state_ptr + slot * stride_ss + block)
    for i in range(max_pos):
        t = start + i
        if t < end:
            t64 = t.to(tl.int64)
            x_row = x_ptr + t64 * stride_x
            qt, kt, g, beta = _head_inputs(x_row, a_ptr + t64 * stride_a, b_ptr + t64 * stride_b, h, kh, offs_k, scale,
                                           neg_rate, dt_bias, HK, DK)
            vt = tl.load(x_row + 2 * HK * DK + h * DV + offs_v).to(tl.float32)
            s = s * tl.exp(g)
            u = beta * (vt - tl.sum(s * kt[:, None], axis=0))
            s = s + kt[:, None] * u[None, :]
            row = t64 * HV + h
            tl.store(out_ptr + row * DV + offs_v, tl.sum(s * qt[:, None], axis=0))
            if VERIFY:  # this position's update (k, u, g) of the state: commit_updates replays it
                update = verify_ptr + seq * stride_vr + i * stride_vp + h * (DK + DV + 1)
                tl.store(update + DK + offs_v, u)
                if vb == 0:
                    tl.store(update + offs_k, kt)
                    tl.store(update + DK + DV, g)
    if not VERIFY:
        tl.store(state_ptr + slot * stride_ss + block, s)


def recurrent_step(conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor, state: torch.Tensor, qsl: torch.Tensor, slots: torch.Tensor, max_pos: int,
                   verify_updates: torch.Tensor | None = None) -> torch.Tensor:
    """The conv output [T, C] (q | k | v channels), b and a [T, Hv] (rows may be strided), A_log and dt_bias [Hv]
    (GatedDeltaNet.heads' inputs); state [S, Hv, Dk, Dv] float32 (the pool's) -> o [T, Hv, Dv] float32.
    verify_updates [R, P, Hv, Dk + Dv + 1]: verify mode, each position's update written there (LayerState)."""
    hv, dk, dv = state.shape[1:]
    hk = _key_heads(conv_out, b, a, hv, dk, dv)
    out = torch.empty(conv_out.shape[0], hv, dv, dtype=torch.float32, device=conv_out.device)
    verify = verify_updates is not None
    target = verify_updates if verify else state
    block_v = min(dv, 32)
    grid = (slots.numel(), hv, triton.cdiv(dv, block_v))
    _recurrent_step[grid](conv_out, b, a, a_log, dt_bias, out, state, target, qsl, slots, conv_out.stride(0),
                          b.stride(0), a.stride(0), state.stride(0), target.stride(0) if verify else 0,
                          target.stride(1) if verify else 0, dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv,
                          BLOCK_V=block_v, max_pos=max_pos, VERIFY=verify, **pdl_args(use_pdl(conv_out)))
    return out


@triton.jit
def _gated_norm(x_ptr, z_ptr, w_ptr, out_ptr, stride_zt, eps, HV: tl.constexpr, DV: tl.constexpr,
                USE_PDL: tl.constexpr):
    """One (token, head) row: GatedRMSNorm's roundings to the output dtype, step by step."""
    pdl_enter(USE_PDL)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, DV)
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + (t * HV + h) * DV + offs).to(dtype).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, 0) / DV + eps)).to(dtype)
    normed = (tl.load(w_ptr + offs).to(tl.float32) * y.to(tl.float32)).to(dtype)
    z = tl.load(z_ptr + t * stride_zt + h * DV + offs).to(tl.float32)
    tl.store(out_ptr + (t * HV + h) * DV + offs, (normed.to(tl.float32) * z * tl.sigmoid(z)).to(dtype))


def gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """layers/gated_deltanet.GatedRMSNorm of the delta rule's output x [T, Hv, Dv] float32 and the gate z
    [T, Hv, Dv] (heads contiguous, rows may be strided) -> [T, Hv, Dv] in `dtype`, in one launch."""
    t, hv, dv = x.shape
    if z.stride(2) != 1 or z.stride(1) != dv:
        raise ValueError("gated_norm reads each row's heads contiguous")
    out = torch.empty(t, hv, dv, dtype=dtype, device=x.device)
    if t:
        _gated_norm[(t, hv)](x.contiguous(), z, weight, out, z.stride(0), eps, HV=hv, DV=dv, **pdl_args(use_pdl(x)))
    return out


@triton.jit
def _commit_updates(state_ptr, updates_ptr, slots_ptr, rows_ptr, accepted_ptr, num_seqs, stride_sl, stride_ss,
                    stride_ul, stride_ur, stride_up, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BLOCK_V: tl.constexpr, POSITIONS: tl.constexpr):
    """One (layer, sequence), value head and block of value dims: the slot's state block, then the updates of
    positions 0..accepted of its verify row, in order, as the verify applied them."""
    pid, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    layer, seq = pid // num_seqs, pid % num_seqs
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    last = tl.load(accepted_ptr + seq)
    offs_k = tl.arange(0, DK)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    at = state_ptr + layer.to(tl.int64) * stride_sl + slot * stride_ss + h * DK * DV + offs_k[:, None] * DV + \
        offs_v[None, :]
    s = tl.load(at)
    base = updates_ptr + layer.to(tl.int64) * stride_ul + row * stride_ur + h * (DK + DV + 1)
    for i in range(POSITIONS):
        if i <= last:
            update = base + i * stride_up
            kt = tl.load(update + offs_k)
            u = tl.load(update + DK + offs_v)
            s = s * tl.exp(tl.load(update + DK + DV)) + kt[:, None] * u[None, :]
    tl.store(at, s)


def commit_updates(state: torch.Tensor, updates: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                   accepted: torch.Tensor) -> None:
    """StatePool.commit_verify's recurrent part in one launch: state [L, S, Hv, Dk, Dv] and updates
    [L, R, P, Hv, Dk + Dv + 1] float32 (the pool's), slots, rows and accepted [B] on the device."""
    layers, _, hv, dk, dv = state.shape
    num_seqs = slots.numel()
    if not num_seqs:
        return
    block_v = min(dv, 32)
    grid = (layers * num_seqs, hv, triton.cdiv(dv, block_v))
    _commit_updates[grid](state, updates, slots, rows, accepted, num_seqs, state.stride(0), state.stride(1),
                          updates.stride(0), updates.stride(1), updates.stride(2), HV=hv, DK=dk, DV=dv,
                          BLOCK_V=block_v, POSITIONS=updates.shape[2])
