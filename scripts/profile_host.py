"""Where an engine step's host time goes: cProfile over decode steps of a real checkpoint, with and without a
drafter, the draft policy live (as served). On a launch-bound target (the demo family on a GPU) the host is the
step's critical path, so what a loaded drafter adds here is what it costs, drafting or not.

    python scripts/profile_host.py --model outrider/demo/target --batch 8 [--draft-model outrider/demo/dflash |
        --spec-type mtp|ngram [--ngram-min-hits 100000]] [--k K] [--tokens 128] [--top 30] [--calls]

(`--ngram-min-hits 100000`: n-gram lookup that never drafts, what a loaded drafter costs when it finds nothing.)

Prints, for the plain engine and then the speculative one: ms per step over a timed pass, the policy's rounds,
then the profiled pass's functions by own time and by cumulative time (outrider's and the libraries' alike). With
--calls, instead of cProfile (whose overhead distorts a 0.5 ms step), the pass times only the Speculator's and the
runner's calls with a wall clock: ms a step in each (a call made inside another counts in both). With --syncs (CUDA),
the pass runs under torch's sync debug mode instead: every implicit host-device synchronisation (`.item()`,
`.tolist()`, a blocking copy) is counted by the outrider lines on the stack. With overlap scheduling one such wait a
step costs the host the step in flight: where a step that drafts nothing costs more than a plain one, look here.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time
import traceback
import warnings
from pathlib import Path

import torch

import outrider

from outrider.bench.profile import PhaseTimer, patched
from outrider.config import EngineConfig, NgramConfig
from outrider.engine.builder import build_engine
from outrider.engine.engine import Engine
from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.tokenizer import Tokenizer


def run(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, int, int]:
    """One wave of greedy requests to completion: (seconds, engine steps, drafted request rounds)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rounds = 0

    def count(out) -> None:
        nonlocal rounds
        if out.finished:
            rounds += out.timing.draft_rounds

    steps0, t0 = engine.counters["steps"], time.perf_counter()
    for ids in prompts:
        engine.add_request(Request(list(ids), params), count)
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0, engine.counters["steps"] - steps0, rounds


def profile(name: str, engine: Engine, prompts: list[list[int]], args) -> None:
    run(engine, prompts, args.tokens)  # warm: the policy measures this batch size
    seconds, steps, rounds = run(engine, prompts, args.tokens)
    print(f"== {name}: {1e3 * seconds / steps:.3f} ms/step over {steps} steps, {rounds} request rounds", flush=True)
    if args.calls:
        timed_calls(engine, prompts, args)
        return
    if args.syncs:
        synchronisations(engine, prompts, args)
        return
    prof = cProfile.Profile()
    prof.enable()
    run(engine, prompts, args.tokens)
    prof.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(args.top)
        print("ncalls" + text.getvalue().split("ncalls", 1)[-1].rstrip(), flush=True)


def timed_calls(engine: Engine, prompts: list[list[int]], args) -> None:
    timer = PhaseTimer(engine.device, synchronise=False)
    targets = [(engine.runner, name, timer.timed(f"runner.{name}")) for name in ("launch", "sample", "collect")]
    if engine.speculation is not None:
        targets += [(engine.speculation.speculator, name, timer.timed(f"speculator.{name}"))
                    for name in ("draft_lengths", "propose", "keep", "learn", "flush", "observe_step")]
    with patched(*targets):
        _, steps, _ = run(engine, prompts, args.tokens)
    for label, seconds in sorted(timer.total.items()):
        print(f"   {label:26s} {1e3 * seconds / steps:.3f} ms/step", flush=True)


def synchronisations(engine: Engine, prompts: list[list[int]], args) -> None:
    """Implicit synchronisations of one pass, per step, by where they happen (the innermost outrider frames)."""
    package = str(Path(outrider.__file__).parent)
    seen: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(package)][-3:]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
        seen[where or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _, steps, _ = run(engine, prompts, args.tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"   {sum(seen.values()) / steps:.2f} implicit synchronisations a step", flush=True)
    for where, n in seen.most_common(args.top):
        print(f"   {n / steps:6.2f}/step  {where}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--spec-type")
    ap.add_argument("--ngram-min-hits", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--k", type=int, help="draft this many tokens per request every decode step (the policy's "
                    "choice replaced): what a round costs, whether or not the policy would draft")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calls", action="store_true", help="time the Speculator's and runner's calls, no cProfile")
    ap.add_argument("--syncs", action="store_true", help="count implicit host-device synchronisations (CUDA)")
    args = ap.parse_args()
    if args.syncs and not torch.cuda.is_available():
        ap.error("--syncs counts CUDA synchronisations: it needs a GPU")
    tok = Tokenizer.from_pretrained(args.model)
    prompts = [tok.encode(f"def function_{i}(x):") for i in range(args.batch)]
    limits = dict(max_num_seqs=args.batch, max_model_len=1024, device=args.device)
    profile("plain", build_engine(EngineConfig(args.model, spec_type="none", **limits)), prompts, args)
    spec = build_engine(EngineConfig(args.model, draft_model=args.draft_model, spec_type=args.spec_type,
                               spec_ngram=NgramConfig(size_n=3, min_hits=args.ngram_min_hits), **limits))
    if args.k is not None:
        spec.speculation.policy.draft_lengths = lambda requests, drafter, in_flight=None, explore=True: [args.k] * len(
            requests)
    profile(f"speculative ({spec.drafter_kind})", spec, prompts, args)


if __name__ == "__main__":
    main()
