"""A speculative round whose every input lives on the device, so that CUDA can capture it whole and replay it.

On a launch-bound target (a plain step that is all host time) a round built step by step costs the host about a
hundred small launches, uploads and index operations, several plain steps' time: no draft length pays for that.
Captured as one CUDA graph, the round leaves the host one replay and one small read a round. That needs a round whose shapes are fixed and whose data never passes through the host:

- `ids` [k + 1]: the next verify's input, the bonus token and k drafts;
- `first` [1]: the bonus token's position (p): the verify feeds positions p .. p + k;
- `table` [1, W]: the sequence's block table (the host rewrites it when the sequence gains blocks, between
  replays; blocks must cover p + k + 1 + the drafter's lookahead);
- `limit` [1]: the most drafts the verdict may keep: k, except in the first round after a switch from a shorter
  length.

`run()` verifies the drafts against the target's greedy tokens, keeps the verdict in `emitted` [k + 1] and
`accepted` [1] (m: the host commits emitted[:m + 1]), lets the drafter learn the k + 1 verified rows and draft the
next round from row m at p + m + 1, and advances `ids` and `first` to that round. Rows past m wrote K/V that the
next round overwrites before anything reads it (its verify starts at p + m + 1 <= p + k + 1).

The policy may change k between rounds. The rounds of the new length take over on the device (`continue_from`), in
order after the round in flight: the next round's bonus token, position and drafts carry over, the first k of them,
or all of them padded to k. Padded, that round keeps no more than the drafts it was given (`limit`): a pad the
target happened to keep would leave the draft model's K/V unwritten where it never fed one. Starting anew instead
costs the host a drafting and the round its overlap with the one before.

Batch 1 and greedy verification: the demo target's case, and the one drafting ahead does not win
(`docs/speculative.md`, "What is left"). Drafters that draft on the device implement RoundDrafter: DFlash
(dflash.py), the chain heads, MTP and EAGLE-3 (chain.py), and the draft model (draft_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from outrider.attention import AttentionMetadata
from outrider.attention.metadata import uniform_metadata_on_device
from outrider.kernels import ops
from outrider.upload import copy_to_host


@dataclass(frozen=True)
class RoundVerdict:
    """A device round's verify forward and its greedy verdict, all on the device."""

    inputs: torch.Tensor  # [k + 1] the verified tokens: the bonus token, then the k drafts
    hidden: torch.Tensor  # [k + 1, H] the target's pre-norm hidden states at positions p .. p + k
    aux_hidden: torch.Tensor | None  # [k + 1, A] the tapped layers' outputs there (drafters that read them)
    positions: torch.Tensor  # [k + 1]
    meta: AttentionMetadata  # the verify's: its slots are where those rows' K/V go
    emitted: torch.Tensor  # [k + 1] the target's greedy token after each row
    accepted: torch.Tensor  # [1] m: drafts kept
    bonus: torch.Tensor  # [1] emitted[m], the next round's first input
    first: torch.Tensor  # [1] p + m + 1, its position


class RoundDrafter(Protocol):
    """A drafter that drafts inside a device round: no host reads, fixed shapes."""

    def lookahead(self, k: int) -> int:
        """Positions past a round's first that drafting k tokens writes K/V at (the Drafter protocol's: the host
        reserves blocks for them)."""

    def round_drafts(self, verdict: RoundVerdict, table: torch.Tensor, k: int) -> torch.Tensor:
        """Learn the verdict's k + 1 rows (rows past m are rewritten by the next round before anything reads
        them), then draft the k tokens after verdict.bonus at verdict.first: the argmax drafts [k]. (No
        probabilities: a request that trims its drafts by them runs no device round, Engine._lone_greedy_decoder.)"""


