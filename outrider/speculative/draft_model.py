"""Classic speculative decoding with a separate small checkpoint (llama-server --model-draft).

The draft model keeps its own paged KV pool indexed by the target's block ids, so a request's block table
serves both. It learns committed tokens as the other drafters learn their rows (on_commit, in the Speculator's
batches): each token it has not seen is fed as a one-token sequence, through its decode graphs when they fit. So a
propose feeds the last committed token alone (its logits give d_1), however long the policy left it idle, then
drafts argmax tokens one position at a time on the device (DeviceChain: one graph for the whole chain).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from outrider.attention import KVCache, get_backend
from outrider.engine.cuda_graphs import CudaGraphRunner, default_buckets
from outrider.engine.request import Request
from outrider.attention.metadata import build_metadata, uniform_metadata_on_device
from outrider.models import load_model
from outrider.speculative.device_chain import DeviceChain
from outrider.speculative.device_round import RoundVerdict
from outrider.speculative.drafter import LEARN_ROWS, Commit, Proposals, block_capacity, greedy_drafts, row_seqs


class DraftModelDrafter:
    kind = "draft"
    aux_layer_ids: tuple[int, ...] = ()
    reads_hidden = False  # it feeds committed tokens to its own model
    learns = True
    stages_on_device = False  # its KV catch-up keeps the drafts as host lists
    drafts_ahead = False
    step_cost = 0.1  # [est] a draft model ~10x smaller than the target

    def __init__(self, path: str, vocab_size: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_draft: int = 16) -> None:
        self.device = torch.device(device)
        self.model, self.config = load_model(path, dtype, self.device)
        cfg = self.config
        self.kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.kv: KVCache | None = None  # allocated by the engine (Drafter.kv)
        self.block_size = block_size
        self.vocab_size = vocab_size  # the target's: drafts outside it are never proposed
        self.max_draft = max_draft
        self.backend = get_backend(self.device)
        self.graphs: CudaGraphRunner | None = None  # decode steps (one token per sequence), on CUDA
        self._logits: torch.Tensor | None = None  # [max batch, V] float32 the graphs write their logits into
        self._computed: dict[int, int] = {}  # request id -> leading positions whose draft KV is valid
        self._pending: dict[int, tuple[int, list[int]]] = {}  # request id -> (position, drafts fed there on)
        self.chain = DeviceChain(self._chain_step, block_size, self.device, offset=1)  # drafts after d_1

    def lookahead(self, k: int) -> int:
        return k  # writes x_last and d_1..d_{k-1}

    def may_propose(self, request: Request) -> bool:
        return True

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        ks = [min(k, self.max_draft, block_capacity(r, self.block_size) - (r.num_tokens - 1))
              for r, k in zip(requests, ks)]
        rows = [i for i, k in enumerate(ks) if k > 0]
        if not rows:
            return Proposals([[] for _ in requests], [[] for _ in requests])
        for i in rows:
            self._settle(requests[i])
        # Feed the last committed token (its logits give d_1), after any the draft KV still lacks.
        starts = [min(self._computed.get(requests[i].request_id, 0), requests[i].num_tokens - 1) for i in rows]
        ids = [t for i, c in zip(rows, starts) for t in requests[i].all_ids[c:]]
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        meta, positions = build_metadata([(requests[i].block_ids, c, requests[i].num_tokens - c)
                                          for i, c in zip(rows, starts)], self.block_size, self.device)
        if self.graphs is not None and self.graphs.can_run(meta):  # one token per row: every row is last
            logits = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv, meta, self.backend).hidden
            last = torch.tensor(meta.query_start_loc_host[1:]).to(self.device, non_blocking=True) - 1
            logits = self.model.compute_logits(hidden.index_select(0, last))
        tokens, conf = greedy_drafts(logits, self.vocab_size)
        out = self.chain.stage(requests, ks, rows, tokens, conf, None).to_host()
        for i in rows:
            req = requests[i]
            self._computed[req.request_id] = req.num_tokens
            self._pending[req.request_id] = (req.num_tokens, out.tokens[i][:-1])
        return out

    def round_drafts(self, verdict: RoundVerdict, table: torch.Tensor, k: int) -> torch.Tensor:
        """device_round.RoundDrafter. The round's inputs were this drafter's own: it fed the bonus token and
        d_1 .. d_{k-1} at p .. p + k - 1 while drafting them, so the kept ones' K/V stands. Feed the last kept input
        (d_k, when all were kept, was never fed; the others are rewritten unchanged) and the next bonus token at
        p + m, p + m + 1 (its logits give d_1), then chain d_2 .. d_k."""
        tokens = torch.cat([verdict.inputs.index_select(0, verdict.accepted), verdict.bonus])
        meta, positions = uniform_metadata_on_device(verdict.first - 1, 2, table, self.block_size)
        hidden = self.model(tokens, positions, self.kv, meta, self.backend).hidden
        drafts, _ = greedy_drafts(self.model.compute_logits(hidden[1:]), self.vocab_size)
        if k == 1:
            return drafts
        chained, _ = self.chain.steps(drafts, None, verdict.first + 1, torch.full_like(verdict.first, k), table, k - 1)
        return torch.cat([drafts, chained[0]])

    def _chain_step(self, tokens: torch.Tensor, state: None, positions: torch.Tensor,
                    meta) -> tuple[None, torch.Tensor, torch.Tensor]:
        """A draft after the first: feed the previous one (DeviceChain's step)."""
        hidden = self.model(tokens, positions, self.kv, meta, self.backend).hidden
        return (None, *greedy_drafts(self.model.compute_logits(hidden), self.vocab_size))

    @torch.inference_mode()
    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor | None,
                  aux_hidden: torch.Tensor | None) -> None:
        """Feed the committed tokens whose draft KV is missing (accepted drafts that propose fed are kept)."""
        fed: list[Commit] = []
        for c in commits:
            self._settle(c.request)
            rid, end = c.request.request_id, c.start + c.count
            begin = max(c.start, self._computed.get(rid, 0))
            if begin < end:
                fed.append(Commit(c.request, begin, end - begin))
                self._computed[rid] = end
        if not fed:
            return
        ids = [t for c in fed for t in c.request.token_slice(c.start, c.start + c.count)]
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if len(ids) <= LEARN_ROWS[-1]:  # a round's tokens: one-token sequences, a decode graph's shape
            meta, positions = build_metadata(row_seqs(fed), self.block_size, self.device)
            if self.graphs is not None and self.graphs.can_run(meta):
                self.graphs.run(input_ids, positions, meta)
                return
        else:  # (a prompt's: ragged)
            meta, positions = build_metadata([(c.request.block_ids, c.start, c.count) for c in fed], self.block_size,
                                             self.device)
        self.model(input_ids, positions, self.kv, meta, self.backend)

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        """The draft model's decode steps (d_1, and learning up to LEARN_ROWS[-1] committed tokens) and, per length,
        the chain of drafts after d_1 (DeviceChain) as CUDA graphs: one eager forward of even a small model costs a
        launch per kernel, tens of them per layer. The decode graphs write their logits into one buffer, as the
        target's decode graphs do."""
        buckets = sorted(set(default_buckets(max_batch)) | set(LEARN_ROWS))
        self._logits = torch.empty((buckets[-1], self.config.vocab_size), dtype=torch.float32, device=self.device)
        self.graphs = CudaGraphRunner(self._decode_logits, max_batch=buckets[-1], buckets=buckets,
                                      max_blocks_per_seq=-(-max_model_len // self.block_size),
                                      max_seq_len=max_model_len, device=self.device, pool=pool)
        self.graphs.capture()
        self.chain.capture(max_batch, max_model_len, self.max_draft - 1, pool)

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self.kv, meta, self.backend).hidden
        into = self._logits[: input_ids.shape[0]] if self._logits is not None else None
        return self.model.compute_logits(hidden, out=into)

    def _settle(self, req: Request) -> None:
        """Keep the speculative KV of drafts that the target accepted (they match committed tokens)."""
        pending = self._pending.pop(req.request_id, None)
        if pending is None:
            return
        pos, fed = pending
        committed = req.all_ids[pos : pos + len(fed)]
        n = next((j for j, (a, b) in enumerate(zip(fed, committed)) if a != b), min(len(fed), len(committed)))
        self._computed[req.request_id] = pos + n

    def release(self, request_id: int) -> None:
        self._computed.pop(request_id, None)
        self._pending.pop(request_id, None)

