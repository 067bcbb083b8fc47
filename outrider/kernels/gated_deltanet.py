"""Gated DeltaNet on CUDA through flash-linear-attention's Triton kernels (the `fla-core` package, the `gpu`
extra): the causal conv and the chunked delta rule over a ragged batch (cu_seqlens), the fused recurrence for
one-token decode. Each sequence's state is gathered from its slot and the final one scattered back, with device
ops only. A verify forward steps the recurrence one position at a time, keeping every position's state (the
verify rows); fla has no kernel that writes them all in one pass.

Semantics: layers/gated_deltanet.GatedDeltaNet.torch_mix (tests/gpu/test_gated_deltanet_gpu.py compares them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outrider.layers.gated_deltanet import GatedDeltaNet, LayerState, Mixed, StateBatch


def _fla():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:
        raise RuntimeError("Gated DeltaNet layers on CUDA need flash-linear-attention: pip install "
                           "'outrider[gpu]' (fla-core)") from e
    return causal_conv1d, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def mix(layer: GatedDeltaNet, mixed: Mixed, state: LayerState, batch: StateBatch) -> torch.Tensor:
    """GatedDeltaNet.torch_mix on fla's kernels -> the delta rule's output [T, Hv, Dv]."""
    if batch.verify:
        return _verify(layer, mixed, state, batch)
    causal_conv1d, chunk_rule, recurrent_rule = _fla()
    qsl = batch.query_start_loc_host
    dtype, device = mixed.qkv.dtype, mixed.qkv.device
    decode = qsl[-1] == len(qsl) - 1  # one token per sequence
    cu = None if decode else torch.tensor(qsl, dtype=torch.int64).to(device, non_blocking=True)
    conv_init = state.conv.index_select(0, batch.slots).to(dtype)
    x = mixed.qkv[:, None] if decode else mixed.qkv[None]  # decode: a batch of one-token sequences
    conv_out, conv_final = causal_conv1d(x, layer.conv1d.weight[:, 0], initial_state=conv_init,
                                         output_final_state=True, activation="silu", cu_seqlens=cu)
    state.conv.index_copy_(0, batch.slots, conv_final.to(state.conv.dtype))
    q, k, v, g, beta = layer.heads(conv_out.flatten(0, 1), mixed.b, mixed.a)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    init = state.recurrent.index_select(0, batch.slots)
    if decode:
        o, final = recurrent_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=1.0,
                                  initial_state=init, output_final_state=True)
    else:
        o, final = chunk_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=init,
                              output_final_state=True, cu_seqlens=cu)
    state.recurrent.index_copy_(0, batch.slots, final.to(state.recurrent.dtype))
    return o.flatten(0, 1).float()


def _verify(layer: GatedDeltaNet, mixed: Mixed, state: LayerState, batch: StateBatch) -> torch.Tensor:
    """Position by position: the sequences that have a query at position p step their conv window and recurrent
    state once, and the states after p go to their verify rows."""
    _, _, recurrent_rule = _fla()
    qsl = batch.query_start_loc_host
    device = mixed.qkv.device
    lens = [b - a for a, b in zip(qsl, qsl[1:])]
    weight = layer.conv1d.weight[:, 0].float()
    conv = state.conv.index_select(0, batch.slots)
    rec = state.recurrent.index_select(0, batch.slots)
    out = torch.empty(qsl[-1], layer.cfg.num_v_heads, layer.cfg.head_v_dim, device=device)
    for p in range(max(lens)):
        rows_host = [i for i, n in enumerate(lens) if n > p]
        rows = torch.tensor(rows_host).to(device, non_blocking=True)
        tokens = torch.tensor([qsl[i] + p for i in rows_host]).to(device, non_blocking=True)
        window = torch.cat([conv[rows, :, 1:], mixed.qkv[tokens].float()[:, :, None]], dim=2)
        conv_out = F.silu((window * weight).sum(-1)).to(mixed.qkv.dtype)
        q, k, v, g, beta = layer.heads(conv_out, mixed.b[tokens], mixed.a[tokens])
        o, final = recurrent_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=1.0,
                                  initial_state=rec[rows], output_final_state=True)
        conv[rows], rec[rows] = window, final.float()
        state.verify_conv[rows, p] = window.to(state.verify_conv.dtype)
        state.verify_recurrent[rows, p] = rec[rows]
        out[tokens] = o[:, 0].float()
    return out
