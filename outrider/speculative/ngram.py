"""N-gram (prompt lookup) drafting, llama-server's `ngram-simple`: no weights, nothing on the device.

The drafts for a request are the tokens that followed the newest earlier occurrence of its last n tokens (prompt
and outputs alike), once that n-gram has occurred at least `min_hits` times. Code edits, answers that quote
their sources and JSON that repeats its keys re-emit what the context already holds, and the target accepts such
drafts in long runs; where nothing repeats, nothing is drafted and the step stays a plain (overlapped) one.

Each request has an index of its n-grams, updated as tokens are committed (each token is hashed once), so a
round costs O(n + k) host work whatever the context length: no scan. Drafts are argmax-like (q one-hot), so
rejection sampling stays lossless at any temperature.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

import torch

from outrider.attention import KVCache
from outrider.config import NgramConfig
from outrider.speculative.drafter import Commit, Proposals

if TYPE_CHECKING:
    from outrider.engine.request import Request

# Drafts per round when the server names no length. A lookup costs nothing on the device, and a verify of 17 rows
# costs a launch-bound target about what one of 9 does, while copies run long: on edit workloads a cap of 16 earns
# more than 8 (docs/benchmarks.md). The policy still measures each length's cost.
NATURAL_N_MAX = 16


def gram_hashes(tokens: list[int], width: int) -> Iterable[int]:
    """Hashes of every window tokens[i:i+width], in order (C-speed iteration: no Python loop per token)."""
    if width == 0:
        return repeat(hash(()), len(tokens) + 1)
    return map(hash, zip(*(tokens[j:] for j in range(width))))


@dataclass
class NgramIndex:
    """One request's n-grams that have a known next token: where each last occurred and how often, and how often
    each (n-1)-gram did (what may_propose checks while the request's last token is still on the device).

    Grams are keyed by hash; a lookup compares the tokens, so a collision can cost a draft, never a wrong one.
    `ops` counts the tokens read and grams hashed: the work a round does, which tests hold flat in context length."""

    n: int
    indexed: int = 0  # grams ending before this position (exclusive end) are indexed
    last: dict[int, int] = field(default_factory=dict)  # n-gram hash -> exclusive end of its newest occurrence
    hits: Counter = field(default_factory=Counter)  # n-gram hash -> occurrences
    prefix_hits: Counter = field(default_factory=Counter)  # (n-1)-gram hash -> occurrences
    ops: int = 0

    def catch_up(self, req: Request, known: int) -> None:
        """Index every gram whose next token lies below `known` (the request's first `known` tokens are on the
        host)."""
        start, n = self.indexed, self.n
        if known <= start:
            return
        if known == start + 1:  # (a decode step's one new gram: what the general path does, without its machinery)
            self._index_one(req, start)
            return
        first = max(0, start - n)  # the grams ending at start.. known - 1 read tokens first.. known - 2
        tokens = req.token_slice(first, known - 1)
        self.ops += len(tokens)
        if known - 1 >= n:
            begin = max(start, n)  # grams ending at begin..known-1 start at begin - n - first in `tokens`
            keys = list(gram_hashes(tokens[begin - n - first :], n))
            self.last.update(zip(keys, range(begin, known)))
            self.hits.update(keys)
            self.ops += len(keys)
        if known - 1 >= n - 1:
            begin = max(start, n - 1)
            keys = list(gram_hashes(tokens[begin - (n - 1) - first :], n - 1))
            self.prefix_hits.update(keys)
            self.ops += len(keys)
        self.indexed = known

    def _index_one(self, req: Request, end: int) -> None:
        """Index the n-gram and the (n-1)-gram that end at `end` (exclusive), whose next token is known."""
        n = self.n
        tokens = req.token_slice(max(0, end - n), end)
        self.ops += len(tokens)
        if end >= n:
            key = hash(tuple(tokens))
            self.last[key] = end
            self.hits[key] += 1
            self.ops += 1
        if end >= n - 1:
            self.prefix_hits[hash(tuple(tokens[len(tokens) - (n - 1):]))] += 1
            self.ops += 1
        self.indexed = end + 1

    def continuation(self, req: Request, known: int, k: int, min_hits: int) -> list[int]:
        """Up to k tokens that followed the newest earlier occurrence of the last n known tokens, if that n-gram
        occurred min_hits times. A continuation that runs into the present repeats itself (a period shorter than
        k keeps going, as an overlapping copy does)."""
        n = self.n
        if known < n + 1:
            return []
        tail = req.token_slice(known - n, known)
        key = hash(tuple(tail))
        self.ops += n + 1
        if self.hits[key] < min_hits:
            return []
        end = self.last[key]
        if req.token_slice(end - n, end) != tail:  # a hash collision
            return []
        out = req.token_slice(end, min(end + k, known))
        period = known - end
        while len(out) < k:
            out.append(out[len(out) - period])
        self.ops += n + k
        return out

    def may_hit(self, req: Request, known: int, pending: int, min_hits: int) -> bool:
        """Whether continuation() may draft once the request's `pending` tokens (still on the device) are known.
        With one pending token, an earlier occurrence of the next tail starts with the last n-1 known tokens: a
        necessary condition, checked in the (n-1)-gram counts."""
        n = self.n
        self.ops += n
        if pending == 0:
            return known >= n + 1 and self.hits[hash(tuple(req.token_slice(known - n, known)))] >= min_hits
        if pending == 1:
            return known >= n and self.prefix_hits[hash(tuple(req.token_slice(known - n + 1, known)))] >= min_hits
        return True


class NgramDrafter:
    kind = "ngram"
    aux_layer_ids: tuple[int, ...] = ()
    reads_hidden = False
    # Indexing committed tokens (on_commit) can wait until a lookup (may_propose, propose catch up first): the
    # engine queues nothing for it alone, which would cost host work on every step.
    learns = False
    stages_on_device = False  # (its drafts are made on the host)
    drafts_ahead = False
    step_cost = 0.01  # [est] a dictionary lookup on the host; nothing runs on the device
    kv_shape = (0, 0, 0)  # no KV pool: a pool of zero layers allocates nothing

    def __init__(self, config: NgramConfig, max_draft: int) -> None:
        self.config = config
        self.max_draft = min(max_draft, config.size_m)
        self.kv: KVCache | None = None  # (no pool)
        self._index: dict[int, NgramIndex] = {}

    def index_of(self, req: Request) -> NgramIndex:
        index = self._index.get(req.request_id)
        if index is None:
            index = self._index[req.request_id] = NgramIndex(self.config.size_n)
        return index

    def lookahead(self, k: int) -> int:
        return 0  # it writes no KV

    def may_propose(self, request: Request) -> bool:
        known = request.num_prompt + len(request.output_ids)
        index = self.index_of(request)
        index.catch_up(request, known)
        return index.may_hit(request, known, request.num_pending, self.config.min_hits)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        tokens = []
        for req, k in zip(requests, ks):
            known = req.num_prompt + len(req.output_ids)
            index = self.index_of(req)
            index.catch_up(req, known)
            tokens.append(index.continuation(req, known, min(k, self.max_draft), self.config.min_hits))
        return Proposals(tokens, [[1.0] * len(t) for t in tokens])

    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor | None,
                  aux_hidden: torch.Tensor | None) -> None:
        for c in commits:  # positions start..start+count-1 and the token after them are known
            self.index_of(c.request).catch_up(c.request, c.start + c.count + 1)

    def release(self, request_id: int) -> None:
        self._index.pop(request_id, None)

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        """Nothing runs on the device."""
