"""A drafter whose acceptance is chosen, not learned, for `bench spec --acceptance α`.

It wraps a real drafter: every propose runs the real one first, so the drafting cost is real, and then replaces
its drafts with the target's own greedy continuation, recorded in a plain run of the same request. Each draft
position keeps the recorded token with probability α; the first position that misses gets a token that the
target will reject and ends the round. The slots after a miss are filled with such tokens too, so the verify
step still feeds as many drafts as the real drafter proposed and costs what it would.

A request's rounds draw how many positions they keep from a stratified sequence, not independently: a benchmark
of a few hundred rounds then realises the geometric law it states. With independent draws, `bench spec`'s seed 0
gave τ 5-10 % below theory at every preset (8 requests: EAGLE-3 α = 0.8, k = 4: τ 3.13 for 3.33), which
understated every speedup measured with it.

Inside device rounds (speculative/device_round.py: a request decoding alone, its rounds captured as CUDA graphs)
the substitution happens on the device (`RoundScript`): the recording and each coming round's kept count are
uploaded when the rounds start, from the same draws, and the captured round replaces the real drafter's drafts
there.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from outrider.engine.request import Request
from outrider.speculative.drafter import Drafter, Proposals, StagedDrafts, VerifiedRows
from outrider.upload import to_device


_GOLDEN = (math.sqrt(5) - 1) / 2  # the additive sequence frac(u0 + j * _GOLDEN) is the most evenly spread


@dataclass
class _Draws:
    """One request's stratified uniform draws: frac(offset + j * _GOLDEN) for its j-th round."""

    offset: float
    taken: int = 0

    def next(self) -> float:
        u = (self.offset + self.taken * _GOLDEN) % 1.0
        self.taken += 1
        return u


