"""Reference attention backend in plain PyTorch: the CPU path and the oracle for the GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outrider.attention import AttentionMetadata, KVCache, QKNormRope


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int, slot_mapping: torch.Tensor) -> None:
    k_flat = kv_cache.k[layer].view(-1, *kv_cache.k[layer].shape[2:])
    v_flat = kv_cache.v[layer].view(-1, *kv_cache.v[layer].shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat.index_copy_(0, slots, k[keep].to(k_flat.dtype))
    v_flat.index_copy_(0, slots, v[keep].to(v_flat.dtype))


def gather_context(kv_cache: KVCache, layer: int, block_table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n cached tokens of one sequence: ([n, Hkv, D], [n, Hkv, D])."""
    bs = kv_cache.block_size
    blocks = block_table[: (n + bs - 1) // bs].long()
    k = kv_cache.k[layer][blocks].flatten(0, 1)[:n]
    v = kv_cache.v[layer][blocks].flatten(0, 1)[:n]
    return k, v


class TorchReferenceBackend:
    def compile_eager_variants(self, kv_cache: KVCache, n_heads: int, max_seq_len: int) -> None:
        """Nothing is compiled: PyTorch's own operators."""

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
              meta: AttentionMetadata, rope: QKNormRope) -> None:
        _, k = rope.apply(q, k)
        store_kv(k, v, kv_cache, layer, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                meta: AttentionMetadata, scale: float, rope: QKNormRope, window: int = 0) -> torch.Tensor:
        q, k = rope.apply(q, k)
        store_kv(k, v, kv_cache, layer, meta.slot_mapping)
        qsl = meta.query_start_loc_host or meta.query_start_loc.tolist()
        lens = meta.seq_lens_host or meta.seq_lens.tolist()
        out = torch.zeros_like(q)
        n_rep = q.shape[1] // k.shape[1]
        for i, ctx_len in enumerate(lens):
            start, end = qsl[i], qsl[i + 1]
            q_len = end - start
            if q_len == 0 or ctx_len == 0:  # (no keys: zero output, as the kernel gives)
                continue
            ck, cv = gather_context(kv_cache, layer, meta.block_tables[i], ctx_len)
            qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
            ki = ck.to(q.dtype).repeat_interleave(n_rep, dim=1).transpose(0, 1)  # [Hq, ctx, D]
            vi = cv.to(q.dtype).repeat_interleave(n_rep, dim=1).transpose(0, 1)
            mask = None
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(ctx_len, device=q.device)[None, :]
            if meta.causal:
                mask = k_pos <= q_pos
            if window > 0:
                in_window = k_pos > q_pos - window
                mask = in_window if mask is None else mask & in_window
            o = F.scaled_dot_product_attention(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                                               attn_mask=mask, scale=scale)
            out[start:end] = o[0].transpose(0, 1)
        return out
