"""Attention over the paged KV cache, behind a small backend interface.

The model's attention layers call `backend.forward(q, k, v, kv_cache, layer, meta, scale, rope, window)` and know
nothing else. q and k arrive un-normed and un-roped, with `rope` saying how to prepare them, so that a backend can fuse
that preparation with the KV store (the Triton backend does both in one kernel). `meta` is built once per step by
the runner and passed explicitly (no module globals), so a GPU backend can keep it in static buffers for
CUDA-graph capture.

KV layout, one pair per layer: k_cache[layer], v_cache[layer] of shape [num_blocks, block_size, n_kv_heads,
head_dim]. A token's slot is block_id * block_size + offset.
"""

from __future__ import annotations

import torch

from outrider.attention.interface import AttentionBackend, AttentionMetadata, KVCache, QKNormRope

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "QKNormRope", "get_backend"]


def get_backend(device: torch.device | str) -> AttentionBackend:
    if torch.device(device).type == "cuda":
        from outrider.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from outrider.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()
