"""Speculative decoding: the drafters (draft model, MTP, DFlash), the draft-length policy and the acceptance math.

`detect_kind` names the drafter a checkpoint directory holds and `load_drafter` builds it; see
docs/speculative.md for the step that uses them.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from outrider.config import ModelConfig
from outrider.models import resolve_model_path
from outrider.spec.drafter import Commit, DraftPolicy, Drafter, Proposals

KINDS = ("draft", "mtp", "dflash")


def detect_kind(draft_path: str, target_path: str | None = None) -> str:
    """"dflash" for a DFlashDraftModel config, "mtp" when the path is the target itself (its MTP tensors are
    the drafter), otherwise "draft" (a separate causal LM sharing the target's tokenizer)."""
    path = resolve_model_path(draft_path)
    raw = json.loads((path / "config.json").read_text())
    if "DFlashDraftModel" in (raw.get("architectures") or []) or "dflash_config" in raw:
        return "dflash"
    if target_path is not None and path.resolve() == resolve_model_path(target_path).resolve():
        return "mtp"
    return "draft"


def drafter_kv_shape(kind: str, target_cfg: ModelConfig, target_path: str,
                     draft_path: str | None) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the KV pool a drafter of this kind allocates beside the target's, with
    as many blocks: the engine sizes both pools together from one memory budget, before loading either."""
    if kind == "draft":
        if draft_path is None:
            raise ValueError("a draft model needs a checkpoint path (--model-draft)")
        cfg = ModelConfig.from_path(resolve_model_path(draft_path))
    elif kind == "dflash":
        from outrider.spec.dflash import dflash_config

        if draft_path is None:
            raise ValueError("DFlash needs its drafter checkpoint path (--model-draft)")
        cfg = dflash_config(resolve_model_path(draft_path))[0]
    elif kind == "mtp":  # one layer of the target's shape
        return 1, target_cfg.num_key_value_heads, target_cfg.head_dim
    else:
        raise ValueError(f"unknown speculative kind {kind!r}; one of {', '.join(KINDS)}")
    return cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim


def load_drafter(kind: str, *, target: nn.Module, target_cfg: ModelConfig, target_path: str,
                 draft_path: str | None, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_draft: int = 16) -> Drafter:
    """Build a drafter whose KV pools share the target's block ids (num_blocks, block_size)."""
    pool = dict(num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)
    if kind == "draft":
        from outrider.spec.draft_model import DraftModelDrafter

        if draft_path is None:
            raise ValueError("a draft model needs a checkpoint path (--model-draft)")
        return DraftModelDrafter(draft_path, target_cfg.vocab_size, max_draft=max_draft, **pool)
    if kind == "mtp":
        from outrider.spec.mtp import MTPDrafter

        return MTPDrafter(target, target_cfg, str(resolve_model_path(draft_path or target_path)),
                          max_draft=max_draft, **pool)
    if kind == "dflash":
        from outrider.spec.dflash import DFlashDrafter

        if draft_path is None:
            raise ValueError("DFlash needs its drafter checkpoint path (--model-draft)")
        return DFlashDrafter(target, target_cfg, str(resolve_model_path(draft_path)), **pool)
    raise ValueError(f"unknown speculative kind {kind!r}; one of {', '.join(KINDS)}")


# `verify` is not re-exported: the name would shadow the outrider.spec.verify module.
__all__ = ["KINDS", "Commit", "DraftPolicy", "Drafter", "Proposals", "detect_kind", "drafter_kv_shape", "load_drafter"]
