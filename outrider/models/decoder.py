"""The decoder the architectures share (outrider/models/architectures/*): pre-norm attention and gated MLP blocks
over the paged KV cache, shaped by the ModelConfig (biases, q/k norm, RoPE). An architecture that differs
subclasses a block here and registers its own `model`/`decoder_layer`; the model contract stays this module's.

Parameter names follow Hugging Face, except that q/k/v_proj and gate/up_proj are packed into qkv_proj and
gate_up_proj (one GEMM each, which matters at batch 1); load_model and load_state_dict still take the HF
tensors (models/loader.py, layers/linear.py).
Small ops go through outrider.kernels.ops (fused Triton kernels on CUDA), and the residual stream is carried
unsummed between layers so each residual add fuses into the next RMSNorm. Attention over the paged KV cache is
delegated to the backend passed to `forward`; nothing here synchronises with the host.
"""

from __future__ import annotations

import torch
from torch import nn

from outrider.attention import AttentionBackend, AttentionMetadata, KVCache, QKNormRope
from outrider.config import ModelConfig
from outrider.kernels import ops
from outrider.layers.linear import Linear, MergedLinear, stack_merged_parts
from outrider.layers.mlp import GatedMLP
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import RotaryEmbedding, rope_attention_factor
from outrider.models import registry
from outrider.models.output import ForwardResult, concat_taps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rope_factor = rope_attention_factor(cfg.rope_scaling, cfg.max_position_embeddings)
        self.scale = self.head_dim ** -0.5 * rope_factor ** 2
        self.eps = cfg.rms_norm_eps
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                     bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        layer_type = cfg.layer_type(layer_idx)
        if layer_type not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layer {layer_idx} is {layer_type!r}: this decoder's layers are full_attention or "
                             "sliding_attention")
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else 0  # (0: the whole context)
        self.register_load_state_dict_pre_hook(stack_merged_parts)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv_proj's output [T, Hq*D + 2*Hkv*D] -> q [T, Hq, D], k and v [T, Hkv, D], q and k not yet normed or
        roped."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)
        # Strided views of the packed output: the fused kernels read rows by stride, no copies.
        return (q.view(t, self.n_heads, self.head_dim), k.view(t, self.n_kv_heads, self.head_dim),
                v.view(t, self.n_kv_heads, self.head_dim))

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding) -> QKNormRope:
        """How this layer prepares q and k: q/k norm (Qwen3), then RoPE at `positions`."""
        q_w, k_w = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        return QKNormRope(positions, rotary.inv_freq, q_w, k_w, self.eps)

    def store_context(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
                      meta: AttentionMetadata, backend: AttentionBackend) -> None:
        """K/V of x stored at meta.slot_mapping, attending nothing: keys only later queries read (DFlash's
        context)."""
        q, k, v = self.split_qkv(self.qkv_proj(x))
        backend.store(q, k, v, kv_cache, self.layer_idx, meta, self.rope(positions, rotary))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, positions: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm attention of the stream x + residual (residual None: x alone) -> (o_proj's output, x +
        residual). The residual add and `norm` go into qkv_proj's GEMM (one kernel at decode)."""
        qkv, residual = norm.forward_linear(x, residual, self.qkv_proj)
        # The backend prepares q/k itself, so it can fuse that with the KV store (one kernel on Triton).
        q, k, v = self.split_qkv(qkv)
        o = backend.forward(q, k, v, kv_cache, self.layer_idx, meta, self.scale, self.rope(positions, rotary),
                            self.window)
        return self.o_proj(o.flatten(1)), residual


class DecoderLayer(nn.Module):
    attention_class: type[Attention] = Attention  # (an architecture's own attention subclasses Attention)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Hidden state in, hidden state out: a single layer, as drafters run it."""
        out, residual = self.forward_residual(h, None, positions, rotary, kv_cache, meta, backend)
        return out + residual

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                         rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata,
                         backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream as (h, residual), whose sum is the stream (residual None: it is h alone).

        Returns the pair after this layer unsummed, so the next layer's norm fuses the add into its kernel. Each
        norm goes to the block it precedes, which fuses it with its first projection (at decode, one GEMM kernel
        does add, norm and projection)."""
        x, residual = self.self_attn(h, residual, self.input_layernorm, positions, rotary, kv_cache, meta, backend)
        return self.mlp(x, residual, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # The architecture's own layers (registry.Architecture.decoder_layer), declared there once.
        self.layers = nn.ModuleList(registry.decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


class CausalLM(nn.Module):
    """The model contract (docs/architecture.md, Contracts): forward -> ForwardResult (pre-norm hidden, taps),
    compute_logits, embed."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embed_tokens with lm_head when the checkpoint ties them (call again after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend, aux_layer_ids: tuple[int, ...] = ()) -> ForwardResult:
        """input_ids, positions [T] -> hidden [T, H] of the last layer, before the final norm; with aux_layer_ids,
        those layers' outputs concatenated as aux_hidden (None without). A call argument, not model state: engines
        sharing the weights (a benchmark's plain and speculative ones) tap different layers."""
        h, residual = self.embed(input_ids), None
        taps = {}
        for i, layer in enumerate(self.model.layers):
            h, residual = layer.forward_residual(h, residual, positions, self.model.rotary_emb, kv_cache, meta,
                                                 backend)
            if i in aux_layer_ids:
                taps[i] = h + residual  # the layer's output, as HF's hidden_states[i + 1]
        return ForwardResult(h + residual, concat_taps(taps, aux_layer_ids))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head -> float32 logits (the LM head's GEMM writes them directly at decode), into
        `out` [T, V] when given."""
        return ops.linear(self.model.norm(hidden), self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32,
                          out=out)
