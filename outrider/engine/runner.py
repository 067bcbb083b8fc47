"""ModelRunner: owns the device side of a step — the model, its KV pool, batch tensors and the sampler.

`prepare` turns a StepPlan into flat tensors and an explicit AttentionMetadata; `forward` runs the model and
returns hidden states. A step is enqueued in two phases: `launch` (the forward) and `sample` (the sampler or
verification over its rows), so the engine can commit the step before it in between when this one's sampling
reads host state that step advances (a grammar's matcher, a penalty's recent tokens). Nothing here decides policy
(scheduler.py) or commits tokens (engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from outrider.attention import AttentionMetadata, KVCache, get_backend
from outrider.attention.metadata import batch_layout, build_metadata, metadata_over
from outrider.engine import pooling, prompt_logprobs
from outrider.engine.cuda_graphs import StepGraphs, capture_step_graphs
from outrider.engine.linear_state import LinearStateSlots
from outrider.graphs import CudaGraphRunner
from outrider.layers.gated_deltanet_types import StateBatch
from outrider.models.hybrid import LinearStates
from outrider.models.output import ForwardResult
from outrider.sampler import ParamTable, Sampler, SamplingRows
from outrider.upload import copy_to_host, to_device
from outrider.engine.request import Request, TokenLogprob
from outrider.speculative.drafter import Commit, PendingDrafts
from outrider.speculative.verify import verify
from outrider.steps import LaunchedStep, ScheduledRequest, StepOutput, StepPlan
from outrider.structured.grammar import token_masks


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sampling: list[int]  # plan indices of the scheduled requests whose logits are sampled this step
    # Flat rows whose logits are needed, in plan order (the last known token of each sampling request, then
    # one per draft token); None when that is every row in order (a pure decode step: no gather needed).
    logits_rows: torch.Tensor | None
    states: StateBatch | None = None  # a hybrid model's linear-layer slots


class BlockTables:
    """Host block tables of the running requests, one row per scheduler slot, kept across steps: a step copies
    only the blocks a request gained since its previous step, not every request's whole (padded) table.

    A row mirrors one `block_ids` list, recognised by identity: BlockPool only appends to a request's list, and
    gives the request a new list whenever its table is rebuilt (admission, free, preemption)."""

    def __init__(self) -> None:
        self.table = np.zeros((0, 1), dtype=np.int32)
        self._mirrors: list[list[int] | None] = []  # the block_ids list each row mirrors
        self._lens: list[int] = []  # entries of that list copied so far

    def gather(self, reqs: list[Request]) -> np.ndarray:
        """[len(reqs), max blocks] int32: the requests' tables (by id_slot, which running requests hold),
        zero-padded."""
        rows = [req.id_slot for req in reqs]
        if rows and max(rows) >= len(self._mirrors):
            self._grow(max(rows) + 1, 1)
        width = 1
        mirrors, lens = self._mirrors, self._lens
        for req in reqs:
            blocks, row = req.block_ids, req.id_slot
            n = len(blocks)
            if n > width:
                width = n
            if mirrors[row] is not blocks or lens[row] != n:  # new blocks, another request or a rebuilt table
                self._copy(row, blocks)
        return self.table[rows, :width]

    def _copy(self, row: int, blocks: list[int]) -> None:
        n = len(blocks)
        if n > self.table.shape[1]:
            self._grow(0, n)
        if self._mirrors[row] is not blocks:
            self.table[row, :n] = blocks
            self.table[row, n:] = 0
            self._mirrors[row] = blocks
        else:
            self.table[row, self._lens[row] : n] = blocks[self._lens[row] :]
        self._lens[row] = n

    def _grow(self, rows: int, width: int) -> None:
        old = self.table
        if width > old.shape[1]:
            width = max(width, 2 * old.shape[1])  # doubling: a growing context reallocates O(log) times
        self.table = np.zeros((max(rows, old.shape[0]), max(width, old.shape[1])), dtype=np.int32)
        self.table[: old.shape[0], : old.shape[1]] = old
        self._mirrors += [None] * (self.table.shape[0] - len(self._mirrors))
        self._lens += [0] * (self.table.shape[0] - len(self._lens))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, vocab_size: int, device: torch.device,
                 aux_layer_ids: tuple[int, ...] = (), graphs: StepGraphs | None = None,
                 states: LinearStateSlots | None = None):
        """aux_layer_ids: the target layers whose outputs every forward also returns (aux_hidden), for a drafter
        that reads them. graphs: the step graphs to capture (CUDA), now. states: a hybrid model's state slots."""
        self.model = model
        self.states = states
        self.aux_layer_ids = aux_layer_ids
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.backend = get_backend(device)
        self.sampler = Sampler(vocab_size, device)
        self.block_tables = BlockTables()
        self.sampling_table = ParamTable()  # by scheduler slot, like block_tables
        # [max batch, V] float32 that forward_decode writes logits into when set (with graphs): every decode graph's
        # logits are rows of this one buffer, not a buffer per captured batch size (that would hold sum(buckets) x
        # vocab floats: 1.3 GB at 256 sequences for Qwen3's vocabulary).
        self.decode_logits: torch.Tensor | None = None
        # Test hook: called with the plan in collect, before the step's results reach the host (e.g. to sleep).
        self.step_hook: Callable[[StepPlan], None] | None = None
        self.graphs: list[CudaGraphRunner] = []  # decode, then verify and prefill CUDA graphs
        self._verify_lens = frozenset(graphs.verify_lens if graphs is not None else ())
        if graphs is not None:
            self.decode_logits = torch.empty((graphs.max_batch, vocab_size), dtype=torch.float32, device=device)
            self.graphs = capture_step_graphs(self, graphs)

    def prepare(self, plan: StepPlan, feed: LaunchedStep | None = None,
                drafts_on_device: PendingDrafts | None = None) -> StepBatch:
        """Flat batch tensors for the plan. A request's pending token (sampled by `feed`, the step still in
        flight) is not on the host yet: its input id is copied from feed's device output instead; so are drafts
        that stayed on the device (`drafts_on_device`), from the drafter's output."""
        ids: list[int] = []
        starts: list[int] = []
        qsl = [0]
        lens: list[int] = []
        sampling: list[int] = []
        rows: list[int] = []
        dst: list[int] = []  # flat rows whose input id comes from feed.token_ids[src]
        src: list[int] = []
        draft_dst: list[int] = []  # flat rows whose input id is drafts_on_device.ids[draft_src]
        draft_src: list[int] = []
        total = 0  # len(ids)
        for i, s in enumerate(plan.scheduled):
            req = s.request
            start, n = req.num_computed, s.num_new_tokens
            if req.num_pending:  # only the last fed token can be pending: the step in flight sampled it
                if n > 1:
                    ids += req.token_slice(start, start + n - 1)
                dst.append(total + n - 1)
                src.append(req.sample_row)  # (its row in feed: read before this step's row is written below)
                ids.append(0)
            else:
                ids += req.token_slice(start, start + n)
            count = n
            if s.draft_tokens:
                first = drafts_on_device.offsets.get(req.request_id) if drafts_on_device is not None else None
                if first is not None:
                    draft_dst.extend(range(total + n, total + n + len(s.draft_tokens)))
                    draft_src.extend(range(first, first + len(s.draft_tokens)))
                ids += s.draft_tokens  # (placeholders where the values are on the device: overwritten there)
                count += len(s.draft_tokens)
            if s.samples:
                # A sampling row reads the last known token's logits, then one row per draft token.
                req.sample_row = len(sampling)
                sampling.append(i)
                rows.extend(range(total + n - 1, total + count))
            total += count
            starts.append(start)
            qsl.append(total)
            lens.append(start + count)
        table = self.block_tables.gather([s.request for s in plan.scheduled])
        positions, slots = batch_layout(starts, qsl, table, self.block_size)
        # (the real offsets, before any padding: a prefill graph's linear layers stop the state there)
        states = self.states.batch(plan, list(qsl), self.device) if self.states is not None else None
        pad = self._chunk_padding(plan, states)
        if pad:  # (rows after the chunk's: they store no K/V, and no real row attends to them)
            ids += [0] * pad
            positions = np.concatenate((positions, np.arange(lens[0], lens[0] + pad)))
            slots = np.concatenate((slots, np.full(pad, -1)))
            qsl[1] += pad
            lens[0] += pad
            table = _covering(table, lens[0], self.block_size)
        every_row = len(rows) == len(ids)  # rows ascend, so this means rows == range(T)
        parts = [(ids, np.int64), (positions, np.int64), (slots, np.int64), (qsl, np.int32), (lens, np.int32),
                 (table, np.int32)]
        # Optional parts go last, so the fixed ones keep their places (each part costs host time per step).
        copies = []  # (flat rows, indices into the device tensor, the device tensor their input ids come from)
        if dst:
            copies.append((dst, src, feed.token_ids))
        if draft_dst:
            copies.append((draft_dst, draft_src, drafts_on_device.ids))
        for rows_to, rows_from, _ in copies:
            parts += [(rows_to, np.int64), (rows_from, np.int64)]
        if not every_row:
            parts.append((rows, np.int64))
        dev = to_device(parts, self.device)
        input_ids = dev[0]
        for j, (_, _, values) in enumerate(copies):
            input_ids.index_copy_(0, dev[6 + 2 * j], values.index_select(0, dev[7 + 2 * j]))
        meta = metadata_over(qsl, lens, dev[2:6], causal=True)
        return StepBatch(input_ids, dev[1], meta, sampling, None if every_row else dev[-1], states)

    def _chunk_padding(self, plan: StepPlan, states: StateBatch | None) -> int:
        """Rows to pad a lone prefill chunk with, up to the shortest captured graph that takes it whole (0: the
        step runs as it is). One sequence's chunk of n tokens padded to q >= n is that graph's step: the pad rows
        sit at the positions after the chunk's, store no K/V (slot -1) and, causal, are seen by no real row; the
        pad rows' keys come from whatever the cache holds, finite, and their outputs are never read. A hybrid
        model's chunk pads only to a prefill graph, whose linear layers keep the pad rows out of the state."""
        if len(plan.scheduled) != 1:
            return 0
        s = plan.scheduled[0]
        n, start = s.num_new_tokens, s.request.num_computed
        if n < 2 or s.draft_tokens or s.request.num_pending:
            return 0
        q = self._lone_graph_len(n, start, states)
        return 0 if q is None else q - n

    def _lone_graph_len(self, n: int, start: int, states: StateBatch | None = None) -> int | None:
        """The rows of the shortest captured graph that takes one sequence's n rows from position `start` whole
        (None: none does)."""
        return min((g.q for g in self.graphs if g.causal and g.q >= n and g.bucket_for(1) is not None
                    and start + g.q <= g.max_seq_len and self._runs(g, states)), default=None)

    def forward(self, batch: StepBatch) -> ForwardResult:
        """The step's forward; a captured decode graph also computes every row's logits, other steps leave them
        None for the caller (it may need only some rows)."""
        states = batch.states
        graph = next((g for g in self.graphs if g.can_run(batch.meta) and self._runs(g, states)), None)
        if graph is not None:
            if states is not None:
                self.states.load_graph(states, graph.q)
            return graph.run(batch.input_ids, batch.positions, batch.meta)
        if states is None:
            return self.forward_eager(batch.input_ids, batch.positions, batch.meta)
        return self.forward_eager(batch.input_ids, batch.positions, batch.meta, self.states.states(states))

    def _runs(self, graph: CudaGraphRunner, states: StateBatch | None) -> bool:
        """Whether `graph` may replay a step: a hybrid model's (`states`) only of its kind, as a verify graph fills
        the verify rows and the others advance the slots."""
        return states is None or (graph.q in self._verify_lens) == states.verify

    def forward_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      states: LinearStates | None = None) -> ForwardResult:
        """The model call: the hidden states, plus aux_hidden when a drafter reads them. states: a hybrid model's
        (its linear layers' slots)."""
        if states is not None:
            return self.model(input_ids, positions, self.kv_cache, meta, self.backend, self.aux_layer_ids, states)
        return self.model(input_ids, positions, self.kv_cache, meta, self.backend, self.aux_layer_ids)

    @torch.inference_mode()
    def hidden_rows(self, spans: Sequence[Commit], replay: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, aux_hidden or None) at these committed rows, recomputed: a forward over them that reads the
        cache (which holds their K/V already) and writes nothing to it (slot -1). Not for a hybrid model: its linear
        layers' state has moved past those rows.

        replay: where the runner has graphs of one sequence's several rows (lone prefill chunks, verify steps), each
        span replays them a piece at a time (the longest graph's rows at most), each piece padded to the shortest
        graph that takes it whole, as a lone prefill chunk is (_chunk_padding); a piece no graph takes runs eager.
        A replay overwrites every graph's outputs, so only where none is still to be read: before a step's launch
        (a sleeping drafter's catch-up, over every row it slept through, which eager on a host-bound target, small
        or quantized, cost tens of plain steps), never inside one (prompt log-probs of a prefix hit)."""
        if self.states is not None:
            raise NotImplementedError("a hybrid model cannot recompute committed rows' hidden states")
        longest = max((g.q for g in self.graphs if g.q > 1 and g.bucket_for(1) is not None), default=0)
        if not (replay and longest):  # (one eager forward over every span)
            ids = [t for c in spans for t in c.request.token_slice(c.start, c.start + c.count)]
            out = self._forward_reading([(c.request.block_ids, c.start, c.count) for c in spans],
                                        torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True))
            return out.hidden, out.aux_hidden
        pieces = [self._piece_rows(c.request, start, min(longest, c.start + c.count - start))
                  for c in spans for start in range(c.start, c.start + c.count, longest)]
        aux = [p.aux_hidden for p in pieces]
        return torch.cat([p.hidden for p in pieces]), None if aux[0] is None else torch.cat(aux)

    def _piece_rows(self, req: Request, start: int, n: int) -> ForwardResult:
        """hidden_rows over the request's n rows from `start`: a graph's replay where one takes them (padded), else
        eager; own tensors (a replay's outputs are the graphs' shared buffers)."""
        q = self._lone_graph_len(max(n, 2), start)  # (not the decode graph: it writes the shared decode logits)
        pad = 0 if q is None else q - n
        table = _covering(np.asarray([req.block_ids], dtype=np.int32), start + n + pad, self.block_size)
        dev = to_device([(req.token_slice(start, start + n) + [0] * pad, np.int64),
                         (np.arange(start, start + n + pad), np.int64), (np.full(n + pad, -1), np.int64),
                         ([0, n + pad], np.int32), ([start + n + pad], np.int32), (table, np.int32)], self.device)
        meta = metadata_over([0, n + pad], [start + n + pad], dev[2:], causal=True)
        if q is None:
            return self.forward_eager(dev[0], dev[1], meta)
        graph = next(g for g in self.graphs if g.q == q and g.can_run(meta))
        out = graph.run(dev[0], dev[1], meta)
        return ForwardResult(out.hidden[:n].clone(), None if out.aux_hidden is None else out.aux_hidden[:n].clone())

    @torch.inference_mode()
    def compile_eager_forwards(self, max_rows: int) -> None:
        """Run the model eagerly once at each row count whose kernels differ (the skinny GEMM's one, two and 3-16
        rows, attention's tile heights, and past them), LM head included, so that no eager step compiles while
        serving: a catch-up over rows the drafter slept through, a prompt joining a running batch, a prompt past
        the largest prefill graph. Warm-up's prompts replay prefill graphs wherever they fit, and a captured launch
        is another kernel variant than an eager one (PDL)."""
        for rows in sorted({1, 2, 3, *(2**i for i in range(7)), 65}):
            if rows <= max_rows:
                self.model.compute_logits(self.forward_unwritten(rows, rows).hidden)

    def forward_unwritten(self, rows: int, context: int) -> ForwardResult:
        """An eager forward of `rows` tokens (id 0) ending a `context`-token sequence laid over the null block
        (block 0: read, never written), writing no K/V (slot -1), and a hybrid model's linear state only into the
        slot nobody owns (LinearStateSlots.scratch)."""
        blocks = [0] * -(-context // self.block_size)
        states = None if self.states is None else LinearStateSlots.scratch(self.states.pool, rows)
        return self._forward_reading([(blocks, context - rows, rows)],
                                     torch.zeros(rows, dtype=torch.int64, device=self.device), states)

    def _forward_reading(self, seqs: list[tuple[list[int], int, int]], ids: torch.Tensor,
                         states: LinearStates | None = None) -> ForwardResult:
        """An eager forward of `ids` over these (block table, start, count) sequences that reads the cache and
        writes no K/V (slot -1)."""
        meta, positions = build_metadata(seqs, self.block_size, self.device)
        meta = replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
        return self.forward_eager(ids, positions, meta, states)

    def forward_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       states: LinearStates | None = None) -> ForwardResult:
        """What decode CUDA graphs capture: forward_eager's result with every row's logits (a decode step samples
        every row), so the final norm and LM head launch inside the graph too."""
        out = self.forward_eager(input_ids, positions, meta, states)
        into = self.decode_logits[: input_ids.shape[0]] if self.decode_logits is not None else None
        return replace(out, logits=self.model.compute_logits(out.hidden, out=into))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, feed: LaunchedStep | None = None,
               drafts_on_device: PendingDrafts | None = None) -> LaunchedStep:
        """Enqueue a step's forward (feeding pending tokens from `feed`, the step in flight, and drafts that stayed
        on the device) and the logits of the rows it samples; `sample` enqueues their sampling."""
        n = len(plan.scheduled)
        batch = self.prepare(plan, feed, drafts_on_device)
        fwd = self.forward(batch)
        if self.states is not None:
            self.states.after_launch(plan)
        hidden, aux, logits = fwd.hidden, fwd.aux_hidden, fwd.logits
        out = StepOutput([[] for _ in range(n)], [[] for _ in range(n)], [0] * n, hidden, aux)
        step = LaunchedStep(plan, batch.sampling, out, drafts_on_device=drafts_on_device,
                            prompt_logprobs=prompt_logprobs.capture(
                                plan, hidden, self.model,
                                lambda req, start, count: self.hidden_rows([Commit(req, start, count)])[0]),
                            pooled=pooling.capture(plan, hidden, self.model), states=batch.states)
        if not batch.sampling:
            return step
        rows = batch.logits_rows
        if logits is None:
            logits = self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows))
        elif rows is not None:  # a graph step with a row that does not sample (a one-token prefill chunk)
            logits = logits.index_select(0, rows)
        step.logits = logits
        step.reads_history = any(_reads_history(plan.scheduled[i].request) for i in batch.sampling)
        return step

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, draft_probs: dict[int, torch.Tensor] | None = None,
               accepted_on_device: bool = False) -> None:
        """Enqueue the sampling (or the verification of drafts) of a launched step's rows. Sampled tokens and
        verdicts stay on the device (tokens can feed the next step; a verdict, the drafter's next round) and start
        an asynchronous copy to the host; `collect` waits for it. The rows' host inputs (constrained masks, penalty
        windows) are computed here, while the device runs the forward.

        draft_probs: request_id -> q [k, V] for drafts that were sampled (absent: argmax drafts).
        accepted_on_device: a verify step counts accepted drafts on the device (Speculator.draft_ahead reads them)."""
        if not step.awaits_sampling:
            return
        plan, sampling = step.plan, step.sampling
        logits, step.logits = step.logits, None
        sampled_reqs = [plan.scheduled[i] for i in sampling]
        on_device, sources = step.drafts_on_device, ()
        if on_device is not None:  # (a verify step whose drafts stayed on the device)
            sources = on_device.sources([s.request.request_id for s in sampled_reqs],
                                        [s.draft_tokens for s in sampled_reqs])
            if step.reads_history:  # masks or penalty windows over the drafts: their values first
                on_device.fill([s.draft_tokens for s in sampled_reqs], sources)
                on_device = None
        specs = self.row_specs(sampled_reqs)
        if len(specs.slots) > len(sampled_reqs):  # some request has draft rows: verify them
            drafts = [s.draft_tokens for s in sampled_reqs]
            probs = draft_probs or {}
            q = [_trim(probs.get(plan.scheduled[i].request.request_id), len(d)) for i, d in zip(sampling, drafts)]
            sbatch = self.sampler.prepare(specs, argmax_drafts=all(x is None for x in q))
            verifying = step.states is not None and step.states.verify
            step.verdict = verify(self.sampler, logits, sbatch, drafts, q, pending=on_device, sources=sources,
                                  accepted_on_device=accepted_on_device or verifying)
            if verifying:  # (every row of a verify step samples: it holds no prompt chunk)
                self.states.commit_verify(step.states, step.verdict.accepted)
            sampled = step.verdict.output
            step.starts = step.verdict.starts
        else:
            sampled = self.sampler.sample(logits, self.sampler.prepare(specs, sample_only=True))
            step.token_ids = sampled.token_ids
            step.starts = range(len(sampling))
        parts = ((sampled.token_ids,) if step.verdict is None else ()) + (
            (sampled.top_ids, sampled.top_logprobs, sampled.chosen_logprob) if sampled.top_ids is not None else ())
        step.host, step.ready = copy_to_host(*parts)

    def collect(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step's tokens to reach the host; fill its StepOutput's tokens and log-probs."""
        out, plan = step.out, step.plan
        if self.step_hook is not None:
            self.step_hook(plan)
        prompt_logprobs.deliver(step.prompt_logprobs)
        pooling.deliver(step.pooled)
        if not step.sampling:
            return out
        if step.verdict is not None:
            verdict = step.verdict.settle()  # the step's one host synchronisation (its copies run in order)
            tokens = verdict.tokens
            for r, i in enumerate(step.sampling):
                out.accepted[i] = verdict.num_accepted[r]
        if step.ready is not None:
            step.ready.synchronize()  # (a plain step's one host synchronisation)
        host = [t.tolist() for t in step.host]
        if step.verdict is None:
            tokens = [[t] for t in host.pop(0)]
        for i, toks in zip(step.sampling, tokens):
            out.tokens[i] = toks
        if host:  # log-prob parts, for the requests that asked
            ids, lps, chosen = host
            for r, i in enumerate(step.sampling):
                n_probs = plan.scheduled[i].request.params.n_probs
                if n_probs > 0:
                    out.logprobs[i] = [TokenLogprob(tok, chosen[p], list(zip(ids[p][:n_probs], lps[p][:n_probs])))
                                       for p, tok in enumerate(tokens[r], start=step.starts[r])]
        return out

    def row_specs(self, sampled: list[ScheduledRequest]) -> SamplingRows:
        """The sampling rows of these (sampling) requests, one per logits row (the last known token's, then one
        per draft token): the request's parameter slot, the output index sampled (the RNG counter), when a
        penalty reads it the history and, for constrained requests, the allowed tokens (computed here, on the
        host, while the device runs the step's forward)."""
        reqs = [s.request for s in sampled]
        self.sampling_table.sync(reqs)
        slot_ids = [req.id_slot for req in reqs]
        slots = np.array(slot_ids, dtype=np.int64)
        # Output index: a pending token (overlap scheduling) counts, it is output.
        steps = np.array([len(req.output_ids) + req.num_pending for req in reqs], dtype=np.int64)
        counts = [len(s.draft_tokens) + 1 for s in sampled]
        if len(sampled) < sum(counts):  # draft rows follow their request's row, each one output index further
            first = np.cumsum(counts) - counts
            slots, steps = np.repeat(slots, counts), np.repeat(steps - first, counts) + np.arange(sum(counts))
        histories = None
        if self.sampling_table.penalized(slot_ids):
            histories = []
            for s in sampled:
                window = _penalty_window(s.request)
                histories += [window + s.draft_tokens[:j] for j in range(len(s.draft_tokens) + 1)]
        allowed = token_masks(sampled, self.sampler.vocab_size)
        return SamplingRows(self.sampling_table, slots, steps, histories, allowed)


def _covering(table: np.ndarray, seq_len: int, block_size: int) -> np.ndarray:
    """The block table widened with zeros (block 0: read, never written) to cover seq_len positions."""
    width = -(-seq_len // block_size)
    if table.shape[1] >= width:
        return table
    return np.pad(table, ((0, 0), (0, width - table.shape[1])))


def _trim(q: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """A drafter's q for the drafts the scheduler kept (it may cut a proposal short)."""
    return None if q is None or k == 0 else q[:k]


def _reads_history(req: Request) -> bool:
    """Does sampling for the request read host state that its committed tokens advance (a grammar's matcher, a
    penalty's recent tokens)?"""
    return req.constraint is not None or req.params.penalized


def _penalty_window(req: Request) -> list[int]:
    """The recent tokens the penalties (DRY among them) look at (none when no penalty is set)."""
    window = req.params.penalty_window
    if window == 0:
        return []
    n = req.num_tokens - req.num_pending  # the known tokens (a pending one is still on the device)
    return req.token_slice(0 if window < 0 else max(0, n - window), n)
