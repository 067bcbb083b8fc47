"""Fused small ops with one signature for every device: Triton on CUDA, plain torch elsewhere.

The torch versions are the semantics (they round like the Hugging Face modules); the Triton versions in
outrider.kernels.fused match them up to reduction order and collapse 3-7 kernel launches into one.
Safe to import on CPU: Triton is imported only when a CUDA tensor arrives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.stride(-1) == 1


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    summed = x + residual if residual is not None else None
    h = summed if summed is not None else x
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x [+ residual]) * weight -> (normed, x + residual, or None when no residual is given)."""
    if _use_triton(x) and (residual is None or residual.stride(-1) == 1):
        from outrider.kernels import fused

        return fused.rms_norm(x, weight, eps, residual)
    return torch_rms_norm(x, weight, eps, residual)


def torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate/up may be the halves of one packed gate_up output (`gu.chunk(2, -1)`)."""
    if _use_triton(gate) and up.stride(-1) == 1:
        from outrider.kernels import fused

        return fused.silu_mul(gate, up)
    return torch_silu_mul(gate, up)


def torch_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None:
        q = torch_rms_norm(q, q_weight, eps)[0]
        k = torch_rms_norm(k, k_weight, eps)[0]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rot(q), rot(k)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm (Qwen3 q_norm/k_norm) then rotate-half RoPE at `positions`.

    q [T, Hq, D], k [T, Hkv, D]; inv_freq [D/2] float32 on q's device (RotaryEmbedding.inv_freq)."""
    half = q.shape[-1] // 2
    if _use_triton(q) and k.stride(-1) == 1 and half & (half - 1) == 0:
        from outrider.kernels import fused

        return fused.qk_norm_rope(q, k, positions, inv_freq, q_weight, k_weight, eps)
    return torch_qk_norm_rope(q, k, positions, inv_freq, q_weight, k_weight, eps)
