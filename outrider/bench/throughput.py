"""`bench throughput`: the nano-vllm workload (N requests, input and output lengths uniform in [lo, hi])."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from outrider.bench.engine_setup import build_engine
from outrider.bench.latency import run_batch
from outrider.bench.profile import CollectWaits, patched
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

    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n_in)] for n_in, _ in lens]  # the client's work
    log = StepLog(engine)
    produced, elapsed, steps = _workload(engine, prompts, lens, log)
    # Bytes: every step streams the weights; every generated token reads its sequence's KV so far.
    kv_reads = sum(n_out * n_in + n_out * (n_out - 1) / 2 for n_in, n_out in lens) * kv_bytes_per_token(cfg, engine.dtype)
    # (a MoE's experts read per step grow with the tokens a step decodes: the mean batch stands in for each step's)
    moved = steps * config_weight_bytes(cfg, engine.dtype.itemsize, max(1, round(produced / steps))) + kv_reads
    reporter.line(f"throughput {name} n={args.num_requests} len=[{args.min_len},{args.max_len}]",
                  f"{produced / elapsed:.0f} output tok/s ({produced} tokens in {elapsed:.2f} s, {steps} steps)",
                  moved, elapsed, tok_s=produced / elapsed, steps=steps)
    print(log.summary(), flush=True)
    if args.json_schema:  # the same workload, constrained (each request ends when the schema is complete)
        grammar = engine.grammars.json_schema(json.loads(Path(args.json_schema).read_text()))
        done, seconds, _ = _workload(engine, prompts, lens, StepLog(engine), grammar)
        reporter.line(f"json-schema {name} n={args.num_requests}",
                      f"{done / seconds:.0f} output tok/s constrained vs {produced / elapsed:.0f} unconstrained "
                      f"({done} tokens in {seconds:.2f} s)", 0, 1.0, tok_s=done / seconds,
                      free_tok_s=produced / elapsed)


def _workload(engine, prompts: list[list[int]], lens: list[tuple[int, int]], log: StepLog,
              grammar=None) -> tuple[int, float, int]:
    """Run every request at once -> (output tokens, seconds, steps)."""
    steps0 = engine.counters["steps"]
    produced = [0]
    with log.instrumented():
        t0 = time.perf_counter()
        for ids, (_, n_out) in zip(prompts, lens):
            params = SamplingParams(max_tokens=n_out, temperature=0.6, ignore_eos=True, grammar=grammar)
            engine.add_request(Request(ids, params),
                               lambda out: produced.__setitem__(0, produced[0] + len(out.new_token_ids)))
        while engine.has_work():
            log.step()
        elapsed = time.perf_counter() - t0
    return produced[0], elapsed, engine.counters["steps"] - steps0


class StepLog:
    """Wall time of each engine.step call, by what the step it launched carried: prompt tokens (prefill), or
    only decodes (by batch size). With overlap scheduling a call's time is mostly the previous step's GPU work,
    so the split is approximate by one step; it adds no synchronisation."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rows: list[tuple[float, int, int]] = []  # (seconds, prompt tokens fed, sequences)
        self.waits = CollectWaits(engine)
        self._plan = None

    def instrumented(self):
        """While active, the scheduler's plans are kept for step() and runner.collect's waits are timed."""
        def keep_plan(schedule):
            def logged(*args, **kwargs):
                self._plan = schedule(*args, **kwargs)
                return self._plan
            return logged

        return patched((self.engine.scheduler, "schedule", keep_plan),
                       (self.engine.runner, "collect", self.waits.wrap))

    def step(self) -> None:
        self._plan = None
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        plan = self._plan
        if plan is not None and plan.scheduled:
            prompt = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1 or not s.samples)
            self.rows.append((dt, prompt, len(plan.scheduled)))

    def summary(self) -> str:
        prefill = [r for r in self.rows if r[1]]
        parts = [f"steps with prompt tokens: {len(prefill)} ({sum(r[1] for r in prefill)} tokens) in "
                 f"{sum(r[0] for r in prefill):.2f} s"]
        decode = [r for r in self.rows if not r[1]]
        for lo, hi in ((1, 64), (65, 128), (129, 192), (193, 1 << 30)):
            rows = [r for r in decode if lo <= r[2] <= hi]
            if rows:
                t = sum(r[0] for r in rows)
                parts.append(f"decode bs {lo}-{min(hi, max(r[2] for r in rows))}: {len(rows)} steps in {t:.2f} s "
                             f"({1e3 * t / len(rows):.2f} ms/step)")
        total = sum(r[0] for r in self.rows)
        parts.append(f"host blocked on the GPU's tokens {self.waits.seconds:.2f} s of {total:.2f}")
        return "throughput steps: " + "; ".join(parts)
