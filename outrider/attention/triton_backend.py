"""CUDA attention backend: fused q/k prep + KV store, then paged attention; a drop-in for TorchReferenceBackend.

Imported only on the CUDA path (get_backend loads it lazily), so CPU runs never import Triton.
Host-side work per call is a few attribute reads; nothing synchronises with the GPU, so the whole
forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from outrider.attention import AttentionMetadata, KVCache, QKNormRope
from outrider.kernels import ops
from outrider.kernels.attention import decode_attention, paged_attention
from outrider.kernels.fused import qk_norm_rope_store_kv


class TritonAttentionBackend:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                meta: AttentionMetadata, scale: float, rope: QKNormRope) -> torch.Tensor:
        """Two kernels: one prepares q and k and writes k/v at meta.slot_mapping, then attention only reads. A
        decode step (one query token per sequence) with OUTRIDER_DECODE_PREP_IN_ATTENTION: one, whose heads must
        sit side by side in each row, as a packed QKV output's do."""
        k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
        adjacent_heads = all(x.stride(1) == x.shape[2] for x in (q, k, v))
        if meta.max_query_len == 1 and ops.DECODE_PREP_IN_ATTENTION and adjacent_heads:
            return decode_attention(q, k, v, rope, k_cache, v_cache, meta, scale)
        q = qk_norm_rope_store_kv(q, k, v, rope.positions, rope.inv_freq, rope.q_weight, rope.k_weight, rope.eps,
                                  k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
