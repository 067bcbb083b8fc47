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
from outrider.spec.verify import verify
from outrider.engine.scheduler import StepPlan


@dataclass
class StepOutput:
    """Per scheduled request (in plan order) unless noted."""

    tokens: list[list[int]]  # the tokens this step commits (empty mid-prefill; m+1 after a verify)
    logprobs: list[list[TokenLogprob]]  # one per committed token, when the request asked for n_probs
    accepted: list[int]  # m: drafts accepted this step
    hidden: torch.Tensor  # [T, H] pre-norm hidden states of every fed row (drafters read these)
    aux_hidden: torch.Tensor | None  # [T, A] outputs of model.aux_layer_ids, when a drafter reads them
    proposed: list[int]  # k: drafts fed this step


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
        self.eog_ids: tuple[int, ...] = ()  # end-of-generation ids, banned by ignore_eos / min_tokens
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

    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [T, H] pre-norm, aux_hidden [T, A] or None) from a captured graph or eagerly."""
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            out = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            out = self.forward_eager(batch.input_ids, batch.positions, batch.meta)
        return (out, None) if isinstance(out, torch.Tensor) else out

    def forward_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """The model call CUDA graphs capture: the hidden states, plus aux_hidden when a drafter reads them."""
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend)
        return (hidden, self.model.aux_hidden) if self.model.aux_layer_ids else hidden

    @torch.inference_mode()
    def execute(self, plan: StepPlan, draft_probs: dict[int, torch.Tensor] | None = None) -> StepOutput:
        """Run one step: forward, sample (or verify drafts on) the rows that need it, bring tokens to the host.

        draft_probs: request_id -> q [k, V] for drafts that were sampled (absent: argmax drafts)."""
        batch = self.prepare(plan)
        hidden, aux = self.forward(batch)
        n = len(plan.scheduled)
        out = StepOutput([[] for _ in range(n)], [[] for _ in range(n)], [0] * n, hidden, aux,
                         [len(s.draft_tokens) for s in plan.scheduled])
        rows = [r for rows in batch.logits_rows for r in rows]
        if rows:
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            sampling = [i for i, s in enumerate(plan.scheduled) if s.samples]
            drafts = [plan.scheduled[i].draft_tokens for i in sampling]
            sbatch = self.sampler.prepare(self.row_specs(plan), sample_only=not any(drafts))
            if any(drafts):
                probs = draft_probs or {}
                q = [_trim(probs.get(plan.scheduled[i].request.request_id), len(d)) for i, d in zip(sampling, drafts)]
                verdict = verify(self.sampler, logits, sbatch, drafts, q)
                tokens, accepted, starts, sampled = verdict.tokens, verdict.num_accepted, verdict.starts, verdict.output
            else:
                sampled = self.sampler.sample(logits, sbatch)
                tokens = [[t] for t in sampled.token_ids.tolist()]  # the step's one host synchronisation
                accepted, starts = [0] * len(sampling), list(range(len(sampling)))
            top = None
            if sampled.top_ids is not None:
                top = (sampled.top_ids.tolist(), sampled.top_logprobs.tolist(), sampled.chosen_logprob.tolist())
            for r, i in enumerate(sampling):
                out.tokens[i], out.accepted[i] = tokens[r], accepted[r]
                n_probs = plan.scheduled[i].request.params.n_probs
                if top is not None and n_probs > 0:
                    ids, lps, chosen = top
                    out.logprobs[i] = [TokenLogprob(tok, chosen[p], list(zip(ids[p][:n_probs], lps[p][:n_probs])))
                                       for p, tok in enumerate(tokens[r], start=starts[r])]
        if self.step_hook is not None:
            self.step_hook(plan)
        return out

    def row_specs(self, plan: StepPlan) -> list[RowSpec]:
        """One sampling row per logits row: its params, seed, output index (RNG counter), history and bans."""
        specs: list[RowSpec] = []
        for s in plan.scheduled:
            if not s.samples:
                continue
            req = s.request
            p = req.params
            history = _penalty_window(req.all_ids, p)
            for j in range(len(s.draft_tokens) + 1):
                step = len(req.output_ids) + j
                # EOS/EOG may not be sampled with ignore_eos, nor before min_tokens (llama-server bans them).
                banned = self.eog_ids if p.ignore_eos or step < p.min_tokens else ()
                specs.append(RowSpec(p, req.seed, step, history + s.draft_tokens[:j], banned))
        return specs


def _trim(q: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """A drafter's q for the drafts the scheduler kept (it may cut a proposal short)."""
    return None if q is None or k == 0 else q[:k]


def _penalty_window(ids: list[int], params: SamplingParams) -> list[int]:
    """The recent tokens the penalties look at (none when no penalty is set)."""
    p = params
    if p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return []
    return ids if p.repeat_last_n < 0 else ids[-p.repeat_last_n :]
