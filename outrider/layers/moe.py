"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): a top-k softmax router over
SwiGLU experts, plus an optional sigmoid-gated shared expert.

Expert weights are held stacked, one 2-D parameter per projection kind (`experts.gate_up_proj` [E * 2I, H], each
expert's gate rows then up rows; `experts.down_proj` [E * H, I]), so one grouped GEMM can read every expert; the
checkpoint's per-expert tensors (`experts.{e}.gate_proj.weight`, ...) load into their rows (`checkpoint_slots`).
On CUDA the experts run as two grouped Triton GEMMs over the tokens sorted by expert (kernels/moe.py), with fixed
shapes and no host sync, so decode captures into CUDA graphs; elsewhere a plain torch loop over the experts hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from outrider.kernels import ops
from outrider.layers.linear import Linear
from outrider.layers.mlp import GatedMLP
from outrider.layers.norm import RMSNorm


@dataclass(frozen=True)
class MoeConfig:
    """The MoE fields of an HF config.json (Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE names)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert (moe_intermediate_size)
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "MoeConfig":
        return cls(num_experts=int(raw["num_experts"]), top_k=int(raw["num_experts_per_tok"]),
                   intermediate_size=int(raw["moe_intermediate_size"]),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                   shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                   decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has the MoE block (else a dense MLP of the model's intermediate_size)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class Routing(NamedTuple):
    """Each token's chosen experts and their weights: ids [T, k] int64, weights [T, k] float32."""

    ids: torch.Tensor
    weights: torch.Tensor


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Softmax over the experts in float32, the top k, renormalised to sum 1 when `normalize` (norm_topk_prob).
    On CUDA one kernel (kernels/moe.py) instead of torch's five: at batch 1 each is a launch that computes little."""
    if logits.is_cuda:
        from outrider.kernels import moe

        return Routing(*moe.route(logits, top_k, normalize))
    return torch_route(logits, top_k, normalize)


def torch_route(logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Reference: the semantics kernels/moe.route matches."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


def torch_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Reference: sum_j w_j * down_e(silu(gate_e x) * up_e x) over each token's experts e = ids[:, j], looping over
    the experts hit (gate_up [E, 2I, H], down [E, H, I]). The semantics the Triton path matches."""
    out = torch.zeros_like(x)
    flat = routing.ids.flatten()
    for e in torch.unique(flat).tolist():
        token, slot = torch.nonzero(routing.ids == e, as_tuple=True)
        gate, up = (x[token] @ gate_up[e].T).chunk(2, dim=-1)
        y = ops.torch_silu_mul(gate, up) @ down[e].T
        out.index_add_(0, token, (y * routing.weights[token, slot, None].to(y.dtype)).to(out.dtype))
    return out


class Experts(nn.Module):
    """The routed experts' stacked weights; `checkpoint_slots` maps the checkpoint's expert tensors to rows: one
    per expert and projection (most releases), or `fused_checkpoint`: gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] as transformers holds them (Qwen3.5-MoE's release), which are our layout already."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 fused_checkpoint: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.fused_checkpoint = fused_checkpoint
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size))

    def checkpoint_slots(self) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """Checkpoint tensor name (relative to this module) -> (our parameter, first row, shape)."""
        e_count, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if self.fused_checkpoint:
            return {"gate_up_proj": ("gate_up_proj", 0, (e_count, 2 * i, h)),
                    "down_proj": ("down_proj", 0, (e_count, h, i))}
        slots = {}
        for e in range(e_count):
            slots[f"{e}.gate_proj.weight"] = ("gate_up_proj", 2 * i * e, (i, h))
            slots[f"{e}.up_proj.weight"] = ("gate_up_proj", 2 * i * e + i, (i, h))
            slots[f"{e}.down_proj.weight"] = ("down_proj", h * e, (h, i))
        return slots

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) as views."""
        return (self.gate_up_proj.view(self.num_experts, 2 * self.intermediate_size, self.hidden_size),
                self.down_proj.view(self.num_experts, self.hidden_size, self.intermediate_size))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        gate_up, down = self.stacked()
        if x.is_cuda:
            from outrider.kernels import moe

            return moe.fused_experts(x, gate_up, down, routing.ids, routing.weights)
        return torch_experts(x, gate_up, down, routing)


class SparseMoe(nn.Module):
    """The MoE feed-forward block with the MLP block's contract (layers/mlp.GatedMLP): pre-norm, residual passed on.
    Parameter names follow the checkpoint: gate (router), experts.*, shared_expert.*, shared_expert_gate."""

    def __init__(self, hidden_size: int, cfg: MoeConfig, fused_checkpoint: bool = False) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = Linear(hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, hidden_size, cfg.intermediate_size, fused_checkpoint)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = GatedMLP(hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm MoE of the stream x + residual (residual None: x alone) -> (block output, x + residual)."""
        h, summed = ops.rms_norm(x, norm.weight, norm.eps, residual)
        residual = x if summed is None else summed
        out = self.experts(h, route(self.gate(h), self.top_k, self.norm_topk_prob))
        if self.has_shared:
            mlp = self.shared_expert
            shared = ops.silu_mul_linear(mlp.gate_up_proj(h), mlp.down_proj.weight, mlp.down_proj.bias)
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * shared
        return out, residual
