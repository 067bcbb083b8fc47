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

import torch

from outrider.attention import AttentionMetadata, KVCache, get_backend
from outrider.attention.metadata import build_metadata, decode_metadata_on_device
from outrider.engine.cuda_graphs import VERIFY_BUCKETS, CudaGraphRunner
from outrider.engine.request import Request
from outrider.speculative.drafter import (LEARN_ROWS, Commit, Proposals, StagedDrafts, TargetView, block_capacity,
                                         row_seqs, stage_drafts)


class ChainDrafter:
    aux_layer_ids: tuple[int, ...] = ()
    reads_hidden = True  # the head's input at each committed pair
    stages_on_device = True

    def __init__(self, target: TargetView, block_size: int, device: torch.device | str, max_draft: int,
                 hidden_size: int, dtype: torch.dtype) -> None:
        """hidden_size, dtype: of the head's output y, which the next chain step reads back."""
        self.device = torch.device(device)
        self.hidden_size, self.dtype = hidden_size, dtype
        self.target = target
        self.kv: KVCache | None = None  # allocated by the engine (Drafter.kv)
        self.block_size = block_size
        self.max_draft = max_draft
        self.backend = get_backend(self.device)
        # request id -> (head output y [H], d_1, its probability) at the last committed pair: d_1 comes for free.
        self._last: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # CUDA graphs (capture_graphs): learning up to LEARN_ROWS[-1] rows (a chain step over them, which gives
        # d_1 too), and by length d the chain of drafts d_2..d_{d+1} at batch 1-8
        self.graphs: CudaGraphRunner | None = None
        self.chains: dict[int, CudaGraphRunner] = {}
        self._hidden_in: torch.Tensor | None = None  # the graphs' static inputs: head output, and per row its k
        self._ks_in: torch.Tensor | None = None

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

    def release(self, request_id: int) -> None:
        self._last.pop(request_id, None)

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        """Learning (a chain step over up to LEARN_ROWS[-1] rows) and, per length, the chain of drafts after d_1 at
        the verify batch sizes, as CUDA graphs: an eager step costs a launch per kernel, and every round learns once
        and chains k - 1 steps. A chain's steps advance their metadata on the device, so one replay runs them all."""
        common = dict(max_blocks_per_seq=-(-max_model_len // self.block_size), max_seq_len=max_model_len,
                      device=self.device, pool=pool)
        self._hidden_in = torch.zeros(LEARN_ROWS[-1], self.hidden_size, dtype=self.dtype, device=self.device)
        self._ks_in = torch.zeros(LEARN_ROWS[-1], dtype=torch.int64, device=self.device)
        learn = CudaGraphRunner(lambda ids, pos, meta: self._step(ids, self._hidden_in[: ids.shape[0]], pos, meta),
                                max_batch=LEARN_ROWS[-1], buckets=LEARN_ROWS, **common)
        learn.capture()
        buckets = [b for b in VERIFY_BUCKETS if b <= max_batch]
        chains = {}
        for depth in range(1, self.max_draft):
            chains[depth] = CudaGraphRunner(
                lambda ids, pos, meta, depth=depth: self._chain_steps(
                    ids, self._hidden_in[: ids.shape[0]], pos, self._ks_in[: ids.shape[0]], meta.block_tables, depth),
                max_batch=buckets[-1], buckets=buckets, **common)
            chains[depth].capture()
        # (only once every graph is captured: a failed capture leaves drafting and learning eager)
        self.graphs, self.chains = learn, chains

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
        owners, drafts, probs = list(rows), [tokens], [conf]
        depth = max(ks[i] for i in rows) - 1
        if depth > 0:
            chained, chained_conf = self._chain(tokens, y, [requests[i] for i in rows], [ks[i] for i in rows], depth)
            kept = [r * depth + j for r, i in enumerate(rows) for j in range(ks[i] - 1)]  # [n, depth] flat, row-major
            flat, flat_conf = chained.reshape(-1), chained_conf.reshape(-1)
            if len(kept) < flat.shape[0]:  # (some request's k is below the longest)
                index = torch.tensor(kept).to(self.device, non_blocking=True)
                flat, flat_conf = flat.index_select(0, index), flat_conf.index_select(0, index)
            owners += [i for i in rows for _ in range(ks[i] - 1)]
            drafts.append(flat)
            probs.append(flat_conf)
        return stage_drafts(owners, drafts, probs, len(requests))

    def _chain(self, tokens: torch.Tensor, y: torch.Tensor, requests: Sequence[Request], ks: list[int],
               depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts d_2..d_{depth+1} and their probabilities, [n, depth] each, for n requests whose d_1 is `tokens`
        (head output y): a captured graph when one fits, else the same steps eagerly."""
        meta, start = build_metadata([(r.block_ids, r.num_tokens - 1, 1) for r in requests], self.block_size,
                                     self.device)
        ks_dev = torch.tensor(ks, dtype=torch.int64).to(self.device, non_blocking=True)
        graphs = self.chains.get(depth)
        if graphs is None or not graphs.can_run(meta):
            return self._chain_steps(tokens, y, start, ks_dev, meta.block_tables, depth)
        n = len(requests)
        self._hidden_in[:n].copy_(y)
        self._ks_in.zero_()  # (rows padding the batch draft nothing)
        self._ks_in[:n].copy_(ks_dev)
        return graphs.run(tokens, start, meta)  # (views until the next replay: stage copies them out at once)

    def _chain_steps(self, tokens: torch.Tensor, y: torch.Tensor, start: torch.Tensor, ks: torch.Tensor,
                     block_tables: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`depth` chain steps from d_1, the head at positions start, start + 1, ...: step j drafts d_{j+2}, and
        writes KV, only for rows whose k reaches it. The metadata of each step is computed on the device."""
        drafted, confidence = [], []
        for j in range(depth):
            positions = start + j
            meta = decode_metadata_on_device(positions, ks > j + 1, block_tables, self.block_size)
            y, tokens, conf = self._step(tokens, y, positions, meta)
            drafted.append(tokens)
            confidence.append(conf)
        return torch.stack(drafted, dim=1), torch.stack(confidence, dim=1)
