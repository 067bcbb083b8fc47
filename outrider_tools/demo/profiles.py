"""The demo family's sizes and training settings: the full profile (the shipped family) and a tiny CPU smoke
profile, with per-field overrides for trials."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from dataclasses import dataclass, field

@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int

    @classmethod
    def of(cls, cfg) -> Shape:
        """The shape of an outrider ModelConfig."""
        return cls(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, cfg.intermediate_size)


@dataclass(frozen=True)
class Profile:
    vocab: int
    seq: int
    target: Shape
    draft: Shape
    dflash: Shape  # hidden must equal the target's
    dflash_taps: tuple[int, ...]
    eagle3: Shape  # the EAGLE-3 head's layer (layers unused: one); hidden must equal the target's
    eagle3_taps: tuple[int, ...]  # target block outputs fc reads, low to high (the config stores them + 1)
    eagle3_vocab: int  # draft vocabulary: the most frequent target tokens of the drafters' training mix
    eagle3_steps: int  # K chained steps in training ("training-time test")
    eagle3_beta: float
    block_size: int
    dflash_gamma: float
    dflash_anchors: int  # blocks per training sequence
    mtp_steps: int  # K recursive steps in training
    mtp_beta: float
    # (steps, batch, lr, warmup) per stage
    target_train: tuple[int, int, float, int]
    draft_train: tuple[int, int, float, int]
    mtp_train: tuple[int, int, float, int]
    dflash_train: tuple[int, int, float, int]
    eagle3_train: tuple[int, int, float, int]
    eval_every: int
    val_windows: int  # held-out windows for the final loss
    gen_prompts: int
    gen_prompt_len: int
    gen_new: int
    gen_batch: int
    eval_prompts: int  # per kind (def-line prompts, context-window prompts)
    eval_new: int
    max_files: int | None = None  # smoke: a subset of files
    max_file_bytes: int = 1_000_000
    max_chat: int = 4000  # per kind: documented functions, documented methods
    package_bytes: int = 80_000_000  # cap on the installed packages' source added to the training text
    # Per-stage caps in seconds. A stage that reaches its cap still completes its learning-rate decay (the
    # schedule follows the larger of step and time progress), so a slower GPU gets fewer steps, not a cut-off run.
    # On one H200 the step counts bind, not these.
    stage_seconds: dict = field(default_factory=dict)


# One H200, about 6.5 minutes for the whole family without EAGLE-3 (outrider/demo/README.md gives the split by
# stage), about 7.5 with it; at most about 9 if every stage cap binds. The 7-layer target trains 1,800 steps x 96 x
# 512 = 88 M tokens, about 3 passes over the stdlib plus up to 80 MB of installed packages' source: 4,000 steps
# over the stdlib alone (55 passes) overfit from step 600 on. With 3 passes there is nothing for
# dropout to do but slow learning (none is used). The drafters' stages are trimmed (MTP 1,500 -> 1,200 steps,
# DFlash 3,000 -> 2,000) to fit one device call (10 minutes).
# The EAGLE-3 head has what the 20 MB budget leaves, about 0.85 MB: fc [256, 768] alone is 393 KB, so one attention
# head of 32, a 32-wide MLP and 384 draft tokens (765 KB with its config). In a CPU trial the 384 most frequent
# tokens covered 88 % of the target's generations and 70 % of the corpus (256: 80 % and 63 %), the cap on what the
# head can draft. Short CPU runs (1,000 steps x 16 x 256 on cached target features) of this shape and of the others
# near the budget (head 64, MLP 96, vocabulary 256 or 512) came within 0.15 of each other and not in the order of
# their sizes (offline EAL 1.82-2.04): too close to choose by, so the choice follows coverage.
FULL = Profile(
    vocab=4096, seq=512,
    target=Shape(256, 7, 4, 2, 64, 640),
    draft=Shape(128, 2, 2, 1, 64, 512),
    dflash=Shape(256, 2, 4, 2, 64, 640),
    dflash_taps=(1, 3, 5), block_size=8, dflash_gamma=4.0, dflash_anchors=64,
    eagle3=Shape(256, 1, 1, 1, 32, 32), eagle3_taps=(1, 3, 5), eagle3_vocab=384, eagle3_steps=4, eagle3_beta=0.8,
    mtp_steps=3, mtp_beta=0.6,
    target_train=(1800, 96, 2e-3, 150),
    draft_train=(1500, 64, 3e-3, 100),
    mtp_train=(1200, 64, 1.5e-3, 100),
    dflash_train=(2000, 64, 1.5e-3, 100),
    eagle3_train=(1500, 64, 2e-3, 100),
    eval_every=100, val_windows=256,
    gen_prompts=8192, gen_prompt_len=64, gen_new=256, gen_batch=2048,
    eval_prompts=32, eval_new=128,
    stage_seconds={"target": 120, "draft": 60, "mtp": 75, "dflash": 95, "eagle3": 75},
)


SMOKE = Profile(
    vocab=512, seq=64,
    target=Shape(64, 4, 2, 1, 32, 128),  # 4 layers: EAGLE-3 taps 3 distinct outputs of layers 0..L-2
    draft=Shape(32, 1, 1, 1, 32, 64),
    dflash=Shape(64, 1, 2, 1, 32, 128),
    dflash_taps=(0, 1), block_size=4, dflash_gamma=2.0, dflash_anchors=8,
    eagle3=Shape(64, 1, 2, 1, 16, 32), eagle3_taps=(0, 1, 2), eagle3_vocab=128, eagle3_steps=3, eagle3_beta=0.8,
    mtp_steps=2, mtp_beta=0.6,
    target_train=(30, 8, 3e-3, 5),
    draft_train=(15, 8, 3e-3, 3),
    mtp_train=(15, 8, 3e-3, 3),
    dflash_train=(15, 8, 3e-3, 3),
    eagle3_train=(15, 8, 3e-3, 3),
    eval_every=10, val_windows=8,
    gen_prompts=16, gen_prompt_len=16, gen_new=24, gen_batch=16,
    eval_prompts=3, eval_new=24,
    max_files=40, max_file_bytes=20_000, max_chat=50, package_bytes=200_000,
    stage_seconds={"target": 60, "draft": 60, "mtp": 60, "dflash": 60, "eagle3": 60},
)


STAGES = ("target", "draft", "mtp", "dflash", "eagle3")


STAGE_DIRS = {"target": "target", "draft": "draft", "mtp": "target", "dflash": "dflash", "eagle3": "eagle3"}


def parse_stages(text: str) -> list[str]:
    """A comma-separated subset of STAGES, in the order they run."""
    names = [s for s in text.split(",") if s]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: stages are a comma-separated subset of {','.join(STAGES)}")
    return [s for s in STAGES if s in names]


def with_overrides(p: Profile, items: list[str]) -> Profile:
    """The profile with FIELD=VALUE items applied, VALUE a Python literal: a dict merges into the field's dict
    (stage_seconds), a tuple gives a Shape field its values."""
    fields = {f.name for f in dataclasses.fields(Profile)}
    changes = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}")
        value, current = ast.literal_eval(text), getattr(p, name)
        if isinstance(current, dict):
            value = {**current, **value}
        elif isinstance(current, Shape):
            value = Shape(*value)
        changes[name] = value
    return dataclasses.replace(p, **changes)

