"""Rotary position embedding (rotate-half layout) with the `default`, `linear`, `llama3` and `longrope` (Phi-3)
frequency rules, and explicit per-frequency divisors (`freq_factors`: GGUF files store Llama 3's rule as these)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 on the CPU."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    if rope_type == "longrope":
        return inv_freq / torch.tensor(_longrope_factors(scaling, max_position_embeddings), dtype=torch.float32,
                                       device="cpu")
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings") or max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, longrope, "
                     "freq_factors")


def _longrope_factors(scaling: dict[str, Any], max_position_embeddings: int) -> list[float]:
    """LongRoPE's per-frequency divisors: the long ones for a context past the original one, else the short ones.
    Chosen once for the model's context (llama.cpp's rule): a paged KV cache cannot re-rotate its keys when a
    sequence crosses the original length, as transformers does per forward."""
    long = max_position_embeddings > scaling["original_max_position_embeddings"]
    return scaling["long_factor" if long else "short_factor"]


def rope_attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """The factor a RoPE rule scales cos and sin by (HF's attention_factor; 1.0 for plain RoPE). Both q and k carry
    it, so attention scores scale by its square: the attention scale takes it, the rotation stays a rotation."""
    scaling = scaling or {}
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])
    if scaling.get("rope_type") != "longrope":
        return 1.0
    original = scaling["original_max_position_embeddings"]  # LongRoPE's default, as transformers computes it
    factor = scaling.get("factor") or max_position_embeddings / original
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


class RotaryEmbedding(nn.Module):
    """Holds RoPE's inverse frequencies, which the attention backend applies (attention.QKNormRope); the buffer
    follows the model's device."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int) -> None:
        super().__init__()
        # Explicit CPU tensor so the buffer is real even when the model is built under torch.device("meta").
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling, max_position_embeddings),
                             persistent=False)
