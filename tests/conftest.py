"""Shared fixtures: tiny HF-format checkpoints, written once per session and cached by their arguments."""

from __future__ import annotations

import json

import pytest
import torch

from outrider.testing import write_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add overhead, and on a busy 2-core machine they stall for longer
    than a step of the timing tests (and make the suite several times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(arch, **kwargs) -> Path of a `write_tiny_checkpoint` directory (do not modify it)."""
    cache = {}

    def make(arch: str = "qwen3", **kwargs):
        key = (arch, json.dumps(kwargs, sort_keys=True, default=str))
        if key not in cache:
            cache[key] = write_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **kwargs)
        return cache[key]

    return make
