"""Build the engine a benchmark runs on: a checkpoint path, or a named shape with random weights."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from outrider.bench.shapes import random_model, write_stub_checkpoint
from outrider.config import EngineConfig
from outrider.engine import builder
from outrider.engine.engine import Engine


def engine_config(args, model: str, **fields) -> EngineConfig:
    """The benchmark flags every engine shares (device, eager, overlap, memory), plus `fields`. A benchmark
    without --gpu-memory-utilization (None) sizes the KV pools itself, in `fields`."""
    if args.gpu_memory_utilization is not None:
        fields["gpu_memory_utilization"] = args.gpu_memory_utilization
    return EngineConfig(model=model, dtype=args.dtype, device=args.device, enforce_eager=args.eager,
                        overlap_schedule=False if args.no_overlap else None, enable_prefix_caching=False,
                        prefill_graph_tokens=args.prefill_graph_tokens, **fields)


def build_engine(args, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 preloaded: tuple[torch.nn.Module, object] | None = None) -> Engine:
    """`preloaded` (model, ModelConfig) wins over args.random_weights; args.model is used otherwise."""
    limits = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    if args.random_weights:
        if preloaded is None:
            preloaded = random_model(args.random_weights, torch.device(args.device))
        stub = write_stub_checkpoint(args.random_weights, Path(tempfile.mkdtemp(prefix="outrider-bench-")),
                                     full_vocab=getattr(args, "json_schema", None) is not None)
        return builder.build_engine(engine_config(args, str(stub), **limits), preloaded=preloaded)
    return builder.build_engine(engine_config(args, args.model, **limits), preloaded=preloaded)
