"""Torch dequantizers: the semantics of every format, on any device, with no host syncs (they also serve embedding
rows inside CUDA graphs).

The GGUF ones compute exactly what ggml's `gguf.quants.dequantize` computes (the same float32 operations in the same
order), so a quantized model on the CPU runs the very weights that dequantizing the file at load time gives.
"""

from __future__ import annotations

import torch

from outrider.quant.formats import FP8Format, GGUFFormat, Int4Format


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [..., 1] float32 (little-endian float16)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., L] bytes -> [..., 2L] values: the L low nibbles, then the L high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., B] bytes -> [..., count] bits, least significant bit of the first byte first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[..., :, None] >> shifts) & 1).flatten(-2)[..., :count]


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (scales [..., 8], mins [..., 8]) as uint8."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., 0:2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[..., 0:2]) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[..., 0:2]) * _nibbles(b[..., 4:]).float() + _f16(b[..., 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6], 32) << 4)
    return _f16(b[..., 0:2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8], 32) << 4)
    return _f16(b[..., 0:2]) * q.float() + _f16(b[..., 2:4])


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: (d * scale) * q - (dmin * min) per 32-value sub-block; q [..., 8, 32]."""
    sc, mn = k_scale_min(b[..., 4:16])
    d = (_f16(b[..., 0:2]) * sc.float())[..., None]
    dm = (_f16(b[..., 2:4]) * mn.float())[..., None]
    return (d * q.float() - dm).flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    qs = b[..., 16:144].unflatten(-1, (4, 32))
    return _k_affine(b, _nibbles(qs).unflatten(-1, (2, 32)).flatten(-3, -2))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qs = b[..., 48:176].unflatten(-1, (4, 32))
    lo = _nibbles(qs).unflatten(-1, (2, 32)).flatten(-3, -2)  # [..., 8, 32]: sub-block s, value l
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
    hi = (b[..., 16:48][..., None, :] >> shifts) & 1  # bit s of qh[l]
    return _k_affine(b, lo | (hi << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., 0:128].unflatten(-1, (2, 64))  # per half of 128 values
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))
    lo = _nibbles(ql).unflatten(-1, (4, 32))  # [..., 2, 4, 32]: quarter 0, 1 low nibbles, 2, 3 high ones
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
    q = (lo | (((qh >> shifts) & 3) << 4)).to(torch.int8) - 32
    scales = b[..., 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[..., 208:210]) * scales)[..., None]  # [..., 16, 1]
    return (d * q.reshape(*q.shape[:-3], 16, 16).float()).flatten(-2)


_GGUF = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k,
         "Q6_K": _q6_k}


def dequantize_gguf(fmt: GGUFFormat, data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / block * type_size] -> float32 [..., K]."""
    blocks = data.unflatten(-1, (-1, fmt.type_size))
    return _GGUF[fmt.name](blocks).flatten(-2)


def fp8_scale_per_value(fmt: FP8Format, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Scales [ceil(N/bn), ceil(K/bk)] -> each value's scale [N, K]."""
    return scale.repeat_interleave(fmt.block_n, 0)[:n].repeat_interleave(fmt.block_k or k, 1)[:, :k]


def dequantize_fp8(fmt: FP8Format, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 [N, K] and scales [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    return data.float() * fp8_scale_per_value(fmt, scale, *data.shape)


def dequantize_int4(fmt: Int4Format, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """INT4 layout (formats.py) -> float32 [N, K]."""
    q = _nibbles(data.unflatten(-1, (-1, fmt.group // 2)))  # [N, groups, group]
    return ((q.float() - zero.float()[..., None]) * scale.float()[..., None]).flatten(-2)
