"""CUDA attention backend: Triton KV store + paged attention, a drop-in for TorchReferenceBackend.

Imported only on the CUDA path (get_backend loads it lazily), so CPU runs never import Triton.
Host-side work per call is a few attribute reads; nothing synchronises with the GPU, so the whole
forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from outrider.attention import AttentionMetadata, KVCache
from outrider.kernels.attention import paged_attention
from outrider.kernels.kv_store import store_kv


class TritonAttentionBackend:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store the new k/v at meta.slot_mapping, then attend q over each sequence's cached context."""
        k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
