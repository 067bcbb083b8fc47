"""Where a step's time goes: wraps the engine's phases with synchronising timers (bench-only instrumentation).

Synchronising around each phase serialises host and GPU, so the phases add up to more than an unprofiled
step; what it shows is each phase's own cost.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

GRAPH_FORWARD = "forward + logits (graph)"  # a decode graph's replay: it computes the logits too


class PhaseTimer:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            self.total[label] += time.perf_counter() - t0
            return out

        setattr(obj, attr, timed)


@contextmanager
def profiled(engine):
    """Instrument one engine's phases for the duration of the block; yields the PhaseTimer."""
    timer = PhaseTimer()
    runner = engine.runner
    targets = [(engine, "step", "step (all)"), (engine.scheduler, "schedule", "schedule"),
               (runner, "prepare", "prepare inputs"), (runner.model, "compute_logits", "logits (eager steps)"),
               (runner.sampler, "prepare", "sampler prepare"), (runner.sampler, "sample", "sample")]
    targets += [(graphs, "run", GRAPH_FORWARD if graphs.q == 1 else "verify forward (graph)") for graphs in runner.graphs]
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in targets]
    for obj, attr, label in targets:
        timer.wrap(obj, attr, label)
    try:
        yield timer
    finally:
        for obj, attr, old in saved:
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
