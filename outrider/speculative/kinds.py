"""The drafter kinds, each declared once: its name (EngineConfig.spec_type), llama-server's --spec-type spelling,
whether it needs weights, how a checkpoint is recognised as one (or a target's own config declares it), how its
vocabulary is checked and how it loads. The CLI, the /props renderer, the flags' help, the demo, the benchmarks and
the engine builder derive their tables from KINDS.

Light on purpose (no torch at import): the CLI reads it before any model loads; each loader imports its drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from outrider.config import NgramConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from outrider.config import ModelConfig
    from outrider.speculative.drafter import Drafter, KVPool, TargetView


@dataclass(frozen=True)
class DrafterLoad:
    """What loading a drafter gets: the target (its modules, config and checkpoint path), the drafter's own
    checkpoint (None: none was given), the KV pool's layout and where its pool comes from once its weights are
    loaded (kv_pool), and the most drafts a round (None: the kind's own)."""

    target: nn.Module
    target_cfg: ModelConfig
    target_path: str
    draft_path: str | None
    block_size: int
    dtype: torch.dtype
    device: torch.device | str
    kv_pool: KVPool | None = None  # (n-gram lookup needs none)
    max_draft: int | None = None
    ngram: NgramConfig = NgramConfig()
    token_map: str | None = None  # the file of ids that drafts through the target's LM head may propose

    def target_view(self) -> TargetView:
        """The target as a drafter borrowing its embedding and LM head sees it (the head cut to the token map)."""
        from outrider.speculative.drafter import TargetView
        from outrider.speculative.token_map import read_token_map

        ids = None if self.token_map is None else read_token_map(self.token_map, self.target_cfg.vocab_size)
        return TargetView.of(self.target, ids)

    def checkpoint(self, what: str) -> str:
        """The drafter's checkpoint path, resolved; a clear error where it needs one and none was given."""
        from outrider.models import resolve_model_path

        if self.draft_path is None:
            raise ValueError(f"{what} needs a checkpoint path (--model-draft)")
        return str(resolve_model_path(self.draft_path))


@dataclass(frozen=True)
class DrafterKind:
    name: str  # EngineConfig.spec_type
    llama_name: str  # llama-server's --spec-type spelling
    weights: bool  # loads weights (at most one such kind in a combination, beside n-gram lookup)
    load: Callable[[DrafterLoad], Drafter]
    # Is a draft checkpoint (its config.json; {} for a GGUF file) this kind? `is_target`: it is the target's own
    # directory. Kinds are tried in KINDS order; None: never detected from a checkpoint.
    detects: Callable[[dict, bool], bool] | None = None
    # Does a target's own config declare this drafter's head in its checkpoint (MTP layers)? Such a target
    # speculates with it with no flag (the first of KINDS that says so); None: never.
    declared_by_target: Callable[[ModelConfig], bool] | None = None
    # Raise IncompatibleDrafter where the drafter cannot draft for the target (speculative/compat.py).
    check_vocabulary: Callable[[ModelConfig, Path, Path], None] | None = None
    target_head: bool = False  # drafts through the target's LM head (a token map can cut it)

    @property
    def in_target(self) -> bool:
        """Its weights ship inside the target's checkpoint (the demo keeps no directory for it)."""
        return self.declared_by_target is not None


def _load_draft_model(a: DrafterLoad) -> Drafter:
    from outrider.speculative.draft_model import DraftModelDrafter

    return DraftModelDrafter(a.checkpoint("a draft model"), a.target_cfg.vocab_size, max_draft=_n_max(a),
                             block_size=a.block_size, dtype=a.dtype, device=a.device, kv_pool=a.kv_pool)


def _load_mtp(a: DrafterLoad) -> Drafter:
    from outrider.models import resolve_model_path
    from outrider.speculative.mtp import MTPDrafter

    return MTPDrafter(a.target_view(), a.target_cfg, str(resolve_model_path(a.draft_path or a.target_path)),
                      max_draft=_n_max(a), block_size=a.block_size, dtype=a.dtype, device=a.device,
                      kv_pool=a.kv_pool)


def _load_dflash(a: DrafterLoad) -> Drafter:
    from outrider.speculative.dflash import DFlashDrafter

    return DFlashDrafter(a.target_view(), a.target_cfg, a.checkpoint("DFlash"), block_size=a.block_size,
                         dtype=a.dtype, device=a.device, kv_pool=a.kv_pool)


def _load_eagle3(a: DrafterLoad) -> Drafter:
    from outrider.speculative.drafter import TargetView
    from outrider.speculative.eagle3 import Eagle3Drafter

    return Eagle3Drafter(TargetView.of(a.target), a.target_cfg, a.checkpoint("EAGLE-3"), max_draft=_n_max(a),
                         block_size=a.block_size, dtype=a.dtype, device=a.device, kv_pool=a.kv_pool)


def _load_ngram(a: DrafterLoad) -> Drafter:
    from outrider.speculative.ngram import NATURAL_N_MAX, NgramDrafter

    return NgramDrafter(a.ngram, a.max_draft if a.max_draft is not None else NATURAL_N_MAX)


def _n_max(a: DrafterLoad) -> int:
    from outrider.speculative.drafter import DEFAULT_N_MAX

    return a.max_draft if a.max_draft is not None else DEFAULT_N_MAX


def _is_dflash(raw: dict, is_target: bool) -> bool:
    return "DFlashDraftModel" in (raw.get("architectures") or []) or "dflash_config" in raw


def _is_eagle3(raw: dict, is_target: bool) -> bool:
    from outrider.speculative.eagle3 import is_eagle3_config

    return is_eagle3_config(raw)


def _check_draft_model(target_cfg: ModelConfig, target: Path, draft: Path) -> None:
    from outrider.speculative.compat import check_draft_model

    check_draft_model(target_cfg, target, draft)


def _check_dflash(target_cfg: ModelConfig, target: Path, draft: Path) -> None:
    from outrider.speculative.compat import check_dflash

    check_dflash(target_cfg, draft)


KINDS = (
    DrafterKind("dflash", "draft-dflash", True, _load_dflash, detects=_is_dflash, check_vocabulary=_check_dflash,
                target_head=True),
    DrafterKind("eagle3", "draft-eagle3", True, _load_eagle3, detects=_is_eagle3),
    DrafterKind("mtp", "draft-mtp", True, _load_mtp, detects=lambda raw, is_target: is_target,
                declared_by_target=lambda target_cfg: target_cfg.mtp_num_hidden_layers > 0, target_head=True),
    # (a separate causal LM sharing the target's tokenizer: whatever checkpoint is no other kind)
    DrafterKind("draft", "draft-simple", True, _load_draft_model, detects=lambda raw, is_target: True,
                check_vocabulary=_check_draft_model),
    DrafterKind("ngram", "ngram-simple", False, _load_ngram),
)
BY_NAME = {k.name: k for k in KINDS}
NAMES = tuple(BY_NAME)


def detect_kind(draft_path: str, target_path: str | None = None) -> str:
    """The kind of the drafter a checkpoint holds: the first of KINDS that recognises it."""
    from outrider.models import resolve_model_path
    from outrider.models.gguf import is_gguf

    path = resolve_model_path(draft_path)
    raw = {} if is_gguf(path) else json.loads((path / "config.json").read_text())  # a GGUF is a draft model
    is_target = target_path is not None and path.resolve() == resolve_model_path(target_path).resolve()
    return next(k.name for k in KINDS if k.detects is not None and k.detects(raw, is_target))


def target_kind(target_cfg: ModelConfig) -> str | None:
    """The kind of the drafter a target's own config declares (it speculates with it with no flag); None: none."""
    return next((k.name for k in KINDS if k.declared_by_target is not None and k.declared_by_target(target_cfg)), None)


def load_drafter(kind: str, **load) -> Drafter:
    """Build a drafter from DrafterLoad's fields, weights loaded; it asks `kv_pool` for its KV pool (of its
    kv_shape, with the target's block ids and block count) once they are. `kind` may name several kinds,
    comma-separated: they are combined (combined.py). A drafter whose vocabulary does not match the target's is
    refused (IncompatibleDrafter, speculative/compat.py)."""
    from outrider.models import resolve_model_path

    load = DrafterLoad(**load)
    if load.token_map is not None and not any(k.target_head for k in KINDS if k.name in kind.split(",")):
        heads = " and ".join(k.name for k in KINDS if k.target_head)
        raise ValueError(f"a token map cuts the target's LM head, which only {heads} draft through; {kind} does not")
    return _load(kind, load, resolve_model_path)


def _load(kind: str, load: DrafterLoad, resolve: Callable) -> Drafter:
    names = kind.split(",")
    if len(names) > 1:
        from outrider.speculative.combined import CombinedDrafter

        if len(set(names)) < len(names):
            raise ValueError(f"speculative kind listed twice in {kind!r}")
        return CombinedDrafter([_load(name, load, resolve) for name in names])
    declared = BY_NAME.get(kind)
    if declared is None:
        raise ValueError(f"unknown speculative kind {kind!r}; one of {', '.join(NAMES)}")
    if declared.check_vocabulary is not None and load.draft_path is not None:
        declared.check_vocabulary(load.target_cfg, resolve(load.target_path), resolve(load.draft_path))
    return declared.load(load)
