"""The timings contract: one RequestTiming per request, stamped by the engine where the work happens.

Every `timings` object the server sends (streamed per-token frames, the final frame, OpenAI bodies) is
rendered from this record by `RequestTiming.to_timings()`, so no two frames can disagree. Formulas follow
llama-server b10406+:
  prompt_ms    = t_first_token - t_prompt_start   (prompt processing up to the first sampled token)
  predicted_ms = t_last_token  - t_first_token    (>= 1 us once a token exists; excludes the first token)
  per-token rates for the prediction are taken over (predicted_n - 1) and are 0 when predicted_n <= 1.
Queue wait (t_prompt_start - t_arrival) is not part of `timings`; it feeds a /metrics histogram.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

now = time.perf_counter  # the one monotonic clock every stamp uses


@dataclass
class RequestTiming:
    t_arrival: float = field(default_factory=now)
    t_prompt_start: float | None = None  # first prompt chunk scheduled
    t_first_token: float | None = None  # first token sampled and on the host
    t_last_token: float | None = None  # latest committed token on the host
    t_finish: float | None = None
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
    def mark_prompt_start(self, t: float | None = None) -> None:
        if self.t_prompt_start is None:
            self.t_prompt_start = now() if t is None else t

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

    # --- derived figures ---
    @property
    def queue_ms(self) -> float:
        return 0.0 if self.t_prompt_start is None else (self.t_prompt_start - self.t_arrival) * 1e3

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
