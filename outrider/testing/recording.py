"""A drafter that records what speculation asks and tells the drafter it wraps, for tests. Installed with
`Speculation.drafting_with(RecordingDrafter(loaded), rounds)`, it answers as the loaded drafter does (every
attribute is the wrapped one's) and logs, in call order:

- each proposal (`propose`, or `stage` for drafters whose drafts stay on the device: read back for the record
  only): the requests' sequences, the lengths asked, the drafts and their confidences, in `proposals`;
- each learning call (`on_commit`): ("learn", [(request id, first row, rows) per commit], hidden rows or None), and
  each release of a request, ("release", request id), in `events`; `note(event)` adds a test's own (a block
  release, a forward) to the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from outrider.engine.request import Request
from outrider.speculative.drafter import Commit, Drafter, Proposals, StagedDrafts


@dataclass
class RecordingDrafter:
    """`min_lookahead`: a round reserves blocks at least this far past a request's last token, as if the drafter
    wrote there (the wrapped drafter's own lookahead where it is further)."""

    inner: Drafter
    min_lookahead: int = 0
    proposals: list[tuple[list[tuple[int, ...]], list[int], list[list[int]], list[list[float]]]] = field(
        default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # (not set yet: copying or unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def note(self, event: tuple[Any, ...]) -> None:
        self.events.append(event)

    def learned(self, request_id: int) -> list[tuple[int, int]]:
        """(first row, rows) of every commit of the request the drafter learned, in order."""
        return [(s, n) for e in self.events if e[0] == "learn" for rid, s, n in e[1] if rid == request_id]

    def _record(self, requests: Sequence[Request], ks: Sequence[int], props: Proposals) -> None:
        self.proposals.append(([tuple(r.all_ids) for r in requests], list(ks), props.tokens, props.confidence))

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        self.note(("propose", len(requests)))
        props = self.inner.propose(requests, ks)
        self._record(requests, ks, props)
        return props

    def stage(self, requests: Sequence[Request], ks: Sequence[int]) -> StagedDrafts:
        self.note(("propose", len(requests)))
        staged = self.inner.stage(requests, ks)
        self._record(requests, ks, staged.to_host())
        return staged

    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor | None,
                  aux_hidden: torch.Tensor | None) -> None:
        rows = None if hidden is None else hidden.shape[0]
        self.note(("learn", [(c.request.request_id, c.start, c.count) for c in commits], rows))
        return self.inner.on_commit(commits, hidden, aux_hidden)

    def release(self, request_id: int) -> None:
        self.note(("release", request_id))
        self.inner.release(request_id)

    def lookahead(self, k: int) -> int:
        return max(self.inner.lookahead(k), self.min_lookahead)
