"""`bench serve`: N concurrent streaming clients against a running server; TTFT and ITL percentiles.

Speaks HTTP/1.1 over asyncio streams (no client library), to /v1/completions with token-id prompts and
`ignore_eos`, so every request produces exactly the asked number of tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from urllib.parse import urlsplit

from outrider.bench.report import Reporter


async def _stream_one(host: str, port: int, body: dict) -> list[float]:
    """POST one streaming completion; returns the arrival time of each chunk that carried text."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (host.encode(), len(payload), payload))
    await writer.drain()
    stamps: list[float] = []
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}")
    async for raw in reader:  # chunked framing lines are skipped: only `data:` lines matter
        line = raw.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
    writer.close()
    return stamps


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


async def _run(args, reporter: Reporter, step_bytes: float | None) -> None:
    url = urlsplit(args.url)
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = [0]

    async def client(record: bool = True) -> None:
        body = {"prompt": [rng.randrange(args.vocab) for _ in range(args.prompt_len)], "max_tokens": args.gen,
                "stream": True, "ignore_eos": True, "temperature": 0}
        async with sem:
            t0 = time.perf_counter()
            stamps = await _stream_one(url.hostname, url.port or 80, body)
        if stamps and record:
            ttfts.append(stamps[0] - t0)
            itls.extend(b - a for a, b in zip(stamps, stamps[1:]))
            tokens[0] += len(stamps)

    # One untimed round at full concurrency first: what a server does once (JIT, allocations at a new batch
    # shape) is not its steady state.
    await asyncio.gather(*(client(record=False) for _ in range(args.concurrency)))
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.num_requests)))
    elapsed = time.perf_counter() - t0
    ms = lambda xs, p: _pct(xs, p) * 1e3  # noqa: E731
    # Bandwidth estimate: each ITL interval is one decode step streaming the weights once.
    moved = (step_bytes or 0.0) * len(itls) / max(1, args.concurrency)
    reporter.line(f"serve c={args.concurrency} n={args.num_requests} in={args.prompt_len} out={args.gen}",
                  f"TTFT p50/p90/p99 {ms(ttfts, 50):.1f}/{ms(ttfts, 90):.1f}/{ms(ttfts, 99):.1f} ms, "
                  f"ITL p50/p90/p99 {ms(itls, 50):.2f}/{ms(itls, 90):.2f}/{ms(itls, 99):.2f} ms, "
                  f"{tokens[0] / elapsed:.0f} output tok/s", moved, elapsed,
                  ttft_p50=_pct(ttfts, 50), itl_p50=_pct(itls, 50), tok_s=tokens[0] / elapsed)


def run(args, reporter: Reporter) -> None:
    step_bytes = None
    if args.random_weights:
        from outrider.bench.shapes import RANDOM_MODELS, config_weight_bytes
        from outrider.config import ModelConfig

        step_bytes = config_weight_bytes(ModelConfig.from_dict(RANDOM_MODELS[args.random_weights]), 2)
    asyncio.run(_run(args, reporter, step_bytes))
