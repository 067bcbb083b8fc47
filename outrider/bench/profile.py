"""Where a step's time goes: wraps the engine's phases with synchronising timers (bench-only instrumentation).

Synchronising around each phase serialises host and GPU, so the phases add up to more than an unprofiled
step; what it shows is each phase's own cost.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from outrider.timing import now

GRAPH_FORWARD = "forward + logits (graph)"  # a decode graph's replay: it computes the logits too
_UNSET = object()


@contextmanager
def patched(*targets):
    """For the duration of the block, obj.attr is wrap(obj.attr) for each (obj, attr, wrap); then the originals
    come back (an attribute the instance did not hold itself, e.g. a method, is deleted again)."""
    saved = [(obj, attr, obj.__dict__.get(attr, _UNSET)) for obj, attr, _ in targets]
    for obj, attr, wrap in targets:
        setattr(obj, attr, wrap(getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is _UNSET:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


class CollectWaits:
    """Seconds the host spent blocked in runner.collect, waiting for the GPU's tokens, while `active()`. Near zero
    per step means the host, not the GPU, sets the pace (with overlap scheduling the GPU then waits for the host
    between steps). Adds no synchronisation."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seconds = 0.0

    def active(self):
        return patched((self.engine.runner, "collect", self.wrap))

    def wrap(self, collect):
        """runner.collect, timed (for `patched`, beside other wrappers)."""

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return collect(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


@contextmanager
def admission_times(engine):
    """For the duration of the block, a dict request id -> the time (timing.now) the scheduler first admitted the
    request: where a client-side "scheduled to first token" measurement starts."""
    times: dict[int, float] = {}

    def watch(schedule):
        def scheduled(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            for req in plan.admitted:
                times.setdefault(req.request_id, now())
            return plan
        return scheduled

    with patched((engine.scheduler, "schedule", watch)):
        yield times



def lone_first_token_s(engine, prompt: list[int], max_tokens: int = 2) -> float:
    """Seconds from adding a greedy request alone to its first token reaching the callback, run to completion.
    With max_tokens >= 2 the next step is already launched when the first token is handed over (overlap)."""
    from outrider.engine.request import Request
    from outrider.params import SamplingParams

    req = Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0, first = now(), []
    engine.add_request(req, lambda out: first.append(now()) if out.new_token_ids and not first else None)
    while engine.has_work():
        engine.step()
    return first[0] - t0

class PhaseTimer:
    """Seconds per label, summed over the calls of the functions wrapped by timed(label) (on a CUDA device,
    synchronised before and after each call unless `synchronise` is off: then the host's own time in them)."""

    def __init__(self, device: torch.device, synchronise: bool = True) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.sync = torch.cuda.synchronize if device.type == "cuda" and synchronise else (lambda: None)

    def timed(self, label: str):
        def wrap(fn):
            def timed_call(*args, **kwargs):
                self.sync()
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                self.sync()
                self.total[label] += time.perf_counter() - t0
                return out

            return timed_call

        return wrap


@contextmanager
def profiled(engine):
    """Instrument one engine's phases for the duration of the block; yields the PhaseTimer."""
    timer = PhaseTimer(engine.device)
    runner = engine.runner
    phases = [(engine, "step", "step (all)"), (engine.scheduler, "schedule", "schedule"),
              (runner, "prepare", "prepare inputs"), (runner.model, "compute_logits", "logits (eager steps)"),
              (runner.sampler, "prepare", "sampler prepare"), (runner.sampler, "sample", "sample")]
    phases += [(graphs, "run", GRAPH_FORWARD if graphs.q == 1 else "verify forward (graph)") for graphs in runner.graphs]
    with patched(*((obj, attr, timer.timed(label)) for obj, attr, label in phases)):
        yield timer
