"""CUDA graphs for uniform steps: every sequence feeds the same number of tokens (decode: 1, verify: k+1).

One graph per batch-size bucket, captured largest first into one shared memory pool. Inputs live in static
buffers; a step copies its tensors in, pads the bucket with rows the kernels ignore (slot -1: no KV write;
seq_len 0: no keys, zero output) and replays. Captured with max_seq_len = the engine's context limit, an upper
bound the attention kernels size their split-KV grid from, so any shorter context replays correctly.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from typing import Callable, Sequence

import torch

from outrider.attention import AttentionMetadata
from outrider.kernels import ops
from outrider.models.output import ForwardResult

Outputs = torch.Tensor | tuple[torch.Tensor, ...] | ForwardResult
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], Outputs]


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class CudaGraphRunner:
    """Captures `forward(input_ids, positions, meta)` per bucket; `run` replays the smallest bucket that fits.

    forward returns a tensor, a tuple of tensors or a ForwardResult (its fields None or tensors) whose first dim
    is the token count, e.g. a closure over `model(ids, pos, kv_cache, meta, backend)`.
    """

    def __init__(self, forward: ForwardFn, *, max_batch: int, max_blocks_per_seq: int, max_seq_len: int,
                 device: torch.device, tokens_per_seq: int = 1, causal: bool = True,
                 buckets: Sequence[int] | None = None, pool=None) -> None:
        self.forward = forward
        self.q = tokens_per_seq
        self.causal = causal
        self.max_seq_len = max_seq_len
        self.buckets = sorted(buckets) if buckets else default_buckets(max_batch)
        self.pool = pool  # share one pool between runners (e.g. decode and verify) via .pool after capture
        n_seq, n_tok = self.buckets[-1], self.buckets[-1] * tokens_per_seq
        self.input_ids = torch.zeros(n_tok, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n_tok, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n_tok,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n_seq, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n_seq, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Every bucket's query_start_loc is a prefix of the same arange: sequence i starts at i * q.
        self.query_start_loc = torch.arange(0, n_tok + 1, tokens_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Outputs] = {}  # each bucket's static output buffers, as forward returned them

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * self.q], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=self.q,
            max_seq_len=self.max_seq_len, causal=self.causal)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its pool memory."""
        # Capture-time inputs touch nothing: slot -1 stores no KV, seq_len 0 reads none.
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        todo = sorted(self.buckets, reverse=True)
        # A collection during capture can free a dead engine's graphs, and destroying a graph while this stream
        # captures invalidates the capture (torch.cuda.graph no longer collects first): collect now, not then.
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with ops.graph_capture():
                self._capture(todo, progress)
        finally:
            if collecting:
                gc.enable()

    def _capture(self, todo: list[int], progress: bool) -> None:
        for i, bs in enumerate(todo):
            n = bs * self.q
            args = (self.input_ids[:n], self.positions[:n], self._meta(bs))
            self.forward(*args)  # warm-up: Triton compiles and cuBLAS picks its kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.forward(*args)
            # A graph's first replay uploads it to the device, slower than any later one: done now, not in the first
            # step that uses it (the speculative policy's cost of a draft length can rest on one such step).
            graph.replay()
            if self.pool is None:
                self.pool = graph.pool()
            self.outputs[bs] = out
            self.graphs[bs] = graph
            if progress:
                sys.stderr.write(f"\rcapturing CUDA graphs (q={self.q}): {i + 1}/{len(todo)} (batch {bs})   ")
        if progress:
            sys.stderr.write("\n")
        torch.cuda.synchronize()

    def bucket_for(self, num_seqs: int) -> int | None:
        for bs in self.buckets:
            if bs >= num_seqs:
                return bs if bs in self.graphs else None
        return None

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a step this runner captured: uniform q tokens per sequence, within the largest bucket."""
        return (meta.causal == self.causal and meta.max_query_len == self.q
                and meta.slot_mapping.shape[0] == meta.num_seqs * self.q
                and meta.block_tables.shape[1] <= self.block_tables.shape[1]
                and self.bucket_for(meta.num_seqs) is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> Outputs:
        """Copy the step into the static buffers, pad, replay; returns views of the real rows, valid until the
        next replay of any graph in this memory pool (the engine's graphs share one)."""
        n_seq = meta.num_seqs
        n_tok = n_seq * self.q
        bs = self.bucket_for(n_seq)
        self.input_ids[:n_tok].copy_(input_ids, non_blocking=True)
        self.positions[:n_tok].copy_(positions, non_blocking=True)
        self.slot_mapping[:n_tok].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n_tok: bs * self.q].fill_(-1)
        self.seq_lens[:n_seq].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n_seq:bs].zero_()
        width = meta.block_tables.shape[1]
        self.block_tables[:n_seq, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return _rows(self.outputs[bs], n_tok)


def _rows(out: Outputs, n: int) -> Outputs:
    """Views of the first n rows of a graph's outputs, in the form forward returned them."""
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, ForwardResult):
        return ForwardResult(*(None if t is None else t[:n] for t in
                               (getattr(out, f.name) for f in dataclasses.fields(out))))
    return tuple(o[:n] for o in out)


