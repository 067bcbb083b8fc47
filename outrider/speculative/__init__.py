"""Speculative decoding: the drafters (draft model, MTP, DFlash, EAGLE-3, n-gram lookup, and combinations of them),
the draft-length policy and the acceptance math.

`detect_kind` names the drafter a checkpoint directory holds and `load_drafter` builds it; see
docs/speculative.md for the step that uses them.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from outrider.config import ModelConfig, NgramConfig
from outrider.models import resolve_model_path
from outrider.models.gguf import is_gguf
from outrider.speculative.compat import IncompatibleDrafter, check_vocabulary
from outrider.speculative.drafter import DEFAULT_N_MAX, Commit, DraftPolicy, Drafter, Proposals, TargetView

KINDS = ("draft", "mtp", "dflash", "eagle3", "ngram")


def detect_kind(draft_path: str, target_path: str | None = None) -> str:
    """"dflash" for a DFlashDraftModel config, "eagle3" for an EAGLE-3 head, "mtp" when the path is the target
    itself (its MTP tensors are the drafter), otherwise "draft" (a separate causal LM sharing the target's
    tokenizer)."""
    from outrider.speculative.eagle3 import is_eagle3_config

    path = resolve_model_path(draft_path)
    raw = {} if is_gguf(path) else json.loads((path / "config.json").read_text())  # a GGUF is a draft model
    if "DFlashDraftModel" in (raw.get("architectures") or []) or "dflash_config" in raw:
        return "dflash"
    if is_eagle3_config(raw):
        return "eagle3"
    if target_path is not None and path.resolve() == resolve_model_path(target_path).resolve():
        return "mtp"
    return "draft"


def load_drafter(kind: str, *, target: nn.Module, target_cfg: ModelConfig, target_path: str,
                 draft_path: str | None, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_draft: int | None = None,
                 ngram: NgramConfig = NgramConfig()) -> Drafter:
    """Build a drafter, weights loaded, drafting up to max_draft tokens a round (None: its kind's own default); its
    KV pool (Drafter.kv, of Drafter.kv_shape, with the target's block ids and block count) is the caller's to
    allocate, once the memory budget is known. `kind` may name several kinds, comma-separated: they are combined
    (combined.py). A drafter whose vocabulary does not match the target's is
    refused (IncompatibleDrafter, speculative/compat.py)."""
    kinds = kind.split(",")
    if len(kinds) > 1:
        from outrider.speculative.combined import CombinedDrafter

        if len(set(kinds)) < len(kinds):
            raise ValueError(f"speculative kind listed twice in {kind!r}")
        return CombinedDrafter([load_drafter(k, target=target, target_cfg=target_cfg, target_path=target_path,
                                             draft_path=draft_path, block_size=block_size, dtype=dtype,
                                             device=device, max_draft=max_draft, ngram=ngram) for k in kinds])
    check_vocabulary(kind, target_cfg, target_path, draft_path)
    pool = dict(block_size=block_size, dtype=dtype, device=device)
    if kind == "ngram":
        from outrider.speculative.ngram import NATURAL_N_MAX, NgramDrafter

        return NgramDrafter(ngram, max_draft if max_draft is not None else NATURAL_N_MAX)
    if max_draft is None:
        max_draft = DEFAULT_N_MAX
    if kind == "draft":
        from outrider.speculative.draft_model import DraftModelDrafter

        if draft_path is None:
            raise ValueError("a draft model needs a checkpoint path (--model-draft)")
        return DraftModelDrafter(draft_path, target_cfg.vocab_size, max_draft=max_draft, **pool)
    view = TargetView.of(target)
    if kind == "mtp":
        from outrider.speculative.mtp import MTPDrafter

        return MTPDrafter(view, target_cfg, str(resolve_model_path(draft_path or target_path)),
                          max_draft=max_draft, **pool)
    if kind == "dflash":
        from outrider.speculative.dflash import DFlashDrafter

        if draft_path is None:
            raise ValueError("DFlash needs its drafter checkpoint path (--model-draft)")
        return DFlashDrafter(view, target_cfg, str(resolve_model_path(draft_path)), **pool)
    if kind == "eagle3":
        from outrider.speculative.eagle3 import Eagle3Drafter

        if draft_path is None:
            raise ValueError("EAGLE-3 needs its head's checkpoint path (--model-draft)")
        return Eagle3Drafter(view, target_cfg, str(resolve_model_path(draft_path)), max_draft=max_draft, **pool)
    raise ValueError(f"unknown speculative kind {kind!r}; one of {', '.join(KINDS)}")


# `verify` is not re-exported: the name would shadow the outrider.speculative.verify module.
__all__ = ["KINDS", "Commit", "DraftPolicy", "Drafter", "IncompatibleDrafter", "Proposals", "detect_kind",
           "load_drafter"]
