"""/metrics: llama-server's `llamacpp:` families, fed from each finished request's timing record, plus
outrider_* histograms (prometheus-client) for time to first token, queue wait, decode rate, accepted length.

The `llamacpp:` counters are sums over the requests that finished normally (the ones a client got `timings`
for), so they reconcile exactly with the sum of those `timings`. They are rendered by hand because
prometheus-client would rename counters that llama-server names without a `_total` suffix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import disable_created_metrics

from outrider.timing import RequestTiming

disable_created_metrics()

_COUNTERS = {  # name -> help, in llama-server's order
    "prompt_tokens_total": "Number of prompt tokens processed.",
    "prompt_tokens_cached_total": "Number of prompt tokens reused from the cache.",
    "prompt_seconds_total": "Prompt process time",
    "tokens_predicted_total": "Number of generation tokens processed.",
    "tokens_predicted_seconds_total": "Predict process time",
    "n_decode_total": "Total number of llama_decode() calls",
    "n_tokens_max": "Largest observed n_tokens.",
    "spec_decode_num_draft_tokens_total": "Number of draft tokens proposed.",
    "spec_decode_num_accepted_tokens_total": "Number of draft tokens accepted.",
    "spec_decode_num_drafts_total": "Number of speculative verification steps.",
}
_GAUGES = {
    "prompt_tokens_seconds": "Average prompt throughput in tokens/s.",
    "predicted_tokens_seconds": "Average generation throughput in tokens/s.",
    "requests_processing": "Number of requests processing.",
    "requests_deferred": "Number of requests deferred.",
    "n_busy_slots_per_decode": "Average number of busy slots per llama_decode() call",
}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


class Metrics:
    def __init__(self) -> None:
        self.totals = dict.fromkeys(_COUNTERS, 0.0)
        self.accepted_per_position: list[int] = []
        # Throughput gauges average over the window since the previous scrape (llama-server's "bucket").
        self._window = [0.0, 0.0, 0.0, 0.0]  # prompt tokens, prompt s, decode intervals, predicted s
        self.registry = CollectorRegistry()
        self.ttft = Histogram("outrider_time_to_first_token_seconds", "Arrival to first token, queue included.",
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.queue_wait = Histogram("outrider_queue_wait_seconds", "Arrival to the prompt's start, plus waits after preemptions.",
                                    registry=self.registry,
                                    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60))
        self.decode_rate = Histogram("outrider_decode_tokens_per_second", "Per-request predicted_per_second.",
                                     registry=self.registry,
                                     buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200))
        self.accepted_length = Histogram("outrider_spec_accepted_length",
                                         "Tokens committed per speculative round (accepted drafts + 1).",
                                         registry=self.registry, buckets=tuple(range(1, 17)))
        self.kv_used = Gauge("outrider_kv_blocks_used", "KV blocks held by running requests.", registry=self.registry)
        self.kv_total = Gauge("outrider_kv_blocks_total", "KV blocks in the pool.", registry=self.registry)
        self.kv_free = Gauge("outrider_kv_blocks_free", "KV blocks no request holds (prefix-cached ones included).",
                             registry=self.registry)
        # A hybrid model's linear-attention state pool (engine/state_pool.py); absent for other models.
        self.state_slots = {part: Gauge(f"outrider_state_slots_{part}", text, registry=self.registry) for part, text in (
            ("total", "Linear-attention state slots in the pool."),
            ("owned", "State slots held by running requests."),
            ("snapshot", "State slots holding prefix-cache snapshots (given up on demand)."),
            ("free", "State slots neither owned nor holding a snapshot."))}

    def on_finished(self, timing: RequestTiming, pooled: bool = False) -> None:
        """Account one request that finished normally (called once, from the event loop). An embedding request
        (`pooled`) counts its prompt work only: the token its prefill samples is never output."""
        t = timing.to_timings()
        if pooled:
            t = {**t, "predicted_n": 0, "predicted_ms": 0.0}
        add = self.totals
        add["prompt_tokens_total"] += t["prompt_n"]
        add["prompt_tokens_cached_total"] += t["cache_n"]
        add["prompt_seconds_total"] += t["prompt_ms"] / 1e3
        add["tokens_predicted_total"] += t["predicted_n"]
        add["tokens_predicted_seconds_total"] += t["predicted_ms"] / 1e3
        add["n_tokens_max"] = max(add["n_tokens_max"], t["cache_n"] + t["prompt_n"] + t["predicted_n"])
        add["spec_decode_num_draft_tokens_total"] += timing.draft_n
        add["spec_decode_num_accepted_tokens_total"] += timing.draft_n_accepted
        add["spec_decode_num_drafts_total"] += timing.draft_rounds
        self._window[0] += t["prompt_n"]
        self._window[1] += t["prompt_ms"] / 1e3
        if t["predicted_n"] > 1:
            self._window[2] += t["predicted_n"] - 1
            self._window[3] += t["predicted_ms"] / 1e3
            self.decode_rate.observe(t["predicted_per_second"])
        if timing.t_first_token is not None:
            self.ttft.observe(timing.t_first_token - timing.t_arrival)
        self.queue_wait.observe(timing.queue_ms / 1e3)
        self._observe_rounds(timing)

    def _observe_rounds(self, timing: RequestTiming) -> None:
        """Rounds that accepted >= i drafts = accepted_per_position[i-1] (acceptance is a prefix), which
        recovers each round's accepted length from the per-request counters."""
        app = timing.accepted_per_position
        for i, n in enumerate(app):
            if i == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += n
        at_least = [timing.draft_rounds, *app, 0]
        for j in range(len(at_least) - 1):
            for _ in range(at_least[j] - at_least[j + 1]):
                self.accepted_length.observe(j + 1)

    def render(self, stats: dict) -> str:
        """Prometheus text; `stats` is the engine's snapshot (steps, running/waiting, busy slot-steps)."""
        totals = {**self.totals, "n_decode_total": stats.get("steps", 0)}
        p_tok, p_s, d_tok, d_s = self._window
        self._window = [0.0, 0.0, 0.0, 0.0]
        steps = stats.get("steps", 0)
        gauges = {
            "prompt_tokens_seconds": p_tok / p_s if p_s > 0 else 0.0,
            "predicted_tokens_seconds": d_tok / d_s if d_s > 0 else 0.0,
            "requests_processing": stats.get("num_running", 0),
            "requests_deferred": stats.get("num_waiting", 0),
            "n_busy_slots_per_decode": stats.get("busy_slots_total", 0) / steps if steps else 0.0,
        }
        lines = []
        for kind, helps, values in (("counter", _COUNTERS, totals), ("gauge", _GAUGES, gauges)):
            for name, help_text in helps.items():
                lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {_num(values[name])}"]
        if self.accepted_per_position:  # llama-server emits it only after the first speculative request
            lines += [f"# HELP llamacpp:{_PER_POS} Accepted draft tokens by draft position.",
                      f"# TYPE llamacpp:{_PER_POS} counter"]
            lines += [f'llamacpp:{_PER_POS}{{position="{i}"}} {n}' for i, n in enumerate(self.accepted_per_position)]
        self.kv_used.set(stats.get("kv_blocks_used", 0))
        self.kv_total.set(stats.get("kv_blocks_total", 0))
        self.kv_free.set(stats.get("kv_blocks_total", 0) - stats.get("kv_blocks_used", 0))
        if "state_slots_total" in stats:
            for part, gauge in self.state_slots.items():
                gauge.set(stats[f"state_slots_{part}"])
        return "\n".join(lines) + "\n" + generate_latest(self.registry).decode()


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
