"""What a model's forward returns: named, so callers never count tuple positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardResult:
    hidden: torch.Tensor  # [T, H] the last layer's output, before the final norm
    aux_hidden: torch.Tensor | None = None  # [T, A] the tapped layers' outputs, concatenated (None: no taps)
    # [T, V] float32 logits of every row, where the caller computed them with the forward (a captured decode
    # graph runs the final norm and LM head inside it); a model's forward leaves them None.
    logits: torch.Tensor | None = None


def concat_taps(outputs: dict[int, torch.Tensor], aux_layer_ids: tuple[int, ...]) -> torch.Tensor | None:
    """aux_hidden from the tapped layers' outputs (layer -> [T, H]): in the order the drafter lists its taps, a
    layer listed twice twice (a drafter's fc reads len(aux_layer_ids) x H columns in that order); None without
    taps."""
    return torch.cat([outputs[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
