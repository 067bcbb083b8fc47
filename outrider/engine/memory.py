"""How many KV blocks to allocate: the memory budget, less what a step needs beyond the weights.

A budget given (kv_cache_memory_gib, --kv-cache-gib) is used as it is, on any device. Otherwise, on the CPU it
is CPU_KV_CACHE_GIB; on CUDA it is the free memory times --gpu-memory-utilization, less what a step needs,
measured before the pool exists: one forward over a full step budget of prompt tokens, then the sampler's worst
case (every running sequence sampling with top-k off, which sorts the whole vocabulary per row).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from outrider.attention import KVCache, get_backend
from outrider.params import SamplingParams

log = logging.getLogger("outrider.engine")

CPU_KV_CACHE_GIB = 1.0  # the CPU's KV budget when none is given
# If the measurement fails: what a step was assumed to need before it was measured.
FALLBACK_RESERVE = int(1.5 * 2**30)
# Beside the measured step and the graphs' logits buffers: the graphs' pool (intermediates of the largest decode
# batch, small per-graph outputs) and the allocator's fragmentation.
GRAPH_RESERVE = 512 * 2**20
DRAFT_GRAPH_BATCH = 64  # the draft model's graphs go up to this batch (DraftPolicy.max_batch's default)


def kv_block_bytes(shape: tuple[int, int, int], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of a KV pool of `shape` (layers, KV heads, head dim): its K and V."""
    layers, kv_heads, head_dim = shape
    return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_kv_blocks(per_block: int, wanted: int, budget: float) -> int:
    """Blocks of `per_block` bytes (across the pools) within `budget`, and no more than the limits use."""
    return max(2, min(wanted, int(budget // per_block)))


def graph_reserve(max_num_seqs: int, vocab_size: int, drafted: bool, eager: bool, prefill_share: float = 0.0,
                  step_reserve: int = 0) -> int:
    """Bytes the CUDA graphs captured after the KV pools take: their pool, the float32 logits buffers of the
    decode graphs (one row per sequence) and of a draft model's (an upper bound: the target's vocabulary), and the
    intermediates of the largest prefill graph, which stay in the pool: prefill_share (its tokens over the measured
    step's) of the measured step's bytes (step_reserve)."""
    if eager:
        return 0
    rows = max_num_seqs + (min(max_num_seqs, DRAFT_GRAPH_BATCH) if drafted else 0)
    return GRAPH_RESERVE + rows * vocab_size * 4 + int(min(1.0, prefill_share) * step_reserve)


def cuda_budget(device: torch.device, utilization: float, reserve: int) -> float:
    """Bytes for the KV pools on a CUDA device: its free memory times `utilization`, less `reserve`."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return free * utilization - reserve


@torch.inference_mode()
def measure_step_reserve(model: torch.nn.Module, model_config, *, tokens: int, rows: int, block_size: int,
                         dtype: torch.dtype, device: torch.device, aux_layer_ids: tuple[int, ...] = (),
                         states: Callable[[int], Any] | None = None) -> int:
    """Peak bytes a step allocates beyond what is allocated now (CUDA): a forward over `tokens` prompt tokens
    (one sequence, over a scratch pool just big enough; tapping aux_layer_ids, as a drafter's steps do), and
    sampling `rows` of its logits with top-k off. states: a hybrid model's LinearStates for a prompt of n tokens.
    FALLBACK_RESERVE when the measurement fails (logged)."""
    from outrider.attention.metadata import build_metadata
    from outrider.sampler import RowSpec, Sampler

    mc = model_config
    try:
        blocks = -(-tokens // block_size)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        cache = KVCache.allocate(mc.num_hidden_layers, blocks + 1, block_size, mc.num_key_value_heads, mc.head_dim,
                                 dtype, device)
        scratch = torch.cuda.memory_allocated(device) - base  # the scratch pool: not part of a step
        torch.cuda.reset_peak_memory_stats(device)
        meta, positions = build_metadata([(list(range(1, blocks + 1)), 0, tokens)], block_size, device)
        extra = {} if states is None else {"states": states(tokens)}
        hidden = model(torch.zeros(tokens, dtype=torch.int64, device=device), positions, cache, meta,
                       get_backend(device), aux_layer_ids, **extra).hidden
        logits = model.compute_logits(hidden[-rows:])
        sampler = Sampler(mc.vocab_size, device)
        spec = RowSpec(SamplingParams(temperature=1.0, top_k=0, top_p=0.95, min_p=0.05, xtc_probability=1.0, seed=0),
                       seed=0, step=0)  # (XTC: one more softmax over the whole vocab)
        sampler.sample(logits, sampler.prepare([spec] * rows))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base - scratch
        del cache, meta, positions, hidden, logits, sampler
        # What the step left allocated for good (a quantized model's dequantization buffer, kernels/quant_gemm.py)
        # is already out of the free memory the budget starts from.
        kept = torch.cuda.memory_allocated(device) - base
        return max(0, peak - kept)
    except Exception as exc:  # a failed measurement must not stop the server: assume what was assumed before
        log.warning("could not measure a step's memory (%s); reserving %.1f GiB", exc, FALLBACK_RESERVE / 2**30)
        return FALLBACK_RESERVE
