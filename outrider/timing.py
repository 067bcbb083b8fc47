"""The timings contract: one RequestTiming per request, stamped by the engine where the work happens.

Every `timings` object the server sends (streamed per-token frames, the final frame, OpenAI bodies) is
rendered from this record by `RequestTiming.to_timings()`, so no two frames can disagree. Formulas follow
llama-server b10406+:
  prompt_ms    = t_first_token - t_prompt_start   (prompt processing up to the first sampled token)
  predicted_ms = t_last_token  - t_first_token    (>= 1 us once a token exists; excludes the first token)
  per-token rates for the prediction are taken over (predicted_n - 1) and are 0 when predicted_n <= 1.

The rule (docs/architecture.md, "Timings"):
- t_prompt_start is the moment the engine launches the step holding the request's first prefill work (with
  overlap scheduling the device may still be finishing the step in flight: that wait counts, it is part of
  serving this prompt). A preemption before the first token discards that prefill; the next admission starts the
  prompt again, with its own prompt_n and cache_n, and everything before it (waiting and the discarded work) is
  queue wait.
- t_first_token is read when the first sampled token reaches the host, before any drafter work on the request.
- A preemption after the first token keeps the prompt figures; its wait and recomputation stall the stream, so
  they lie inside predicted_ms, and the wait is also added to the queue wait.
Queue wait is not part of `timings`; it feeds a /metrics histogram.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

now = time.perf_counter  # the one monotonic clock every stamp uses


@dataclass
class RequestTiming:
    t_arrival: float = field(default_factory=now)
    t_prompt_start: float | None = None  # the step with the (last started) prefill was launched
    t_first_token: float | None = None  # first token sampled and on the host
    t_last_token: float | None = None  # latest committed token on the host
    t_finish: float | None = None
    t_preempted: float | None = None  # preempted after its first token, not yet running again
    requeue_s: float = 0.0  # waits after preemptions that came after the first token
    prompt_n: int = 0  # prompt tokens computed (excluding the cache)
    cache_n: int = 0  # prompt tokens reused from the prefix cache
    predicted_n: int = 0  # tokens generated, the first one included
    # Speculative counters (only rendered when draft_n > 0)
    draft_kind: str | None = None
    draft_n: int = 0  # drafted positions proposed
    draft_n_accepted: int = 0
    draft_rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = accepted drafts at depth i

    # --- stamps (called from the engine thread only) ---
    def mark_admitted(self, t: float, cache_n: int, prompt_n: int) -> None:
        """The request was admitted and its first step launched at t, reusing cache_n prompt tokens. Before the
        first token this (re)starts the prompt; after it, it ends a wait that a preemption began."""
        if self.t_first_token is None:
            self.t_prompt_start, self.cache_n, self.prompt_n = t, cache_n, prompt_n
        elif self.t_preempted is not None:
            self.requeue_s += max(0.0, t - self.t_preempted)
            self.t_preempted = None

    def mark_preempted(self, t: float) -> None:
        if self.t_first_token is not None:
            self.t_preempted = t

    def mark_tokens(self, n: int, t: float | None = None) -> None:
        """n tokens were committed in one step, the clock read after they reached the host."""
        if n <= 0:
            return
        t = now() if t is None else t
        if self.t_first_token is None:
            self.t_first_token = t
        self.t_last_token = t
        self.predicted_n += n

    def mark_draft_round(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.draft_rounds += 1
        self.draft_n += proposed
        self.draft_n_accepted += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def mark_finished(self, t: float | None = None) -> None:
        if self.t_finish is None:
            self.t_finish = now() if t is None else t

    def snapshot(self) -> RequestTiming:
        """A copy as of now: what a frame rendered later on another thread must show (the engine thread keeps
        stamping this record, so reading it then would report work done after the frame's tokens)."""
        snap = copy.copy(self)
        snap.accepted_per_position = list(self.accepted_per_position)
        return snap

    def at_progress(self, processed: int, t: float) -> RequestTiming:
        """The record as a prefill report at time t sees it: `processed` prompt tokens (the cached ones included)
        done, so prompt_n counts those computed and prompt_ms runs to t (llama-server's first report, before any
        prompt work: prompt_n 0, prompt_ms 0). Once the first token exists, the record as it is."""
        snap = self.snapshot()
        if self.t_first_token is None:
            snap.prompt_n = max(0, processed - self.cache_n)
            snap.t_first_token = t if snap.prompt_n > 0 else None  # (the end of prompt_ms; no token exists yet)
        return snap

    # --- derived figures ---
    @property
    def queue_ms(self) -> float:
        """Waiting for a slot: before the prompt started, and after any preemption past the first token."""
        first = 0.0 if self.t_prompt_start is None else self.t_prompt_start - self.t_arrival
        return (first + self.requeue_s) * 1e3

    @property
    def prompt_ms(self) -> float:
        if self.t_prompt_start is None or self.t_first_token is None:
            return 0.0
        return max(0.0, self.t_first_token - self.t_prompt_start) * 1e3

    @property
    def predicted_ms(self) -> float:
        if self.t_first_token is None or self.t_last_token is None:
            return 0.0
        return max(1e-3, (self.t_last_token - self.t_first_token) * 1e3)

    def to_timings(self) -> dict:
        """llama-server's `timings`: numbers only (the drafter kind is rendered beside it, as `draft_kind`)."""
        prompt_ms, predicted_ms = self.prompt_ms, self.predicted_ms
        n_rate = self.predicted_n - 1
        out = {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / self.prompt_n if self.prompt_n > 0 else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n_rate if n_rate > 0 else 0.0,
            "predicted_per_second": 1e3 * n_rate / predicted_ms if n_rate > 0 and predicted_ms > 0 else 0.0,
        }
        if self.draft_n > 0:
            out.update(
                draft_n=self.draft_n,
                draft_n_accepted=self.draft_n_accepted,
                draft_rounds=self.draft_rounds,
            )
        return out
