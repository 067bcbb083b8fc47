"""ModelRunner: owns the device side of a step — the model, its KV pool, batch tensors and the sampler.

`prepare` turns a StepPlan into flat tensors and an explicit AttentionMetadata; `forward` runs the model and
returns hidden states; `sample` runs the vectorised sampler. Nothing here decides policy (scheduler.py) or
commits tokens (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from outrider.attention import AttentionMetadata, KVCache, get_backend
from outrider.engine.cuda_graphs import CudaGraphRunner
from outrider.engine.sampler import RowSpec, Sampler
from outrider.engine.request import TokenLogprob
from outrider.params import SamplingParams
from outrider.engine.scheduler import StepPlan


@dataclass
class StepOutput:
    tokens: list[list[int]]  # per scheduled request: the tokens this step commits (empty mid-prefill)
    logprobs: list[list[TokenLogprob]]  # per scheduled request, when it asked for n_probs
    hidden: torch.Tensor  # [T, H] pre-norm hidden states of every fed token (drafters read these)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # logits rows: for each scheduled request, the flat indices whose logits are needed (empty = none)
    logits_rows: list[list[int]]


def build_metadata(seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device,
                   causal: bool = True) -> tuple[AttentionMetadata, torch.Tensor]:
    """seqs: (block table, tokens already cached, query tokens this step) per sequence -> (meta, positions)."""
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    lens: list[int] = []
    for blocks, start, n in seqs:
        for p in range(start, start + n):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
    width = max((len(b) for b, _, _ in seqs), default=1) or 1
    table = [b + [0] * (width - len(b)) for b, _, _ in seqs]

    def t(x: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=t(slots, torch.int64),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(lens, torch.int32),
        block_tables=t(table, torch.int32),
        max_query_len=max((n for _, _, n in seqs), default=0),
        max_seq_len=max(lens, default=0),
        causal=causal,
        query_start_loc_host=qsl,
        seq_lens_host=lens,
    )
    return meta, t(positions, torch.int64)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, vocab_size: int, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.backend = get_backend(device)
        self.sampler = Sampler(vocab_size, device)
        self.graphs: CudaGraphRunner | None = None  # decode CUDA graphs, set by the engine on CUDA
        # Test hook: called with the plan inside each step, before results reach the host (e.g. to sleep).
        self.step_hook: Callable[[StepPlan], None] | None = None

    def prepare(self, plan: StepPlan) -> StepBatch:
        ids: list[int] = []
        seqs: list[tuple[list[int], int, int]] = []
        logits_rows: list[list[int]] = []
        for s in plan.scheduled:
            req = s.request
            start = req.num_computed
            toks = req.all_ids[start : start + s.num_new_tokens] + s.draft_tokens
            base = len(ids)
            ids.extend(toks)
            seqs.append((req.block_ids, start, len(toks)))
            # A sampling row reads the last known token's logits, then one row per draft token.
            first = base + s.num_new_tokens - 1
            logits_rows.append(list(range(first, base + len(toks))) if s.samples else [])
        meta, positions = build_metadata(seqs, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return StepBatch(input_ids, positions, meta, logits_rows)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step: forward, sample the rows that need it, and bring the tokens to the host."""
        batch = self.prepare(plan)
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, self.backend)
        rows = [r for rows in batch.logits_rows for r in rows]
        tokens: list[list[int]] = [[] for _ in plan.scheduled]
        logprobs: list[list[TokenLogprob]] = [[] for _ in plan.scheduled]
        if rows:
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            sbatch = self.sampler.prepare(self.row_specs(plan))
            out = self.sampler.sample(logits, sbatch)
            token_ids = out.token_ids.tolist()  # the step's one host synchronisation
            top = None
            if out.top_ids is not None:
                top = (out.top_ids.tolist(), out.top_logprobs.tolist(), out.chosen_logprob.tolist())
            r = 0
            for i, s in enumerate(plan.scheduled):
                if not s.samples:
                    continue
                tokens[i] = [token_ids[r]]
                n_probs = s.request.params.n_probs
                if top is not None and n_probs > 0:
                    ids, lps, chosen = top
                    logprobs[i] = [TokenLogprob(token_ids[r], chosen[r], list(zip(ids[r][:n_probs], lps[r][:n_probs])))]
                r += 1
        if self.step_hook is not None:
            self.step_hook(plan)
        return StepOutput(tokens, logprobs, hidden)

    @staticmethod
    def row_specs(plan: StepPlan) -> list[RowSpec]:
        """One sampling row per logits row: its params, seed, output index (RNG counter) and history."""
        specs: list[RowSpec] = []
        for s in plan.scheduled:
            if not s.samples:
                continue
            req = s.request
            history = _penalty_window(req.all_ids, req.params)
            for j in range(len(s.draft_tokens) + 1):
                specs.append(RowSpec(req.params, req.seed, len(req.output_ids) + j,
                                     history + s.draft_tokens[:j]))
        return specs


def _penalty_window(ids: list[int], params: SamplingParams) -> list[int]:
    """The recent tokens the penalties look at (none when no penalty is set)."""
    p = params
    if p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return []
    return ids if p.repeat_last_n < 0 else ids[-p.repeat_last_n :]
