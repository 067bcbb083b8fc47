"""One decoder for the Llama family: Llama (incl. llama3 RoPE), Qwen2 (qkv bias) and Qwen3 (per-head q/k norm).

Parameter names follow Hugging Face so checkpoints load by name. Attention over the paged KV cache is delegated
to the backend passed to `forward`; nothing here synchronises with the host.
"""

from __future__ import annotations

import torch
from torch import nn

from outrider.attention import AttentionBackend, AttentionMetadata, KVCache
from outrider.config import ModelConfig
from outrider.layers.mlp import GatedMLP
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        qkv_bias = cfg.attention_bias
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"  # Qwen2 biases q/k/v only
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = backend.forward(q, k, v, kv_cache, self.layer_idx, meta, self.scale)
        return self.o_proj(o.reshape(t, self.n_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, kv_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """The model contract of docs/team-interfaces.md: forward -> pre-norm hidden, compute_logits, embed."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embed_tokens with lm_head when the checkpoint ties them (call again after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, H] of the last layer, before the final norm."""
        h = self.embed(input_ids)
        aux = []
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, self.model.rotary_emb, kv_cache, meta, backend)
            if i in self.aux_layer_ids:
                aux.append(h)
        self.aux_hidden = torch.cat(aux, dim=-1) if aux else None
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()
