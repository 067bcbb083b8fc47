"""The target's step graphs: decode, verify and lone prefill chunks, in one memory pool (outrider/graphs.py
captures them)."""

from __future__ import annotations

from dataclasses import dataclass

from outrider.graphs import VERIFY_BUCKETS, CudaGraphRunner

SMALLEST_PREFILL_GRAPH = 8  # (shorter chunks of one sequence replay the verify graphs, when there are some)


def prefill_graph_lens(max_tokens: int, max_model_len: int) -> list[int]:
    """The chunk lengths captured for lone prefill chunks of up to max_tokens (EngineConfig.prefill_graph_tokens):
    powers of two from SMALLEST_PREFILL_GRAPH to the first one that covers max_tokens, within the context."""
    lens, q = [], SMALLEST_PREFILL_GRAPH
    while max_tokens and q < 2 * max_tokens and q <= max_model_len:
        lens.append(q)
        q *= 2
    return lens


@dataclass(frozen=True)
class StepGraphs:
    """Which step graphs a runner captures: decode up to max_batch sequences; per q in verify_lens, verify steps of
    q tokens per sequence (a decode token and q - 1 drafts); per q in prefill_lens, one sequence's prefill chunk of
    q tokens (ModelRunner.prepare pads a shorter one up to it)."""

    max_batch: int
    max_model_len: int
    verify_lens: tuple[int, ...] = ()
    prefill_lens: tuple[int, ...] = ()


def capture_step_graphs(runner, shapes: StepGraphs, progress: bool = True) -> list[CudaGraphRunner]:
    """Graphs over a ModelRunner's model, KV cache and attention backend, in one memory pool: decode (the LM head
    inside, as every row samples; into the runner's decode_logits), then verify and prefill steps. Graphs of several
    tokens a sequence stop at the hidden states: the runner applies the LM head to the rows it needs, so that no
    graph keeps a [batch * q, vocab] logits buffer alive."""
    common = dict(max_blocks_per_seq=-(-shapes.max_model_len // runner.kv_cache.block_size),
                  max_seq_len=shapes.max_model_len, device=runner.device)
    decode = CudaGraphRunner(_with_states(runner, runner.forward_decode, verify=False), max_batch=shapes.max_batch,
                             **common)
    decode.capture(progress)
    graphs = [decode]
    verify_buckets = [b for b in VERIFY_BUCKETS if b <= shapes.max_batch]
    for q, buckets, verify in ([(q, verify_buckets, True) for q in shapes.verify_lens]
                               + [(q, [1], False) for q in shapes.prefill_lens]):
        graph = CudaGraphRunner(_with_states(runner, runner.forward_eager, verify), max_batch=buckets[-1],
                                tokens_per_seq=q, buckets=buckets, pool=decode.pool, **common)
        graph.capture(progress)
        graphs.append(graph)
    return graphs


def _with_states(runner, forward, verify: bool):
    """forward as a graph captures it: for a hybrid model, over the runner's static slot rows (verify: a verify
    step's, writing the verify rows)."""
    if runner.states is None:
        return forward
    return lambda input_ids, positions, meta: forward(input_ids, positions, meta, runner.states.for_graph(meta, verify))
