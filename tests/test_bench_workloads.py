"""Workloads and presets for `bench spec` with n-gram lookup and EAGLE-3."""

from __future__ import annotations

import json

import torch

from outrider.bench import workloads
from outrider.speculative.eagle3 import load_eagle3
from outrider.models import registry
from outrider.testing.checkpoints import write_tiny_checkpoint

SOURCE = '''def alpha(x):
    """Double x."""
    return alpha_helper(x) * 2


def beta(y):
    return alpha(y) + 1
'''


def test_an_edit_prompt_repeats_the_file_head_with_its_first_definition_renamed():
    prompt = workloads.edit_prompt(SOURCE, max_chars=10_000, head_lines=3)
    original, edited = prompt.split(workloads.EDIT_MARK.format(old="alpha", new="alpha_v2"))
    assert original == SOURCE.rstrip("\n")
    assert edited == 'def alpha_v2(x):\n    """Double x."""\n    return alpha_helper(x) * 2'  # whole words only
    assert workloads.edit_prompt("x = 1\n" * 20 + SOURCE, max_chars=10_000) is None  # no definition up top


def test_workloads_write_the_prompt_lists_bench_spec_reads(tmp_path):
    novel = json.loads(workloads.write_workload("novel", tmp_path / "novel.json").read_text())
    assert novel and all(isinstance(p, str) for p in novel)
    if workloads.held_out_files():  # (the held-out files come from this interpreter's standard library)
        edit = json.loads(workloads.write_workload("edit", tmp_path / "edit.json").read_text())
        assert len(edit) == 64 and all("# --- the same module, edited:" in p for p in edit)


def test_the_eagle3_preset_writes_a_head_the_drafter_loads(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "target", "qwen3", hidden_size=64, layers=6, tokenizer=False)
    shape = workloads.Eagle3Shape(draft_vocab=100, aux_layer_ids=(2, 3, 4))
    path = workloads.write_eagle3_preset(target, shape, tmp_path / "eagle3", torch.bfloat16, seed=1)
    model, _, taps = load_eagle3(str(path), registry.load_config(target))
    assert taps == (1, 2, 3) and model.lm_head.weight.shape[0] == 100 and model.fc.weight.dtype == torch.bfloat16
    assert workloads.EAGLE3_PRESETS["qwen3-8b"].aux_layer_ids == (2, 18, 33)  # (2, L // 2, L - 3) for L = 36
