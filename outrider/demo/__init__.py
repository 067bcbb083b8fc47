"""The bundled demo model family, trained by scripts/train_demo.py on Python source (stdlib and installed packages).

Layout of this package directory (see README.md here, the model card):
  target/  Qwen3ForCausalLM checkpoint; its model.safetensors also holds a Qwen3.5-style MTP layer (`mtp.*`,
           config `mtp_num_hidden_layers: 1`)
  draft/   a smaller Qwen3ForCausalLM draft model sharing the target's tokenizer
  dflash/  a DFlashDraftModel drafter for the target (block_size and dflash_config in its config.json)
  eagle3/  an EAGLE-3 head for the target (LlamaForCausalLMEagle3)
  metrics.json, eval_prompts.json  training metrics and the held-out prompts used to measure acceptance
"""

from __future__ import annotations

import json
from pathlib import Path

from outrider.speculative.kinds import KINDS as KINDS_DECLARED

DEMO_DIR = Path(__file__).resolve().parent
SERVED_NAME = "outrider-demo"  # the model's name in /props, /v1/models and responses when the demo is served

# The demo ships a drafter of every kind with weights: kind -> directory holding it (MTP lives in the target's)
DRAFTER_KINDS = tuple(k.name for k in KINDS_DECLARED if k.weights)
KINDS = {"target": "target", **{k.name: "target" if k.in_target else k.name for k in KINDS_DECLARED if k.weights}}


def demo_path(kind: str = "target") -> Path:
    """Directory of a shipped demo checkpoint: "target", "draft", "dflash", "eagle3", or "mtp" (= the target
    directory, whose checkpoint carries the MTP layer). Raises FileNotFoundError if the artifact is not installed."""
    if kind not in KINDS:
        raise ValueError(f"unknown demo kind {kind!r}; one of {', '.join(KINDS)}")
    path = DEMO_DIR / KINDS[kind]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"demo {kind} checkpoint not found at {path}; run scripts/train_demo.py")
    return path


def is_demo_target(path: str | Path) -> bool:
    """Whether `path` is the shipped demo target's directory (however it is spelled)."""
    return Path(path).resolve() == DEMO_DIR / KINDS["target"]


def is_available() -> bool:
    """True when the target and every drafter of the family are installed."""
    return all((DEMO_DIR / d / "config.json").is_file() for d in KINDS.values())


def eval_prompts() -> list[dict]:
    """The held-out prompts (dicts with kind "def" | "window", file, prompt) used for acceptance measurements."""
    return json.loads((DEMO_DIR / "eval_prompts.json").read_text())

