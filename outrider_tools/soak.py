"""Soak test: many concurrent clients against a real `outrider serve` on loopback, then a leak check.

Each client loops until the deadline: a random route (native /completion, OpenAI /v1/completions or
/v1/chat/completions), streamed or not, with random sampling parameters; some streams are dropped mid-way and
some plain requests abandoned (disconnects), and about 5 % of requests are invalid on purpose. Afterwards the
server must be idle again: no slot processing and every KV block free (`outrider_kv_blocks_free` in /metrics).

Checked for every request: the status is the expected one (200, or the 400 naming the field for the invalid
ones; anything else, 5xx included, is an error), the response is well formed, and its `timings` add up (token
counts agree with the body, rates with their times, times fit inside the client's own wall time, draft counters
are consistent). The server's resident memory is sampled every second: growth between the first and last third
of the run must stay under 5 %.

    python scripts/soak.py --duration 600 --clients 64             # the bundled demo model, its draft model loaded
    python scripts/soak.py -m CKPT --duration 60 -- -md DRAFT -np 8  # args after -- go to `outrider serve`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from outrider_tools.server_process import ServerProcess, sse_events

PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def push(self, item):", "for i in range(10):",
           "def read_config(path):\n    with open(path) as f:", "# sort a list of dicts by key\n", "return self._",
           "if __name__ == '__main__':"]
# Invalid on purpose: (route, body, the field the 400 must name)
INVALID = [
    ("/completion", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/completion", {"prompt": "x", "n_predict": -5}, "n_predict"),
    ("/completion", {"prompt": [1, 2, 999999]}, "prompt"),
    ("/completion", {"prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
]
DRAFT_KEYS = ("draft_n", "draft_n_accepted", "draft_rounds", "draft_kind")


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0  # answered in full and checked
    invalid: int = 0  # invalid on purpose, answered with the right 400
    disconnected: int = 0  # dropped by the client on purpose
    predicted_tokens: int = 0
    errors: list[str] = field(default_factory=list)  # unexpected statuses, malformed bodies, timings that disagree


@dataclass
class SoakReport:
    clients: int
    duration_s: float
    requests: int
    completed: int
    invalid: int
    disconnected: int
    predicted_tokens: int
    errors: list[str]
    busy_slots_after: int
    kv_blocks_total: int
    leaked_blocks: int  # KV blocks not free once the load is over
    rss_first_mib: float  # median resident memory of the server over the first third of the run
    rss_last_mib: float  # ... and over the last third
    drafter: str

    @property
    def rss_growth(self) -> float:
        return self.rss_last_mib / self.rss_first_mib - 1


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timings_problems(t: dict, predicted: int, prompt_tokens: int, wall_ms: float) -> list[str]:
    """What does not add up in one response's `timings`, given its token counts and the client's wall time."""
    out = []
    if t["predicted_n"] != predicted:
        out.append(f"predicted_n {t['predicted_n']} != {predicted} tokens returned")
    if t["prompt_n"] + t["cache_n"] != prompt_tokens:
        out.append(f"prompt_n {t['prompt_n']} + cache_n {t['cache_n']} != {prompt_tokens} prompt tokens")
    if not (0 <= t["prompt_ms"] and 0 <= t["predicted_ms"] and t["prompt_ms"] + t["predicted_ms"] <= wall_ms):
        out.append(f"prompt_ms {t['prompt_ms']:.1f} + predicted_ms {t['predicted_ms']:.1f} outside the wall time "
                   f"{wall_ms:.1f}")
    if t["prompt_n"] > 0 and not math.isclose(t["prompt_per_token_ms"], t["prompt_ms"] / t["prompt_n"], rel_tol=1e-6):
        out.append("prompt_per_token_ms != prompt_ms / prompt_n")
    n = t["predicted_n"] - 1
    if n > 0 and not math.isclose(t["predicted_per_second"], 1e3 * n / t["predicted_ms"], rel_tol=1e-6):
        out.append("predicted_per_second != 1000 (predicted_n - 1) / predicted_ms")
    if "draft_n" in t:  # every round commits its accepted drafts and at least one token (the prefill gave one)
        if not (0 <= t["draft_n_accepted"] <= t["draft_n"] and t["draft_rounds"] > 0
                and t["predicted_n"] >= t["draft_rounds"] + t["draft_n_accepted"]):
            out.append(f"draft counters disagree: {t}")
    return out


def random_request(rng: random.Random) -> tuple[str, dict, bool]:
    """(route, body, streamed) with random sampling parameters."""
    route = rng.choice(["/completion", "/v1/completions", "/v1/chat/completions"])
    stream = rng.random() < 0.5
    n = rng.randint(1, 48)
    body: dict = {"temperature": rng.choice([0.0, 0.3, 0.8, 1.2]), "top_k": rng.choice([0, 1, 5, 40]),
                  "top_p": rng.choice([0.5, 0.9, 1.0]), "min_p": rng.choice([0.0, 0.05, 0.2]),
                  "repeat_penalty": rng.choice([1.0, 1.0, 1.1]), "stream": stream}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(1 << 20)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["\n", ":", "return"])]
    prompt = rng.choice(PROMPTS)
    if route == "/completion":
        body.update(prompt=prompt, n_predict=n)
        if rng.random() < 0.2:
            body["n_probs"] = rng.randint(1, 3)
    elif route == "/v1/completions":
        body.update(prompt=prompt, max_tokens=n)
    else:
        body.update(messages=[{"role": "user", "content": prompt}], max_tokens=n)
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return route, body, stream


def check_plain(route: str, r: httpx.Response, wall_ms: float) -> tuple[int, list[str]]:
    """(tokens predicted, problems) of a complete non-streamed answer."""
    if r.status_code != 200:
        return 0, [f"{route}: status {r.status_code}: {r.text[:200]}"]
    body = r.json()
    t = body["timings"]
    if route == "/completion":
        ok = body["stop"] is True and isinstance(body["content"], str) and body["stop_type"] in ("eos", "word", "limit")
        predicted, prompt = body["tokens_predicted"], body["tokens_evaluated"]
    else:
        choice = body["choices"][0]
        text = choice["text"] if route == "/v1/completions" else choice["message"]["content"]
        ok = isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
        predicted, prompt = body["usage"]["completion_tokens"], body["usage"]["prompt_tokens"]
    problems = [] if ok else [f"{route}: malformed body {str(body)[:200]}"]
    return predicted, problems + [f"{route}: {p}" for p in timings_problems(t, predicted, prompt, wall_ms)]


def check_stream(route: str, events: list, wall_ms: float) -> tuple[int, list[str]]:
    """(tokens predicted, problems) of a complete SSE stream."""
    if route == "/completion":
        final = events[-1]
        frames = events[:-1]
        tokens = sum(len(e["tokens"]) for e in frames)
        ok = final["stop"] is True and all(e["stop"] is False for e in frames) and tokens == final["tokens_predicted"]
        predicted, prompt, t = final["tokens_predicted"], final["tokens_evaluated"], final["timings"]
    else:
        last = events[-2]
        ok = events[-1] == "[DONE]" and "timings" in last and all(isinstance(e, dict) for e in events[:-1])
        t = last.get("timings", {})
        usage = next((e["usage"] for e in events[:-1] if e.get("usage")), None)
        finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
        ok = ok and finishes and finishes[-1] in ("stop", "length")
        predicted = usage["completion_tokens"] if usage else t.get("predicted_n", -1)
        prompt = usage["prompt_tokens"] if usage else t.get("prompt_n", 0) + t.get("cache_n", 0)
    if not ok or not t:
        return 0, [f"{route}: malformed stream ending {str(events[-2:])[:300]}"]
    return predicted, [f"{route} (stream): {p}" for p in timings_problems(t, predicted, prompt, wall_ms)]


async def one_request(ac: httpx.AsyncClient, rng: random.Random, tally: Tally, invalid_rate: float,
                      disconnect_rate: float) -> None:
    tally.requests += 1
    if rng.random() < invalid_rate:
        route, body, name = rng.choice(INVALID)
        r = await ac.post(route, json=body)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code == 400 and f"'{name}'" in err.get("message", ""):
            tally.invalid += 1
        else:
            tally.errors.append(f"invalid {route} {body}: {r.status_code} {r.text[:200]}")
        return
    route, body, stream = random_request(rng)
    drop = rng.random() < disconnect_rate
    t0 = time.perf_counter()
    if not stream:
        try:  # a dropped one is abandoned after a moment: the client closes the connection
            r = await asyncio.wait_for(ac.post(route, json=body), timeout=rng.uniform(0.01, 0.3) if drop else None)
        except asyncio.TimeoutError:
            tally.disconnected += 1
            return
        predicted, problems = check_plain(route, r, (time.perf_counter() - t0) * 1e3)
    else:
        keep = rng.randint(1, 5) if drop else None
        async with ac.stream("POST", route, json=body) as r:
            if r.status_code != 200:
                tally.errors.append(f"{route} (stream): status {r.status_code}: {(await r.aread())[:200]!r}")
                return
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += sse_events([line])
                    if keep is not None and len(events) >= keep:
                        tally.disconnected += 1
                        return
        if any(isinstance(e, dict) and "error" in e for e in events):
            tally.errors.append(f"{route} (stream): error frame {events[-1]}")
            return
        predicted, problems = check_stream(route, events, (time.perf_counter() - t0) * 1e3)
    tally.errors += problems
    tally.completed += not problems
    tally.predicted_tokens += predicted


async def client_loop(url: str, seed: int, deadline: float, tally: Tally, invalid_rate: float,
                      disconnect_rate: float) -> None:
    rng = random.Random(seed)
    # One connection per client, as a real client would keep; a dropped stream closes it and the next opens anew.
    async with httpx.AsyncClient(base_url=url, timeout=300) as ac:
        while time.monotonic() < deadline:
            try:
                await one_request(ac, rng, tally, invalid_rate, disconnect_rate)
            except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as e:
                tally.errors.append(f"client error: {type(e).__name__}: {e}")


async def sample_rss(pid: int, deadline: float, samples: list[tuple[float, int]]) -> None:
    while time.monotonic() < deadline:
        samples.append((time.monotonic(), rss_bytes(pid)))
        await asyncio.sleep(1.0)


async def wait_idle(ac: httpx.AsyncClient, timeout: float = 30.0) -> tuple[int, int, int]:
    """(busy slots, KV blocks total, KV blocks not free), once idle or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        busy = sum(s["is_processing"] for s in (await ac.get("/slots")).json())
        text = (await ac.get("/metrics")).text
        gauges = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                          if line.startswith("outrider_kv_blocks_"))}
        total, free = int(gauges["outrider_kv_blocks_total"]), int(gauges["outrider_kv_blocks_free"])
        if (busy == 0 and free == total) or time.monotonic() > deadline:
            return busy, total, total - free
        await asyncio.sleep(0.1)


