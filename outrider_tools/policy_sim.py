"""DraftPolicy alone against a simulated device: what its choices of k earn, next to the best fixed k.

Rounds cost `base + per_draft * k` ms and a plain step `plain` ms (defaults: the 8B shape's costs as `bench spec`
measured them on an H200); each draft is accepted with probability alpha until the first miss. Requests of
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

PRESETS = {  # name: (max draft, fixed ms of a round, ms per draft, the drafter's own step_cost estimate)
    "eagle3": (4, 7.3, 0.25, 0.05),
    "dflash": (15, 7.6, 0.06, 0.02),
}


def simulate(alpha: float, n_max: int, base: float, per_draft: float, step_cost: float, plain: float,
             requests: int, tokens: int, seed: int, fixed_k: int | None = None) -> tuple[float, int]:
    """(tokens per second over plain decoding's, undrafted decisions), with the policy's k or a fixed one (capped,
    as the policy caps it, by the tokens a request has left)."""
    rng = random.Random(seed)
    policy = DraftPolicy(n_max=n_max, measured=True)
    drafter = SimpleNamespace(max_draft=n_max, step_cost=step_cost)

    def cost(k: int) -> float:
        return (plain if k == 0 else base + per_draft * k) / 1e3

    for k in range(n_max + 1):  # what warm-up calibration leaves: every length measured
        policy.observe_step(1, k, cost(k))
    seconds = made = undrafted = 0
    for _ in range(requests):
        req = Request([0], SamplingParams(max_tokens=tokens))
        req.limit_outputs(tokens + 1)
        while len(req.output_ids) < tokens:
            if fixed_k is None:
                k = policy.draft_lengths([req], drafter)[0]
            else:
                k = min(fixed_k, tokens - len(req.output_ids) - 1)
            accepted = 0
            if k:
                accepted = next((j for j in range(k) if rng.random() >= alpha), k)
                policy.record(req.request_id, k, accepted)
            else:
                undrafted += 1
            policy.observe_step(1, k, cost(k))
            seconds += cost(k)
            n = min(accepted + 1, tokens - len(req.output_ids))
            req.output_ids += [0] * n
            made += n
        policy.release(req.request_id)
    return made / seconds * plain / 1e3, undrafted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alpha", type=float, nargs="*", default=[0.86, 0.8, 0.7, 0.5, 0.0])
    ap.add_argument("--plain", type=float, default=4.48, help="ms of a plain step")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, (n_max, base, per_draft, step_cost) in PRESETS.items():
        for alpha in args.alpha:
            speedup, undrafted = simulate(alpha, n_max, base, per_draft, step_cost, args.plain, args.requests,
                                          args.tokens, args.seed)
            best, best_k = max((simulate(alpha, n_max, base, per_draft, step_cost, args.plain, args.requests,
                                         args.tokens, args.seed, fixed_k=k)[0], k) for k in range(n_max + 1))
            print(f"{name} alpha={alpha}: policy {speedup:.2f}x ({undrafted} undrafted decisions); "
                  f"best fixed k={best_k}: {best:.2f}x")


if __name__ == "__main__":
    main()
