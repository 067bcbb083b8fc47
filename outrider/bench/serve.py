"""`bench serve`: N concurrent streaming clients against a running server; TTFT and ITL percentiles.

Speaks HTTP/1.1 over asyncio streams (no client library), to /v1/completions with token-id prompts and
`ignore_eos`, so every request produces exactly the asked number of tokens. A streamed chunk may carry several
tokens (a speculative round commits them together), so tokens are counted, not chunks: each chunk's count is the
growth of `timings.predicted_n` (llama-server's `timings_per_token`), and a request's total is its `usage`. A
server that reports neither per chunk has its total spread evenly over the chunks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from outrider.bench.report import Reporter


@dataclass(frozen=True)
class Stream:
    """One streamed completion: when each chunk that carried tokens arrived, and how many it carried."""

    stamps: list[float]
    tokens: list[float]  # per chunk (fractional only when spread evenly)

    @property
    def total(self) -> int:
        return round(sum(self.tokens))

    def itls(self) -> list[float]:
        """Inter-token latencies: a chunk's gap since the previous one, shared by the tokens it carried."""
        return [gap / n for gap, n in zip((b - a for a, b in zip(self.stamps, self.stamps[1:])), self.tokens[1:])
                for _ in range(round(n))]


async def _stream_one(host: str, port: int, body: dict) -> Stream:
    """POST one streaming completion; returns its chunks that carried tokens."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (host.encode(), len(payload), payload))
    await writer.drain()
    stamps: list[float] = []
    counts: list[int | None] = []  # None: the chunk did not say
    predicted, usage = 0, None
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}")
    async for raw in reader:  # chunked framing lines are skipped: only `data:` lines matter
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        t = time.perf_counter()
        usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
        if not chunk.get("choices") or chunk["choices"][0].get("text") is None:
            continue
        n = None
        if "predicted_n" in (chunk.get("timings") or {}):
            n, predicted = chunk["timings"]["predicted_n"] - predicted, chunk["timings"]["predicted_n"]
            if n == 0:
                continue  # a chunk with no new token (e.g. only a finish reason)
        stamps.append(t)
        counts.append(n)
    writer.close()
    if None not in counts:
        return Stream(stamps, [float(n) for n in counts])
    total = usage if usage is not None else len(stamps)
    return Stream(stamps, [total / len(stamps)] * len(stamps))


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


async def _run(args, reporter: Reporter, step_bytes: float | None) -> None:
    url = urlsplit(args.url)
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    streams: list[Stream] = []

    async def client(record: bool = True) -> None:
        body = {"prompt": [rng.randrange(args.vocab) for _ in range(args.prompt_len)], "max_tokens": args.gen,
                "stream": True, "ignore_eos": True, "temperature": 0, "timings_per_token": True,
                "stream_options": {"include_usage": True}}
        async with sem:
            t0 = time.perf_counter()
            stream = await _stream_one(url.hostname, url.port or 80, body)
        if stream.stamps and record:
            ttfts.append(stream.stamps[0] - t0)
            streams.append(stream)

    # One untimed round at full concurrency first: what a server does once (JIT, allocations at a new batch
    # shape) is not its steady state.
    await asyncio.gather(*(client(record=False) for _ in range(args.concurrency)))
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.num_requests)))
    elapsed = time.perf_counter() - t0
    itls = [x for s in streams for x in s.itls()]
    tokens = sum(s.total for s in streams)
    chunks = sum(len(s.stamps) for s in streams)
    ms = lambda xs, p: _pct(xs, p) * 1e3  # noqa: E731
    # Bandwidth estimate: each chunk after a request's first is one decode step streaming the weights once.
    moved = (step_bytes or 0.0) * (chunks - len(streams)) / max(1, args.concurrency)
    reporter.line(f"serve c={args.concurrency} n={args.num_requests} in={args.prompt_len} out={args.gen}",
                  f"TTFT p50/p90/p99 {ms(ttfts, 50):.1f}/{ms(ttfts, 90):.1f}/{ms(ttfts, 99):.1f} ms, "
                  f"ITL p50/p90/p99 {ms(itls, 50):.2f}/{ms(itls, 90):.2f}/{ms(itls, 99):.2f} ms, "
                  f"{tokens / elapsed:.0f} output tok/s ({tokens} tokens in {chunks} chunks)", moved, elapsed,
                  ttft_p50=_pct(ttfts, 50), itl_p50=_pct(itls, 50), tok_s=tokens / elapsed, tokens=tokens,
                  chunks=chunks)


def run(args, reporter: Reporter) -> None:
    step_bytes = None
    if args.random_weights:
        from outrider.bench.shapes import RANDOM_MODELS, config_weight_bytes
        from outrider.models import registry

        step_bytes = config_weight_bytes(registry.model_config(RANDOM_MODELS[args.random_weights]), 2)
    asyncio.run(_run(args, reporter, step_bytes))
