"""Multi-token-prediction heads shipped inside the target checkpoint, used as a drafter.

Two layouts: Qwen3-Next / Qwen3.5 (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.*`, `mtp.norm`; top level also in Qwen3.5's multimodal release, whose decoder sits under
`model.language_model.`) and MiMo (`model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj,
<decoder layer>, final_layernorm}`). Both fuse the embedding of token t_{i+1} with the target's final-norm
hidden h_i, run one decoder layer with its own KV (one extra layer, indexed by the target's block ids), norm,
and use the target's lm_head to predict t_{i+2}. Drafting deeper than 1 feeds the head its own output back,
reusing layer 0 (released checkpoints have one layer; acceptance decays with depth).

On a hybrid target (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: models/hybrid.py) the Qwen layer is the model's own kind of
full-attention layer (`mtp_layer`: gated attention, partial RoPE, the model's MoE or dense MLP), and the head's
tensors pass through the architecture's checkpoint conversion (their RMSNorms store w for (1 + w)). Experts are
read as the checkpoint stores them: per expert, or fused (`mlp.experts.gate_up_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

from outrider.attention import AttentionBackend, AttentionMetadata, KVCache
from outrider.config import ModelConfig
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import RotaryEmbedding
from outrider.models import read_tensors, registry
from outrider.models.loader import assign_tensors
from outrider.models.hybrid import HybridCausalLM, mtp_layer
from outrider.speculative.chain import ChainDrafter
from outrider.speculative.drafter import KVPool, TargetView, greedy_drafts


class QwenMTP(nn.Module):
    """x = fc([pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)]); y = norm(layers.0(x))."""

    prefix = "mtp."

    def __init__(self, cfg: ModelConfig, fused_experts: bool = False) -> None:
        """fused_experts: a MoE layer's experts are stored fused (Qwen3.5-MoE's release)."""
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        hybrid = registry.of(cfg).model is HybridCausalLM  # (its layer 0 may be a linear-attention one)
        self.layers = nn.ModuleList([mtp_layer(cfg, fused_experts) if hybrid else registry.decoder_layer(cfg, 0)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.norm(self.layers[0](self.fuse(emb, hidden), positions, rotary, kv, meta, backend))


class MiMoMTP(nn.Module):
    """A decoder layer wrapped as x = input_proj([hidden_layernorm(h), token_layernorm(emb)]) (hidden first);
    y = final_layernorm(layer(x))."""

    prefix = "model.mtp_layers.0."

    def __init__(self, cfg: ModelConfig, fused_experts: bool = False) -> None:
        super().__init__()
        layer = registry.decoder_layer(cfg, 0)
        # The layer's modules sit beside the head's own in the checkpoint (self_attn, mlp, ... unprefixed): they are
        # registered here, and the layer, which shares them, runs them.
        for name, child in layer.named_children():
            self.add_module(name, child)
        self.layer = layer.forward
        h = cfg.hidden_size
        self.token_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(emb)], dim=-1))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.final_layernorm(self.layer(self.fuse(emb, hidden), positions, rotary, kv, meta, backend))


LAYOUTS = {"qwen": QwenMTP, "mimo": MiMoMTP}


def load_mtp_head(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[str, nn.Module]:
    """(layout name, head) from the MTP tensors in the target checkpoint at `path`."""
    for layout, cls in LAYOUTS.items():
        tensors = read_tensors(path, cls.prefix)
        if tensors:
            break
    else:
        raise ValueError(f"no MTP tensors ({', '.join(c.prefix for c in LAYOUTS.values())}*) in {path}")
    convert = registry.of(cfg).from_checkpoint or (lambda name, t: t)
    state = {name[len(cls.prefix):]: convert(name, t) for name, t in tensors.items()}
    # Only layer 0 is used (see the module docstring); deeper Qwen layers are left on disk.
    state = {n: t for n, t in state.items() if not n.startswith("layers.") or n.startswith("layers.0.")}
    with torch.device("meta"):
        head = cls(cfg, fused_experts=any(n.endswith("mlp.experts.gate_up_proj") for n in state))
    assign_tensors(head, state, f"the MTP head ({cls.prefix}*) of {path}")
    return layout, head.to(device=device, dtype=dtype).eval().requires_grad_(False)


class MTPDrafter(ChainDrafter):
    """Reads the target's final-norm hidden state and drafts through the target's own LM head."""

    kind = "mtp"
    step_cost = 0.05  # [est] one decoder layer of the target per drafted token

    def __init__(self, target: TargetView, cfg: ModelConfig, path: str, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, kv_pool: KVPool, max_draft: int = 4) -> None:
        super().__init__(target, block_size, device, max_draft, cfg.hidden_size, dtype)
        self.layout, self.head = load_mtp_head(path, cfg, dtype, self.device)
        self.kv_shape = (1, cfg.num_key_value_heads, cfg.head_dim)  # one decoder layer of the target's shape
        self.kv = kv_pool(self.kv_shape, self.aux_layer_ids)
        self.vocab_size = cfg.vocab_size

    def context(self, hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> torch.Tensor:
        return self.target.final_norm(hidden)  # h_i after the target's final norm

    def run_head(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.head(self.target.embed(tokens), hidden, positions, self.target.rotary, self.kv,
                         meta, self.backend)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(y).float()

    def drafts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, conf = greedy_drafts(logits, self.vocab_size)
        return self.target.tokens(ids), conf