def run(url: str, pid: int, clients: int, duration_s: float, seed: int = 0, invalid_rate: float = 0.05,
        disconnect_rate: float = 0.1) -> SoakReport:
    """Load the server at `url` (process `pid`) for `duration_s` seconds with `clients` concurrent clients."""
    tally = Tally()
    samples: list[tuple[float, int]] = []

    async def main():
        start = time.monotonic()
        deadline = start + duration_s
        await asyncio.gather(sample_rss(pid, deadline, samples),
                             *(client_loop(url, seed * 1000 + i, deadline, tally, invalid_rate, disconnect_rate)
                               for i in range(clients)))
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            idle = await wait_idle(ac)
            drafter = (await ac.get("/props")).json()["default_generation_settings"]["params"]["speculative.types"]
        return start, time.monotonic() - start, idle, drafter

    start, took, (busy, total, leaked), drafter = asyncio.run(main())
    third = duration_s / 3

    def median_mib(lo: float, hi: float) -> float:
        return statistics.median(r for t, r in samples if lo <= t - start < hi) / 2**20

    return SoakReport(clients=clients, duration_s=round(took, 1), requests=tally.requests, completed=tally.completed,
                      invalid=tally.invalid, disconnected=tally.disconnected, predicted_tokens=tally.predicted_tokens,
                      errors=tally.errors, busy_slots_after=busy, kv_blocks_total=total, leaked_blocks=leaked,
                      rss_first_mib=median_mib(0, third), rss_last_mib=median_mib(2 * third, duration_s + 1),
                      drafter=drafter)


SERVER_ARGS = ["--demo-draft", "draft", "-np", "8", "--max-queue", "128", "-c", "1024", "--metrics"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", help="checkpoint to serve (default: the bundled demo model)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="write the report here as JSON")
    parser.add_argument("server_args", nargs="*", help="extra `outrider serve` arguments (after --)")
    args = parser.parse_args()
    server = ServerProcess((["-m", args.model] if args.model else []) + SERVER_ARGS + args.server_args)
    try:
        report = run(server.url, server.proc.pid, args.clients, args.duration, args.seed)
    finally:
        server.stop()
    summary = {**asdict(report), "errors": len(report.errors), "rss_growth": round(report.rss_growth, 4)}
    print(json.dumps(summary, indent=2))
    for e in report.errors[:20]:
        print("error:", e, file=sys.stderr)
    if args.report:
        Path(args.report).write_text(json.dumps({**asdict(report), "rss_growth": report.rss_growth}, indent=2) + "\n")
    ok = not report.errors and not report.leaked_blocks and not report.busy_slots_after and report.rss_growth < 0.05
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
