"""Heads that draft by chaining one decoder layer over the target's hidden states: MTP (mtp.py) and EAGLE-3
(eagle3.py).

Both pair a target hidden state at position i with the committed token t_{i+1}, run their layer at position i
(its own KV: one extra layer indexed by the target's block ids) and predict t_{i+2}. The head's output at a
request's last committed pair gives d_1 for free after each commit; every further draft feeds the head its own
output and draft back (a chain: top-1 per step). Subclasses say what the head reads from the target, how it runs,
and how its logits become target token ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from outrider.attention import AttentionMetadata, KVCache, get_backend
from outrider.attention.metadata import build_metadata, uniform_metadata_on_device
from outrider.graphs import CudaGraphRunner
from outrider.speculative.device_chain import DeviceChain
from outrider.speculative.device_round import RoundVerdict
from outrider.speculative.drafter import (LEARN_ROWS, Commit, Proposals, StagedDrafts, TargetView, VerifiedRows,
                                         block_capacity, row_seqs, stage_drafts)

if TYPE_CHECKING:
    from outrider.engine.request import Request


class ChainDrafter:
    kv: KVCache  # the head's own pool: its constructor asks its KVPool for it
    aux_layer_ids: tuple[int, ...] = ()
    reads_hidden = True  # the head's input at each committed pair
    learns = True
    stages_on_device = True
    drafts_ahead = True

    def __init__(self, target: TargetView, block_size: int, device: torch.device | str, max_draft: int,
                 hidden_size: int, dtype: torch.dtype) -> None:
        """hidden_size, dtype: of the head's output y, which the next chain step reads back."""
        self.device = torch.device(device)
        self.hidden_size, self.dtype = hidden_size, dtype
        self.target = target
        self.block_size = block_size
        self.max_draft = max_draft
        self.backend = get_backend(self.device)
        # request id -> (head output y [H], d_1, its probability) at the last committed pair: d_1 comes for free.
        self._last: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Learning up to LEARN_ROWS[-1] rows as CUDA graphs (capture_graphs): a chain step over them, which gives
        # d_1 too. The drafts after d_1 chain on the device, from the head's output at d_1's position.
        self.graphs: CudaGraphRunner | None = None
        self._hidden_in: torch.Tensor | None = None  # the learning graphs' static hidden input
        self.chain = DeviceChain(lambda tokens, y, positions, meta: self._step(tokens, y, positions, meta),
                                 block_size, self.device, offset=0, state_size=hidden_size, dtype=dtype)

    # --- what a head defines ---
    def context(self, hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> torch.Tensor:
        """The head's hidden input for committed target rows (hidden pre-norm, aux_hidden the aux layers')."""
        raise NotImplementedError

    def run_head(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Head output y for pairs (hidden_i, tokens_i), writing its KV; y is fed back as the next hidden."""
        raise NotImplementedError

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """float32 logits over the head's vocabulary."""
        raise NotImplementedError

    def drafts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Argmax drafts as target token ids, and their probabilities."""
        raise NotImplementedError

    # --- the Drafter protocol ---
    def lookahead(self, k: int) -> int:
        return max(k - 1, 0)  # drafts d_2..d_k write the head's KV at positions p..p+k-2

    def may_propose(self, request: Request) -> bool:
        return True

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, seqs: list[tuple[list[int], int, int]]) -> torch.Tensor:
        meta, positions = build_metadata(seqs, self.block_size, self.device)
        return self.run_head(tokens, hidden, positions, meta)

    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chain step: (y, the next drafts, their probabilities)."""
        y = self.run_head(tokens, hidden, positions, meta)
        return (y, *self.drafts(self.logits(y)))

    def _learn_rows(self, tokens: torch.Tensor, hidden: torch.Tensor,
                    seqs: list[tuple[list[int], int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chain step over committed rows as one-token sequences `seqs`: through a learning graph when one fits
        (its outputs copied out: the next replay overwrites them), else eager."""
        meta, positions = build_metadata(seqs, self.block_size, self.device)
        if self.graphs is None or not self.graphs.can_run(meta):
            return self._step(tokens, hidden, positions, meta)
        self._hidden_in[: hidden.shape[0]].copy_(hidden)
        return tuple(t.clone() for t in self.graphs.run(tokens, positions, meta))

    @torch.inference_mode()
    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> None:
        # Pair each committed row i with t_{i+1}, already committed.
        nxt = [t for c in commits for t in c.request.token_slice(c.start + 1, c.start + c.count + 1)]
        if len(nxt) != hidden.shape[0]:
            raise ValueError("on_commit needs every committed row's next token in the request")
        tokens = torch.tensor(nxt, dtype=torch.int64).to(self.device, non_blocking=True)
        ctx = self.context(hidden, aux_hidden)
        ends = torch.tensor([n - 1 for n in itertools.accumulate(c.count for c in commits)])
        ends = ends.to(self.device, non_blocking=True)
        if len(nxt) <= LEARN_ROWS[-1]:  # a round's rows: one chain step over them as one-token sequences
            y, drafts, conf = (t.index_select(0, ends) for t in self._learn_rows(tokens, ctx, row_seqs(commits)))
        else:  # (a prefill's: ragged, and logits only where d_1 comes from)
            y = self._run(tokens, ctx, [(c.request.block_ids, c.start, c.count) for c in commits]).index_select(0, ends)
            drafts, conf = self.drafts(self.logits(y))
        for i, c in enumerate(commits):
            self._last[c.request.request_id] = (y[i], drafts[i], conf[i])

    @torch.inference_mode()
    def draft_ahead(self, rows: VerifiedRows, ks: Sequence[int]) -> StagedDrafts:
        # Each verified row pairs with the token emitted after it, as on_commit pairs committed rows.
        y, drafts, conf = self._learn_rows(rows.emitted, self.context(rows.hidden, rows.aux_hidden), rows.seqs())
        y, drafts, conf = (t.index_select(0, rows.last()) for t in (y, drafts, conf))
        for i, req in enumerate(rows.requests):
            self._last[req.request_id] = (y[i], drafts[i], conf[i])
        ks = [min(k, self.max_draft) for k in ks]
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if len(drafting) < len(ks):
            index = torch.tensor(drafting, dtype=torch.int64).to(self.device, non_blocking=True)
            y, drafts, conf, shift = (t.index_select(0, index) for t in (y, drafts, conf, rows.accepted))
        else:
            shift = rows.accepted
        return self.chain.stage(rows.requests, ks, drafting, drafts, conf, y, shift=shift)

    def round_drafts(self, verdict: RoundVerdict, table: torch.Tensor, k: int) -> torch.Tensor:
        """device_round.RoundDrafter: the head over the k + 1 verified rows as one-token sequences (row i paired
        with the target's token after it), d_1 from row m, then d_2 .. d_k chained from the bonus token's position."""
        n = verdict.positions.shape[0]
        rows, _ = uniform_metadata_on_device(verdict.positions, 1, table.expand(n, -1).contiguous(), self.block_size)
        y, drafts, _ = self._step(verdict.emitted, self.context(verdict.hidden, verdict.aux_hidden),
                                  verdict.positions, rows)
        y, drafts = y.index_select(0, verdict.accepted), drafts.index_select(0, verdict.accepted)
        if k == 1:
            return drafts
        chained, _ = self.chain.steps(drafts, y, verdict.first, torch.full_like(verdict.first, k), table, k - 1)
        return torch.cat([drafts, chained[0]])

    def release(self, request_id: int) -> None:
        self._last.pop(request_id, None)

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        """Learning (a chain step over up to LEARN_ROWS[-1] rows) and, per length, the chain of drafts after d_1 at
        the verify batch sizes, as CUDA graphs: an eager step costs a launch per kernel, and every round learns once
        and chains k - 1 steps (one replay: DeviceChain)."""
        self._hidden_in = torch.zeros(LEARN_ROWS[-1], self.hidden_size, dtype=self.dtype, device=self.device)
        learn = CudaGraphRunner(lambda ids, pos, meta: self._step(ids, self._hidden_in[: ids.shape[0]], pos, meta),
                                max_batch=LEARN_ROWS[-1], buckets=LEARN_ROWS,
                                max_blocks_per_seq=-(-max_model_len // self.block_size), max_seq_len=max_model_len,
                                device=self.device, pool=pool)
        learn.capture()
        self.graphs = learn  # (only once captured: a failed capture leaves learning eager)
        self.chain.capture(max_batch, max_model_len, self.max_draft - 1, pool)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        return self.stage(requests, ks).to_host()

    @torch.inference_mode()
    def stage(self, requests: Sequence[Request], ks: Sequence[int]) -> StagedDrafts:
        ks = [min(k, self.max_draft, block_capacity(r, self.block_size) - r.num_tokens + 2)
              if r.request_id in self._last else 0 for r, k in zip(requests, ks)]
        rows = [i for i, k in enumerate(ks) if k > 0]
        if not rows:
            return stage_drafts([], [], [], len(requests))
        y, tokens, conf = (torch.stack(parts) for parts in zip(*(self._last[requests[i].request_id] for i in rows)))
        return self.chain.stage(requests, ks, rows, tokens, conf, y)
