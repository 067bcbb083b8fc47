"""Host time per engine step on CPU, with the model stubbed out (no GPU needed).

The forward returns zeros and the LM head returns rows of a fixed random bank over a small vocabulary, so what
is left in a step is the engine's own Python: schedule, batch preparation, sampler preparation, the (cheap) CPU
sampling and commit. Times are CPU time of the engine thread (robust to other processes on the machine).
Prints ms/step per scenario with a phase breakdown (phases nest: `launch` holds prepare, stub model, row specs,
sampler prepare and sample; `gc` is Python's cyclic garbage collector, wherever it ran), and a checksum of
every output (tokens, text, finish reason): identical before and after a host-side change means the change
kept the behaviour.

    .venv/bin/python scripts/host_overhead.py [--only SCENARIO] [--repeat N] [--profile SCENARIO]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import pstats
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from outrider.config import EngineConfig
from outrider.engine.builder import build_engine
from outrider.engine.engine import Engine
from outrider.engine.request import Request
from outrider.models.output import ForwardResult
from outrider.params import SamplingParams
from outrider.testing.checkpoints import write_tiny_checkpoint

VOCAB = 500  # prompts draw ids below this (the tiny tokenizer's vocabulary is larger)


def stub_engine(ckpt: Path, prefix_caching: bool, max_num_seqs: int, max_model_len: int, bank_rows: int) -> Engine:
    engine = build_engine(EngineConfig(model=str(ckpt), device="cpu", max_num_seqs=max_num_seqs,
                                       max_model_len=max_model_len, max_num_batched_tokens=16384,
                                       enable_prefix_caching=prefix_caching,
                                       num_kv_blocks=max_num_seqs * -(-max_model_len // 16) + 1))
    hidden = engine.model_config.hidden_size
    bank = torch.randn(bank_rows, engine.model_config.vocab_size, generator=torch.Generator().manual_seed(0))
    engine.runner.forward_eager = lambda ids, pos, meta: ForwardResult(torch.zeros(ids.shape[0], hidden))

    def logits(h: torch.Tensor) -> torch.Tensor:  # rows of the bank in turn: cheap and deterministic
        start = engine.logits_offset % (bank.shape[0] - h.shape[0])
        engine.logits_offset += h.shape[0]
        return bank[start : start + h.shape[0]]

    engine.model.compute_logits = logits
    return engine


class Phases:
    """CPU time of this thread per wrapped method, and in the garbage collector."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._gc_start = 0.0

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            out = fn(*args, **kwargs)
            self.total[label] += time.thread_time() - t0
            return out

        setattr(obj, attr, timed)

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            self.total["gc"] += time.thread_time() - self._gc_start


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]], profile: bool) -> dict:
    phases = Phases()
    r = engine.runner
    for obj, attr, label in [(engine.scheduler, "schedule", "schedule"), (r, "launch", "launch"),
                             (r, "prepare", "prepare inputs"), (r, "forward_eager", "stub model"),
                             (engine.model, "compute_logits", "stub model"), (r, "row_specs", "row specs"),
                             (r.sampler, "prepare", "sampler prepare"), (r.sampler, "sample", "sample (cpu)"),
                             (engine, "_commit", "commit")]:
        phases.wrap(obj, attr, label)
    engine.logits_offset = 0  # the same logits every run: the digest compares runs
    # Outputs are hashed as they arrive, not kept: a growing heap would make the collector's full passes (paid
    # inside engine steps) depend on this harness.
    digests: dict[int, hashlib._Hash] = {}
    tokens = [0]

    def on_output(out) -> None:
        digests[out.request_id].update(repr((out.new_token_ids, out.text, out.finish_reason)).encode())
        tokens[0] += len(out.new_token_ids)

    for ids, params in requests:
        req = Request(ids, params)
        digests[req.request_id] = hashlib.sha256()
        engine.add_request(req, on_output)
    prof = cProfile.Profile() if profile else None
    steps0 = engine.counters["steps"]
    gc.collect()
    gc.callbacks.append(phases.on_gc)
    t0 = time.thread_time()
    if prof:
        prof.enable()
    while engine.has_work():
        engine.step()
    if prof:
        prof.disable()
    elapsed = time.thread_time() - t0
    gc.callbacks.remove(phases.on_gc)
    digest = hashlib.sha256(b"".join(digests[k].digest() for k in sorted(digests)))
    return dict(elapsed=elapsed, steps=engine.counters["steps"] - steps0, tokens=tokens[0],
                phases=dict(phases.total), digest=digest.hexdigest()[:16], prof=prof)


def scenarios() -> dict[str, tuple[int, list[tuple[list[int], SamplingParams]]]]:
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    return {
        # bench latency: bs=1, in=128, out=256, greedy
        "bs1": (1, [(prompt(128), greedy(256))]),
        # bench spec's demo rows at batch 8: 16 requests, in=128, out=128, greedy
        "bs8": (8, [(prompt(128), greedy(128)) for _ in range(16)]),
        # 256 sequences decoding at ~1k context, greedy
        "decode256": (256, [(prompt(1024), greedy(128)) for _ in range(256)]),
        # bench throughput: 256 requests, in/out U[100, 1024], temperature 0.6
        "throughput": (256, [(prompt(i), SamplingParams(max_tokens=o, temperature=0.6, ignore_eos=True, seed=k))
                             for k, (i, o) in enumerate(lens)]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="run only this scenario")
    ap.add_argument("--repeat", type=int, default=1, help="runs per scenario; the fastest is reported")
    ap.add_argument("--profile", help="cProfile this scenario and print the top functions")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--vocab", type=int, help="the model's vocabulary, e.g. 151936 as `bench --random-weights` "
                    "has (ids past the tiny tokenizer's decode to nothing there too); default: the tokenizer's")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ckpt = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", hidden_size=32, layers=1, vocab_size=args.vocab)
    engines: dict[int, Engine] = {}
    for name, (seqs, reqs) in scenarios().items():
        if args.only and name != args.only:
            continue
        if seqs not in engines:
            # (a smaller logits bank for a large vocabulary: it is vocab x rows float32)
            engines[seqs] = stub_engine(ckpt, not args.no_prefix_caching, seqs, 2 * 1024 + 16,
                                        8192 if not args.vocab else max(512, 2**28 // (4 * args.vocab)))
        engine = engines[seqs]
        runs = []
        for _ in range(args.repeat):
            engine.pool.reset_prefix_cache()
            runs.append(run(engine, reqs, profile=args.profile == name))
        res = min(runs, key=lambda r: r["elapsed"])
        steps = res["steps"]
        host = (res["elapsed"] - res["phases"]["stub model"]) / steps * 1e3
        parts = ", ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in res["phases"].items())
        print(f"{name}: host {host:.3f} ms/step (stub model excluded) over {steps} steps, {res['tokens']} tokens, "
              f"outputs digest {res['digest']}")
        print(f"  ms/step: {parts}")
        if res["prof"] is not None:
            pstats.Stats(res["prof"]).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
