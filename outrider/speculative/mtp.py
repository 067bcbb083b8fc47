"""Multi-token-prediction heads shipped inside the target checkpoint, used as a drafter.

Two layouts: Qwen3-Next / Qwen3.5 (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.*`, `mtp.norm`) and MiMo (`model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj,
<decoder layer>, final_layernorm}`). Both fuse the embedding of token t_{i+1} with the target's final-norm
hidden h_i, run one decoder layer with its own KV (one extra layer, indexed by the target's block ids), norm,
and use the target's lm_head to predict t_{i+2}. Drafting deeper than 1 feeds the head its own output back,
reusing layer 0 (released checkpoints have one layer; acceptance decays with depth).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from outrider.attention import AttentionBackend, AttentionMetadata, KVCache, get_backend
from outrider.config import ModelConfig
from outrider.engine.request import Request
from outrider.attention.metadata import build_metadata
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import RotaryEmbedding
from outrider.models import read_tensors
from outrider.models.llama import DecoderLayer
from outrider.speculative.drafter import (Commit, Proposals, TargetView, block_capacity, collect_drafts,
                                         greedy_drafts)


class QwenMTP(nn.Module):
    """x = fc([pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)]); y = norm(layers.0(x))."""

    prefix = "mtp."

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.norm(self.layers[0](self.fuse(emb, hidden), positions, rotary, kv, meta, backend))


class MiMoMTP(DecoderLayer):
    """A decoder layer wrapped as x = input_proj([hidden_layernorm(h), token_layernorm(emb)]) (hidden first);
    y = final_layernorm(layer(x))."""

    prefix = "model.mtp_layers.0."

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, 0)
        h = cfg.hidden_size
        self.token_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(emb)], dim=-1))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.final_layernorm(super().forward(self.fuse(emb, hidden), positions, rotary, kv, meta, backend))


LAYOUTS = {"qwen": QwenMTP, "mimo": MiMoMTP}


def load_mtp_head(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[str, nn.Module]:
    """(layout name, head) from the MTP tensors in the target checkpoint at `path`."""
    for layout, cls in LAYOUTS.items():
        tensors = read_tensors(path, cls.prefix)
        if tensors:
            break
    else:
        raise ValueError(f"no MTP tensors ({', '.join(c.prefix for c in LAYOUTS.values())}*) in {path}")
    state = {name[len(cls.prefix):]: t for name, t in tensors.items()}
    # Only layer 0 is used (see the module docstring); deeper Qwen layers are left on disk.
    state = {n: t for n, t in state.items() if not n.startswith("layers.") or n.startswith("layers.0.")}
    with torch.device("meta"):
        head = cls(cfg)
    head.load_state_dict(state, strict=True, assign=True)
    return layout, head.to(device=device, dtype=dtype).eval().requires_grad_(False)


class MTPDrafter:
    kind = "mtp"
    aux_layer_ids: tuple[int, ...] = ()
    step_cost = 0.05  # [est] one decoder layer of the target per drafted token

    def __init__(self, target: TargetView, cfg: ModelConfig, path: str, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, max_draft: int = 4) -> None:
        self.device = torch.device(device)
        self.target = target
        self.layout, self.head = load_mtp_head(path, cfg, dtype, self.device)
        self.kv_shape = (1, cfg.num_key_value_heads, cfg.head_dim)  # one decoder layer of the target's shape
        self.kv: KVCache | None = None  # allocated by the engine (Drafter.kv)
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.max_draft = max_draft
        self.backend = get_backend(self.device)
        # request id -> (head output y [H], its logits [V]) at the last committed pair: d_1 comes for free.
        self._last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def lookahead(self, k: int) -> int:
        return max(k - 1, 0)  # drafts d_2..d_k write the head's KV at positions p..p+k-2

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, seqs: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Head output y for pairs (hidden_i, tokens_i) at the positions `seqs` describe; writes its KV."""
        meta, positions = build_metadata(seqs, self.block_size, self.device)
        return self.head(self.target.embed(tokens), hidden, positions, self.target.rotary, self.kv,
                         meta, self.backend)

    @torch.inference_mode()
    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> None:
        # Pair h_i (after the target's final norm) with t_{i+1}, already committed.
        nxt = [t for c in commits for t in c.request.all_ids[c.start + 1 : c.start + c.count + 1]]
        if len(nxt) != hidden.shape[0]:
            raise ValueError("on_commit needs every committed row's next token in request.all_ids")
        tokens = torch.tensor(nxt, dtype=torch.int64).to(self.device, non_blocking=True)
        y = self._run(tokens, self.target.final_norm(hidden),
                      [(c.request.block_ids, c.start, c.count) for c in commits])
        ends = [n - 1 for n in itertools.accumulate(c.count for c in commits)]
        y_last = y.index_select(0, torch.tensor(ends).to(self.device, non_blocking=True))
        logits = self.target.lm_head(y_last).float()
        for i, c in enumerate(commits):
            self._last[c.request.request_id] = (y_last[i], logits[i])

    def release(self, request_id: int) -> None:
        self._last.pop(request_id, None)

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        """Nothing captured: its forwards run eager (docs/speculative.md)."""

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        ks = [min(k, self.max_draft, block_capacity(r, self.block_size) - r.num_tokens + 2)
              if r.request_id in self._last else 0 for r, k in zip(requests, ks)]
        rows = [i for i, k in enumerate(ks) if k > 0]
        steps = []
        if rows:
            y = torch.stack([self._last[requests[i].request_id][0] for i in rows])
            logits = torch.stack([self._last[requests[i].request_id][1] for i in rows])
            tokens, conf = greedy_drafts(logits, self.vocab_size)
            steps.append((rows, tokens, conf))
        for j in range(2, max((ks[i] for i in rows), default=0) + 1):
            prev, rows = rows, [i for i in rows if ks[i] >= j]
            keep = torch.tensor([prev.index(i) for i in rows]).to(self.device, non_blocking=True)
            p = [requests[i].num_tokens - 1 for i in rows]
            y = self._run(tokens.index_select(0, keep), y.index_select(0, keep),
                          [(requests[i].block_ids, pos + j - 2, 1) for i, pos in zip(rows, p)])
            tokens, conf = greedy_drafts(self.target.lm_head(y).float(), self.vocab_size)
            steps.append((rows, tokens, conf))
        return collect_drafts([i for rows, _, _ in steps for i in rows], [t for _, t, _ in steps],
                              [c for _, _, c in steps], len(requests))

