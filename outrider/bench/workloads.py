"""Workloads and drafter presets for `bench spec` that the n-gram and EAGLE-3 kinds need.

- `edit`: a file, then the same file again with a small change near its top (an identifier renamed where it is
  defined): the continuation re-emits the rest of the file, as a model asked to edit code does. n-gram lookup
  drafts it from the first copy.
- `novel`: the demo family's held-out prompts as they are (a signature or a window of an unseen file): nothing
  to look up, so lookup must cost nothing.
Both are lists of prompt strings, the JSON `bench spec --prompts` reads. The files are the demo's held-out
standard-library files (docs: outrider/demo/README.md), read from this interpreter's standard library.

`EAGLE3_PRESETS`: EAGLE-3 heads of published shapes with random weights, beside a random-weights target, for
`bench spec --random-weights ... --spec-type eagle3 --acceptance α`.
"""

from __future__ import annotations

import json
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EDIT_MARK = "\n\n# --- the same module, edited: {old} is now {new} ---\n\n"


def held_out_files() -> list[Path]:
    """The demo's held-out files (those its eval prompts come from) found in this interpreter's stdlib."""
    from outrider.demo import eval_prompts

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = sorted({p["file"] for p in eval_prompts()})
    return [stdlib / n for n in names if (stdlib / n).is_file()]


def edit_prompt(source: str, max_chars: int, head_lines: int = 6) -> str | None:
    """`source` cut to whole lines within max_chars, the edit mark, and its first `head_lines` lines again with the
    first function or class defined there renamed (None: nothing to rename in them)."""
    text = source[:max_chars].rsplit("\n", 1)[0]
    head = "\n".join(text.split("\n")[:head_lines])
    found = re.search(r"^(?:def|class) ([A-Za-z_]\w*)", text, re.M)
    if found is None or found.start() > len(head):
        return None
    old = found.group(1)
    new = old + "_v2"
    return text + EDIT_MARK.format(old=old, new=new) + re.sub(rf"\b{old}\b", new, head)


def edit_workload(count: int = 64, max_chars: int = 2400) -> list[str]:
    """Up to `count` edit prompts, one per window of `max_chars` (about 700 demo tokens: prompt and re-emission
    fit the demo's 2048-token context) starting at each top-level definition of the held-out files."""
    prompts = []
    for path in held_out_files():
        source = path.read_text(encoding="utf-8", errors="replace")
        for start in (m.start() for m in re.finditer(r"^(?:def|class) ", source, re.M)):
            prompt = edit_prompt(source[start:], max_chars)
            if prompt is not None:
                prompts.append(prompt)
            if len(prompts) == count:
                return prompts
    return prompts


def novel_workload() -> list[str]:
    from outrider.demo import eval_prompts

    return [p["prompt"] for p in eval_prompts()]


WORKLOADS = {"edit": edit_workload, "novel": novel_workload}


def write_workload(name: str, path: str | Path) -> Path:
    """The named workload as a JSON list of prompts (`bench spec --prompts PATH`)."""
    prompts = WORKLOADS[name]()
    if not prompts:
        raise SystemExit(f"workload {name}: no prompts (are the demo's held-out stdlib files installed?)")
    path = Path(path)
    path.write_text(json.dumps(prompts, indent=1) + "\n")
    return path


@dataclass(frozen=True)
class Eagle3Shape:
    """An EAGLE-3 head of a published shape: one layer at the target's dimensions, a reduced draft vocabulary."""

    draft_vocab: int
    aux_layer_ids: tuple[int, int, int]  # layer inputs (vLLM's convention)


EAGLE3_PRESETS = {
    # The shape of RedHatAI/Qwen3-8B-speculator.eagle3 and AngelSlim's Qwen3-8B head: 32 K draft ids, the usual
    # taps (2, L // 2, L - 3) of a 36-layer target.
    "qwen3-8b": Eagle3Shape(draft_vocab=32000, aux_layer_ids=(2, 18, 33)),
    "tiny-qwen3": Eagle3Shape(draft_vocab=256, aux_layer_ids=(1, 2, 3)),  # (CPU tests)
}


def write_eagle3_preset(target_dir: Path, shape: Eagle3Shape, path: Path, dtype: torch.dtype, seed: int) -> Path:
    """A random head of `shape` for the (stub) target checkpoint at target_dir: its reduced vocabulary is the
    target's first draft_vocab ids (with controlled acceptance, which ids it covers does not matter)."""
    from outrider.testing.drafters import write_eagle3_checkpoint

    return write_eagle3_checkpoint(path, target_dir, draft_ids=list(range(shape.draft_vocab)),
                                   aux_layer_ids=list(shape.aux_layer_ids), seed=seed, dtype=dtype)
