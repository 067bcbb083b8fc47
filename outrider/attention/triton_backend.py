"""CUDA attention backend: fused q/k prep + KV store, then paged attention; a drop-in for TorchReferenceBackend.

Imported only on the CUDA path (get_backend loads it lazily), so CPU runs never import Triton.
Host-side work per call is a few attribute reads; nothing synchronises with the GPU, so the whole
forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from outrider.attention.interface import AttentionMetadata, KVCache, QKNormRope
from outrider.kernels.attention import compile_eager_variants, paged_attention
from outrider.kernels.fused import qk_norm_rope_store_kv


class TritonAttentionBackend:
    def compile_eager_variants(self, kv_cache: KVCache, n_heads: int, max_seq_len: int) -> None:
        """Every tile variant of paged attention an eager step can launch (kernels.attention)."""
        compile_eager_variants(kv_cache.k[0], kv_cache.v[0], n_heads, max_seq_len)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                meta: AttentionMetadata, scale: float, rope: QKNormRope, window: int = 0) -> torch.Tensor:
        """Two kernels: one prepares q and k and writes k/v at meta.slot_mapping, then attention only reads."""
        k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
        q = qk_norm_rope_store_kv(q, k, v, rope.positions, rope.inv_freq, rope.q_weight, rope.k_weight, rope.eps,
                                  k_cache, v_cache, meta.slot_mapping, rope.order)
        return paged_attention(q, k_cache, v_cache, meta, scale, window=window)

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
              meta: AttentionMetadata, rope: QKNormRope) -> None:
        """One kernel (it prepares q too: that costs less than a kernel of its own for k)."""
        qk_norm_rope_store_kv(q, k, v, rope.positions, rope.inv_freq, rope.q_weight, rope.k_weight, rope.eps,
                              kv_cache.k[layer], kv_cache.v[layer], meta.slot_mapping, rope.order)
