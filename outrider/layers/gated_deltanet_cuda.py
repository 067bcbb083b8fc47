"""Gated DeltaNet on CUDA. Prompts go through flash-linear-attention's Triton kernels (the `fla-core` package,
the `gpu` extra): its causal conv and chunked delta rule over the ragged batch (cu_seqlens), each sequence's
state gathered from its slot and the final one scattered back. Decode and verify steps go through our own step
kernels (kernels/delta_rule.py), which work on the slots in place and keep every verify position's state; all
device ops, so those steps capture into CUDA graphs.

Semantics: layers/gated_deltanet.GatedDeltaNet.torch_mix (tests/gpu/test_gated_deltanet_gpu.py compares them).
"""

from __future__ import annotations

import torch

from outrider.layers.gated_deltanet_types import Gates, LayerState, Mixed, StateBatch


def _fla():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise RuntimeError("Gated DeltaNet layers on CUDA need flash-linear-attention: pip install "
                           "'outrider[gpu]' (fla-core)") from e
    return causal_conv1d, chunk_gated_delta_rule


# Queries up to this long (decode, a verify) run the in-place step kernels; longer ones fla's chunked kernels.
SHORT_QUERY = 16


def mix(conv_weight: torch.Tensor, gates: Gates, mixed: Mixed, state: LayerState, batch: StateBatch) -> torch.Tensor:
    """GatedDeltaNet.torch_mix on the GPU, given the layer's depthwise conv weight [C, K] and the parameters its
    heads read -> the delta rule's output [T, Hv, Dv] float32."""
    qsl = batch.query_start_loc_host
    longest = max(b - a for a, b in zip(qsl, qsl[1:]))
    if batch.verify or longest <= SHORT_QUERY:
        return _short(conv_weight, gates, mixed, state, batch, longest)
    return _chunked(conv_weight, gates, mixed, state, batch)


def _short(conv_weight: torch.Tensor, gates: Gates, mixed: Mixed, state: LayerState, batch: StateBatch,
           longest: int) -> torch.Tensor:
    """Decode and verify: kernels/delta_rule.py, on the slots in place (verify: into the verify rows); the
    recurrent kernel computes the heads itself."""
    from outrider.kernels.delta_rule import causal_conv_step, recurrent_step

    qsl = _device_qsl(batch, mixed.qkv.device)
    conv_out = causal_conv_step(mixed.qkv, conv_weight, state.conv, qsl, batch.slots, longest,
                                state.verify_inputs if batch.verify else None)
    return recurrent_step(conv_out, mixed.b, mixed.a, gates.a_log, gates.dt_bias, state.recurrent, qsl, batch.slots,
                          longest, state.verify_updates if batch.verify else None)


def _chunked(conv_weight: torch.Tensor, gates: Gates, mixed: Mixed, state: LayerState,
             batch: StateBatch) -> torch.Tensor:
    """Prompts: fla's causal conv and chunked delta rule over the ragged batch, states gathered from the slots
    and scattered back, the heads between them one launch of ours (kernels/delta_rule.heads). The host offsets go
    along, so that fla never reads the device's back (a sync a layer)."""
    from outrider.kernels.delta_rule import heads

    causal_conv1d, chunk_rule = _fla()
    dtype = mixed.qkv.dtype
    cu = _device_qsl(batch, mixed.qkv.device).to(torch.int64)
    cu_cpu = batch.query_start_loc_cpu
    if cu_cpu is None:
        cu_cpu = torch.tensor(batch.query_start_loc_host, dtype=torch.int64)
    conv_init = state.conv.index_select(0, batch.slots).to(dtype)
    conv_out, conv_final = causal_conv1d(mixed.qkv[None], conv_weight, initial_state=conv_init,
                                         output_final_state=True, activation="silu", cu_seqlens=cu,
                                         cu_seqlens_cpu=cu_cpu)
    state.conv.index_copy_(0, batch.slots, conv_final.to(state.conv.dtype))
    _, dk, dv = state.recurrent.shape[1:]
    q, k, v, g, beta = heads(conv_out[0], mixed.b, mixed.a, gates.a_log, gates.dt_bias, dk, dv)
    o, final = chunk_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                          initial_state=state.recurrent.index_select(0, batch.slots), output_final_state=True,
                          cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    state.recurrent.index_copy_(0, batch.slots, final.to(state.recurrent.dtype))
    return o[0].float()


def _device_qsl(batch: StateBatch, device: torch.device) -> torch.Tensor:
    if batch.query_start_loc is not None:
        return batch.query_start_loc
    return torch.tensor(batch.query_start_loc_host).to(device, non_blocking=True)
