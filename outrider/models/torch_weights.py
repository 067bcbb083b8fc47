"""Weights saved with torch.save (`pytorch_model.bin`, sharded with `pytorch_model.bin.index.json`, or `.pth` /
`.pt` files), for checkpoints released without safetensors (the most-cited EAGLE-3 heads among them).

They are read with `torch.load(weights_only=True)`: the unpickler builds tensors and plain containers only, so a
file that holds anything else (arbitrary objects, code) is refused with a message, never executed."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

PATTERNS = ("*.bin", "*.pth", "*.pt")


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's torch.save files: those pytorch_model.bin.index.json names, else every .bin/.pth/.pt."""
    index = path / "pytorch_model.bin.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(f for pattern in PATTERNS for f in path.glob(pattern) if f.name != "training_args.bin")


def load_state_dict(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        raise ValueError(f"{file.name} is not a plain tensor file (torch.load with weights_only=True refuses it, "
                         f"so it is not read: it could run code). Convert it to safetensors. ({e})") from e
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{file.name} is not a state dict of named tensors")
    return state


@dataclass(frozen=True)
class PickledTensor:
    """A tensor of a loaded torch.save file (the interface of loader.SafetensorsTensor)."""

    name: str
    shape: tuple[int, ...]
    source: str
    tensor: torch.Tensor

    def read(self) -> torch.Tensor:
        return self.tensor


def pickled_tensors(path: Path) -> Iterator[PickledTensor]:
    for file in weight_files(path):
        for name, tensor in load_state_dict(file).items():
            yield PickledTensor(name, tuple(tensor.shape), file.name, tensor)
