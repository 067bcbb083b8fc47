"""Host side of a step: the batch layout built in bulk, its one-copy upload, and block tables kept across steps."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.engine.request import Request
from outrider.engine.runner import BlockTables, build_metadata
from outrider.engine.upload import to_device
from outrider.params import SamplingParams

BS = 4


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=6), st.randoms())
def test_build_metadata_matches_per_token_definition(seqs, rnd):
    blocks = [rnd.sample(range(1, 100), -(-(start + n) // BS)) for start, n in seqs]
    meta, positions = build_metadata([(b, s, n) for b, (s, n) in zip(blocks, seqs)], BS, torch.device("cpu"))
    want_pos = [p for s, n in seqs for p in range(s, s + n)]
    want_slots = [b[p // BS] * BS + p % BS for b, (s, n) in zip(blocks, seqs) for p in range(s, s + n)]
    assert positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert positions.tolist() == want_pos and meta.slot_mapping.tolist() == want_slots
    assert meta.query_start_loc.tolist() == meta.query_start_loc_host == [0, *np.cumsum([n for _, n in seqs])]
    assert meta.seq_lens.tolist() == meta.seq_lens_host == [s + n for s, n in seqs]
    assert meta.block_tables.tolist() == [b + [0] * (max(map(len, blocks)) - len(b)) for b in blocks]
    assert meta.max_query_len == max(n for _, n in seqs) and meta.max_seq_len == max(s + n for s, n in seqs)


def test_to_device_round_trip_is_aligned():
    arrays = [np.arange(3, dtype=np.int64), np.array([1.5, -np.inf], dtype=np.float32),
              np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros((0, 4), dtype=np.int32), np.array([-1], np.int64)]
    out = to_device([(a, a.dtype.type) for a in arrays] + [([7, 8, 9], np.int32)], torch.device("cpu"))
    assert out[-1].tolist() == [7, 8, 9] and out[-1].data_ptr() % 16 == 0
    for a, t in zip(arrays, out):
        assert t.dtype == {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}[a.dtype.type]
        assert t.shape == a.shape and np.array_equal(t.numpy(), a)
        assert t.data_ptr() % 16 == 0


def test_block_tables_follow_appends_and_new_lists():
    tables = BlockTables()
    a, b = Request([1], SamplingParams()), Request([2], SamplingParams())
    a.id_slot, b.id_slot = 0, 3
    a.block_ids, b.block_ids = [5], [7, 8]
    assert tables.gather([a, b]).tolist() == [[5, 0], [7, 8]]
    a.block_ids += [6, 9]  # grown in place (BlockPool appends)
    assert tables.gather([b, a]).tolist() == [[7, 8, 0], [5, 6, 9]]
    b.block_ids = [4]  # a new list (re-admitted after preemption): the row is rewritten, stale entries cleared
    assert tables.gather([b]).tolist() == [[4]]
    c = Request([3], SamplingParams())
    c.id_slot, c.block_ids = 3, [1, 2]  # b's slot, reused by another request
    assert tables.gather([a, c]).tolist() == [[5, 6, 9], [1, 2, 0]]
