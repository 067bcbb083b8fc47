"""The hybrid decoder of Qwen3-Next and Qwen3.5: Gated DeltaNet layers (layers/gated_deltanet.py) interleaved with
gated full-attention layers, by `layer_types` (or every `full_attention_interval`-th layer full), with a dense or
MoE feed-forward block (layers/moe.py).

Full attention differs from the shared decoder's (models/decoder.py) in two ways: q_proj also yields a per-head
output gate (o * sigmoid(gate) before o_proj), and RoPE turns only the first `partial_rotary_factor` of each head.
Partial RoPE rides on the backend's full rotate-half RoPE: q and k heads are read in a fixed permutation of their
dimensions that puts each rotary pair (i, i + r/2) at (i, i + D/2) and the unrotated dimensions at frequency 0
(cos 1, sin 0). Attention scores are sums over the head dimension, so the permutation changes nothing else; v
keeps its order. The backend's q/k preparation reads through the permutation (QKNormRope.order), so nothing is
gathered beforehand.

Norms: checkpoints store these models' RMSNorm weights as w in (1 + w) x / rms(x) (the gated norm inside the
linear-attention layers excepted); `one_centered_norms` turns them into our w on load.

MTP heads (`mtp.layers.0`) run `mtp_layer`: a full-attention layer with the model's feed-forward kind, whatever
layer_types says of layer 0 (the shared `decoder_layer(cfg, 0)` is a linear layer in these models).

Forward contract: the shared one (ForwardResult; docs/architecture.md, Contracts) plus `states`, the linear
layers' state: a pool whose `layer(i)` gives the i-th linear layer's LayerState (engine/state_pool.py) and the
batch's StateBatch (each sequence's slot; verify mode). The KV cache holds the full-attention layers only, in
order (`num_kv_layers`); the state pool the linear ones (`num_linear_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from outrider.attention import AttentionBackend, AttentionMetadata, KVCache, QKNormRope
from outrider.config import ModelConfig
from outrider.kernels import ops
from outrider.layers.gated_deltanet import (QWEN3_5_PROJECTIONS, GatedDeltaNet, GatedDeltaNetConfig, LayerState,
                                            StateBatch)
from outrider.layers.linear import Linear, MergedLinear, stack_merged_parts
from outrider.layers.mlp import GatedMLP
from outrider.layers.moe import MoeConfig, SparseMoe
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import rope_inv_freq
from outrider.models.decoder import CausalLM
from outrider.models.output import ForwardResult, concat_taps

FULL, LINEAR = "full_attention", "linear_attention"


@dataclass(frozen=True)
class HybridConfig:
    """What the hybrid decoder reads beyond ModelConfig, from the same config.json."""

    layer_types: tuple[str, ...]
    rotary_dim: int
    linear: GatedDeltaNetConfig
    moe: MoeConfig | None  # None: dense feed-forward everywhere
    fused_experts: bool = False  # the checkpoint holds each layer's experts fused (layers/moe.Experts)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, projections: tuple[str, ...],
                          fused_experts: bool = False) -> "HybridConfig":
        """`projections`: the checkpoint's linear input projections (layers/gated_deltanet.py), unless the config
        names them (`linear_projections`: the GGUF reader does, for llama.cpp's)."""
        raw = cfg.raw
        types = raw.get("layer_types")
        if not types:
            interval = raw.get("full_attention_interval", 4)
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(cfg.num_hidden_layers)]
        unknown = sorted(set(types) - {FULL, LINEAR})
        if unknown or len(types) != cfg.num_hidden_layers:
            raise ValueError(f"layer_types must list {cfg.num_hidden_layers} of {FULL}, {LINEAR}; got {types}")
        factor = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        linear = GatedDeltaNetConfig.from_dict(raw, tuple(raw.get("linear_projections") or projections))
        return cls(tuple(types), int(cfg.head_dim * factor), linear,
                   MoeConfig.from_dict(raw) if raw.get("num_experts") else None, fused_experts)


