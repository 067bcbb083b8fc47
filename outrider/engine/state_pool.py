"""Slots of recurrent state for the linear-attention (Gated DeltaNet) layers of hybrid models, beside the paged KV
of their full-attention layers (docs/architecture.md, "Hybrid models").

A slot holds one sequence's state in every linear-attention layer: a conv state and a recurrent state per layer,
stored stacked ([layers, slots, ...]) so that one indexing op moves a slot's state through all layers. A slot is
free, owned by a running request, or holds a prefix snapshot (the state at a KV block boundary, under that block's
hash). Snapshots are a cache: they live in slots no request needs and are evicted, least recently used first,
when a request needs one. Slot 0 is never handed out: it is the scratch slot padded rows of a captured batch
point at.

Speculative verify: a verify forward writes, for each of its query positions, its conv input and its rank-one
update of the recurrent state (k, u and the log decay g) to verify rows ([layers, rows, positions, ...], row = the
sequence's row in the batch), and leaves the slots as they were; `commit_verify` then gives each sequence's slot the
conv window after its last accepted position (the last K of the window and the inputs up to it) and replays the
updates up to it on the slot's recurrent state, on the device and without a host sync, so the next round continues
from exactly the accepted prefix. A position costs C + Hv (Dk + Dv + 1) numbers where a state is C K + Hv Dk Dv:
about 3 % of a slot at Qwen3.5-4B's shape, in memory and in what the verify writes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from outrider.layers.gated_deltanet import GatedDeltaNetConfig, LayerState, apply_updates

PAD_SLOT = 0


@dataclass(frozen=True)
class StateLayout:
    """The state one sequence keeps per linear-attention layer, and how many such layers the model has."""

    num_layers: int
    conv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]  # (Hv, Dk, Dv)
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, cfg: GatedDeltaNetConfig, num_layers: int) -> "StateLayout":
        return cls(num_layers, cfg.conv_state_shape, cfg.recurrent_state_shape)

    @property
    def update_shape(self) -> tuple[int, int]:
        """One verify position's update of the recurrent state: (Hv, Dk + Dv + 1), k, u and g a head."""
        hv, dk, dv = self.recurrent_shape
        return (hv, dk + dv + 1)

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state in all layers."""
        return self._bytes(_numel(self.conv_shape) + _numel(self.recurrent_shape))

    @property
    def bytes_per_verify_position(self) -> int:
        """One verify position of one row, in all layers: its conv input and its update."""
        return self._bytes(self.conv_shape[0] + _numel(self.update_shape))

    def _bytes(self, per_layer: int) -> int:
        return self.num_layers * per_layer * torch.empty((), dtype=self.dtype).element_size()

    def pool_bytes(self, num_slots: int, verify_rows: int, verify_positions: int) -> int:
        """What a StatePool of these sizes allocates (slot 0 included)."""
        return self.bytes_per_slot * (num_slots + 1) + self.bytes_per_verify_position * verify_rows * verify_positions


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def slots_for_budget(layout: StateLayout, budget_bytes: int, verify_rows: int, verify_positions: int) -> int:
    """How many slots (for running requests and snapshots) a pool of `budget_bytes` holds, its verify rows and
    scratch slot paid first. The engine gives the state pool max_num_seqs slots plus the snapshots it wants from
    the memory budget before sizing the KV pool from the rest."""
    spare = budget_bytes - layout.pool_bytes(0, verify_rows, verify_positions)
    return max(0, spare // layout.bytes_per_slot)


class StatePool:
    """Per-request slots of linear-attention state, prefix snapshots in spare slots, and verify rows."""

    def __init__(self, layout: StateLayout, num_slots: int, verify_rows: int = 0, verify_positions: int = 0,
                 device: str | torch.device = "cpu") -> None:
        if num_slots < 1:
            raise ValueError("a state pool needs at least one slot")
        self.layout = layout
        self.num_slots = num_slots
        n, dev, dtype = layout.num_layers, torch.device(device), layout.dtype
        self.conv = torch.zeros(n, num_slots + 1, *layout.conv_shape, dtype=dtype, device=dev)
        self.recurrent = torch.zeros(n, num_slots + 1, *layout.recurrent_shape, dtype=dtype, device=dev)
        rows = (verify_rows, verify_positions)
        self.verify_inputs = torch.zeros(n, *rows, layout.conv_shape[0], dtype=dtype, device=dev)
        self.verify_updates = torch.zeros(n, *rows, *layout.update_shape, dtype=dtype, device=dev)
        self._free = list(range(num_slots, 0, -1))  # popped from the end: lowest slot first
        self._owned: set[int] = set()
        self._snapshots: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, least recently used first

    # --- what the model reads --------------------------------------------------------------------------------

    def layer(self, i: int) -> LayerState:
        """Linear-attention layer i's views (the i-th of the model's linear-attention layers, in order)."""
        return LayerState(self.conv[i], self.recurrent[i], self.verify_inputs[i], self.verify_updates[i])

    # --- slots of running requests ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Slots a request can get now: free ones and those holding snapshots (evicted on demand)."""
        return len(self._free) + len(self._snapshots)

    @property
    def num_owned(self) -> int:
        return len(self._owned)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def allocate(self, start: Hashable | None = None) -> int:
        """A slot for a new (or recomputing) request, its state zeroed, or the snapshot `start`'s (a prefix hit):
        never a stale state."""
        if start is not None:  # (most recently used: evicted for this slot only when it is the last spare one)
            self._snapshots.move_to_end(start)
        slot = self._take()
        if slot is None:
            raise RuntimeError("state pool exhausted: every slot is owned by a running request")
        self._owned.add(slot)
        if start is None:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
        elif start in self._snapshots:
            self._copy(self._snapshots[start], slot)
        # (else the snapshot's own slot was taken: it holds that state already)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._owned:
            raise ValueError(f"state slot {slot} is not owned by a request")
        self._owned.remove(slot)
        self._free.append(slot)

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
            return slot
        return None

    # --- prefix snapshots ------------------------------------------------------------------------------------

    def snapshot(self, slot: int, key: Hashable) -> bool:
        """Keep a copy of `slot`'s state under `key` (the hash of the KV block the state ends). False when no
        slot is spare (nothing is evicted for it but older snapshots)."""
        if slot not in self._owned:
            raise ValueError(f"state slot {slot} is not owned by a request")
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return True
        target = self._take()
        if target is None:
            return False
        self._copy(slot, target)
        self._snapshots[key] = target
        return True

    def has_snapshot(self, key: Hashable) -> bool:
        return key in self._snapshots

    def longest_snapshot(self, keys: Sequence[Hashable]) -> int:
        """Of a prefix's block keys (in order), how many a hit may reuse: the index + 1 of the last key with a
        snapshot (0: none). The state there is exact; the prefix hit is cut to it."""
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in self._snapshots:
                return n
        return 0

    def restore(self, key: Hashable, slot: int) -> None:
        """Copy the snapshot `key` into the request's `slot` (a prefix hit's state)."""
        if slot not in self._owned:
            raise ValueError(f"state slot {slot} is not owned by a request")
        self._snapshots.move_to_end(key)
        self._copy(self._snapshots[key], slot)

    def drop(self, key: Hashable) -> None:
        """Forget a snapshot (its KV block left the prefix cache, so no hit can reach it)."""
        slot = self._snapshots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def _copy(self, src: int, dst: int) -> None:
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    # --- speculative verify ----------------------------------------------------------------------------------

    def commit_verify(self, slots: torch.Tensor, rows: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a verify forward: slot slots[b] takes the state after position accepted[b] of verify row rows[b]
        (accepted = drafts accepted: position 0 is the verified token itself), in every layer. Device tensors
        [B] int64; device ops only, so it runs inside a captured round."""
        # The conv window after position j: the last K of the slot's window and the row's inputs 0..j.
        window = self.conv[:, slots]  # [L, B, C, K]
        inputs = torch.cat([window, self.verify_inputs[:, rows].transpose(2, 3)], dim=-1)  # [L, B, C, K + P]
        at = accepted[:, None] + 1 + torch.arange(window.shape[-1], device=accepted.device)  # [B, K]
        self.conv[:, slots] = inputs.gather(-1, at[None, :, None, :].expand(window.shape))
        if self.recurrent.is_cuda:
            from outrider.kernels.delta_rule import commit_updates

            commit_updates(self.recurrent, self.verify_updates, slots, rows, accepted)
            return
        state, updates = self.recurrent[:, slots], self.verify_updates[:, rows]  # [L, B, ...], [L, B, P, ...]
        for i in range(updates.shape[2]):
            live = (accepted >= i)[None, :, None, None, None]
            state = torch.where(live, apply_updates(state, updates[:, :, i]), state)
        self.recurrent[:, slots] = state
