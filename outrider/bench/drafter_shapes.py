"""Drafters of stated shapes with random weights, beside a random-weights target (`bench spec --random-weights`).

Each preset writes what the engine loads: a stub target directory (config.json and the tiny tokenizer; the
target's weights are handed to the engine in memory) and the drafter's checkpoint in its real on-disk format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from outrider.bench.shapes import RANDOM_MODELS, write_random_checkpoint, write_stub_checkpoint
from outrider.models import registry


@dataclass(frozen=True)
class DrafterShape:
    kind: str  # "draft" | "mtp" | "dflash" | "eagle3"
    draft_model: str | None = None  # draft: the RANDOM_MODELS shape of the draft model
    layers: int = 0  # dflash: decoder layers at the target's dimensions
    block_size: int = 0  # dflash: drafts per block + 1
    target_layer_ids: tuple[int, ...] = ()  # dflash: the target layers whose outputs it reads
    mask_token_id: int = 0  # dflash
    sliding_window: int = 0  # dflash: the newer layout's window (every layer but the last slides); 0: none
    # dflash: the release's config.json values that differ from the target's (attention heads, head size, ...)
    config: tuple[tuple[str, int], ...] = ()


PRESETS: dict[tuple[str, str], DrafterShape] = {
    ("qwen3-8b", "draft"): DrafterShape("draft", draft_model="qwen3-0.6b"),
    # One MTP layer in the Qwen3.5 layout (mtp.fc, pre-fc norms, one decoder layer, norm) at 8B dimensions.
    ("qwen3-8b", "mtp"): DrafterShape("mtp"),
    # The published z-lab/Qwen3-8B-DFlash-b16 shape.
    ("qwen3-8b", "dflash"): DrafterShape("dflash", layers=5, block_size=16, target_layer_ids=(1, 9, 17, 25, 33),
                                         mask_token_id=151669),
    # An EAGLE-3 head of the published Qwen3-8B heads' shape (bench/workloads.py: EAGLE3_PRESETS).
    ("qwen3-8b", "eagle3"): DrafterShape("eagle3"),
    # Qwen/Qwen3.5-4B's own MTP head (mtp.*: one gated full-attention layer with the dense MLP, mtp_layer).
    ("qwen3.5-4b", "mtp"): DrafterShape("mtp"),
    # The published z-lab/Qwen3.5-4B-DFlash shape: 6 layers (5 sliding, window 4096, then 1 full), block 16 in
    # dflash_config, taps every 4th target layer from 1, 32 heads of 128 (8 KV) where the target has 16 of 256.
    ("qwen3.5-4b", "dflash"): DrafterShape("dflash", layers=6, block_size=16,
                                           target_layer_ids=(1, 5, 9, 13, 17, 21, 25, 29), mask_token_id=248077,
                                           sliding_window=4096,
                                           config=(("num_attention_heads", 32), ("num_key_value_heads", 8),
                                                   ("head_dim", 128))),
    # The drafter scripts/train_smollm2_drafter.py trains: two target-shaped layers, block 8, taps 1, 14, 27 (its
    # mask token, <reponame>, is id 4 in SmolLM2's vocabulary).
    ("smollm2-135m", "dflash"): DrafterShape("dflash", layers=2, block_size=8, target_layer_ids=(1, 14, 27),
                                             mask_token_id=4),
    ("tiny-qwen3.5", "mtp"): DrafterShape("mtp"),
    # (its attention shaped unlike the target's, as the 4B drafter's is: twice the heads, half the head size)
    ("tiny-qwen3.5", "dflash"): DrafterShape("dflash", layers=2, block_size=4, target_layer_ids=(1, 2),
                                             mask_token_id=4, sliding_window=8,
                                             config=(("num_attention_heads", 8), ("num_key_value_heads", 4),
                                                     ("head_dim", 8))),
    ("tiny-qwen3", "draft"): DrafterShape("draft", draft_model="tiny-qwen3-draft"),
    ("tiny-qwen3", "mtp"): DrafterShape("mtp"),
    ("tiny-qwen3", "eagle3"): DrafterShape("eagle3"),
    ("tiny-qwen3", "dflash"): DrafterShape("dflash", layers=2, block_size=4, target_layer_ids=(1, 2),
                                           mask_token_id=4),
}


@dataclass(frozen=True)
class PresetPaths:
    target: Path  # the stub target directory (for MTP, it also holds the mtp.* tensors)
    draft: Path | None  # the drafter's own checkpoint (draft model, DFlash); None for MTP


def preset(target: str, kind: str) -> DrafterShape:
    shape = PRESETS.get((target, kind))
    if shape is None:
        have = ", ".join(f"{t} + {k}" for t, k in PRESETS)
        raise SystemExit(f"no drafter preset for --random-weights {target} --spec-type {kind}; presets: {have}")
    return shape


def write_preset(target: str, shape: DrafterShape, root: Path, dtype: torch.dtype, seed: int) -> PresetPaths:
    """Write the stub target and the drafter's random checkpoint under `root`."""
    if shape.kind == "mtp":
        return PresetPaths(_write_mtp_stub(target, root / "target", dtype, seed), None)
    stub = write_stub_checkpoint(target, root / "target")
    if shape.kind == "draft":
        return PresetPaths(stub, write_random_checkpoint(shape.draft_model, root / "draft", dtype, seed + 1))
    if shape.kind == "eagle3":
        from outrider.bench.workloads import EAGLE3_PRESETS, write_eagle3_preset

        return PresetPaths(stub, write_eagle3_preset(stub, EAGLE3_PRESETS[target], root / "eagle3", dtype, seed + 1))
    from outrider.testing.drafters import write_dflash_checkpoint

    draft = write_dflash_checkpoint(root / "dflash", stub, layers=shape.layers, block_size=shape.block_size,
                                    mask_token_id=shape.mask_token_id, target_layer_ids=list(shape.target_layer_ids),
                                    sliding_window=shape.sliding_window, config=dict(shape.config), seed=seed + 1,
                                    dtype=dtype)
    return PresetPaths(stub, draft)


def _write_mtp_stub(target: str, path: Path, dtype: torch.dtype, seed: int) -> Path:
    """The stub target announcing one MTP layer, with that layer's random tensors (and no others: the target's
    weights come from memory)."""
    from safetensors.torch import save_file

    from outrider.speculative.mtp import QwenMTP
    from outrider.testing.drafters import random_params

    write_stub_checkpoint(target, path, mtp_num_hidden_layers=1)
    with torch.device("meta"):
        head = QwenMTP(registry.model_config(RANDOM_MODELS[target]))
    tensors = {n: t.to(dtype).contiguous() for n, t in random_params(head, QwenMTP.prefix, seed + 1).items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