# Batch sizes captured for verify steps: speculation pays at small batches, and each (batch, k) pair is a graph.
VERIFY_BUCKETS = (1, 2, 4, 8)
SMALLEST_PREFILL_GRAPH = 8  # (shorter chunks of one sequence replay the verify graphs, when there are some)


def prefill_graph_lens(max_tokens: int, max_model_len: int) -> list[int]:
    """The chunk lengths captured for lone prefill chunks of up to max_tokens (EngineConfig.prefill_graph_tokens):
    powers of two from SMALLEST_PREFILL_GRAPH to the first one that covers max_tokens, within the context."""
    lens, q = [], SMALLEST_PREFILL_GRAPH
    while max_tokens and q < 2 * max_tokens and q <= max_model_len:
        lens.append(q)
        q *= 2
    return lens


def capture_step_graphs(runner, max_batch: int, max_model_len: int, verify_lens: Sequence[int] = (),
                        prefill_lens: Sequence[int] = (), progress: bool = True) -> list[CudaGraphRunner]:
    """Graphs over a ModelRunner's model, KV cache and attention backend, in one memory pool: decode (one token
    per sequence; the LM head inside, as every row samples); per q in verify_lens, verify steps of q tokens per
    sequence (a decode token and q - 1 drafts); per q in prefill_lens, one sequence's prefill chunk of q tokens
    (ModelRunner.prepare pads a shorter one up to it). Graphs of several tokens a sequence stop at the hidden
    states: the runner applies the LM head to the rows it needs, so that no graph keeps a [batch * q, vocab]
    logits buffer alive."""
    common = dict(max_blocks_per_seq=-(-max_model_len // runner.kv_cache.block_size), max_seq_len=max_model_len,
                  device=runner.device)
    # One logits buffer for every decode bucket (a buffer per bucket would hold sum(buckets) x vocab floats:
    # 1.3 GB at 256 sequences for Qwen3's vocabulary).
    runner.decode_logits = torch.empty((max_batch, runner.sampler.vocab_size), dtype=torch.float32,
                                       device=runner.device)
    decode = CudaGraphRunner(runner.forward_decode, max_batch=max_batch, **common)
    decode.capture(progress)
    graphs = [decode]
    verify_buckets = [b for b in VERIFY_BUCKETS if b <= max_batch]
    for q, buckets in [(q, verify_buckets) for q in verify_lens] + [(q, [1]) for q in prefill_lens]:
        graph = CudaGraphRunner(runner.forward_eager, max_batch=buckets[-1], tokens_per_seq=q, buckets=buckets,
                                pool=decode.pool, **common)
        graph.capture(progress)
        graphs.append(graph)
    return graphs
