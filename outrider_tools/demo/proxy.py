"""The offline acceptance proxy: greedy speculative decoding simulated over teacher-forced drafts (exact for greedy
verification up to numerics; not the engine's measurement), and the held-out prompts it runs on."""

from __future__ import annotations

import random
import re

def walk(matches: list[list[bool]], start: int, end: int, k: int) -> list[int]:
    """Speculative greedy decode over positions: at committed last index n the drafts for n+1..n+k are accepted
    while they match. matches[n][j] says whether draft j+1 proposed at n equals token n+j+1. Returns the
    acceptance length of every full step (n + k <= end)."""
    taus, n = [], start
    while n + k <= end:
        m = 0
        while m < k and matches[n][m]:
            m += 1
        taus.append(m + 1)
        n += m + 1
    return taus


REPEAT_NGRAM = 8


def repeated_tokens(seq: list[int], start: int, n: int = REPEAT_NGRAM) -> int:
    """How many tokens from index `start` on end an n-gram already present earlier in seq."""
    seen, repeated = set(), 0
    for i in range(n - 1, len(seq)):
        gram = tuple(seq[i - n + 1:i + 1])
        repeated += i >= start and gram in seen
        seen.add(gram)
    return repeated


def summarize(taus: list[int]) -> dict:
    if not taus:
        return {"mean_tau": None, "steps": 0}
    return {"mean_tau": round(sum(taus) / len(taus), 3), "steps": len(taus)}


def make_eval_prompts(held_files, per_kind: int, seed: int) -> list[dict]:
    """Held-out prompts: `def` lines (dedented, no newline, like the README's `def fibonacci(n):`) and ~400-char
    windows of held-out files ending at a line break."""
    rng = random.Random(seed + 99)
    defs, windows = [], []
    for rel, text in held_files:
        lines = text.splitlines(keepends=True)
        for line in lines:
            s = line.strip()
            if re.match(r"def [A-Za-z_]\w*\(.*\)( -> .+)?:$", s) and len(s) < 80:
                defs.append({"kind": "def", "file": rel, "prompt": s})
        if len(lines) > 20:
            for _ in range(2):
                i = rng.randrange(0, len(lines) - 10)
                chunk = ""
                while i < len(lines) and len(chunk) < 400:
                    chunk += lines[i]
                    i += 1
                if chunk.strip():
                    windows.append({"kind": "window", "file": rel, "prompt": chunk})
    rng.shuffle(defs)
    rng.shuffle(windows)
    # A short file can yield the same window twice (the published eval_prompts.json has one such pair, indices 35
    # and 36). Dropping repeats after the shuffle keeps every other choice of this seed as it was.
    def first_of_each(items):
        seen = set()
        return [x for x in items if not (x["prompt"] in seen or seen.add(x["prompt"]))]

    return first_of_each(defs)[:per_kind] + first_of_each(windows)[:per_kind]

