"""StatePool (engine/state_pool.py): slots are never leaked or shared, a new slot starts from zero, snapshots
restore exactly the state they copied, and a verify commit takes each row's state at its accepted position."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from outrider.engine.state_pool import PAD_SLOT, StateLayout, StatePool, slots_for_budget
from outrider.layers.gated_deltanet import QWEN3_5_PROJECTIONS, GatedDeltaNetConfig, apply_updates

LAYOUT = StateLayout(num_layers=2, conv_shape=(3, 4), recurrent_shape=(2, 3, 2))


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / free / write / snapshot / restore / drop against a model of what each slot holds."""

    def __init__(self):
        super().__init__()
        self.pool = StatePool(LAYOUT, num_slots=5)
        self.owned: dict[int, float] = {}  # slot -> the value its state was last filled with (0: fresh)
        self.snapshots: dict[str, float] = {}  # key -> the value its state held when taken (if still kept)
        self.counter = 0.0

    @rule()
    def allocate(self):
        if len(self.owned) == self.pool.num_slots:
            with pytest.raises(RuntimeError):
                self.pool.allocate()
            return
        slot = self.pool.allocate()
        assert slot != PAD_SLOT and slot not in self.owned
        assert not self.pool.recurrent[:, slot].any() and not self.pool.conv[:, slot].any()
        self.owned[slot] = 0.0
        self._forget_evicted()

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def write(self, data):
        slot = data.draw(st.sampled_from(sorted(self.owned)))
        self.counter += 1
        self.pool.conv[:, slot] = self.counter
        self.pool.recurrent[:, slot] = -self.counter
        self.owned[slot] = self.counter

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        slot = data.draw(st.sampled_from(sorted(self.owned)))
        self.pool.free(slot)
        del self.owned[slot]
        with pytest.raises(ValueError):
            self.pool.free(slot)  # no double free

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), key=st.sampled_from("abcdef"))
    def snapshot(self, data, key):
        slot = data.draw(st.sampled_from(sorted(self.owned)))
        kept = self.pool.snapshot(slot, key)
        if key in self.snapshots:
            assert kept  # already there: refreshed, not replaced
        elif kept:
            self.snapshots[key] = self.owned[slot]
        self._forget_evicted()

    @precondition(lambda self: self.owned and self.snapshots)
    @rule(data=st.data())
    def restore(self, data):
        key = data.draw(st.sampled_from(sorted(self.snapshots)))
        slot = data.draw(st.sampled_from(sorted(self.owned)))
        self.pool.restore(key, slot)
        self.owned[slot] = self.snapshots[key]

    @rule(key=st.sampled_from("abcdef"))
    def drop(self, key):
        self.pool.drop(key)
        self.snapshots.pop(key, None)

    def _forget_evicted(self):
        for key in [k for k in self.snapshots if not self.pool.has_snapshot(k)]:
            del self.snapshots[key]

    @invariant()
    def slots_are_accounted_for(self):
        free = set(self.pool._free)
        snap = set(self.pool._snapshots.values())
        owned = set(self.pool._owned)
        assert owned == set(self.owned)
        assert not (free & snap) and not (free & owned) and not (snap & owned)
        assert free | snap | owned == set(range(1, self.pool.num_slots + 1))
        assert len(snap) == len(self.pool._snapshots)  # no two keys share a slot

    @invariant()
    def states_are_what_was_written(self):
        for slot, value in self.owned.items():
            assert torch.all(self.pool.conv[:, slot] == value) and torch.all(self.pool.recurrent[:, slot] == -value)
        for key, value in self.snapshots.items():
            slot = self.pool._snapshots[key]
            assert torch.all(self.pool.conv[:, slot] == value)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_commit_verify_takes_each_rows_accepted_position(accepted):
    pool = StatePool(LAYOUT, num_slots=6, verify_rows=4, verify_positions=4)
    slots = [pool.allocate() for _ in accepted]
    pool.recurrent.copy_(torch.randn_like(pool.recurrent))
    pool.conv.copy_(torch.randn_like(pool.conv))
    pool.verify_inputs.copy_(torch.randn_like(pool.verify_inputs))
    pool.verify_updates.copy_(torch.randn_like(pool.verify_updates) * 0.5)
    rows = list(range(len(accepted)))[::-1]  # rows need not follow slots
    others, windows = pool.recurrent.clone(), pool.conv.clone()
    pool.commit_verify(torch.tensor(slots), torch.tensor(rows), torch.tensor(accepted))
    for slot, row, j in zip(slots, rows, accepted):
        want = others[:, slot]
        for i in range(j + 1):  # (the row's updates up to the accepted position, in order)
            want = apply_updates(want, pool.verify_updates[:, row, i])
        torch.testing.assert_close(pool.recurrent[:, slot], want, rtol=0, atol=0)
        k = windows.shape[-1]  # (the window after position j: the last k of the window and the inputs 0..j)
        inputs = torch.cat([windows[:, slot], pool.verify_inputs[:, row, :j + 1].transpose(1, 2)], dim=-1)
        assert torch.equal(pool.conv[:, slot], inputs[..., -k:])
    untouched = [s for s in range(pool.num_slots + 1) if s not in slots]
    assert torch.equal(pool.recurrent[:, untouched], others[:, untouched])


def test_longest_snapshot_cuts_a_prefix_hit_to_the_last_exact_state():
    pool = StatePool(LAYOUT, num_slots=4)
    slot = pool.allocate()
    pool.snapshot(slot, "h1")
    pool.snapshot(slot, "h3")
    assert pool.longest_snapshot(["h1", "h2", "h3", "h4"]) == 3
    assert pool.longest_snapshot(["h1", "h2"]) == 1
    assert pool.longest_snapshot(["h0", "h2"]) == 0


def test_snapshots_give_way_to_requests_and_newer_snapshots_oldest_first():
    pool = StatePool(LAYOUT, num_slots=3)
    slot = pool.allocate()
    assert pool.snapshot(slot, "old") and pool.snapshot(slot, "new")
    assert pool.snapshot(slot, "newest")  # no free slot: the least recently used snapshot makes room
    assert not pool.has_snapshot("old") and pool.has_snapshot("new")
    pool.allocate()
    assert not pool.has_snapshot("new") and pool.has_snapshot("newest")
    last = pool.allocate()
    assert pool.num_snapshots == 0
    assert not pool.snapshot(last, "nowhere")  # every slot is owned by a request: no snapshot is kept
    with pytest.raises(RuntimeError):
        pool.allocate()


def test_budget_pays_the_verify_rows_and_the_scratch_slot_first():
    cfg = GatedDeltaNetConfig(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8,
                              conv_kernel=4, rms_norm_eps=1e-6, projections=QWEN3_5_PROJECTIONS)
    layout = StateLayout.of(cfg, num_layers=3)
    per_slot = 3 * (cfg.conv_dim * 4 + 4 * 16 * 8) * 4
    per_position = 3 * (cfg.conv_dim + 4 * (16 + 8 + 1)) * 4  # (a conv input and an update a position)
    assert (layout.bytes_per_slot, layout.bytes_per_verify_position) == (per_slot, per_position)
    n = slots_for_budget(layout, 100 * per_slot, verify_rows=4, verify_positions=5)
    assert n == (100 * per_slot - 20 * per_position) // per_slot - 1
    pool = StatePool(layout, n, 4, 5)
    used = sum(t.numel() * t.element_size() for t in (pool.conv, pool.recurrent, pool.verify_inputs,
                                                       pool.verify_updates))
    assert used == layout.pool_bytes(n, 4, 5) <= 100 * per_slot
