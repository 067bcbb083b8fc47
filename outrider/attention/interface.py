"""The attention backend interface and the data it is handed: AttentionMetadata (one ragged batch over the paged
cache), KVCache (the pool), QKNormRope (how q and k are prepared). Below the backends and the kernels, which import
it; outrider.attention re-exports it and picks a backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from outrider.kernels import ops


@dataclass
class AttentionMetadata:
    """Describes one ragged batch of queries over the paged cache.

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; its context after this step has
    seq_lens[i] tokens, the last (q_len_i) of which are the new queries, so query j of sequence i sits at
    absolute position seq_lens[i] - q_len_i + j.
    """

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written (-1 = padding, skip)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padding entries are 0 and never read)
    max_query_len: int  # host ints: kernels size their grids from these
    max_seq_len: int
    causal: bool = True  # False: every query sees the whole context (DFlash block drafting)
    # Host copies for the reference backend (it loops over sequences); None on the GPU path.
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class KVCache:
    """The paged pool of one model: per-layer K and V tensors sharing block ids."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


@dataclass
class QKNormRope:
    """How q and k are prepared before attention: optional per-head RMSNorm (Qwen3 q_norm/k_norm), then RoPE."""

    positions: torch.Tensor  # [T]: each new token's absolute position
    inv_freq: torch.Tensor  # [D/2] float32 on the tokens' device (RotaryEmbedding.inv_freq)
    q_weight: torch.Tensor | None  # [D] per-head norm weights, or both None (no q/k norm)
    k_weight: torch.Tensor | None
    eps: float
    # [D] int64: the head dimension read at each position of q, k and the norm weights (None: in order). Partial
    # RoPE rides on this (models/hybrid.py): prepared q and k come out, and k is cached, in this order.
    order: torch.Tensor | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> (prepared q, prepared k): the reference semantics (ops.qk_norm_rope)."""
        return ops.qk_norm_rope(q, k, self.positions, self.inv_freq, self.q_weight, self.k_weight, self.eps,
                                self.order)


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                meta: AttentionMetadata, scale: float, rope: QKNormRope, window: int = 0) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens, q and k not yet prepared -> out [T, Hq, D].

        Prepares q and k as rope.apply does, stores the prepared k and v into the cache at meta.slot_mapping
        (slot -1: skip), then attends each query over its sequence's cached context (causally unless
        meta.causal is False). window > 0 (sliding-window attention): a query at position p sees only the keys at
        positions p - window + 1 .. p; every key stays cached. Rows may be strided views of a packed QKV output
        (last dim contiguous)."""
        ...

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
              meta: AttentionMetadata, rope: QKNormRope) -> None:
        """forward's first half alone: prepare k, store k and v at meta.slot_mapping (slot -1: skip), attend
        nothing (keys and values for later queries, e.g. DFlash's context). q is the packed projection's, unused."""
        ...

    def compile_eager_variants(self, kv_cache: KVCache, n_heads: int, max_seq_len: int) -> None:
        """Compile now whatever a step outside the CUDA graphs could otherwise compile while serving (warm-up)."""
        ...
