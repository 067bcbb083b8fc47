"""The engine's side of a hybrid model's linear-attention state (docs/architecture.md, "Hybrid models"): which
StatePool slot each running request owns, the StateBatch of each step, prefix snapshots at block boundaries, and the
commit of a verify's accepted positions.

A request owns a slot from admission to finish or preemption; a resumed request gets a fresh (zeroed) slot and
recomputes, or restores the snapshot its prefix hit ends at (BlockPool cuts a hit to a snapshot). Snapshots are
taken when a prefill chunk ends on the block boundary the scheduler cuts there (`chunk_end`) and dropped when the
block's K/V leaves the prefix cache.
"""

from __future__ import annotations

import torch

from outrider.attention import AttentionMetadata
from outrider.engine.kv_cache import chain_hash
from outrider.engine.request import Request
from outrider.engine.state_pool import PAD_SLOT, StatePool
from outrider.layers.gated_deltanet_types import StateBatch, state_batch
from outrider.models.hybrid import LinearStates
from outrider.steps import StepPlan


class LinearStateSlots:
    def __init__(self, pool: StatePool, block_size: int, max_batch: int, prefix_caching: bool) -> None:
        """max_batch: the most sequences a captured graph holds (its static slot rows)."""
        self.pool = pool
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._slots: dict[int, int] = {}  # request id -> owned slot
        device = pool.conv.device
        # What captured graphs read: the step's slots, padded with PAD_SLOT (the decode and verify graphs), a prefill
        # graph's real query offsets ([0, chunk length]; its rows after them are padding), and the lone request's
        # slot of a device round.
        self.graph_slots = torch.full((max_batch,), PAD_SLOT, dtype=torch.int64, device=device)
        self.prefill_qsl = torch.zeros(2, dtype=torch.int64, device=device)
        self.round_slot = torch.full((1,), PAD_SLOT, dtype=torch.int64, device=device)
        self._round_row = torch.zeros(1, dtype=torch.int64, device=device)
        self._round_host = PAD_SLOT

    # --- ownership ---
    def admit(self, req: Request, cached_hash: int | None) -> None:
        """A slot for an admitted request: the snapshot at the end of its prefix hit (`cached_hash`, the hit's last
        block), else zeros."""
        self._slots[req.request_id] = self.pool.allocate(start=cached_hash)

    def release(self, req: Request) -> None:
        slot = self._slots.pop(req.request_id, None)
        if slot is not None:
            self.pool.free(slot)

    def slot(self, req: Request) -> int:
        return self._slots[req.request_id]

    # --- prefix snapshots ---
    def snapshot_at(self, req: Request) -> int:
        """The position whose state a prefix hit of req's known tokens can reuse: the end of the last full block
        before its last token (a hit always leaves the last token to compute); 0: none."""
        return (req.num_tokens - 1) // self.block_size * self.block_size if self.prefix_caching else 0

    def chunk_end(self, req: Request, start: int, n: int) -> int:
        """A prefill chunk of up to n tokens from `start`, ended at the snapshot position when it would cross it."""
        at = self.snapshot_at(req)
        return at - start if start < at < start + n else n

    def after_launch(self, plan: StepPlan) -> None:
        """Snapshot the slots of requests whose chunk just ended at their snapshot position (enqueued after the
        step's forward, so the copy holds the state there)."""
        if not self.prefix_caching:
            return
        for s in plan.scheduled:
            req, end = s.request, s.start + s.num_new_tokens
            if not s.draft_tokens and end > s.start and end == self.snapshot_at(req) > 0:
                self.pool.snapshot(self.slot(req), self._hash(req, end))

    def _hash(self, req: Request, end: int) -> int:
        """The prefix cache's hash of the block ending at `end` (kv_cache.chain_hash over the blocks before it)."""
        bs, h = self.block_size, None
        for i in range(0, end, bs):
            h = chain_hash(h, tuple(req.token_slice(i, i + bs)))
        return h

    # --- steps ---
    def batch(self, plan: StepPlan, qsl: list[int], device: torch.device) -> StateBatch:
        """A step's StateBatch: a verify when any request feeds drafts (the scheduler keeps prompt chunks out of
        such steps)."""
        return state_batch(qsl, [self.slot(s.request) for s in plan.scheduled], device,
                           verify=any(s.draft_tokens for s in plan.scheduled))

    def states(self, batch: StateBatch) -> LinearStates:
        return LinearStates(self.pool, batch)

    @staticmethod
    def scratch(pool: StatePool, tokens: int) -> LinearStates:
        """One prompt of `tokens` in PAD_SLOT, which nobody owns (memory.measure_step_reserve's forward)."""
        return LinearStates(pool, state_batch([0, tokens], [PAD_SLOT], pool.conv.device))

    def for_graph(self, meta: AttentionMetadata, verify: bool) -> LinearStates:
        """A captured graph's states: uniform queries of meta.max_query_len tokens over graph_slots (filled per
        replay by `load_graph`); a prefill graph's, one chunk padded to them, ending at prefill_qsl's end. The host
        slot list is read only by the CPU reference, never on a graph."""
        n, q = meta.query_start_loc.shape[0] - 1, meta.max_query_len
        if _prefill(q, verify):
            return self.states(StateBatch([0, q], self.graph_slots[:1], [PAD_SLOT], query_start_loc=self.prefill_qsl,
                                          padded=True))
        return self.states(StateBatch(list(range(0, n * q + 1, q)), self.graph_slots[:n], [PAD_SLOT] * n, verify,
                                      meta.query_start_loc))

    def load_graph(self, batch: StateBatch, q: int) -> None:
        """The static inputs of the graph of q tokens a sequence that replays the step of `batch` (its real
        offsets: a prefill chunk's, not the padded ones)."""
        n = len(batch.slots_host)
        self.graph_slots[:n].copy_(batch.slots, non_blocking=True)
        self.graph_slots[n:].fill_(PAD_SLOT)
        if _prefill(q, batch.verify):
            self.prefill_qsl.copy_(batch.query_start_loc, non_blocking=True)

    def commit_verify(self, batch: StateBatch, accepted: torch.Tensor) -> None:
        """After a verify step: each sequence continues from the state after its accepted drafts (device ops)."""
        rows = torch.arange(len(batch.slots_host), dtype=torch.int64, device=batch.slots.device)
        self.pool.commit_verify(batch.slots, rows, accepted.to(torch.int64))

    # --- device rounds (one sequence, speculation/device_round.py) ---
    def bind_round(self, req: Request) -> None:
        self._round_host = self.slot(req)
        self.round_slot.fill_(self._round_host)

    def round_states(self, meta: AttentionMetadata) -> LinearStates:
        """The round's verify states: its one sequence's meta.max_query_len tokens, the query offsets on the device
        (a captured round copies nothing from the host)."""
        q = meta.max_query_len
        return self.states(StateBatch([0, q], self.round_slot, [self._round_host], True, meta.query_start_loc))

    def commit_round(self, accepted: torch.Tensor) -> None:
        self.pool.commit_verify(self.round_slot, self._round_row, accepted)

    # --- reports ---
    def stats(self) -> dict:
        pool = self.pool
        return {"state_slots_total": pool.num_slots, "state_slots_owned": pool.num_owned,
                "state_slots_snapshot": pool.num_snapshots,
                "state_slots_free": pool.num_slots - pool.num_owned - pool.num_snapshots}


def _prefill(q: int, verify: bool) -> bool:
    """Whether a graph of q tokens a sequence is a prefill graph (one sequence's chunk, padded up to q)."""
    return q > 1 and not verify
