"""Token maps: the target's token ids that drafters sharing its LM head (MTP heads, DFlash) may propose, as
SGLang's --speculative-token-map and FR-Spec's frequency-ranked vocabularies give them.

A draft's logits then cover those rows of the head only. With a large vocabulary the head is most of a draft's
weight reads (Qwen3.5: 248,320 rows of 2,560, 1.27 GB in bf16, against ~0.2 GB for the MTP layer itself), and a
32k-token map reads an eighth of it. Output stays lossless whatever the map: the target verifies every draft,
and tokens outside the map are simply never drafted, so only acceptance can suffer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The ids of a token map file, int64 [N]: a JSON list of ints, or a torch-saved 1-D integer tensor (.pt, as
    SGLang's). Refused with the reason: an empty map, ids repeated or outside [0, vocab_size)."""
    path = Path(path)
    try:
        if path.suffix == ".pt":
            ids = torch.load(path, map_location="cpu", weights_only=True)
        else:
            ids = torch.tensor(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"token map {path}: not a JSON list of token ids or a saved 1-D tensor ({exc})") from exc
    if isinstance(ids, torch.Tensor) and ids.numel() == 0:
        raise ValueError(f"token map {path}: empty")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"token map {path}: need a flat list of integer token ids")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token map {path}: ids must lie in [0, {vocab_size}) (the target's vocabulary)")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"token map {path}: an id is listed twice")
    return ids
