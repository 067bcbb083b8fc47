"""Building AttentionMetadata for a ragged batch: what the runner does every step and drafters do for their own
passes (they import this, not the engine's runner)."""

from __future__ import annotations

import dataclasses
import itertools
import operator

import numpy as np
import torch

from outrider.attention import AttentionMetadata
from outrider.upload import to_device


def batch_layout(starts: list[int], qsl: list[int], table: np.ndarray,
                 block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, slot mapping) of a ragged batch, in bulk: sequence i feeds the tokens qsl[i]:qsl[i+1] from
    position starts[i], through its block table row table[i]."""
    start = np.array(starts, dtype=np.int64)
    num_seqs, num_tokens = len(starts), qsl[-1]
    if num_tokens == num_seqs:  # one token per sequence (decode)
        seq, positions = np.arange(num_seqs), start
    else:
        count = np.diff(qsl)
        seq = np.repeat(np.arange(num_seqs), count)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(start - qsl[:-1], count)
    block, offset = np.divmod(positions, block_size)
    return positions, table[seq, block] * block_size + offset  # (slots: int64 by promotion)


def metadata_over(qsl: list[int], lens: list[int], dev: list[torch.Tensor], causal: bool) -> AttentionMetadata:
    """AttentionMetadata over device tensors dev = [slot mapping, query start offsets, seq lens, block tables]."""
    return AttentionMetadata(
        slot_mapping=dev[0], query_start_loc=dev[1], seq_lens=dev[2], block_tables=dev[3],
        max_query_len=max(map(operator.sub, qsl[1:], qsl), default=0), max_seq_len=max(lens, default=0),
        causal=causal, query_start_loc_host=qsl, seq_lens_host=lens)


def build_metadata(seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device,
                   causal: bool = True) -> tuple[AttentionMetadata, torch.Tensor]:
    """seqs: (block table, tokens already cached, query tokens this step) per sequence -> (meta, positions)."""
    width = max((len(b) for b, _, _ in seqs), default=1) or 1
    table = np.zeros((len(seqs), width), dtype=np.int32)  # padding entries are 0 and never read
    for i, (blocks, _, _) in enumerate(seqs):
        table[i, : len(blocks)] = blocks
    starts = [s for _, s, _ in seqs]
    qsl = list(itertools.accumulate((n for _, _, n in seqs), initial=0))
    lens = [s + n for _, s, n in seqs]
    positions, slots = batch_layout(starts, qsl, table, block_size)
    dev = to_device([(positions, np.int64), (slots, np.int64), (qsl, np.int32), (lens, np.int32), (table, np.int32)],
                    torch.device(device))
    return metadata_over(qsl, lens, dev[1:], causal), dev[0]


def decode_metadata_on_device(positions: torch.Tensor, live: torch.Tensor, block_tables: torch.Tensor,
                              block_size: int) -> AttentionMetadata:
    """One query per sequence at `positions` [B] (int64), computed on the device from the block tables [B, W]: no
    host copy, so a chain of decode steps can run (and be captured in one CUDA graph) without the host. Rows not
    `live` write no K/V and read no keys; their positions may lie past their block tables."""
    meta, _ = uniform_metadata_on_device(positions, 1, block_tables, block_size)
    return dataclasses.replace(meta, slot_mapping=torch.where(live, meta.slot_mapping, -1),
                               seq_lens=torch.where(live, meta.seq_lens, 0))


def shifted_metadata(meta: AttentionMetadata, positions: torch.Tensor, shift: torch.Tensor, owner: torch.Tensor,
                     max_shift: int, block_size: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """A batch from `build_metadata` moved shift[i] positions further on, on the device (shift [B] int64, at most
    max_shift; owner [T]: each query's sequence): positions, seq lens and slots follow, the slots looked up in the
    block tables, which must cover the moved positions. What drafts or verifies a round from a verdict the host
    has not read does this: its sequences start at p_i + m_i, m_i on the device."""
    moved = positions + shift.index_select(0, owner)
    blocks = meta.block_tables[owner, moved // block_size].to(torch.int64)
    return dataclasses.replace(meta, slot_mapping=blocks * block_size + moved % block_size,
                               seq_lens=meta.seq_lens + shift.to(meta.seq_lens.dtype),
                               max_seq_len=meta.max_seq_len + max_shift, seq_lens_host=None), moved


def uniform_metadata_on_device(first: torch.Tensor, q: int, block_tables: torch.Tensor, block_size: int,
                               causal: bool = True) -> tuple[AttentionMetadata, torch.Tensor]:
    """q queries per sequence at positions first[b] .. first[b] + q - 1, sequence b's keys up to its last query, all
    computed on the device from `first` [B] int64 and the block tables [B, W] (which must cover those positions):
    (meta, positions [B * q]). max_seq_len is the tables' reach, an upper bound as CUDA graphs need."""
    n, width = first.shape[0], block_tables.shape[1]
    positions = (first[:, None] + torch.arange(q, device=first.device)).reshape(-1)
    owner = torch.arange(n * q, device=first.device) // q  # (repeat_interleave could sync to size its output)
    block = torch.clamp(positions // block_size, max=width - 1)
    slots = block_tables[owner, block].to(torch.int64) * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(0, n * q + 1, q, dtype=torch.int32, device=first.device),
        seq_lens=(first + q).to(torch.int32), block_tables=block_tables, max_query_len=q,
        max_seq_len=width * block_size, causal=causal)
    return meta, positions
