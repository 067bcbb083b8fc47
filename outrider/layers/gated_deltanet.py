"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, over explicit per-sequence state.

Per token t and value head: a short causal depthwise convolution (kernel K, SiLU) over the packed q|k|v channels,
then the gated delta rule on a [Dk, Dv] matrix state S:
    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
with q, k L2-normalised (q also scaled by Dk^-1/2), g_t = -exp(A_log) softplus(a_t + dt_bias), beta_t =
sigmoid(b_t), q/k heads shared by groups of value heads; o is RMS-normed per head, times silu(z), projected out.

State lives outside the layer (engine/state_pool.py): per sequence a conv state [C, K] (its last K conv inputs,
oldest first; fla's layout) and a recurrent state [Hv, Dk, Dv], both float32, addressed by slot. A forward reads
and advances each sequence's slot, so chunked prefill carries state from chunk to chunk. A verify forward
(`StateBatch.verify`) leaves the slots alone and writes into verify rows instead the conv state after every
position and every position's rank-one update of the recurrent state (k, u, g), so that accepting j drafts
continues from the state after position j (StatePool.commit_verify replays the first j + 1 updates), exactly.

The torch reference here is the semantics and the CPU path: a chunked form for prompts (per chunk of 64, the
delta updates solved as one unit-triangular system) and the plain recurrence for short queries. On CUDA the
kernels of flash-linear-attention (`fla`, Triton; the `gpu` extra) do the same, imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from outrider.layers.gated_deltanet_types import Gates, LayerState, Mixed, StateBatch
from outrider.layers.linear import Linear, MergedLinear, stack_merged_parts

CHUNK = 64  # the chunked form's block length (fla's too)

# How checkpoints lay out the input projections: the tensors (module names), in packing order. In_proj_qkvz and
# in_proj_ba interleave their parts per key head ([q_g, k_g, v_g, z_g] and [b_g, a_g] for each group g of value
# heads); the others hold each part for all heads, in head order.
QWEN3_5_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN3_NEXT_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")
QWEN3_NEXT_GGUF_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_ba")  # llama.cpp splits qkvz, not ba


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The linear-attention fields of an HF config (Qwen3-Next / Qwen3.5 names), and the checkpoint's layout of
    the input projections (one of the *_PROJECTIONS above)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    rms_norm_eps: float
    projections: tuple[str, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], projections: tuple[str, ...]) -> "GatedDeltaNetConfig":
        return cls(hidden_size=raw["hidden_size"], num_k_heads=raw["linear_num_key_heads"],
                   num_v_heads=raw["linear_num_value_heads"], head_k_dim=raw["linear_key_head_dim"],
                   head_v_dim=raw["linear_value_head_dim"], conv_kernel=raw["linear_conv_kernel_dim"],
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-6), projections=projections)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


# --- the torch reference, one sequence at a time -------------------------------------------------------------


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of x [L, C] (weight [C, K]) after the K inputs in `state` [C, K] ->
    (y [L, C], the conv states after each position [L, C, K])."""
    k = weight.shape[1]
    seq = torch.cat([state.to(x.dtype), x.T], dim=1)  # [C, K + L]
    windows = seq.unfold(1, k, 1)[:, 1:]  # [C, L, K]: window t ends at input t
    y = (windows * weight[:, None, :].to(x.dtype)).sum(-1).T
    return F.silu(y), windows.permute(1, 0, 2)


class DeltaRun(NamedTuple):
    """recurrent_delta_rule's result: the output o [L, H, Dv], the state after each position [L, H, Dk, Dv], and
    each position's update [L, H, Dk + Dv + 1] (k, u, g: S <- exp(g) S + k u^T; apply_updates)."""

    out: torch.Tensor
    states: torch.Tensor
    updates: torch.Tensor


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> DeltaRun:
    """The gated delta rule token by token. q, k [L, H, Dk] (normalised, q scaled), v [L, H, Dv], g, beta [L, H],
    state [H, Dk, Dv], all float32."""
    outs, states, us = [], [], []
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
        states.append(s)
        us.append(u)
    return DeltaRun(torch.stack(outs), torch.stack(states), torch.cat([k, torch.stack(us), g[..., None]], dim=-1))