class DeviceRound:
    """One sequence's rounds of k drafts, state on the device (see the module docstring)."""

    def __init__(self, runner, drafter: RoundDrafter, k: int, max_blocks: int) -> None:
        """runner: the target's ModelRunner (its forward taps the layers the drafter reads)."""
        self.runner, self.drafter, self.k = runner, drafter, k
        device = runner.device
        self.ids = torch.zeros(k + 1, dtype=torch.int64, device=device)
        self.first = torch.zeros(1, dtype=torch.int64, device=device)
        self.table = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
        self.emitted = torch.zeros(k + 1, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(1, dtype=torch.int64, device=device)
        self.limit = torch.full((1,), k, dtype=torch.int64, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None  # (capture)
        self._table_of: tuple[int, int] | None = None  # (id, length) of the block list the table holds

    def load(self, bonus: int, drafts: list[int] | torch.Tensor, position: int, blocks: list[int]) -> None:
        """Start from the host's state: `bonus` at `position` (its K/V not yet written), k drafts after it (a
        list, or a device tensor: copied without a sync)."""
        if len(drafts) != self.k:
            raise ValueError(f"a round verifies {self.k} drafts, got {len(drafts)}")
        self.ids[:1].fill_(bonus)
        self.ids[1:].copy_(torch.as_tensor(drafts, dtype=torch.int64), non_blocking=True)
        self.first.fill_(position)
        self.limit.fill_(self.k)
        self.set_blocks(blocks)

    def continue_from(self, previous: DeviceRound) -> None:
        """Take over the rounds `previous` (the same sequence's, of another length) ran, on the device and without a
        sync: its next round's bonus token, position and first k drafts; with fewer, all of them, padded by the last
        and kept no further (module docstring). The block table is the caller's to set."""
        n = min(self.k, previous.k)
        self.ids[: n + 1].copy_(previous.ids[: n + 1])
        self.ids[n + 1 :].copy_(previous.ids[n : n + 1].expand(self.k - n))
        self.first.copy_(previous.first)
        self.limit.fill_(n)

    def set_blocks(self, blocks: list[int]) -> None:
        """The sequence's block table, as the host's pool holds it now (copied only when it grew: the pool only
        appends to a running request's list, and gives it a new list when it rebuilds one)."""
        if (id(blocks), len(blocks)) == self._table_of:
            return
        if len(blocks) > self.table.shape[1]:
            raise ValueError(f"{len(blocks)} blocks exceed the round's table of {self.table.shape[1]}")
        self.table[0, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self._table_of = (id(blocks), len(blocks))

    def follow(self, req) -> None:
        """The sequence's block table and, for a hybrid target, its state slot, as the host holds them now."""
        self.set_blocks(req.block_ids)
        if self.runner.states is not None:
            self.runner.states.bind_round(req)

    def reach(self) -> int:
        """Positions, from the bonus token's, that the next run may write K/V at (for the host's reservation)."""
        return self.k + 1 + self.drafter.lookahead(self.k)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """CUDA: record the round as one graph (in memory pool `pool`, e.g. the engine's graphs'), which `replay`
        then launches. Its state must lead nowhere live (a fresh round's: block table zeros, so the capture's
        warm-up writes only the padding block)."""
        graph = torch.cuda.CUDAGraph()
        with ops.graph_capture():  # (its kernels warmed up, so compiled, before the capture)
            self.run()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=pool):
                self.run()
        graph.replay()  # (a graph's first replay uploads it: not in a request's round)
        torch.cuda.synchronize()
        self._graph = graph

    def replay(self) -> None:
        """One round: the captured graph, or the same work eagerly (CPU, or not captured)."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self.run()

    @torch.inference_mode()
    def run(self) -> None:
        """The round: what a captured graph replays (no host reads, fixed shapes)."""
        k, runner = self.k, self.runner
        meta, positions = uniform_metadata_on_device(self.first, k + 1, self.table, runner.block_size)
        states = runner.states
        if states is None:
            out = runner.forward_eager(self.ids, positions, meta)
        else:
            out = runner.forward_eager(self.ids, positions, meta, states.round_states(meta))
        hidden, aux = out.hidden, out.aux_hidden
        greedy = runner.model.compute_logits(hidden).argmax(dim=-1)
        # m: the drafts that equal the target's greedy token before them, up to the first that does not.
        m = (self.ids[1:] == greedy[:-1]).to(torch.int64).cumprod(0).sum(0, keepdim=True)
        m = torch.minimum(m, self.limit)
        self.limit.fill_(k)
        self.emitted.copy_(greedy)
        self.accepted.copy_(m)
        if states is not None:  # (a hybrid target's linear layers continue from the state after the m drafts)
            states.commit_round(m)
        verdict = RoundVerdict(inputs=self.ids, hidden=hidden, aux_hidden=aux, positions=positions, meta=meta,
                               emitted=greedy, accepted=m, bonus=greedy.index_select(0, m), first=self.first + m + 1)
        drafts = self.drafter.round_drafts(verdict, self.table, k)
        self.ids.copy_(torch.cat([verdict.bonus, drafts]))
        self.first.copy_(verdict.first)

    def read(self) -> list[int]:
        """The last run's committed tokens, emitted[:m + 1] (a host synchronisation)."""
        return committed(self.verdict_to_host())

    def verdict_to_host(self) -> RoundCopy:
        """Start copying the last run's verdict to the host, so that the next run may start before it is read."""
        if self.emitted.is_cuda:
            return RoundCopy(*copy_to_host(self.emitted, self.accepted))
        return RoundCopy([self.emitted.clone(), self.accepted.clone()], None)  # (the next run overwrites them)


@dataclass(frozen=True)
class RoundCopy:
    """A run's verdict on its way to the host: [emitted, accepted], complete once `ready` has passed."""

    host: list[torch.Tensor]
    ready: torch.cuda.Event | None


def committed(copy: RoundCopy) -> list[int]:
    """A run's committed tokens, emitted[:m + 1], once its copy has arrived (waiting for that copy alone)."""
    if copy.ready is not None:
        copy.ready.synchronize()
    emitted, accepted = copy.host
    return emitted.tolist()[: int(accepted[0]) + 1]


def device_rounds(runner, drafter: RoundDrafter, n_max: int, max_blocks: int,
                  graph_pool=None) -> dict[int, DeviceRound]:
    """A DeviceRound of this drafter per draft length 1..n_max, over the target's runner; captured as CUDA graphs into
    `graph_pool` (the target graphs' memory pool) when given."""
    rounds = {}
    for k in range(1, n_max + 1):
        rounds[k] = DeviceRound(runner, drafter, k, max_blocks)
        if graph_pool is not None:
            rounds[k].capture(graph_pool)
    return rounds
