"""DRY ("Don't Repeat Yourself"), llama.cpp's repetition penalty over repeated sequences, on the host.

For the last `dry_penalty_last_n` tokens (the window), a token that would extend a repeat of length L >=
allowed_length (the window's suffix of L tokens also appears earlier, followed by that token) gets its logit
lowered by multiplier * base^(L - allowed_length). Repeats do not run across a sequence breaker: the window's
most recent breaker caps L at the number of tokens after it, and a token that alone is a breaker is never
penalised. A breaker is a string; its token forms are the tokens whose text contains it (heads alone) and the
tokens whose text ends with a prefix of it, followed by the rest of it tokenized (heads with tails).

The search is per row and runs on the host (numpy): O(n + c log n) for a window of n tokens with c earlier
occurrences of its last token (hashes and a binary search per occurrence, vectorised); the sampler applies the (row, token, penalty) triples to the logits on the device, for the
whole batch at once (Sampler.adjusted_logits).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

MAX_BREAKER_BYTES = 40  # llama.cpp's limits on a breaker's length and its tail's tokens
MAX_TAIL_TOKENS = 20
_FLOAT_MAX_LOG = 88.7228391  # log(float32 max): the exponent is capped below overflow


@dataclass(frozen=True)
class Breakers:
    """A request's sequence breakers in token form: head token -> the tails that complete a breaker after it
    (an empty tail: the head alone is one)."""

    entries: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]  # (head, its tails), by head

    @functools.cached_property
    def tails(self) -> Mapping[int, tuple[tuple[int, ...], ...]]:
        return dict(self.entries)

    @functools.cached_property
    def single(self) -> list[int]:
        return [h for h, tails in self.entries if () in tails]


def breaker_sequences(tokenizer, breakers: tuple[str, ...]) -> Breakers:
    """The token form of these breaker strings under `tokenizer` (cached: the vocab scan runs once per list)."""
    return _breaker_sequences(tokenizer, breakers)


@functools.lru_cache(maxsize=64)
def _breaker_sequences(tokenizer, breakers: tuple[str, ...]) -> Breakers:
    blob, starts, ends = _vocab_blob(tokenizer)
    data = np.frombuffer(blob, dtype=np.uint8)
    tails: dict[int, set[tuple[int, ...]]] = {}
    for text in breakers:
        raw = text.encode()[:MAX_BREAKER_BYTES]
        if not raw:
            continue
        # the tokens holding the whole breaker: one alone
        hits = np.array([m.start() for m in re.finditer(b"(?=" + re.escape(raw) + b")", blob)], dtype=np.int64)
        at = np.searchsorted(starts, hits, side="right") - 1
        whole = set(at[hits + len(raw) <= ends[at]].tolist())
        for tok in whole:
            tails.setdefault(tok, set()).add(())
        # the tokens ending with the breaker's first `length` bytes: a head, the rest tokenized its tail
        for length in range(1, len(raw)):
            heads = np.flatnonzero((ends - starts >= length) & (data[np.maximum(ends - 1, 0)] == raw[length - 1]))
            for i in range(length - 1):
                heads = heads[data[ends[heads] - length + i] == raw[i]]
            heads = [tok for tok in heads.tolist() if tok not in whole]
            if heads:
                rest = raw[length:].decode("utf-8", errors="ignore")
                tail = tuple(tokenizer.encode(rest, add_special=False, parse_special=False)[:MAX_TAIL_TOKENS])
                for tok in heads:
                    tails.setdefault(tok, set()).add(tail)
    return Breakers(tuple((h, tuple(sorted(t))) for h, t in sorted(tails.items())))


@functools.lru_cache(maxsize=4)
def _vocab_blob(tokenizer) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Every token's bytes one after another, and where each starts and ends."""
    pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(lengths)
    return b"".join(pieces), ends - lengths, ends


