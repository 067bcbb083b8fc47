"""Gemma 3's text model: Gemma3ForCausalLM, and the language model of Gemma3ForConditionalGeneration (served as text
only; its vision tower is not loaded). The shared decoder with Gemma's differences:
- RMSNorms scale by (1 + w): checkpoints store w, so loading adds 1 (llama.cpp's converter has added it in GGUF);
- sandwich norms: each block's output is normed (post_attention_layernorm, post_feedforward_layernorm) before its
  residual add, the MLP's input by pre_feedforward_layernorm;
- GeGLU (gelu_pytorch_tanh), the embedding scaled by sqrt(hidden), q/k norm, attention scaled by
  query_pre_attn_scalar ** -0.5, the final logits soft-capped where the config says so;
- local layers attend over a sliding window with their own RoPE base (rope_local_base_freq, no scaling), global
  layers over the whole context with rope_theta and the config's RoPE scaling; every sixth layer is global unless
  layer_types says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from outrider.attention import AttentionBackend, AttentionMetadata, KVCache, QKNormRope
from outrider.config import ModelConfig
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import RotaryEmbedding
from outrider.models.decoder import Attention, CausalLM, DecoderLayer
from outrider.models.registry import Architecture, register

# Gemma3TextConfig's defaults: a released multimodal config.json lists only what differs from them.
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "sliding_window": 4096, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": 2,
            "eos_token_id": 1}


@dataclass(frozen=True)
class Gemma3Settings:
    """Gemma's own settings, beyond ModelConfig's fields, read from the (text) config."""

    local_rope_theta: float
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None

    @classmethod
    def of(cls, cfg: ModelConfig) -> Gemma3Settings:
        raw = cfg.raw
        local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
        return cls(float(local.get("rope_theta") or raw["rope_local_base_freq"]), float(raw["query_pre_attn_scalar"]),
                   raw.get("final_logit_softcapping"))


def config(raw: dict[str, Any]) -> dict[str, Any]:
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise ValueError(f"Gemma 3 with {key} = {raw[key]!r} is not supported")
    period = raw["sliding_window_pattern"]
    layer_types = tuple(raw.get("layer_types") or (
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(raw["num_hidden_layers"])))
    full = (raw.get("rope_parameters") or {}).get("full_attention")  # (transformers 5 nests RoPE per layer type)
    rope = {"rope_theta": full.get("rope_theta", DEFAULTS["rope_theta"]),
            "rope_scaling": None if full.get("rope_type", "default") == "default" else full} if full else {}
    return {"qk_norm": True, "hidden_act": raw["hidden_activation"], "layer_types": layer_types,
            "sliding_window": int(raw["sliding_window"]), **rope}


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        settings = Gemma3Settings.of(cfg)
        self.scale = settings.query_pre_attn_scalar ** -0.5
        if self.window:  # local layers rotate by their own base, without the global layers' scaling
            self.local_rotary = RotaryEmbedding(cfg.head_dim, settings.local_rope_theta, None,
                                                cfg.max_position_embeddings)

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding) -> QKNormRope:
        return super().rope(positions, self.local_rotary if self.window else rotary)


class Gemma3DecoderLayer(DecoderLayer):
    attention_class = Gemma3Attention

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                         rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata,
                         backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward_residual with each block's output normed before it joins the stream."""
        x, residual = self.self_attn(h, residual, self.input_layernorm, positions, rotary, kv_cache, meta, backend)
        x, residual = self.mlp(self.post_attention_layernorm(x), residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(x), residual


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.softcap = Gemma3Settings.of(cfg).final_logit_softcapping
        # A CPU scalar even when built on "meta"; the product takes the embedding's dtype, as transformers' does.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, device="cpu"), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, out)
        return logits.div_(self.softcap).tanh_().mul_(self.softcap) if self.softcap else logits


def from_checkpoint(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor + 1 if name.endswith("norm.weight") else tensor


def gguf_config(hparam: Callable[..., Any], values: Callable[[str], list[float] | None]) -> dict[str, Any]:
    """llama.cpp's gemma3 files: the window, the global RoPE base (the local one is llama.cpp's 10000 unless the
    file says), the softcap (0: none); query_pre_attn_scalar is not stored: llama.cpp scales by the head size,
    except for the 27B model (62 layers) by hidden / heads, as the released configs do."""
    heads, hidden = hparam("attention.head_count"), hparam("embedding_length")
    scalar = hidden // heads if hparam("block_count") == 62 else hparam("attention.key_length", hidden // heads)
    return {"sliding_window": hparam("attention.sliding_window"),
            "rope_local_base_freq": hparam("rope.freq_base_swa", DEFAULTS["rope_local_base_freq"]),
            "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": hparam("final_logit_softcapping", 0.0) or None}


def gguf_write(writer: Any, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As llama.cpp's converter: the window, the softcap where set, RoPE scaling as its type and factor; the norms
    stored as 1 + w."""
    import gguf

    writer.add_sliding_window(cfg.sliding_window)
    softcap = Gemma3Settings.of(cfg).final_logit_softcapping
    if softcap:
        writer.add_final_logit_softcapping(softcap)
    if cfg.rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType[cfg.rope_scaling["rope_type"].upper()])
        writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    return {name: from_checkpoint(name, t) for name, t in tensors.items()}


GEMMA3 = register(Architecture(
    name="gemma3", hf_names=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), model_type="gemma3_text",
    model=Gemma3ForCausalLM, decoder_layer=Gemma3DecoderLayer, config=config, config_defaults=DEFAULTS,
    text_config=True,
    # (transformers 5 saves the language model under model.language_model., earlier releases language_model.)
    tensor_renames=(("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head.")),
    ignored_prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                      "multi_modal_projector."),
    from_checkpoint=from_checkpoint, gguf_names=("gemma3",), gguf_config=gguf_config, gguf_write=gguf_write,
    gguf_layer_tensors={"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"},
    tiny_config={"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16, "sliding_window": 4,
                 "sliding_window_pattern": 2, "rope_local_base_freq": 100.0, "pad_token_id": None},
))
