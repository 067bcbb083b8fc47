"""`bench throughput`: the nano-vllm workload (N requests, input and output lengths uniform in [lo, hi])."""

from __future__ import annotations

import random
import time

from outrider.bench.engine_setup import build_engine
from outrider.bench.latency import run_batch
from outrider.bench.report import Reporter
from outrider.bench.shapes import config_weight_bytes, kv_bytes_per_token
from outrider.engine.request import Request
from outrider.params import SamplingParams


def run(args, reporter: Reporter) -> None:
    engine = build_engine(args, max_num_seqs=args.max_num_seqs, max_model_len=2 * args.max_len + 16,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    cfg = engine.model_config
    name = (args.random_weights or args.model) + ("" if engine.overlap else " (no overlap)")
    rng = random.Random(args.seed)
    lens = [(rng.randint(args.min_len, args.max_len), rng.randint(args.min_len, args.max_len))
            for _ in range(args.num_requests)]
    run_batch(engine, [[rng.randrange(cfg.vocab_size) for _ in range(16)]], 8)  # warm-up

    steps0 = engine.counters["steps"]
    produced = [0]
    t0 = time.perf_counter()
    for n_in, n_out in lens:
        ids = [rng.randrange(cfg.vocab_size) for _ in range(n_in)]
        params = SamplingParams(max_tokens=n_out, temperature=0.6, ignore_eos=True)
        engine.add_request(Request(ids, params), lambda out: produced.__setitem__(0, produced[0] + len(out.new_token_ids)))
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - t0
    steps = engine.counters["steps"] - steps0
    # Bytes: every step streams the weights; every generated token reads its sequence's KV so far.
    kv_reads = sum(n_out * n_in + n_out * (n_out - 1) / 2 for n_in, n_out in lens) * kv_bytes_per_token(cfg, engine.dtype)
    moved = steps * config_weight_bytes(cfg, engine.dtype.itemsize) + kv_reads
    reporter.line(f"throughput {name} n={args.num_requests} len=[{args.min_len},{args.max_len}]",
                  f"{produced[0] / elapsed:.0f} output tok/s ({produced[0]} tokens in {elapsed:.2f} s, {steps} steps)",
                  moved, elapsed, tok_s=produced[0] / elapsed, steps=steps)