def dry_penalties(window: np.ndarray, multiplier: float, base: float, allowed_length: int,
                  breakers: Breakers | None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, penalties to subtract from their logits) for a row whose recent tokens are `window` (int64,
    already cut to dry_penalty_last_n)."""
    none = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    tokens = np.asarray(window, dtype=np.int64)
    n = len(tokens)
    if multiplier == 0.0 or n <= allowed_length:
        return none
    limit = _repeat_limit(tokens, breakers)
    if limit < allowed_length:
        return none
    # match[j]: the longest L <= limit with tokens[j-L+1 .. j] == tokens[n-L .. n-1], for j < n-1
    match = np.zeros(n - 1, dtype=np.int64)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) if limit >= 1 else np.zeros(0, dtype=np.int64)
    if ends.size:
        match[ends] = _common_suffixes(tokens, ends, np.minimum(ends + 1, limit))
    ends = np.flatnonzero(match >= allowed_length)
    if not ends.size:
        return none
    following, lengths = tokens[ends + 1], match[ends]
    ids, at = np.unique(following, return_inverse=True)
    longest = np.zeros(len(ids), dtype=np.int64)
    np.maximum.at(longest, at, lengths)
    if breakers is not None and breakers.single:
        keep = ~np.isin(ids, breakers.single)
        ids, longest = ids[keep], longest[keep]
    exponent = longest - allowed_length
    if base > 1.000001:
        exponent = np.minimum(exponent, int(_FLOAT_MAX_LOG / math.log(base)))
    return ids, (multiplier * np.power(np.float64(base), exponent)).astype(np.float32)


# Polynomial hashes modulo two primes below 2^31 (every product of two residues fits in int64): a segment's hash
# is comparable to another's in O(1), so each candidate's repeat length is a binary search, O(n + c log n) for the
# window (a periodic text, where a loop over lengths would be quadratic, included). Two unequal segments agree on
# both hashes with probability about 2^-62.
_MODULI = (2147483629, 2147483587)
_BASE = 1_000_003
_powers: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # modulus -> (B^t, B^-t) mod it, t < len


def _power_tables(modulus: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    tables = _powers.get(modulus)
    if tables is None or len(tables[0]) < n:
        inverse = pow(_BASE, -1, modulus)
        size = 1 << max(n - 1, 1).bit_length()
        up, down = np.ones(1, dtype=np.int64), np.ones(1, dtype=np.int64)
        while len(up) < size:  # doubling: [x^0 .. x^(k-1)] then those times x^k
            k = len(up)
            up = np.concatenate([up, up * pow(_BASE, k, modulus) % modulus])
            down = np.concatenate([down, down * pow(inverse, k, modulus) % modulus])
        tables = _powers[modulus] = (up, down)
    return tables


def _common_suffixes(tokens: np.ndarray, ends: np.ndarray, most: np.ndarray) -> np.ndarray:
    """For each end j, the longest L <= most[j] with tokens[j-L+1 .. j] == tokens[n-L .. n-1]."""
    n = len(tokens)
    sums = []
    for modulus in _MODULI:
        up, down = _power_tables(modulus, n)
        scaled = tokens % modulus * down[:n] % modulus  # x_t * B^-t
        sums.append((modulus, up, np.concatenate([[0], np.cumsum(scaled) % modulus])))

    def equal(at: np.ndarray, length: np.ndarray) -> np.ndarray:
        ok = np.ones(len(at), dtype=bool)
        a, b = at + 1 - length, n - length  # the two segments' starts
        for modulus, up, prefix in sums:  # sum of x_t * B^(t - start): the segment's hash
            ha = (prefix[at + 1] - prefix[a]) % modulus * up[a] % modulus
            hb = (prefix[n] - prefix[b]) % modulus * up[b] % modulus
            ok &= ha == hb
        return ok

    most = most.astype(np.int64)
    out = np.where(equal(ends, most), most, 0)  # whole matches first: runs and periodic text end here
    todo = np.flatnonzero(out < most)  # (L >= 1 known: the last tokens are equal)
    lo, hi = np.ones(len(todo), dtype=np.int64), most[todo] - 1
    while todo.size:  # binary search on the ends not settled yet
        mid = (lo + hi + 1) // 2
        ok = equal(ends[todo], mid)
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
        done = lo >= hi
        out[todo[done]] = lo[done]
        todo, lo, hi = todo[~done], lo[~done], hi[~done]
    return out


def _repeat_limit(tokens: np.ndarray, breakers: Breakers | None) -> int:
    """How long a repeat may be: the tokens after the most recent breaker (all of them without one)."""
    n = len(tokens)
    if breakers is None or not breakers.tails:
        return n
    heads = np.flatnonzero(np.isin(tokens, list(breakers.tails)))
    for at in heads[::-1].tolist():
        after = n - 1 - at  # tokens after the head
        longest = -1
        for tail in breakers.tails[int(tokens[at])]:
            if longest < len(tail) <= after and tuple(tokens[at + 1 : at + 1 + len(tail)].tolist()) == tail:
                longest = len(tail)
        if longest >= 0:
            return after - longest
    return n
