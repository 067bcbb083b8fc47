"""Checkpoints saved with torch.save (pytorch_model.bin, sharded or not, .pth/.pt) load like safetensors ones,
through torch.load(weights_only=True): a file holding anything but tensors is refused, never unpickled."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from outrider.models import load_model, read_tensors
from outrider.testing import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("w") / "tiny", "qwen3", seed=2)


def as_torch_files(checkpoint, dst, shards: int):
    shutil.copytree(checkpoint, dst)
    state = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(state)
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return dst
    weight_map = {}
    for i in range(shards):
        part = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({n: state[n] for n in names[i::shards]}, dst / part)
        weight_map.update({n: part for n in names[i::shards]})
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("shards", [1, 3])
def test_torch_save_checkpoints_load_as_safetensors_ones(checkpoint, tmp_path, shards):
    converted = as_torch_files(checkpoint, tmp_path / "bin", shards)
    want, _ = load_model(checkpoint, dtype="float32")
    got, _ = load_model(converted, dtype="float32")
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    assert read_tensors(converted, "model.norm").keys() == read_tensors(checkpoint, "model.norm").keys()


def test_files_holding_more_than_tensors_are_refused(checkpoint, tmp_path):
    dst = as_torch_files(checkpoint, tmp_path / "unsafe", 1)
    (dst / "pytorch_model.bin").unlink()
    state = load_file(checkpoint / "model.safetensors")
    torch.save({**state, "args": argparse.Namespace(x=1)}, dst / "head.pth")
    with pytest.raises(ValueError, match="head.pth is not a plain tensor file .*weights_only"):
        load_model(dst, dtype="float32")


def test_a_hub_repo_without_safetensors_fetches_its_torch_files():
    from outrider.models.hub import snapshot_patterns

    assert "*.bin" in snapshot_patterns(("config.json", "pytorch_model.bin"))
    assert "*.bin" not in snapshot_patterns(("config.json", "model.safetensors", "training_args.bin"))