def one_centered_norms(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Checkpoint -> our value: RMSNorm weights (every `*norm*.weight`, the MTP head's pre_fc_norm_embedding and
    pre_fc_norm_hidden included) are stored as w for (1 + w); the linear layers' gated norm is not."""
    module, _, kind = name.rpartition(".")
    if kind == "weight" and "norm" in module.rpartition(".")[2] and not module.endswith("linear_attn.norm"):
        return tensor + 1
    return tensor


def partial_rope_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """order[p] = the head dimension read at position p: rotary pair (i, i + r/2) lands on (i, i + D/2), the
    unrotated dimensions fill the rest in order."""
    half, rh = head_dim // 2, rotary_dim // 2
    rest = list(range(rotary_dim, head_dim))
    return torch.tensor(list(range(rh)) + rest[:half - rh] + list(range(rh, rotary_dim)) + rest[half - rh:],
                        device="cpu")


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate from q_proj and partial RoPE, over KV layer `kv_index`."""

    def __init__(self, cfg: ModelConfig, kv_index: int, rotary_dim: int) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale, self.eps = self.head_dim ** -0.5, cfg.rms_norm_eps
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q_proj": 2 * q_size, "k_proj": kv_size, "v_proj": kv_size},
                                     bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # (None: RoPE turns every dimension, read in order)
        order = partial_rope_order(self.head_dim, rotary_dim) if rotary_dim < self.head_dim else None
        self.register_buffer("order", order, persistent=False)
        self.register_load_state_dict_pre_hook(stack_merged_parts)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, positions: torch.Tensor,
                inv_freq: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm.forward_linear(x, residual, self.qkv_proj)
        t = qkv.shape[0]
        q_gate, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)
        q_gate = q_gate.view(t, self.n_heads, 2 * self.head_dim)  # per head: [query | gate]
        q, gate = q_gate[..., :self.head_dim], q_gate[..., self.head_dim:]
        k, v = k.view(t, self.n_kv_heads, self.head_dim), v.view(t, self.n_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, kv_cache, self.kv_index, meta, self.scale,
                            QKNormRope(positions, inv_freq, self.q_norm.weight, self.k_norm.weight, self.eps,
                                       self.order))
        return self.o_proj(ops.sigmoid_gate(o, gate).flatten(1)), residual


class LinearStates(NamedTuple):
    """The linear layers' state for one forward: `pool.layer(i)` -> the i-th linear layer's LayerState, and the
    batch's slots (StateBatch)."""

    pool: "StateSource"
    batch: StateBatch


class StateSource(Protocol):
    def layer(self, i: int) -> LayerState: ...


class HybridDecoderLayer(nn.Module):
    """One layer: gated full attention (KV layer `index`) or Gated DeltaNet (state layer `index`), then the dense
    or MoE (`sparse`) feed-forward block; pre-norm, the residual stream carried unsummed as in models/decoder.py."""

    def __init__(self, cfg: ModelConfig, hybrid: HybridConfig, kind: str, index: int, sparse: bool) -> None:
        super().__init__()
        self.kind, self.index = kind, index
        if kind == FULL:
            self.self_attn = GatedAttention(cfg, index, hybrid.rotary_dim)
        else:
            self.linear_attn = GatedDeltaNet(hybrid.linear, index)
        self.mlp = (SparseMoe(cfg.hidden_size, hybrid.moe, hybrid.fused_experts) if sparse
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Hidden state in, hidden state out, as drafters run a single layer (a full-attention one: an MTP
        head's); `rotary` is the target's (its inv_freq already in partial_rope_order)."""
        out, residual = self.forward_residual(h, None, positions, rotary.inv_freq, kv_cache, meta, backend, None)
        return out + residual

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                         inv_freq: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                         backend: AttentionBackend, states: LinearStates | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == FULL:
            x, residual = self.self_attn(h, residual, self.input_layernorm, positions, inv_freq, kv_cache, meta,
                                         backend)
        else:
            normed, summed = ops.rms_norm(h, self.input_layernorm.weight, self.input_layernorm.eps, residual)
            residual = h if summed is None else summed
            x = self.linear_attn(normed, states.pool.layer(self.index), states.batch)
        return self.mlp(x, residual, self.post_attention_layernorm)


def hybrid_layer(cfg: ModelConfig, layer_idx: int, projections: tuple[str, ...],
                 fused_experts: bool = False) -> HybridDecoderLayer:
    """An architecture's `decoder_layer` (models/registry.py), with its checkpoint's layouts of the linear
    projections and the experts."""
    hybrid = HybridConfig.from_model_config(cfg, projections, fused_experts)
    kind = hybrid.layer_types[layer_idx]
    return HybridDecoderLayer(cfg, hybrid, kind, hybrid.layer_types[:layer_idx].count(kind),
                              hybrid.moe is not None and hybrid.moe.is_sparse(layer_idx))


def mtp_layer(cfg: ModelConfig, fused_experts: bool = False) -> HybridDecoderLayer:
    """The layer of a Qwen3-Next / Qwen3.5 MTP head (`mtp.layers.0.*`): always gated full attention (over the
    head's own KV layer, index 0), with the model's MoE block when the model has experts."""
    hybrid = HybridConfig.from_model_config(cfg, QWEN3_5_PROJECTIONS, fused_experts)
    return HybridDecoderLayer(cfg, hybrid, FULL, 0, hybrid.moe is not None)


class HybridCausalLM(CausalLM):
    """The shared causal LM (embedding, final norm, LM head, tying) over the architecture's hybrid layers; see the
    module doc for the forward contract."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hybrid = HybridConfig.from_model_config(cfg, QWEN3_5_PROJECTIONS)  # (the layout changes no state shape)
        self.num_kv_layers = hybrid.layer_types.count(FULL)
        self.num_linear_layers = hybrid.layer_types.count(LINEAR)
        self.linear_config = hybrid.linear  # what the state pool's slots are shaped by
        rotary = rope_inv_freq(hybrid.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # Frequency 0 for the unrotated dimensions (partial_rope_order put them there).
        inv_freq = torch.cat([rotary, torch.zeros(cfg.head_dim // 2 - rotary.numel(), device="cpu")])
        self.model.rotary_emb.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend, aux_layer_ids: tuple[int, ...] = (),
                states: LinearStates | None = None) -> ForwardResult:
        if states is None and self.num_linear_layers:
            raise ValueError(f"{self.config.architecture} needs `states` in its forward: the state slots of its "
                             "linear-attention layers (docs/architecture.md, Hybrid models)")
        h, residual = self.embed(input_ids), None
        taps = {}
        inv_freq = self.model.rotary_emb.inv_freq
        for i, layer in enumerate(self.model.layers):
            h, residual = layer.forward_residual(h, residual, positions, inv_freq, kv_cache, meta, backend, states)
            if i in aux_layer_ids:
                taps[i] = h + residual
        return ForwardResult(h + residual, concat_taps(taps, aux_layer_ids))


def hybrid_config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields every hybrid checkpoint implies: q/k norm; biases as `attention_bias` says."""
    bias = bool(raw.get("attention_bias", False))
    return {"qk_norm": True, "attention_bias": bias, "o_proj_bias": bias}