def apply_updates(state: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """The recurrent state [..., H, Dk, Dv] after one position's updates [..., H, Dk + Dv + 1] (DeltaRun.updates)."""
    dk, dv = state.shape[-2:]
    k, u, g = updates[..., :dk], updates[..., dk:dk + dv], updates[..., dk + dv]
    return state * g.exp()[..., None, None] + k[..., :, None] * u[..., None, :]


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_delta_rule's output and final state [H, Dk, Dv], a chunk of positions at a time.

    Within a chunk, with G_i the cumulative log decay and S0 the chunk's initial state, every update u_i solves
    u_i + beta_i sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j = beta_i (v_i - e^{G_i} S0^T k_i), a unit lower-triangular
    system; then o_i = e^{G_i} S0^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) u_j and the chunk's last state is
    e^{G_last} S0 + sum_j e^{G_last - G_j} k_j u_j^T."""
    outs = []
    s = state
    for a in range(0, q.shape[0], chunk):
        qc, kc, vc = (t[a:a + chunk].transpose(0, 1) for t in (q, k, v))  # [H, C, D]
        gc, bc = g[a:a + chunk].T, beta[a:a + chunk].T  # [H, C]
        cum = gc.cumsum(-1)
        n = qc.shape[1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, i, j]
        kk = (kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]
        system = torch.eye(n, device=q.device) + kk.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append(cum.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u)
        last = cum[:, -1:]
        s = last.exp()[:, :, None] * s + (kc * (last - cum).exp()[:, :, None]).transpose(1, 2) @ u
    return torch.cat(outs, dim=1).transpose(0, 1), s


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# --- the layer -----------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta rule's output, times silu(z) (Qwen3-Next's RMSNormGated rounding)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The delta rule's output `core` [T, Hv, Dv] float32, rounded to `dtype` first, and the gate z -> `dtype`."""
        if core.is_cuda:
            from outrider.kernels.delta_rule import gated_norm

            return gated_norm(core, z, self.weight, self.eps, dtype)
        x = core.to(dtype)
        xf = x.float()
        normed = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear-attention layer: hidden [T, H] -> [T, H] (no norm or residual: the decoder
    layer's). Checkpoint names: conv1d, dt_bias, A_log, norm, out_proj and the input projections (packed into
    one GEMM, `in_proj`)."""

    def __init__(self, cfg: GatedDeltaNetConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        hv = cfg.num_v_heads
        rows = {"in_proj_qkv": cfg.conv_dim, "in_proj_z": cfg.value_dim, "in_proj_b": hv, "in_proj_a": hv,
                "in_proj_qkvz": cfg.conv_dim + cfg.value_dim, "in_proj_ba": 2 * hv}
        self.in_proj = MergedLinear(cfg.hidden_size, {name: rows[name] for name in cfg.projections})
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False,
                                padding=cfg.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(cfg.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(cfg.value_dim, cfg.hidden_size, bias=False)
        self.register_load_state_dict_pre_hook(stack_merged_parts)

    def split(self, x: torch.Tensor) -> Mixed:
        cfg, t = self.cfg, x.shape[0]
        parts = dict(zip(cfg.projections, self.in_proj(x).split(self.in_proj.sizes, dim=-1)))
        r = cfg.num_v_heads // cfg.num_k_heads
        if "in_proj_qkvz" in parts:
            q, k, v, z = parts["in_proj_qkvz"].view(t, cfg.num_k_heads, -1).split(
                [cfg.head_k_dim, cfg.head_k_dim, r * cfg.head_v_dim, r * cfg.head_v_dim], dim=-1)
            qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        else:
            qkv, z = parts["in_proj_qkv"], parts["in_proj_z"]
        if "in_proj_ba" in parts:
            b, a = (p.reshape(t, -1) for p in parts["in_proj_ba"].view(t, cfg.num_k_heads, 2 * r).split([r, r], -1))
        else:
            b, a = parts["in_proj_b"], parts["in_proj_a"]
        return Mixed(qkv, z.reshape(t, cfg.num_v_heads, cfg.head_v_dim), b, a)

    def heads(self, conv_out: torch.Tensor, b: torch.Tensor,
              a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [L, C] -> q, k [L, Hv, Dk] (normalised, q scaled, repeated per value head), v [L, Hv, Dv],
        g, beta [L, Hv], all float32."""
        cfg, n = self.cfg, conv_out.shape[0]
        q, k, v = conv_out.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        r = cfg.num_v_heads // cfg.num_k_heads
        q = l2_normalize(q.view(n, cfg.num_k_heads, cfg.head_k_dim)).repeat_interleave(r, 1) * cfg.head_k_dim ** -0.5
        k = l2_normalize(k.view(n, cfg.num_k_heads, cfg.head_k_dim)).repeat_interleave(r, 1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v.reshape(n, cfg.num_v_heads, cfg.head_v_dim), g, b.float().sigmoid()

    def forward(self, x: torch.Tensor, state: LayerState, batch: StateBatch) -> torch.Tensor:
        mixed = self.split(x)
        if x.is_cuda:
            from outrider.layers import gated_deltanet_cuda

            core = gated_deltanet_cuda.mix(self.conv1d.weight[:, 0], Gates(self.A_log, self.dt_bias), mixed, state,
                                           batch)
        else:
            core = self.torch_mix(mixed, state, batch)
        return self.out_proj(self.norm(core, mixed.z, x.dtype).flatten(1))

    def torch_mix(self, mixed: Mixed, state: LayerState, batch: StateBatch) -> torch.Tensor:
        """The reference, sequence by sequence: conv and delta rule from each slot's state, which advances (or,
        verifying, the verify rows are filled) -> the delta rule's output [T, Hv, Dv] float32."""
        weight = self.conv1d.weight[:, 0]
        qsl = batch.query_start_loc_host
        out = torch.empty(qsl[-1], self.cfg.num_v_heads, self.cfg.head_v_dim, device=mixed.qkv.device)
        for i, slot in enumerate(batch.slots_host):
            a, b = qsl[i], qsl[i + 1]
            if a == b:
                continue
            conv_out, conv_states = causal_conv(mixed.qkv[a:b], weight, state.conv[slot])
            q, k, v, g, beta = self.heads(conv_out, mixed.b[a:b], mixed.a[a:b])
            if batch.verify:
                o, _, updates = recurrent_delta_rule(q, k, v, g, beta, state.recurrent[slot])
                state.verify_inputs[i, :b - a] = conv_states[:, :, -1]
                state.verify_updates[i, :b - a] = updates
            elif b - a < CHUNK:
                o, states, _ = recurrent_delta_rule(q, k, v, g, beta, state.recurrent[slot])
                state.recurrent[slot] = states[-1]
                state.conv[slot] = conv_states[-1]
            else:
                o, state.recurrent[slot] = chunked_delta_rule(q, k, v, g, beta, state.recurrent[slot])
                state.conv[slot] = conv_states[-1]
            out[a:b] = o
        return out
