"""Transfers: one host-to-device copy per step for many small arrays (batch layout, sampling parameters), and
asynchronous device-to-host copies the host waits for alone."""

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
    layout = []  # (values, dtype, first element in the dtype's view, size, shape: None when 1-D, needing no view)
    words = 0  # in 4-byte words
    for values, dtype in parts:
        array = isinstance(values, np.ndarray)
        size = values.size if array else len(values)
        shape = values.shape if array and values.ndim != 1 else None
        layout.append((values, dtype, words // _WORDS[dtype], size, shape))
        words += -(-size * _WORDS[dtype] // 4) * 4
    # A fresh buffer per call: the caching host allocator keeps it from reuse until its copy has run.
    buf = torch.empty(words, dtype=torch.int32, pin_memory=device.type == "cuda")
    host = buf.numpy()
    host_views = {np.int32: host}
    for values, dtype, start, size, shape in layout:
        if dtype not in host_views:
            host_views[dtype] = host.view(dtype)
        host_views[dtype][start : start + size] = values if shape is None else values.ravel()
    dev = buf.to(device, non_blocking=True)
    dev_views = {np.int32: dev}
    out = []
    for values, dtype, start, size, shape in layout:
        if dtype not in dev_views:
            dev_views[dtype] = dev.view(_TORCH[dtype])
        view = dev_views[dtype][start : start + size]
        out.append(view if shape is None else view.view(shape))
    return out


def copy_to_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Start copying device tensors into pinned host memory, and an event recorded after the copies: the host waits
    on that event for these copies alone, not for device work enqueued after them. (CPU tensors: themselves, no
    event.)"""
    if not tensors or not tensors[0].is_cuda:
        return list(tensors), None
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    ready = torch.cuda.Event()
    ready.record()
    return hosts, ready
