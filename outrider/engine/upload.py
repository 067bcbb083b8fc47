"""One host-to-device transfer per step for many small arrays (batch layout, sampling parameters)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_WORDS = {np.int64: 2, np.int32: 1, np.float32: 1}  # 4-byte words per element
_TORCH = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}


def to_device(parts: Sequence[tuple[Sequence | np.ndarray, type]], device: torch.device) -> list[torch.Tensor]:
    """(values, dtype) pairs -> device tensors, through one host buffer and one copy: one launch instead of one
    per tensor, and on CUDA from pinned memory, so the copy is asynchronous. `values` is a list (1-D) or an
    array (any shape); dtype is np.int64, np.int32 or np.float32. Lists are written straight into the buffer.

    Each tensor starts 16-byte aligned: Triton specialises kernels on pointer alignment, so unaligned views
    would compile (and run) other variants than the ones warmed up."""
    if not parts:
        return []
    offsets, words = [], 0  # in 4-byte words
    for values, dtype in parts:
        offsets.append(words)
        size = values.size if isinstance(values, np.ndarray) else len(values)
        words += -(-size * _WORDS[dtype] // 4) * 4
    # A fresh buffer per call: the caching host allocator keeps it from reuse until its copy has run.
    buf = torch.empty(words, dtype=torch.int32, pin_memory=device.type == "cuda")
    host = buf.numpy()
    host_views = {np.int32: host}
    for (values, dtype), off in zip(parts, offsets):
        if dtype not in host_views:
            host_views[dtype] = host.view(dtype)
        start = off // _WORDS[dtype]
        if isinstance(values, np.ndarray):
            host_views[dtype][start : start + values.size] = values.ravel()
        else:
            host_views[dtype][start : start + len(values)] = values
    dev = buf.to(device, non_blocking=True)
    dev_views = {np.int32: dev}
    out = []
    for (values, dtype), off in zip(parts, offsets):
        if dtype not in dev_views:
            dev_views[dtype] = dev.view(_TORCH[dtype])
        start = off // _WORDS[dtype]
        if isinstance(values, np.ndarray):
            out.append(dev_views[dtype][start : start + values.size].view(values.shape))
        else:
            out.append(dev_views[dtype][start : start + len(values)])
    return out