class RoundScript:
    """Controlled acceptance inside device rounds, for the request that runs them: its recording by position, the
    positions each coming round keeps (drawn for the drafter's longest round: a round of k drafts keeps at most k,
    whichever length the policy chooses for it), and the rounds taken since they were uploaded."""

    def __init__(self, max_len: int, max_rounds: int, device: torch.device) -> None:
        self.script = torch.zeros(max_len, dtype=torch.int64, device=device)
        self.kept = torch.zeros(max_rounds, dtype=torch.int64, device=device)
        self.taken = torch.zeros(1, dtype=torch.int64, device=device)

    def load(self, script: list[int], kept: list[int]) -> None:
        n = min(len(script), self.script.shape[0])
        self.script[:n] = torch.tensor(script[:n], dtype=torch.int64)
        self.kept[: len(kept)] = torch.tensor(kept[: self.kept.shape[0]], dtype=torch.int64)
        self.taken.zero_()

    def drafts(self, first: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
        """The next round's k drafts, for positions first + 1 ...: the recording's first kept, then tokens the
        target rejects (as ControlledDrafter._replacement); one round taken."""
        j = torch.arange(k, device=first.device)
        truth = self.script.index_select(0, torch.clamp(first + 1 + j, max=self.script.shape[0] - 1))
        kept = self.kept.index_select(0, torch.clamp(self.taken, max=self.kept.shape[0] - 1))
        self.taken.add_(1)
        return torch.where(j < kept, truth, (truth + 1) % vocab_size)


class ControlledDrafter:
    """The Drafter protocol: propose is replaced; every other member is the wrapped drafter's."""

    def __init__(self, inner: Drafter, acceptance: float, vocab_size: int, seed: int,
                 rounds: RoundScript | None = None) -> None:
        """rounds: where device rounds find their substitutes (None: the engine runs none)."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.inner = inner
        self.rounds = rounds
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.seed = seed
        self._script: dict[int, list[int]] = {}  # request id -> prompt + the plain run's greedy output
        self._draws: dict[int, _Draws] = {}
        self._checked: dict[int, int] = {}  # request id -> leading tokens found equal to the recording
        self.off_script: set[int] = set()  # requests whose committed tokens left the recording

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # kind, max_draft, kv_shape, on_commit, release, ...

    def expect(self, request_id: int, sequence: list[int], stream: int) -> None:
        """Request `request_id` should commit `sequence` (its prompt, then the plain run's output). `stream`
        seeds its own draws, so whether a position is kept does not depend on what else is in the batch."""
        self._script[request_id] = sequence
        self._draws[request_id] = _Draws(random.Random(self.seed * 1_000_003 + stream).random())
        self._checked[request_id] = 0

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        real = self.inner.propose(requests, ks)
        tokens = [self._substitute(req, len(drafts)) for req, drafts in zip(requests, real.tokens)]
        self._load_rounds(requests, [len(t) for t in tokens])
        # Argmax drafts (q one-hot), each fully confident: only greedy verification is measured.
        return Proposals(tokens, [[1.0] * len(t) for t in tokens])

    def stage(self, requests: Sequence[Request], ks: Sequence[int]) -> StagedDrafts:
        """As propose, for a drafter that leaves its drafts on the device: the real drafter really runs, and its
        drafts are replaced by these (uploaded without a sync), as its counts allow."""
        real = self.inner.stage(requests, ks)
        tokens = [t for req, n in zip(requests, real.counts) for t in self._substitute(req, n)]
        self._load_rounds(requests, real.counts)
        ids = torch.tensor(tokens, dtype=torch.int64).to(real.ids.device, non_blocking=True)
        return StagedDrafts(ids, torch.ones(len(tokens), dtype=torch.float64, device=real.ids.device), real.counts)

    def draft_ahead(self, rows: VerifiedRows, ks: Sequence[int]) -> StagedDrafts:
        """As stage, ahead of a verdict the host has not read: the replacement for every possible accepted count
        m_i is uploaded, and the device picks the one the verdict gives."""
        real = self.inner.draft_ahead(rows, ks)
        table, picks, owners = [], [], []
        for i, (req, n) in enumerate(zip(rows.requests, real.counts)):
            if not n:
                continue
            self._check(req)
            kept = self._kept(req, n)
            base = len(table)
            for m in range(rows.counts[i]):  # (the round in flight commits m + 1 tokens, its pending one first)
                table += self._replacement(req, req.num_tokens + m, n, kept)
            picks += [base + j for j in range(n)]
            owners += [i] * n
        if not table:
            return real
        device = real.ids.device
        table_d, picks_d, owners_d, counts_d = to_device(
            [(table, np.int64), (picks, np.int64), (owners, np.int64), ([real.counts[i] for i in owners], np.int64)],
            device)
        index = picks_d + rows.accepted.index_select(0, owners_d) * counts_d
        return StagedDrafts(table_d.index_select(0, index), torch.ones(len(picks), dtype=torch.float64, device=device),
                            real.counts)

    def round_drafts(self, verdict, table: torch.Tensor, k: int) -> torch.Tensor:
        """device_round.RoundDrafter: the real drafter drafts (its cost is real), then RoundScript's drafts replace
        its own."""
        drafts = self.inner.round_drafts(verdict, table, k)
        return self.rounds.drafts(verdict.first, k, self.vocab_size).to(drafts.dtype)

    def _load_rounds(self, requests: Sequence[Request], counts: Sequence[int]) -> None:
        """A lone request's first drafts may start device rounds (Speculator.device_round_drafts): upload its
        recording and the kept counts of its coming rounds, from a copy of its draws."""
        if self.rounds is None or len(requests) != 1 or not counts[0]:
            return
        rid = requests[0].request_id
        if rid not in self._script:
            return
        draws = replace(self._draws[rid])
        kept = [self._kept_of(draws.next(), self.inner.max_draft) for _ in range(self.rounds.kept.shape[0])]
        self.rounds.load(self._script[rid], kept)

    def _substitute(self, req: Request, n: int) -> list[int]:
        self._check(req)
        return self._replacement(req, req.num_tokens, n, self._kept(req, n))

    def _check(self, req: Request) -> None:
        """Mark the request off script if its committed tokens left the recording (numerics: the speculative run's
        target chose another token)."""
        rid = req.request_id
        script, known, checked = self._script[rid], req.num_tokens - req.num_pending, self._checked[rid]
        if rid not in self.off_script and req.token_slice(checked, known) != script[checked:known]:
            self.off_script.add(rid)
        self._checked[rid] = known

    def _kept(self, req: Request, n: int) -> int:
        """Leading positions of a round of n drafts that keep the recorded token: each with probability α, up to
        the first miss, so at least j with probability α^j. The round's uniform draw u is term r of the request's
        frac(u0 + r * golden ratio), r its round (device rounds draw from a copy: past them the host skips ahead,
        so no draw is used twice), and it keeps j positions when 1 - u <= α^j."""
        draws = self._draws[req.request_id]
        draws.taken = max(draws.taken, req.timing.draft_rounds)
        return self._kept_of(draws.next(), n)

    def _kept_of(self, u: float, n: int) -> int:
        if self.acceptance <= 0.0 or self.acceptance >= 1.0:
            return n if self.acceptance >= 1.0 else 0
        return min(n, int(math.log1p(-u) / math.log(self.acceptance)))

    def _replacement(self, req: Request, at: int, n: int, kept: int) -> list[int]:
        """n drafts for positions at, at + 1, ...: the recording's first `kept`, then (from the first miss on) a
        token other than the target's (past the recording's end, any token)."""
        truth = self._script[req.request_id][at : at + n]
        kept = min(kept, len(truth))
        return truth[:kept] + [(t + 1) % self.vocab_size for t in (truth + [0] * n)[kept:n]]
