"""Rotary position embedding (rotate-half layout) with the `default`, `linear` and `llama3` frequency rules, and
explicit per-frequency divisors (`freq_factors`: GGUF files store Llama 3's rule as these)."""

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
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings") or max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, freq_factors")


def rope_attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """The factor a RoPE rule scales cos and sin by (HF's attention_factor; 1.0 for plain RoPE). Both q and k carry
    it, so attention scores scale by its square: the attention scale takes it, the rotation stays a rotation."""
    return float((scaling or {}).get("attention_factor") or 1.0)


class RotaryEmbedding(nn.Module):
    """Holds RoPE's inverse frequencies, which the attention backend applies (attention.QKNormRope); the buffer
    follows the model's device."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int) -> None:
        super().__init__()
        # Explicit CPU tensor so the buffer is real even when the model is built under torch.device("meta").
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling, max_position_embeddings),
                             persistent=False)
