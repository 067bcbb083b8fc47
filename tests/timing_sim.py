"""A simulated device for timing tests: each step takes a chosen time on an injected clock.

The engine reads `SimulatedDevice` as its clock (`LLM(..., clock=sim)`). `install` wraps the runner: launching a
step costs the host `host_s` before its first kernel is enqueued (scheduling, batch building, upload), and
`launch_s` more when it prefills (enqueueing a long prompt's kernels is host work, while the device runs them);
the device runs steps back to back in launch order (a prefill step lasts `prefill_s`, one that verifies drafts
`verify_s`, any other `round_s`); sampling a step whose rows include a constrained request costs the host `mask_s`
first (the masks), and the device cannot finish the step before that sampling is enqueued; collecting a step waits
until the device has finished it. The real computation still happens (instantly, as far as the
clock knows), so tokens and stops are real. Every step's device interval is recorded, which gives each request's
true phase times to check `timings` against."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimStep:
    launched: float  # host clock when the engine began launching it
    begin: float  # device started it
    end: float  # device finished it
    prefill: bool
    requests: list  # the engine Requests scheduled in it
    admitted: list  # those admitted by this step (first admission or a resume)
    sampled: list  # those whose token this step samples


@dataclass
class SimulatedDevice:
    prefill_s: float
    round_s: float
    launch_s: float = 0.0
    host_s: float = 0.0
    mask_s: float = 0.0
    verify_s: float | None = None  # a decode step that verifies drafts (None: round_s)
    t: float = 100.0  # the host clock
    free_at: float = 0.0  # the device is busy until then
    steps: list[SimStep] = field(default_factory=list)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        """Host work of that length (e.g. a slow drafter)."""
        self.t += seconds

    def install(self, engine) -> SimulatedDevice:
        runner = engine.runner
        launch, sample, collect = runner.launch, runner.sample, runner.collect
        by_step: dict[int, SimStep] = {}

        def timed_launch(plan, *args, **kwargs):
            launched = self.t
            step = launch(plan, *args, **kwargs)
            prefill = plan.has_prefill
            self.t += self.host_s
            begin = max(self.free_at, self.t)  # its first kernel is enqueued once the batch is built
            self.t += self.launch_s if prefill else 0.0
            verifies = any(s.draft_tokens for s in plan.scheduled) and self.verify_s is not None
            self.free_at = begin + (self.prefill_s if prefill else self.verify_s if verifies else self.round_s)
            sim = SimStep(launched, begin, self.free_at, prefill, [s.request for s in plan.scheduled],
                          list(plan.admitted), [s.request for s in plan.scheduled if s.samples])
            self.steps.append(sim)
            by_step[id(step)] = sim
            return step

        def timed_sample(step, *args, **kwargs):
            sample(step, *args, **kwargs)
            sim = by_step[id(step)]
            if any(r.constraint is not None for r in sim.sampled):
                self.t += self.mask_s
                sim.end = self.free_at = max(sim.end, self.t)  # its sampling kernels follow the masks' upload

        def timed_collect(step):
            out = collect(step)
            self.t = max(self.t, by_step.pop(id(step)).end)
            return out

        runner.launch, runner.sample, runner.collect = timed_launch, timed_sample, timed_collect
        return self

    def steps_of(self, req) -> list[SimStep]:
        return [s for s in self.steps if any(r is req for r in s.requests)]
