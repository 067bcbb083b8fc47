"""Load-time check that a drafter speaks the target's vocabulary. Drafts are token ids: a draft model whose ids
name other tokens would propose drafts the target rejects, and one whose embedding is smaller than the target's
vocabulary would fail on the first target token it cannot embed. Either is refused before it serves a request.

- draft model: its embedding must hold every id of the target's tokenizer, and every token of the target's
  tokenizer must have the same id in the draft's (extra draft tokens are harmless: drafts are cut to the
  target's vocabulary). Without a tokenizer.json in the draft checkpoint only the size can be checked (logged).
- DFlash: it borrows the target's embedding and LM head, so its config must name the target's vocabulary size
  and a mask token inside it.
- MTP: the head ships in the target checkpoint; nothing to check.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import tokenizers

from outrider.config import ModelConfig
from outrider.models import gguf, registry
from outrider.tokenizer import Tokenizer

log = logging.getLogger("outrider.speculative")


class IncompatibleDrafter(ValueError):
    """The drafter's vocabulary does not match the target's."""


def _vocab(path: Path) -> dict[str, int] | None:
    """The checkpoint's tokens by id: a GGUF file's own vocabulary, else tokenizer.json when there is one."""
    if gguf.is_gguf(path):
        return Tokenizer.from_pretrained(path).vocab()
    file = path / "tokenizer.json"
    return tokenizers.Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True) if file.is_file() else None


def _config(path: Path) -> ModelConfig:
    return gguf.model_config(gguf.open_gguf(path)) if gguf.is_gguf(path) else registry.load_config(path)


def check_draft_model(target_cfg: ModelConfig, target: Path, draft: Path) -> None:
    """Raise IncompatibleDrafter, naming the mismatch, when the draft model cannot draft for this target."""
    draft_rows = _config(draft).vocab_size
    target_vocab, draft_vocab = _vocab(target), _vocab(draft)
    n_target = len(target_vocab) if target_vocab is not None else target_cfg.vocab_size
    if draft_rows < n_target:
        raise IncompatibleDrafter(f"the draft model embeds {draft_rows} token ids but the target's vocabulary has "
                                  f"{n_target} tokens: it cannot read the target's tokens past id {draft_rows - 1}")
    if target_vocab is None or draft_vocab is None:
        log.warning("cannot compare tokenizers (no tokenizer.json in %s): assuming the draft model shares the "
                    "target's vocabulary", target if target_vocab is None else draft)
        return
    differ = sorted((i, tok) for tok, i in target_vocab.items() if draft_vocab.get(tok) != i)
    if differ:
        i, tok = differ[0]
        raise IncompatibleDrafter(f"the draft model's tokenizer does not match the target's: {len(differ)} of "
                                  f"{len(target_vocab)} target tokens have another id in the draft's (e.g. "
                                  f"{tok!r}: target id {i}, draft id {draft_vocab.get(tok)})")


def check_dflash(target_cfg: ModelConfig, draft: Path) -> None:
    """Raise IncompatibleDrafter when the DFlash drafter was built for another vocabulary."""
    raw = json.loads((draft / "config.json").read_text())
    vocab = raw.get("vocab_size", target_cfg.vocab_size)
    if vocab != target_cfg.vocab_size:
        raise IncompatibleDrafter(f"the DFlash drafter was built for a vocabulary of {vocab} tokens; the target's "
                                  f"has {target_cfg.vocab_size}")
    mask = (raw.get("dflash_config") or {}).get("mask_token_id")
    if mask is not None and not 0 <= mask < target_cfg.vocab_size:
        raise IncompatibleDrafter(f"the DFlash mask token id {mask} is outside the target's vocabulary "
                                  f"({target_cfg.vocab_size} tokens)")
