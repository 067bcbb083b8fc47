"""How Triton kernels launch: inside CUDA-graph capture or not, as programmatic dependent launches or not, and the
row limits of the skinny GEMM. The dispatcher (ops) and the kernels (fused, gemm, attention) all read these, so
they live below all of them. Safe to import anywhere: no Triton here.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

# Rows the skinny GEMM (kernels/gemm.py) takes: up to FOLD_MAX_ROWS on CUDA cores, with a pre-norm or SiLU folded
# into the projection; beyond, up to SKINNY_MAX_ROWS (a verify step's), 16-bit only, on tensor cores without folds.
FOLD_MAX_ROWS = 2
SKINNY_MAX_ROWS = 16
# Launch Triton kernels captured into CUDA graphs as programmatic dependent launches (Hopper and later): a
# kernel's blocks are scheduled while the previous kernel finishes and wait on it in-kernel (gdc_wait), to hide
# the gap between dependent kernels of a decode step, and to prefetch weights and K/V into L2 before the wait
# (its effect: docs/benchmarks.md). (A constant so that tests can compare graphs with and without it.)
PDL = True
_in_graph_capture = False


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def cuda_properties(device: torch.device):
    """A CUDA device's properties, queried once per device (a driver call each time otherwise)."""
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())


@contextmanager
def graph_capture():
    """Marks the forwards a CUDA graph runner warms up and captures (ops may pick graph-only kernels there)."""
    global _in_graph_capture
    _in_graph_capture = True
    try:
        yield
    finally:
        _in_graph_capture = False


def in_graph_capture() -> bool:
    return _in_graph_capture


def use_pdl(x: torch.Tensor) -> bool:
    """Whether Triton kernels on x's device launch with PDL now: inside graph capture, on compute capability 9+."""
    return PDL and _in_graph_capture and x.is_cuda and cuda_properties(x.device).major >= 9


def pdl_args(pdl: bool) -> dict:
    """A PDL-aware Triton kernel's launch keywords: its USE_PDL flag (fused.pdl_enter), and launch_pdl only when
    set (older Tritons lack the keyword)."""
    return {"USE_PDL": pdl, "launch_pdl": True} if pdl else {"USE_PDL": False}


def is_power_of_two(n: int) -> bool:
    """Whether n can be a Triton block side (tl.arange takes powers of two only)."""
    return n > 0 and n & (n - 1) == 0
