"""DFlash (z-lab) block-diffusion drafter: one forward drafts a whole block.

Checkpoint: config.json with architectures ["DFlashDraftModel"], block_size, dflash_config {mask_token_id,
target_layer_ids}; tensors fc, hidden_norm, layers.N.* (Qwen3 decoder layers), norm. It has no embedding or
LM head: both are borrowed from the target. Context: the outputs of target layers `target_layer_ids` at every
committed position, fused as ctx = hidden_norm(fc(cat(taps))), enter each draft layer only as keys/values
(k_norm(k_proj(ctx)) with RoPE, v_proj(ctx)), written into the drafter's paged KV on commit. Drafting: the
block [x_last, MASK * (B-1)] at positions p..p+B-1 attends non-causally over that context and itself; the
target's LM head on the normed outputs at block slots 1..B-1 gives the drafts.

Config: z-lab's first releases put `block_size` at the top level; newer ones (Qwen3.5 / Qwen3.6 targets) put it in
`dflash_config.block_size` and add `layer_types` with `sliding_attention` layers, `sliding_window`,
`use_sliding_window` and `rope_parameters`. A sliding layer's block queries see the context keys of their last
`sliding_window` positions (and the whole block, non-causally, as every layer does); `use_sliding_window: false`
makes every layer full attention, as transformers' Qwen3 config does. Every key is read or known to change nothing
(DRAFTER_KEYS, HF's generic keys among them); any other is refused by name, never defaulted.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from outrider.attention import KVCache, get_backend
from outrider.config import ModelConfig
from outrider.graphs import VERIFY_BUCKETS, CudaGraphRunner
from outrider.attention.metadata import build_metadata, shifted_metadata, uniform_metadata_on_device
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import RotaryEmbedding
from outrider.models import read_tensors, registry
from outrider.models.registry import decoder_layer
from outrider.speculative.device_round import RoundVerdict
from outrider.speculative.drafter import (LEARN_ROWS, Commit, KVPool, Proposals, StagedDrafts, TargetView,
                                         VerifiedRows, block_capacity, greedy_drafts, row_seqs, stage_drafts)

if TYPE_CHECKING:
    from outrider.engine.request import Request


def _taps(aux_hidden: torch.Tensor | None) -> torch.Tensor:
    if aux_hidden is None:
        raise ValueError("DFlash needs the target's aux_hidden: tap drafter.aux_layer_ids in the target's forward")
    return aux_hidden


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps when the config names none: the middle layer, or points spread over 1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    taps = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return [min(max(t, 0), num_target_layers - 1) for t in taps]  # only tiny test targets need the clamp


# Keys of a DFlash config.json that outrider reads, or that change nothing for inference (HF's generic bookkeeping;
# max_window_layers, which layer_types or use_sliding_window supersede).
DRAFTER_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout",
    "tie_word_embeddings", "max_window_layers",
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "attention_bias", "layer_types", "sliding_window", "use_sliding_window",
    "block_size", "num_target_layers", "dflash_config", "is_causal",
})
DFLASH_CONFIG_KEYS = frozenset({"mask_token_id", "target_layer_ids", "block_size"})


@dataclass(frozen=True)
class DFlashConfig:
    """What a DFlash drafter's config.json says: its layers (a Qwen3 ModelConfig), block size, mask token and the
    target layers it reads."""

    layers: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], target_layers: int) -> "DFlashConfig":
        unknown = sorted(set(raw) - DRAFTER_KEYS)
        dflash = raw.get("dflash_config") or {}
        unknown += sorted(f"dflash_config.{k}" for k in set(dflash) - DFLASH_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"DFlash config keys outrider does not understand: {', '.join(unknown)}")
        if raw.get("is_causal"):
            raise ValueError("DFlash config is_causal: true: outrider drafts a block non-causally, as DFlash does")
        sizes = {raw.get("block_size"), dflash.get("block_size")} - {None}
        if len(sizes) != 1:
            raise ValueError("DFlash config needs one block size (block_size or dflash_config.block_size); got "
                             f"{sorted(sizes) or 'none'}")
        if "mask_token_id" not in dflash:
            raise ValueError("DFlash config needs dflash_config.mask_token_id")
        layers = {**raw, "architectures": ["Qwen3ForCausalLM"]}  # Qwen3 decoder layers: q/k norm, no biases
        if not raw.get("use_sliding_window", True):  # (transformers' Qwen3 config: then no layer slides)
            layers["layer_types"] = ["full_attention"] * raw["num_hidden_layers"]
        cfg = registry.model_config(layers)
        taps = dflash.get("target_layer_ids") or default_target_layers(
            raw.get("num_target_layers", target_layers), cfg.num_hidden_layers)
        if not all(0 <= t < target_layers for t in taps):
            raise ValueError(f"DFlash target_layer_ids {list(taps)} name layers outside the target's {target_layers}")
        return cls(cfg, int(sizes.pop()), int(dflash["mask_token_id"]), tuple(taps))


class DFlashModel(nn.Module):
    """The drafter's own weights, under the checkpoint's tensor names."""

    def __init__(self, cfg: ModelConfig, context_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(context_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDrafter:
    kind = "dflash"
    reads_hidden = True  # its context: the taps' outputs at every committed position
    learns = True
    stages_on_device = True
    drafts_ahead = True
    step_cost = 0.02  # [est] one small forward per block, whatever k is

    def __init__(self, target: TargetView, target_cfg: ModelConfig, path: str, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, kv_pool: KVPool) -> None:
        config = DFlashConfig.from_dict(json.loads((Path(path) / "config.json").read_text()),
                                        target_cfg.num_hidden_layers)
        cfg, taps = config.layers, config.target_layer_ids
        self.mask_token_id = config.mask_token_id
        self.aux_layer_ids = taps
        self.block = config.block_size
        self.max_draft = self.block - 1
        self.device = torch.device(device)
        self.target = target
        with torch.device("meta"):
            model = DFlashModel(cfg, len(taps) * target_cfg.hidden_size)
        model.load_state_dict(read_tensors(path), strict=True, assign=True)
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.max_position_embeddings).to(self.device)
        self.kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.kv: KVCache = kv_pool(self.kv_shape, self.aux_layer_ids)
        self.block_size = block_size
        self.vocab_size = target_cfg.vocab_size
        self.backend = get_backend(self.device)
        self.graphs: CudaGraphRunner | None = None  # full-block drafting at batch 1-8 (capture_graphs, CUDA)
        self.learn_graphs: CudaGraphRunner | None = None  # learning up to LEARN_ROWS[-1] rows (capture_graphs)
        self._aux_in: torch.Tensor | None = None  # the learning graphs' static input

    def lookahead(self, k: int) -> int:
        return self.block if k > 0 else 0  # the whole block's K/V is written, whatever k is

    def may_propose(self, request: Request) -> bool:
        return True

    @torch.inference_mode()
    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> None:
        graphed = self.learn_graphs is not None and _taps(aux_hidden).shape[0] <= LEARN_ROWS[-1]
        seqs = row_seqs(commits) if graphed else [(c.request.block_ids, c.start, c.count) for c in commits]
        meta, positions = build_metadata(seqs, self.block_size, self.device)
        self._learn(_taps(aux_hidden), meta, positions)

    @torch.inference_mode()
    def draft_ahead(self, rows: VerifiedRows, ks: Sequence[int]) -> StagedDrafts:
        self._learn(_taps(rows.aux_hidden), *build_metadata(rows.seqs(), self.block_size, self.device))
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if not drafting:
            return stage_drafts([], [], [], len(ks))
        # Each block starts at the request's last committed row's next token: [x, MASK * (B - 1)] from p_i + m_i.
        n, width = len(drafting), self.block
        index = torch.tensor(drafting, dtype=torch.int64).to(self.device, non_blocking=True)
        last = rows.last().index_select(0, index)
        tokens = torch.full((n, width), self.mask_token_id, dtype=torch.int64, device=self.device)
        tokens[:, 0] = rows.emitted.index_select(0, last)
        requests = [rows.requests[i] for i in drafting]
        meta, positions = build_metadata([(r.block_ids, r.num_tokens - 1, width) for r in requests], self.block_size,
                                         self.device, causal=False)
        shift = rows.accepted.index_select(0, index)
        owner = torch.arange(n, device=self.device).repeat_interleave(width)
        meta, positions = shifted_metadata(meta, positions, shift, owner, max(rows.counts) - 1, self.block_size)
        drafts, conf = self._run_block(tokens.view(-1), positions, meta)
        picks = [b * width + j for b, i in enumerate(drafting) for j in range(1, ks[i] + 1)]  # block slots 1..k
        index = torch.tensor(picks, dtype=torch.int64).to(self.device, non_blocking=True)
        return stage_drafts([i for i in drafting for _ in range(ks[i])], [drafts.index_select(0, index)],
                            [conf.index_select(0, index)], len(ks))

    def round_drafts(self, verdict: RoundVerdict, table: torch.Tensor, k: int) -> torch.Tensor:
        """device_round.RoundDrafter: the verified rows' context, then the block [bonus, MASK * (B - 1)] at first."""
        self._store_context(_taps(verdict.aux_hidden), verdict.positions, verdict.meta)
        block_meta, block_positions = uniform_metadata_on_device(verdict.first, self.block, table, self.block_size,
                                                                 causal=False)
        masks = torch.full((self.block - 1,), self.mask_token_id, dtype=torch.int64, device=self.device)
        drafts, _ = self._block_drafts(torch.cat([verdict.bonus, masks]), block_positions, block_meta)
        return drafts[1 : k + 1]

    def _learn(self, aux_hidden: torch.Tensor, meta, positions: torch.Tensor) -> None:
        """Write these rows' context: through a learning graph when they are few one-token sequences (LEARN_ROWS)."""
        if self.learn_graphs is not None and self.learn_graphs.can_run(meta):
            self._aux_in[: aux_hidden.shape[0]].copy_(aux_hidden)
            self.learn_graphs.run(positions, positions, meta)  # (its input is _aux_in: the ids are unused)
        else:
            self._store_context(aux_hidden, positions, meta)

    def _store_context(self, aux_hidden: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The committed rows' context K/V into every draft layer's cache; returns the fused context."""
        ctx = self.model.hidden_norm(self.model.fc(aux_hidden))
        for layer in self.model.layers:
            layer.self_attn.store_context(ctx, positions, self.rotary, self.kv, meta, self.backend)
        return ctx

    def block_drafts(self, tokens: torch.Tensor,
                     seqs: list[tuple[list[int], int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Argmax drafts and their probabilities [sum L] at every slot of blocks `tokens` at (block table, first
        position, L) each: a captured graph when every block is whole and the batch fits one, else eager."""
        meta, positions = build_metadata(seqs, self.block_size, self.device, causal=False)
        return self._run_block(tokens, positions, meta)

    def _run_block(self, tokens: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(tokens, positions, meta)
        return self._block_drafts(tokens, positions, meta)

    def _block_drafts(self, tokens: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole block through the target's LM head: as cheap as the drafted slots alone (the head's weights
        are the cost), and in the graph, not a handful of launches after it."""
        ids, conf = greedy_drafts(self.target.lm_head(self._block_forward(tokens, positions, meta)), self.vocab_size)
        return self.target.tokens(ids), conf

    def _block_forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        h = self.target.embed(tokens)
        for layer in self.model.layers:
            h = layer(h, positions, self.rotary, self.kv, meta, self.backend)
        return self.model.norm(h)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        return self.stage(requests, ks).to_host()

    @torch.inference_mode()
    def stage(self, requests: Sequence[Request], ks: Sequence[int]) -> StagedDrafts:
        # A block shrinks (as the reference does near max length) rather than write past the block table.
        lens = [min(self.block, block_capacity(r, self.block_size) - r.num_tokens + 1) for r in requests]
        ks = [min(k, n - 1) for k, n in zip(ks, lens)]
        rows = [i for i, k in enumerate(ks) if k > 0]
        if not rows:
            return stage_drafts([], [], [], len(requests))
        ids = [t for i in rows for t in [requests[i].all_ids[-1]] + [self.mask_token_id] * (lens[i] - 1)]
        tokens = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        drafts, conf = self.block_drafts(tokens, [(requests[i].block_ids, requests[i].num_tokens - 1, lens[i])
                                                  for i in rows])
        starts = itertools.accumulate((lens[i] for i in rows), initial=0)
        picks = [s + j for s, i in zip(starts, rows) for j in range(1, ks[i] + 1)]  # block slots 1..k
        index = torch.tensor(picks, dtype=torch.int64).to(self.device, non_blocking=True)
        return stage_drafts([i for i in rows for _ in range(ks[i])], [drafts.index_select(0, index)],
                            [conf.index_select(0, index)], len(requests))

    def release(self, request_id: int) -> None:
        """Nothing per request: the context lives in the request's own blocks."""

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        """Whole-block drafting at the verify batch sizes, and learning a round's committed rows, as CUDA graphs: one
        eager forward of even a few layers costs a launch per kernel, and every round runs one of each."""
        common = dict(max_blocks_per_seq=-(-max_model_len // self.block_size), max_seq_len=max_model_len,
                      device=self.device, pool=pool)
        buckets = [b for b in VERIFY_BUCKETS if b <= max_batch]
        graphs = CudaGraphRunner(self._block_drafts, max_batch=buckets[-1], tokens_per_seq=self.block, causal=False,
                                 buckets=buckets, **common)
        graphs.capture()
        self._aux_in = torch.zeros(LEARN_ROWS[-1], self.model.fc.in_features, dtype=self.model.fc.weight.dtype,
                                   device=self.device)
        learn = CudaGraphRunner(lambda ids, pos, meta: self._store_context(self._aux_in[: ids.shape[0]], pos, meta),
                                max_batch=LEARN_ROWS[-1], buckets=LEARN_ROWS, **common)
        learn.capture()
        # (only once every bucket is captured: a failed capture leaves drafting and learning eager)
        self.graphs, self.learn_graphs = graphs, learn
