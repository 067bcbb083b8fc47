"""Host side of a step: the batch layout built in bulk, its one-copy upload, and block tables kept across steps."""

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.engine.request import Request
from outrider.attention.metadata import build_metadata, decode_metadata_on_device
from outrider.engine.runner import BlockTables
from outrider.upload import to_device
from outrider.params import SamplingParams
from spec_helpers import check_hidden_rows_recompute_without_writing
from outrider.testing.checkpoints import write_tiny_checkpoint

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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans()), min_size=1, max_size=6), st.randoms())
def test_decode_metadata_on_the_device_matches_the_host_built_one_for_live_rows(rows, rnd):
    """One query per sequence, metadata computed on the device from the block tables: for live rows what
    build_metadata gives; a row not live writes nothing and reads nothing, even at a position past its table."""
    blocks = [rnd.sample(range(1, 100), pos // BS + 1) for pos, _ in rows]
    host, _ = build_metadata([(b, pos, 1) for b, (pos, _) in zip(blocks, rows)], BS, torch.device("cpu"))
    live = torch.tensor([ok for _, ok in rows])
    beyond = [pos + (0 if ok else 2 * BS) for pos, ok in rows]  # (a dead row's position may lie past its table)
    meta = decode_metadata_on_device(torch.tensor(beyond), live, host.block_tables, BS)
    assert meta.slot_mapping.tolist() == [s if ok else -1 for s, (_, ok) in zip(host.slot_mapping.tolist(), rows)]
    assert meta.seq_lens.tolist() == [n if ok else 0 for n, (_, ok) in zip(host.seq_lens.tolist(), rows)]
    assert meta.query_start_loc.tolist() == host.query_start_loc.tolist() and meta.max_query_len == 1
    assert meta.max_seq_len >= max(host.seq_lens_host) and meta.causal


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


class _FakeGraphs:
    """A captured-graph stand-in: replays steps of q tokens per sequence, returning `outputs`."""

    def __init__(self, q: int, outputs):
        self.q, self.outputs, self.replays = q, outputs, 0

    def can_run(self, meta) -> bool:
        return meta.max_query_len == self.q and meta.slot_mapping.shape[0] == meta.num_seqs * self.q

    def run(self, input_ids, positions, meta):
        self.replays += 1
        return self.outputs


def test_forward_replays_the_graph_that_fits():
    """Decode graphs return hidden, [aux] and logits, verify graphs hidden and [aux]; steps no graph fits run
    eager."""
    from outrider.engine.runner import ModelRunner, StepBatch
    from outrider.models.output import ForwardResult

    hidden, aux, logits = torch.zeros(2, 4), torch.ones(2, 8), torch.full((2, 16), 2.0)
    for with_aux in (False, True):
        runner = ModelRunner.__new__(ModelRunner)
        taps = aux if with_aux else None
        runner.forward_eager = lambda ids, pos, meta: ForwardResult(hidden + 5, taps)
        decode = _FakeGraphs(1, ForwardResult(hidden, taps, logits))
        verify = _FakeGraphs(3, ForwardResult(hidden, taps))
        runner.graphs = [decode, verify]
        for q_lens, fits in (([1, 1], decode), ([3], verify), ([2, 1], None)):
            meta, pos = build_metadata([([1], 0, n) for n in q_lens], BS, torch.device("cpu"))
            ids = torch.zeros(sum(q_lens), dtype=torch.int64)
            out = runner.forward(StepBatch(ids, pos, meta, [], None))
            h, a, lg = out.hidden, out.aux_hidden, out.logits
            assert torch.equal(h, hidden if fits else hidden + 5)
            assert (a is aux) if with_aux else a is None
            assert (lg is logits) if fits is decode else lg is None
        assert decode.replays == verify.replays == 1


def test_forward_decode_writes_logits_into_the_shared_buffer(tmp_path):
    """With decode_logits set (as a runner built with graphs sets it), decode logits land in its first rows: every decode
    graph shares that one buffer. The values are compute_logits' own."""
    from outrider import LLM
    from outrider.testing.checkpoints import write_tiny_checkpoint

    runner = LLM(str(write_tiny_checkpoint(tmp_path / "tiny")), device="cpu").engine.runner
    meta, pos = build_metadata([([1], 3, 1), ([2], 5, 1)], 16, torch.device("cpu"))
    ids = torch.tensor([7, 9])
    with torch.inference_mode():
        out = runner.forward_decode(ids, pos, meta)
        hidden, logits = out.hidden, out.logits
        runner.decode_logits = torch.full((4, logits.shape[1]), float("nan"))
        out = runner.forward_decode(ids, pos, meta)
        hidden2, shared = out.hidden, out.logits
    assert shared.data_ptr() == runner.decode_logits.data_ptr() and shared.shape == logits.shape
    assert torch.equal(shared, logits) and torch.equal(hidden2, hidden)
    assert runner.decode_logits[2:].isnan().all()


def test_hidden_rows_are_recomputed_from_the_cache_without_writing_it(tmp_path):
    check_hidden_rows_recompute_without_writing(write_tiny_checkpoint(tmp_path / "tiny"), "cpu")


class _ReplayingGraph:
    """A lone sequence's graph of q rows as capture_step_graphs records it: `run` is the runner's eager forward on
    the padded step, its results written into buffers the next run overwrites (the graphs' shared pool)."""

    def __init__(self, runner, q: int, max_seq_len: int):
        self.forward, self.q, self.max_seq_len, self.causal = runner.forward_eager, q, max_seq_len, True
        self.steps: list[tuple[list[int], list[int]]] = []  # (positions, slots) of each replay
        self.out = None

    def bucket_for(self, num_seqs: int) -> int | None:
        return 1 if num_seqs == 1 else None

    def can_run(self, meta) -> bool:
        return meta.max_query_len == self.q and meta.num_seqs == 1 and meta.slot_mapping.shape[0] == self.q

    def run(self, input_ids, positions, meta):
        self.steps.append((positions.tolist(), meta.slot_mapping.tolist()))
        out = self.forward(input_ids, positions, meta)
        if self.out is None:
            self.out = out
        else:
            self.out.hidden.copy_(out.hidden)
        return self.out


def test_recomputed_rows_replay_lone_graphs_padded_piece_by_piece_as_an_eager_forward_reads_them(tmp_path):
    """hidden_rows(replay=True) over two spans, with graphs of 8 and 16 rows: the 30-row span replays the 16-row
    graph twice (16 rows, then 14 padded), the 3-row span the 8-row graph; pad rows sit after the piece and no row
    writes K/V. The rows equal one eager forward's, though every replay reuses the same output buffer; a piece no
    graph takes near the context's end runs eager. Without replay (prompt log-probs, inside a step) no graph runs."""
    from outrider import LLM
    from outrider.speculative.drafter import Commit

    engine = LLM(str(write_tiny_checkpoint(tmp_path / "tiny")), device="cpu", dtype="float32").engine
    runner = engine.runner
    reqs = [Request([5, 9, 100, 13, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            for _ in range(2)]
    for req in reqs:
        engine.add_request(req, lambda out: None)
    while len(reqs[0].output_ids) < 36:
        engine.step()
    spans = [Commit(reqs[0], 4, 30), Commit(reqs[1], 20, 3)]
    eager = runner.hidden_rows(spans)[0]
    runner.graphs = [_ReplayingGraph(runner, q, 64) for q in (8, 16)]
    assert torch.equal(runner.hidden_rows(spans)[0], eager) and not any(g.steps for g in runner.graphs)
    torch.testing.assert_close(runner.hidden_rows(spans, replay=True)[0], eager, atol=1e-5, rtol=1e-5)
    short, long = runner.graphs
    assert [p for p, _ in long.steps] == [list(range(4, 20)), list(range(20, 36))]
    assert [p for p, _ in short.steps] == [list(range(20, 28))]
    assert all(set(slots) == {-1} for g in runner.graphs for _, slots in g.steps)
    runner.graphs = [_ReplayingGraph(runner, q, 24) for q in (8, 16)]  # the second piece (20..35) fits none
    torch.testing.assert_close(runner.hidden_rows(spans[:1], replay=True)[0], eager[:30], atol=1e-5, rtol=1e-5)
    assert [p for p, _ in runner.graphs[1].steps] == [list(range(4, 20))]


def test_a_hybrid_step_replays_only_a_graph_of_its_kind():
    """A hybrid model's verify graph writes the verify rows, the others advance the slots: a prompt chunk of a
    verify graph's length runs eager (or a prefill graph), a verify step replays the verify graph, each with its
    states loaded for the graph's length."""
    from outrider.engine.runner import ModelRunner, StepBatch
    from outrider.layers.gated_deltanet_types import StateBatch
    from outrider.models.output import ForwardResult

    hidden = torch.zeros(3, 4)
    runner = ModelRunner.__new__(ModelRunner)
    loaded: list[int] = []
    runner.states = types.SimpleNamespace(load_graph=lambda batch, q: loaded.append(q), states=lambda batch: batch)
    runner.forward_eager = lambda ids, pos, meta, states: ForwardResult(hidden + 5, None)
    verify, prefill = _FakeGraphs(3, ForwardResult(hidden, None)), _FakeGraphs(8, ForwardResult(hidden, None))
    runner.graphs, runner._verify_lens = [_FakeGraphs(1, None), verify, prefill], frozenset({3})
    meta, pos = build_metadata([([1], 0, 3)], BS, torch.device("cpu"))
    ids = torch.zeros(3, dtype=torch.int64)
    for is_verify, want in ((False, hidden + 5), (True, hidden)):
        states = StateBatch([0, 3], torch.tensor([0]), [0], is_verify)
        assert torch.equal(runner.forward(StepBatch(ids, pos, meta, [], None, states)).hidden, want)
    assert verify.replays == 1 and loaded == [3]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_warming_the_eager_forwards_writes_nothing_a_request_owns(tmp_path, arch):
    """compile_eager_forwards (warm-up's eager forwards over the null block) writes no K/V, even into block 0, nor a
    hybrid model's linear state outside the slot nobody owns; a request running meanwhile ends as it would have
    (float32, greedy)."""
    from outrider import LLM
    from outrider.engine.state_pool import PAD_SLOT

    llm = LLM(write_tiny_checkpoint(tmp_path / "tiny", arch, layers=4), device="cpu", dtype="float32")
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = llm.generate([[5, 9, 100, 13, 7]], params)[0].token_ids
    req = Request([5, 9, 100, 13, 7], params)
    engine.add_request(req, lambda out: None)
    for _ in range(4):
        engine.step()
    cache = engine.kv_cache.k + engine.kv_cache.v
    pool = engine.runner.states.pool if engine.runner.states is not None else None
    owned = [] if pool is None else [t[:, i] for t in (pool.conv, pool.recurrent) for i in range(t.shape[1])
                                     if i != PAD_SLOT]
    kept = [t.clone() for t in cache + owned]
    engine.runner.compile_eager_forwards(80)
    assert all(torch.equal(a, b) for a, b in zip(kept, cache + owned))
    while engine.has_work():
        engine.step()
    assert req.output_ids == want
