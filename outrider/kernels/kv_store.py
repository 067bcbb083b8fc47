"""Triton KV-store kernel: writes each new token's K and V into its paged-cache slot (slot -1 = skip)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt,
                  N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < N_HEADS) & (d < HEAD_DIM)
    # k/v row t always exists, so its loads need not wait for the slot: all three take one round trip.
    slot = tl.load(slot_ptr + t)
    k = tl.load(k_ptr + t * stride_kt + h * HEAD_DIM + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * HEAD_DIM + d, mask=mask)
    # The cache is contiguous [NB, page, Hkv, D]: a slot (block * page + offset) is a row of Hkv * D.
    dst = slot * (N_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    # dst < 0 exactly when slot is -1: padding rows of a CUDA-graph bucket, or tokens whose KV is not kept.
    mask = mask & (dst >= 0)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (rows may be strided, e.g. views of a packed QKV output) -> the contiguous paged
    caches [NB, page, Hkv, D] at slot_mapping [T]."""
    t, n_heads, head_dim = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or k.stride(1) != head_dim:
        k = k.contiguous()
    if v.stride(-1) != 1 or v.stride(1) != head_dim:
        v = v.contiguous()
    _store_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        N_HEADS=n_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )
