"""What a Gated DeltaNet step passes between the layer (layers/gated_deltanet.py) and its CUDA path
(layers/gated_deltanet_cuda.py): the per-slot state tensors, the batch's layout, the input projection's parts, the
gates' parameters."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Gates(NamedTuple):
    """A layer's per-value-head decay parameters, A_log and dt_bias [Hv] (GatedDeltaNet.heads reads them)."""

    a_log: torch.Tensor
    dt_bias: torch.Tensor


class LayerState(NamedTuple):
    """One linear-attention layer's state tensors, indexed by slot: conv [S, C, K], recurrent [S, Hv, Dk, Dv];
    and the verify rows a verify forward fills (P = the most query tokens a verify has), what the state after each
    position follows from, far smaller than that state: each position's conv input [R, P, C] (float32; the conv
    window after position j is the last K of the slot's window and the inputs 0..j), and its update of the
    recurrent state [R, P, Hv, Dk + Dv + 1]: k (normalised), u and the log decay g, with S <- exp(g) S + k u^T."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    verify_inputs: torch.Tensor | None = None
    verify_updates: torch.Tensor | None = None


class StateBatch(NamedTuple):
    """What a linear-attention layer needs of a ragged batch beyond its tokens: sequence i owns the query tokens
    query_start_loc[i]:query_start_loc[i + 1] and state slot slots[i]. verify: write the state after each query
    position to verify row i (slots untouched) instead of advancing the slot; for the whole batch, so a verify
    batch holds no prompt chunks (at most the verify rows' positions per sequence), and every row of it is then
    committed (StatePool.commit_verify; a row without drafts at position 0)."""

    query_start_loc_host: list[int]
    slots: torch.Tensor  # [B] int64, on the state's device
    slots_host: list[int]
    verify: bool = False
    # [B + 1] on the device, one tensor for every layer of a forward (a graph's: its attention metadata's, or a
    # prefill graph's real offsets)
    query_start_loc: torch.Tensor | None = None
    # [B + 1] int64 on the host: fla's varlen kernels read the chunk layout from it instead of syncing on the
    # device copy, and one object for every layer of a forward lets fla compute that layout once
    query_start_loc_cpu: torch.Tensor | None = None
    # A prefill graph's lone chunk, padded up to the captured rows (query_start_loc_host's end): its real end is
    # query_start_loc[1], on the device only, and the rows after it must leave the slot's state as it was
    padded: bool = False


def state_batch(qsl: list[int], slots: list[int], device: torch.device, verify: bool = False) -> StateBatch:
    """A step's StateBatch, its offsets copied to the device once for all its layers (none copies from the
    host)."""
    qsl_cpu = torch.tensor(qsl, dtype=torch.int64)
    return StateBatch(qsl, torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True), slots, verify,
                      qsl_cpu.to(device, non_blocking=True), qsl_cpu)


class Mixed(NamedTuple):
    """The input projection's parts: conv inputs q|k|v [T, C], gate z [T, Hv, Dv], b and a [T, Hv]."""

    qkv: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor
