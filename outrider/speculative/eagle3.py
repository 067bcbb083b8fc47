"""EAGLE-3 draft heads (Li et al. 2025), in the layout vLLM, SGLang and the EAGLE reference code load.

Checkpoint: config.json with architectures `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM` (the EAGLE
reference layout: tensors under `midlayer.`) or `Eagle3Speculator` (vLLM speculators: the layer's config under
`transformer_layer_config`, tensors under `layers.0.`), `draft_vocab_size`, and optionally the target layers it
reads, `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`). Tensors:
  fc            [H, 3 H_target]  over the concatenated outputs of three target layers (low, middle, high)
  layers.0.*    one Llama decoder layer whose q/k/v read [input_layernorm(embedding) ; hidden_norm(hidden)] (2H)
                and whose residual stream starts from the hidden input (hidden_norm(hidden) with
                `norm_before_residual`)
  norm          the final RMSNorm; the pre-norm output is the hidden input of the next draft step
  lm_head       [draft_vocab, H]: logits over a reduced draft vocabulary
  d2t           [draft_vocab] int64: draft id i is target id i + d2t[i]; t2d [V] bool marks the target ids covered
  embed_tokens  optional: without it the target's embedding is used
Aux layer ids count layer inputs (vLLM's convention: id j is the output of target layer j - 1; default (2, L // 2,
L - 3)), concatenated in layer order. Drafting is a chain (chain.py): top-1 over the draft vocabulary, mapped to
target ids, so q is one-hot on the target vocabulary and rejection sampling stays lossless.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from outrider.attention import AttentionBackend, AttentionMetadata, KVCache
from outrider.config import ModelConfig
from outrider.layers.linear import Linear, MergedLinear
from outrider.layers.mlp import GatedMLP
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import RotaryEmbedding
from outrider.models import read_tensors
from outrider.models import registry
from outrider.models.registry import decoder_layer
from outrider.speculative.chain import ChainDrafter
from outrider.speculative.drafter import KVPool, TargetView, greedy_drafts

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


def is_eagle3_config(raw: dict) -> bool:
    speculators = raw.get("speculators_config") or {}
    return (any(a in ARCHITECTURES for a in raw.get("architectures") or []) or "eagle_config" in raw
            or speculators.get("algorithm") == "eagle3")


def layer_config(raw: dict) -> ModelConfig:
    """The draft layer's shape: a Llama decoder layer (no q/k norm, no biases unless the config says so)."""
    cfg = {**raw, **(raw.get("transformer_layer_config") or {})}
    return registry.model_config({**cfg, "architectures": ["LlamaForCausalLM"]})


def aux_layer_ids(raw: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers (our aux_layer_ids: layer outputs, as the runner taps them) whose outputs fc reads, in
    layer order."""
    inputs = (raw.get("eagle_aux_hidden_state_layer_ids")
              or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
              or (2, num_target_layers // 2, num_target_layers - 3))
    outputs = sorted({j - 1 for j in inputs})  # the input of layer j is the output of layer j - 1
    if len(outputs) != len(inputs) or not 0 <= outputs[0] <= outputs[-1] < num_target_layers - 1:
        raise ValueError(f"EAGLE-3 aux layer ids {list(inputs)} must be distinct inputs of layers 1.."
                         f"{num_target_layers - 1} of the target (id 0, the embedding, is not tapped)")
    return tuple(outputs)


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose attention reads [input_layernorm(emb) ; hidden_norm(hidden)]."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = decoder_layer(cfg, 0).self_attn
        attn = self.self_attn
        attn.qkv_proj = MergedLinear(2 * h, attn.qkv_proj.parts, bias=cfg.attention_bias)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The layer's output before the final norm."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn = self.self_attn
        q, k, v = attn.split_qkv(attn.qkv_proj(torch.cat([self.input_layernorm(emb), normed], dim=-1)))
        o = backend.forward(q, k, v, kv, 0, meta, attn.scale, attn.rope(positions, rotary))
        out, residual = self.mlp(attn.o_proj(o.flatten(1)), residual, self.post_attention_layernorm)
        return out + residual


class Eagle3Model(nn.Module):
    """The head's weights under their checkpoint names (`midlayer.` read as `layers.0.`)."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, num_taps: int, draft_vocab: int,
                 norm_before_residual: bool = False, own_embedding: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = Linear(num_taps * target_hidden, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, norm_before_residual)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h)


def load_eagle3(path: str, target_cfg: ModelConfig) -> tuple[Eagle3Model, ModelConfig, tuple[int, ...]]:
    """(head on the CPU, in the checkpoint's dtype; its layer config; the target layers it taps)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = layer_config(raw)
    taps = aux_layer_ids(raw, target_cfg.num_hidden_layers)
    target_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
    if target_hidden != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"EAGLE-3 head for hidden size {target_hidden} and vocabulary {cfg.vocab_size}; the target "
                         f"has {target_cfg.hidden_size} and {target_cfg.vocab_size}")
    state = {name.replace("midlayer.", "layers.0.", 1): t for name, t in read_tensors(path).items()}
    t2d = state.pop("t2d", None)
    draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
    state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.int64))  # no map: the full vocabulary
    state["d2t"] = state["d2t"].to(torch.int64)
    targets = torch.arange(draft_vocab) + state["d2t"]
    if not bool(((targets >= 0) & (targets < cfg.vocab_size)).all()) or (
            t2d is not None and not bool(t2d.bool()[targets].all())):
        raise ValueError("EAGLE-3 d2t maps draft ids outside the target vocabulary (or disagrees with t2d)")
    own_embedding = "embed_tokens.weight" in state
    if not own_embedding and cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError("an EAGLE-3 head narrower than the target needs its own embed_tokens")
    with torch.device("meta"):
        model = Eagle3Model(cfg, target_hidden, len(taps), draft_vocab,
                            bool(raw.get("norm_before_residual", False)), own_embedding)
    model.load_state_dict(state, strict=True, assign=True)
    return model, cfg, taps


class Eagle3Drafter(ChainDrafter):
    """Reads three target layers' outputs through fc; drafts over its reduced vocabulary, mapped by d2t."""

    kind = "eagle3"
    step_cost = 0.05  # [est] one decoder layer and a reduced LM head per drafted token

    def __init__(self, target: TargetView, target_cfg: ModelConfig, path: str, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, kv_pool: KVPool, max_draft: int = 4) -> None:
        model, cfg, aux_layer_ids = load_eagle3(path, target_cfg)
        super().__init__(target, block_size, device, max_draft, cfg.hidden_size, dtype)
        self.aux_layer_ids = aux_layer_ids
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)  # (d2t stays int64)
        self.embed = self.model.embed_tokens if hasattr(self.model, "embed_tokens") else target.embed
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.max_position_embeddings).to(self.device)
        self.kv_shape = (1, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = kv_pool(self.kv_shape, self.aux_layer_ids)
        self.draft_vocab = self.model.lm_head.out_features

    def context(self, hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> torch.Tensor:
        if aux_hidden is None:
            raise ValueError("EAGLE-3 needs the target's aux_hidden: tap drafter.aux_layer_ids in the target's forward")
        return self.model.fc(aux_hidden)

    def run_head(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.model.layers[0](self.embed(tokens), hidden, positions, self.rotary, self.kv, meta, self.backend)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.norm(y)).float()

    def drafts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, conf = greedy_drafts(logits, self.draft_vocab)
        return ids + self.model.d2t[ids], conf
