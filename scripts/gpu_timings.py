"""Timings and speculation on the device, at engine level (no HTTP): what docs/benchmarks.md reports for the
timing rule and the speculative policy. Prints one line per measurement.

  prompt   a 1,024-token prompt arrives while another request decodes (overlap on): its prompt_ms against the
           time from the step that scheduled it to its first token handed over, and TTFT of a lone prompt
           with overlap on and off (max_tokens=2).
  spec     the demo family, greedy, 128 tokens per request, batch 1 and 8: plain against each drafter kind with
           the measured-cost policy, and one forced round split into propose / verify / learn.

Usage: python scripts/gpu_timings.py prompt|spec [--shapes qwen3-0.6b qwen3-8b]"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from outrider.bench.profile import admission_times, lone_first_token_s
from outrider.bench.shapes import random_model, write_stub_checkpoint
from outrider.config import EngineConfig
from outrider.demo import demo_path
from outrider.engine.builder import build_engine
from outrider.engine.engine import Engine
from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.timing import now


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def shape_engine(shape: str, overlap: bool | None, model=None) -> Engine:
    stub = write_stub_checkpoint(shape, Path(tempfile.mkdtemp(prefix="outrider-timings-")))
    config = EngineConfig(model=str(stub), max_num_seqs=4, max_model_len=4096, overlap_schedule=overlap,
                          enable_prefix_caching=False, gpu_memory_utilization=0.5)
    return build_engine(config, preloaded=model)


def prompt_case(engine: Engine, vocab: int) -> tuple[float, float]:
    """(prompt_ms, ms from the launch that scheduled the prompt to its first token handed over)."""
    with admission_times(engine) as scheduled:
        a = Request([7 + i for i in range(32)], greedy(400))
        engine.add_request(a, lambda out: None)
        for _ in range(20):
            engine.step()
        b = Request([11 + i % (vocab - 11) for i in range(1024)], greedy(4))
        first: list[float] = []
        engine.add_request(b, lambda out: first.append(now()) if out.new_token_ids and not first else None)
        while not first:
            engine.step()
        engine.abort(a.request_id)
        while engine.has_work():
            engine.step()
    return b.timing.prompt_ms, (first[0] - scheduled[b.request_id]) * 1e3


def lone_ttft(engine: Engine, vocab: int) -> float:
    return lone_first_token_s(engine, [13 + i % (vocab - 13) for i in range(1024)]) * 1e3


def run_prompt(shapes: list[str]) -> None:
    for shape in shapes:
        model = random_model(shape, torch.device("cuda"))
        for overlap in (True, False):
            engine = shape_engine(shape, overlap, model)
            vocab = engine.model_config.vocab_size
            cases = [prompt_case(engine, vocab) for _ in range(5)]
            ttft = [lone_ttft(engine, vocab) for _ in range(5)]
            for prompt_ms, client_ms in cases:
                ok = abs(prompt_ms - client_ms) <= max(0.05 * client_ms, 2.0)
                print(f"prompt {shape} overlap={overlap} prompt_ms={prompt_ms:.2f} scheduled_to_first_token_ms="
                      f"{client_ms:.2f} within={ok}")
            print(f"ttft {shape} overlap={overlap} lone 1024-token prompt, max_tokens=2: median "
                  f"{statistics.median(ttft):.2f} ms (all {[round(x, 2) for x in ttft]})")
            del engine
            torch.cuda.empty_cache()


def demo_engine(kind: str | None, max_num_seqs: int, measured: bool | None = None) -> Engine:
    kwargs = {}
    if kind == "mtp":
        kwargs = dict(spec_type="mtp")
    elif kind in ("draft", "dflash"):
        kwargs = dict(draft_model=str(demo_path(kind)))
    else:
        kwargs = dict(spec_type="none")
    return build_engine(EngineConfig(model=str(demo_path("target")), max_num_seqs=max_num_seqs, max_model_len=2048,
                               gpu_memory_utilization=0.3, spec_measured_costs=measured, **kwargs))


def tok_per_s(engine: Engine, batch: int, tokens: int = 128) -> tuple[float, float]:
    """(output tok/s over a batch of greedy requests, tokens per round)."""
    prompts = [[0] + [40 + (17 * i + 3 * j) % 3000 for j in range(24)] for i in range(batch)]
    reqs = [Request(p, greedy(tokens)) for p in prompts]
    torch.cuda.synchronize()
    t0 = now()
    for r in reqs:
        engine.add_request(r, lambda out: None)
    while engine.has_work():
        engine.step()
    torch.cuda.synchronize()
    seconds = now() - t0
    rounds = sum(r.timing.draft_rounds for r in reqs)
    tau = sum(r.timing.draft_n_accepted + r.timing.draft_rounds for r in reqs) / rounds if rounds else 0.0
    return batch * tokens / seconds, tau


def round_split(engine: Engine) -> str:
    """Host-timed phases of forced speculative rounds at batch 1 (CUDA synchronised around each)."""
    phases: dict[str, list[float]] = {"propose": [], "forward": [], "verify": [], "collect": [], "commit+learn": []}
    spec, runner = engine.speculation.speculator, engine.runner

    def timed(name, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t0 = now()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            phases[name].append((now() - t0) * 1e3)
            return out
        return wrapper

    propose, launch, sample, collect = spec.propose, runner.launch, runner.sample, runner.collect
    spec.propose, runner.launch, runner.sample, runner.collect, engine.deliver = (
        timed("propose", propose), timed("forward", launch), timed("verify", sample), timed("collect", collect),
        timed("commit+learn", engine.deliver))
    step_ms = []
    req = Request([0] + [50 + j for j in range(24)], greedy(96))
    engine.add_request(req, lambda out: None)
    while engine.has_work():
        torch.cuda.synchronize()
        t0 = now()
        engine.step()
        torch.cuda.synchronize()
        step_ms.append((now() - t0) * 1e3)
    spec.propose, runner.launch, runner.sample, runner.collect = propose, launch, sample, collect
    del engine.deliver
    med = {k: statistics.median(v[2:]) if len(v) > 2 else float("nan") for k, v in phases.items()}
    return (f"step {statistics.median(step_ms[2:]):.3f} ms; " + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
            + f"; tau {(req.timing.draft_n_accepted + req.timing.draft_rounds) / max(req.timing.draft_rounds, 1):.2f}")


def run_spec() -> None:
    for batch in (1, 8):
        plain = tok_per_s(demo_engine(None, 8), batch)[0]
        print(f"spec demo batch={batch} plain {plain:.0f} tok/s")
        for kind in ("draft", "mtp", "dflash"):
            engine = demo_engine(kind, 8)
            speed, tau = tok_per_s(engine, batch)
            speed, tau = tok_per_s(engine, batch)  # the second run: costs measured while serving the first
            print(f"spec demo batch={batch} {kind}: {speed:.0f} tok/s ({speed / plain:.2f}x plain), tau {tau:.2f}")
    for kind in ("draft", "mtp", "dflash"):
        print(f"round demo {kind} forced (fixed-cost policy): {round_split(demo_engine(kind, 8, measured=False))}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["prompt", "spec"])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    args = ap.parse_args()
    run_prompt(args.shapes) if args.what == "prompt" else run_spec()
    sys.stdout.flush()
