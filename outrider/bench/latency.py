"""`bench latency`: batch-B decode speed and TTFT at given prompt/output lengths, engine level."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from outrider.bench.engine_setup import build_engine
from outrider.bench.profile import CollectWaits
from outrider.bench.report import Reporter
from outrider.bench.shapes import config_weight_bytes, kv_bytes_per_token, state_bytes_per_sequence
from outrider.engine.request import Request
from outrider.params import SamplingParams


@dataclass(frozen=True)
class BatchRun:
    ttft_s: float  # until the batch's last request had its first token
    tok_s: float  # decode tokens per second per sequence, after the first token
    steps: int
    blocked_s: float  # the host's time blocked on the GPU's tokens (runner.collect): ~0 when the host sets the pace

    @property
    def blocked_ms_per_step(self) -> float:
        return 1e3 * self.blocked_s / max(self.steps, 1)


def run_batch(engine, prompts: list[list[int]], gen: int, grammar=None) -> BatchRun:
    """Run the prompts together to `gen` tokens each (fewer if `grammar` completes first)."""
    stamps: dict[int, list[float]] = {}
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, grammar=grammar)
    requests = [Request(list(ids), params) for ids in prompts]
    waits = CollectWaits(engine)
    steps0 = engine.counters["steps"]
    with waits.active():
        t0 = time.perf_counter()
        for req in requests:
            stamps[req.request_id] = []
            engine.add_request(req, lambda out, s=stamps[req.request_id]: s.append(time.perf_counter()))
        while engine.has_work():
            engine.step()
    firsts = [s[0] for s in stamps.values()]
    lasts = [s[-1] for s in stamps.values()]
    after_first = sum(len(r.output_ids) - 1 for r in requests) / len(requests)
    span = max(lasts) - max(firsts)
    return BatchRun(ttft_s=max(firsts) - t0, tok_s=after_first / span if span > 0 else 0.0,
                    steps=engine.counters["steps"] - steps0, blocked_s=waits.seconds)


def schema_rate(engine, args, reporter: Reporter, prompts, free: BatchRun, name: str, step_bytes: float) -> None:
    """The same batch constrained by --json-schema, against the unconstrained rate measured in this process. With
    overlap scheduling constrained steps overlap too: each forward is launched before the step in flight is
    committed, and the masks are computed on the host while it runs."""
    grammar = engine.grammars.json_schema(json.loads(Path(args.json_schema).read_text()))
    run_batch(engine, prompts(), 8, grammar)  # warm-up
    constrained = run_batch(engine, prompts(), args.gen, grammar)
    rate, free_rate = constrained.tok_s, free.tok_s
    reporter.line(f"json-schema {name} bs={args.batch}",
                  f"{rate:.1f} tok/s/seq constrained vs {free_rate:.1f} unconstrained "
                  f"({100 * (1 - rate / free_rate):+.1f}% slower); host blocked on the GPU "
                  f"{constrained.blocked_ms_per_step:.2f} vs {free.blocked_ms_per_step:.2f} ms/step",
                  step_bytes * rate, 1.0, tok_s=rate, free_tok_s=free_rate,
                  blocked_ms_per_step=constrained.blocked_ms_per_step,
                  free_blocked_ms_per_step=free.blocked_ms_per_step)


def run(args, reporter: Reporter) -> None:
    # HF first, in processes of its own, while this one holds no GPU memory yet.
    hf_rows = _compare_hf(args) if args.compare == "hf" else []
    max_len = max(args.prompt_len + args.gen, args.ttft_prompt_len + 2) + 16
    engine = build_engine(args, max_num_seqs=args.batch, max_model_len=max_len,
                          max_num_batched_tokens=max(2048, args.batch * args.prompt_len, args.ttft_prompt_len))
    cfg = engine.model_config
    name = (args.random_weights or args.model) + ("" if engine.overlap else " (no overlap)")
    rng = random.Random(args.seed)
    prompt = lambda n: [rng.randrange(cfg.vocab_size) for _ in range(n)]  # noqa: E731
    # A step's bytes: the weights it reads (a MoE's active ones: bench/shapes.py), each sequence's linear-attention
    # state (read and written) and KV so far. Their time at --peak-bw is the bandwidth bound the % below is of.
    w_bytes = config_weight_bytes(cfg, engine.dtype.itemsize, args.batch)
    state_seq = state_bytes_per_sequence(cfg)
    kv_tok = kv_bytes_per_token(cfg, engine.dtype)

    # Warm-up at the measured shapes, so Triton's compiles (prefill and decode variants) stay out of TTFT.
    run_batch(engine, [prompt(args.prompt_len) for _ in range(args.batch)], 8)
    free = run_batch(engine, [prompt(args.prompt_len) for _ in range(args.batch)], args.gen)
    rate = free.tok_s
    step_bytes = w_bytes + args.batch * (state_seq + (args.prompt_len + args.gen / 2) * kv_tok)
    bound = f", bound {1e3 * step_bytes / reporter.peak_bw:.2f} ms/step" if reporter.peak_bw else ""
    reporter.line(f"latency {name} bs={args.batch} in={args.prompt_len} out={args.gen}",
                  f"{rate:.1f} tok/s/seq ({1e3 / rate:.2f} ms/step, {rate * args.batch:.0f} tok/s total), "
                  f"TTFT {free.ttft_s * 1e3:.1f} ms; host blocked on the GPU {free.blocked_ms_per_step:.2f} ms/step; "
                  f"step reads {w_bytes / 1e9:.2f} GB of weights{' (active)' if _is_moe(cfg) else ''} + "
                  f"{(step_bytes - w_bytes) / 1e9:.3f} GB of state and KV{bound}",
                  step_bytes * rate, 1.0, tok_s=rate, ttft_s=free.ttft_s, blocked_ms_per_step=free.blocked_ms_per_step,
                  weight_bytes=w_bytes, step_bytes=step_bytes)
    if args.profile:
        from outrider.bench.profile import GRAPH_FORWARD, profiled

        steps0 = engine.counters["steps"]
        with profiled(engine) as timer:
            run_batch(engine, [prompt(args.prompt_len) for _ in range(args.batch)], args.gen)
        n = engine.counters["steps"] - steps0
        parts = ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in timer.total.items())
        fwd = timer.total.get(GRAPH_FORWARD, 0.0) / n
        reporter.line(f"profile {name} bs={args.batch}", f"ms/step over {n} steps: {parts}",
                      step_bytes, fwd, **{k: v / n for k, v in timer.total.items()})
    if args.json_schema:
        schema_rate(engine, args, reporter, lambda: [prompt(args.prompt_len) for _ in range(args.batch)], free,
                    name, step_bytes)
    if args.ttft_prompt_len:
        # Two tokens: the first is delivered while the second step is already scheduled (overlap), as in serving.
        ttfts = [run_batch(engine, [prompt(args.ttft_prompt_len)], 2).ttft_s for _ in range(3)]
        best = min(ttfts)
        per_token = config_weight_bytes(cfg, engine.dtype.itemsize)  # (a MoE's active weights: top-k experts)
        layer_params = (per_token - engine.dtype.itemsize * cfg.vocab_size * cfg.hidden_size) / engine.dtype.itemsize
        flops = 2 * layer_params * args.ttft_prompt_len
        reporter.line(f"ttft {name} in={args.ttft_prompt_len}",
                      f"{best * 1e3:.1f} ms (best of 3, max_tokens 2; {flops / best / 1e12:.0f} TFLOP/s over the "
                      f"weights)", w_bytes, best, ttft_s=best)
    hf_bytes = w_bytes + args.batch * (args.prompt_len + args.gen / 2) * kv_tok
    for r in hf_rows:
        label = f"hf-transformers {r.config} {name} bs={r.batch} in={args.prompt_len} out={args.gen}"
        if r.tok_s is None:
            reporter.note(label, f"failed: {r.detail}", config=r.config, batch=r.batch, error=r.detail, pid=r.pid)
            continue
        ours = rate * args.batch
        reporter.line(label, f"{r.tok_s:.1f} tok/s total ({1e3 * r.batch / r.tok_s:.2f} ms/step), TTFT "
                      f"{r.ttft_s * 1e3:.1f} ms ({r.detail}; own process); outrider/hf = {ours / r.tok_s:.2f}x",
                      hf_bytes * r.tok_s / r.batch, 1.0, config=r.config, batch=r.batch, tok_s=r.tok_s,
                      ttft_s=r.ttft_s, ratio=ours / r.tok_s, pid=r.pid)


def _is_moe(cfg) -> bool:
    return bool(cfg.raw.get("num_experts"))


def _compare_hf(args) -> list:
    from outrider.bench.hf import compare

    source = ["--model", args.model] if args.model else ["--random-weights", args.random_weights]
    return compare(source, args.hf_configs, args.device, args.batch, args.prompt_len, args.gen, args.seed,
                   args.hf_timeout)
