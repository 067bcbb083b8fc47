"""DraftPolicy alone against a simulated device: what its choices of k earn, next to the best fixed k.

Rounds cost `base + per_draft * k` ms and a plain step `plain` ms; each draft is accepted with probability alpha until
the first miss. A round that wakes a sleeping drafter (DraftPolicy.lets_sleep held at an undrafted decision before
it) pays `wake` ms more, its catch-up, which the policy's measured costs leave out as the engine's do, and which is
told to the policy (observe_wake) as the engine tells it. Requests of
--tokens tokens run one after another at batch 1, each through the policy's own decisions and records, as the engine
drives it. Prints tokens per second relative to plain decoding, the undrafted decisions, and the best fixed k run
the same way (the ideal a policy that knew alpha would reach).

    python scripts/simulate_policy.py [--alpha 0.86 0.8 0.7 0.5 0] [--requests 24]
"""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.speculative.drafter import DraftPolicy

# name: (max draft, fixed ms of a round, ms per draft, the drafter's own step_cost estimate, ms of a plain step, ms of
# a catch-up), as `bench spec` measured them: the 8B shape's presets on an H200 (a catch-up there is a target forward
# over the rows slept through: not modelled), SmolLM2-135M's Q4_1 GGUF with its trained DFlash drafter on an H100
# (undrafted steps of 25-30 ms where a round woke the drafter, against 0.97 ms plain ones)
PRESETS = {
    "eagle3": (4, 7.3, 0.25, 0.05, 4.48, 0.0),
    "dflash": (15, 7.6, 0.06, 0.02, 4.48, 0.0),
    "smollm2-dflash": (7, 1.74, 0.026, 0.02, 0.965, 25.0),
}


def simulate(alpha: float, n_max: int, base: float, per_draft: float, step_cost: float, plain: float, wake: float,
             requests: int, tokens: int, seed: int, fixed_k: int | None = None,
             then: tuple[float, int] | None = None) -> tuple[float, int]:
    """(tokens per second over plain decoding's, undrafted decisions), with the policy's k or a fixed one (capped,
    as the policy caps it, by the tokens a request has left). then: (alpha, requests) of a second phase the same
    policy serves next, whose figures are returned instead (how fast it unlearns an acceptance)."""
    rng = random.Random(seed)
    policy = DraftPolicy(n_max=n_max, measured=True)
    drafter = SimpleNamespace(max_draft=n_max, step_cost=step_cost)

    def cost(k: int) -> float:
        return (plain if k == 0 else base + per_draft * k) / 1e3

    for k in range(n_max + 1):  # what warm-up calibration leaves: every length measured
        policy.observe_step(1, k, cost(k))
    for phase_alpha, count in [(alpha, requests), *([then] if then else [])]:
        seconds, made, undrafted = _serve(policy, drafter, cost, phase_alpha, count, tokens, wake, rng, fixed_k)
    return made / seconds * plain / 1e3, undrafted


def _serve(policy: DraftPolicy, drafter, cost, alpha: float, requests: int, tokens: int, wake: float,
           rng: random.Random, fixed_k: int | None) -> tuple[float, int, int]:
    """Requests one after another: (seconds, tokens made, undrafted decisions)."""
    seconds = made = undrafted = 0
    for _ in range(requests):
        req = Request([0], SamplingParams(max_tokens=tokens))
        req.limit_outputs(tokens + 1)
        asleep = False  # (alone, a request's prompt is learned: it starts awake)
        while len(req.output_ids) < tokens:
            if fixed_k is None:
                k = policy.draft_lengths([req], drafter)[0]
            else:
                k = min(fixed_k, tokens - len(req.output_ids) - 1)
            accepted = 0
            if k:
                accepted = next((j for j in range(k) if rng.random() >= alpha), k)
                policy.record(req.request_id, k, accepted)
                if asleep:
                    seconds += wake / 1e3
                    policy.observe_wake(1, wake / 1e3)
                asleep = False
            else:
                undrafted += 1
                asleep = asleep or (fixed_k is None and policy.lets_sleep(1))
            policy.observe_step(1, k, cost(k))
            seconds += cost(k)
            n = min(accepted + 1, tokens - len(req.output_ids))
            req.output_ids += [0] * n
            made += n
        policy.release(req.request_id)
    return seconds, made, undrafted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alpha", type=float, nargs="*", default=[0.86, 0.8, 0.7, 0.5, 0.0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, costs in PRESETS.items():
        for alpha in args.alpha:
            run = dict(requests=args.requests, tokens=args.tokens, seed=args.seed)
            speedup, undrafted = simulate(alpha, *costs, **run)
            best, best_k = max((simulate(alpha, *costs, **run, fixed_k=k)[0], k) for k in range(costs[0] + 1))
            print(f"{name} alpha={alpha}: policy {speedup:.2f}x ({undrafted} undrafted decisions); "
                  f"best fixed k={best_k}: {best:.2f}x")


if __name__ == "__main__":
    main()
