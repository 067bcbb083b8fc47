"""Drafting after the first draft without the host: the k - 1 autoregressive steps of a chain whose attention
metadata is advanced on the device (`decode_metadata_on_device`), so the host builds nothing per step, and on CUDA
one captured graph per batch size and chain length replays all of them. MTP and EAGLE-3 heads (chain.py) and the
draft model (draft_model.py) draft through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from outrider.attention import AttentionMetadata
from outrider.attention.metadata import build_metadata, decode_metadata_on_device
from outrider.graphs import VERIFY_BUCKETS, CudaGraphRunner
from outrider.speculative.drafter import StagedDrafts, block_capacity, stage_drafts

if TYPE_CHECKING:
    from outrider.engine.request import Request

# Chains captured as graphs go up to this length (k <= 8): every length is a graph of its own per batch size, so a
# draft model's capture grows with the square of it; a longer chain runs the same steps eagerly.
MAX_GRAPH_DEPTH = 7

# One draft step: (the previous drafts [n], the drafter's state [n, S] or None, positions [n], metadata) ->
# (the next state, the next drafts, their probabilities).
Step = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, AttentionMetadata],
                tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]


class DeviceChain:
    def __init__(self, step: Step, block_size: int, device: torch.device, offset: int, state_size: int = 0,
                 dtype: torch.dtype | None = None) -> None:
        """offset: the first chained step's position after the request's last committed token (a head drafting
        d_2 reads it there: 0; a draft model feeds d_1 after it: 1). state_size, dtype: of the step's state (0:
        none)."""
        self.step, self.block_size, self.device, self.offset = step, block_size, device, offset
        self.state_size, self.dtype = state_size, dtype
        self.graphs: dict[int, CudaGraphRunner] = {}  # by chain length (capture)
        self._state_in: torch.Tensor | None = None  # the graphs' static inputs besides the runner's own
        self._ks_in: torch.Tensor | None = None

    def stage(self, requests: Sequence[Request], ks: Sequence[int], rows: list[int], tokens: torch.Tensor,
              conf: torch.Tensor, state: torch.Tensor | None, shift: torch.Tensor | None = None) -> StagedDrafts:
        """Every request's drafts, left on the device: requests[i] gets ks[i]; `rows` are those with ks > 0, in
        order, whose d_1 (and its probability) are `tokens` and `conf`, and the step's state after it `state`.
        shift [len(rows)] (on the device): the chains start that many positions further on (drafting from a
        verdict the host has not read: Drafter.draft_ahead)."""
        owners, drafts, probs = list(rows), [tokens], [conf]
        depth = max((ks[i] for i in rows), default=0) - 1
        if depth > 0:
            chained, chained_conf = self._run(tokens, state, [requests[i] for i in rows], [ks[i] for i in rows], depth,
                                              shift)
            kept = [r * depth + j for r, i in enumerate(rows) for j in range(ks[i] - 1)]  # [n, depth] flat, row-major
            flat, flat_conf = chained.reshape(-1), chained_conf.reshape(-1)
            if len(kept) < flat.shape[0]:  # (some request's k is below the longest)
                index = torch.tensor(kept).to(self.device, non_blocking=True)
                flat, flat_conf = flat.index_select(0, index), flat_conf.index_select(0, index)
            owners += [i for i in rows for _ in range(ks[i] - 1)]
            drafts.append(flat)
            probs.append(flat_conf)
        return stage_drafts(owners, drafts, probs, len(requests))

    def _run(self, tokens: torch.Tensor, state: torch.Tensor | None, requests: Sequence[Request], ks: list[int],
             depth: int, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts d_2..d_{depth+1} and their probabilities, [n, depth] each: a captured graph when one fits, else
        the same steps eagerly."""
        # (A request whose own k is 1 drafts nothing here, and its block table may end before the first chained
        # position: it starts at its last slot instead, which it never writes.)
        first = [min(r.num_tokens - 1 + self.offset, block_capacity(r, self.block_size) - 1) for r in requests]
        meta, start = build_metadata([(r.block_ids, p, 1) for r, p in zip(requests, first)], self.block_size,
                                     self.device)
        if shift is not None:
            start = start + shift
        ks_dev = torch.tensor(ks, dtype=torch.int64).to(self.device, non_blocking=True)
        graphs = self.graphs.get(depth)
        if graphs is None or not graphs.can_run(meta):
            return self.steps(tokens, state, start, ks_dev, meta.block_tables, depth)
        n = len(requests)
        if state is not None:
            self._state_in[:n].copy_(state)
        self._ks_in.zero_()  # (rows padding the batch draft nothing)
        self._ks_in[:n].copy_(ks_dev)
        return graphs.run(tokens, start, meta)  # (views until the next replay: stage copies them out at once)

    def steps(self, tokens: torch.Tensor, state: torch.Tensor | None, start: torch.Tensor, ks: torch.Tensor,
              block_tables: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`depth` steps from d_1 at positions start, start + 1, ...: step j drafts d_{j+2}, and writes KV, only
        for rows whose k reaches it (the others may lie past their block tables)."""
        drafted, confidence = [], []
        for j in range(depth):
            positions = start + j
            meta = decode_metadata_on_device(positions, ks > j + 1, block_tables, self.block_size)
            state, tokens, conf = self.step(tokens, state, positions, meta)
            drafted.append(tokens)
            confidence.append(conf)
        return torch.stack(drafted, dim=1), torch.stack(confidence, dim=1)

    def capture(self, max_batch: int, max_model_len: int, max_depth: int, pool) -> None:
        """A graph per chain length 1..max_depth (at most MAX_GRAPH_DEPTH) at the verify batch sizes, into the target
        graphs' pool."""
        buckets = [b for b in VERIFY_BUCKETS if b <= max_batch]
        self._ks_in = torch.zeros(buckets[-1], dtype=torch.int64, device=self.device)
        if self.state_size:
            self._state_in = torch.zeros(buckets[-1], self.state_size, dtype=self.dtype, device=self.device)
        graphs = {}
        for depth in range(1, min(max_depth, MAX_GRAPH_DEPTH) + 1):
            graphs[depth] = CudaGraphRunner(
                lambda ids, pos, meta, depth=depth: self.steps(
                    ids, None if self._state_in is None else self._state_in[: ids.shape[0]], pos,
                    self._ks_in[: ids.shape[0]], meta.block_tables, depth),
                max_batch=buckets[-1], buckets=buckets, max_blocks_per_seq=-(-max_model_len // self.block_size),
                max_seq_len=max_model_len, device=self.device, pool=pool)
            graphs[depth].capture()
        self.graphs = graphs  # (only once every length is captured: a failed capture leaves chains eager)
