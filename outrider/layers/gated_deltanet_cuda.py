"""Gated DeltaNet on CUDA. Prompts go through flash-linear-attention's Triton kernels (the `fla-core` package,
the `gpu` extra): its causal conv and chunked delta rule over the ragged batch (cu_seqlens), each sequence's
state gathered from its slot and the final one scattered back. Decode and verify steps go through our own step
kernels (kernels/delta_rule.py), which work on the slots in place and keep every verify position's state; all
device ops, so those steps capture into CUDA graphs. So do lone prompt chunks padded up to a prefill graph's rows
(`StateBatch.padded`): fla's kernels over them as one sequence, the pad rows inert.

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
    if batch.padded:
        return _padded(conv_weight, gates, mixed, state, batch)
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

    qsl = batch.query_start_loc
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
    cu, cu_cpu = batch.query_start_loc.to(torch.int64), batch.query_start_loc_cpu
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


def _padded(conv_weight: torch.Tensor, gates: Gates, mixed: Mixed, state: LayerState,
            batch: StateBatch) -> torch.Tensor:
    """A prefill graph's lone chunk: fla's kernels over all the captured rows as one sequence, without cu_seqlens
    (fla lays chunks out from them on the host, which a graph would freeze), so no launch depends on the real
    length; that is read on the device only, where the pad rows after it are made inert (the padded chunks'
    helpers below). Their conv inputs are zeroed first: they hold whatever the padded forward computed there, and
    a non-finite one would reach the state through 0 * inf."""
    from outrider.kernels.delta_rule import heads

    causal_conv1d, chunk_rule = _fla()
    slot, length = batch.slots[:1], batch.query_start_loc[1:].to(torch.int64)
    real = real_rows(mixed.qkv.shape[0], length)
    x = mixed.qkv.where(real, 0)
    conv_init = state.conv.index_select(0, slot).to(x.dtype)
    conv_out, _ = causal_conv1d(x[None], conv_weight, initial_state=conv_init, activation="silu")
    state.conv.index_copy_(0, slot, conv_window_at(conv_init[0], x, length)[None].to(state.conv.dtype))
    _, dk, dv = state.recurrent.shape[1:]
    q, k, v, g, beta = heads(conv_out[0], mixed.b, mixed.a, gates.a_log, gates.dt_bias, dk, dv)
    g, beta = still_gates(g, beta, real)
    o, final = chunk_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                          initial_state=state.recurrent.index_select(0, slot), output_final_state=True)
    state.recurrent.index_copy_(0, slot, final.to(state.recurrent.dtype))
    return o[0].float()


# --- padded chunks (a prefill graph's: its captured rows, the real length only on the device), in torch ops so
# that the CPU checks them against the reference (tests/test_gated_deltanet.py) ---------------------------------


def real_rows(rows: int, length: torch.Tensor) -> torch.Tensor:
    """[rows, 1] bool: True before `length` ([1] int64, on the device: a graph's chunk length changes per replay)."""
    return (torch.arange(rows, device=length.device) < length)[:, None]


def still_gates(g: torch.Tensor, beta: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g and beta [L, H] with 0 at the pad rows (real_rows False): such a position leaves the recurrent state as it
    is (S <- exp(0) S + k 0 (v - S^T k)), so the state after a padded chunk is the state after its real rows."""
    return g.where(real, 0.0), beta.where(real, 0.0)


def conv_window_at(state: torch.Tensor, x: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """The conv state [C, K] after the first `length` ([1] int64, on the device) inputs of x [T, C] from the window
    `state` [C, K]: the last K of the window and those inputs, picked on the device (the conv is causal, so the
    real rows' outputs ignore the pad rows after them; its state must not)."""
    k = state.shape[1]
    seq = torch.cat([state, x.T.to(state.dtype)], dim=1)  # [C, K + T]: input j at column K + j
    return seq.index_select(1, length + torch.arange(k, device=x.device))
