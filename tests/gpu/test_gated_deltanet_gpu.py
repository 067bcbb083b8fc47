"""Gated DeltaNet's GPU path (layers/gated_deltanet_cuda.py: fla's kernels for prompts, ours for decode and verify)
against the torch reference: a ragged prefill, decode steps and a ragged verify, state slots included."""

from __future__ import annotations

import pytest
import torch

from outrider.layers.gated_deltanet import (QWEN3_5_PROJECTIONS, QWEN3_NEXT_PROJECTIONS, GatedDeltaNet,
                                            GatedDeltaNetConfig, LayerState)
from outrider.layers.gated_deltanet_types import Gates, state_batch

RAW = {"hidden_size": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
       "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6}


def _layer(packed: bool, dtype: torch.dtype, device: torch.device) -> GatedDeltaNet:
    torch.manual_seed(0)
    projections = QWEN3_NEXT_PROJECTIONS if packed else QWEN3_5_PROJECTIONS
    layer = GatedDeltaNet(GatedDeltaNetConfig.from_dict(RAW, projections), 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 2.0))
    return layer.to(device, dtype).eval()


def _state(cfg: GatedDeltaNetConfig, device: torch.device) -> LayerState:
    def underway(*shape):  # states of sequences already some tokens in
        return torch.randn(*shape, device=device) * 0.1

    return LayerState(underway(6, *cfg.conv_state_shape), underway(6, *cfg.recurrent_state_shape),
                      underway(3, 5, cfg.conv_dim),
                      underway(3, 5, cfg.num_v_heads, cfg.head_k_dim + cfg.head_v_dim + 1))


def _step(layer, x, state, lens, slots, verify=False, reference=False):
    """One ragged step through the GPU path (gated_deltanet_cuda.mix; on CUDA the layer's forward picks it)
    or the torch reference -> the delta rule's output [T, Hv, Dv]."""
    from outrider.layers import gated_deltanet_cuda

    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    batch = state_batch(qsl, slots, x.device, verify)
    with torch.no_grad():
        mixed = layer.split(x)
        if reference:
            return layer.torch_mix(mixed, state, batch)
        return gated_deltanet_cuda.mix(layer.conv1d.weight[:, 0], Gates(layer.A_log, layer.dt_bias), mixed, state,
                                       batch)


STEPS = {"prefill": ([70, 5, 130], [4, 0, 2], False),  # ragged, past one chunk
         "decode": ([1, 1, 1], [4, 0, 2], False),
         "verify": ([4, 2, 5], [4, 0, 2], True)}  # ragged


def _compare(layer, steps, device, tol: float):
    fast, ref = _state(layer.cfg, device), _state(layer.cfg, device)
    for a, b in zip(fast, ref):
        b.copy_(a)
    gen = torch.Generator(device=device).manual_seed(1)
    for lens, slots, verify in steps:
        x = torch.randn(sum(lens), RAW["hidden_size"], device=device, generator=gen).to(layer.dt_bias.dtype)
        got = _step(layer, x, fast, lens, slots, verify)
        want = _step(layer, x, ref, lens, slots, verify, reference=True)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for a, b in zip(fast, ref):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("packed", [True, False], ids=["qwen3_next", "qwen3_5"])
def test_step_kernels_match_the_reference_at_decode_and_verify(packed, device):
    layer = _layer(packed, torch.float32, device)
    _compare(layer, [STEPS["decode"], STEPS["verify"], STEPS["decode"]], device, tol=1e-4)


@pytest.mark.cuda_only
@pytest.mark.parametrize("packed", [True, False], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fla_prefill_then_steps_match_the_reference(packed, dtype, device):
    pytest.importorskip("fla")
    layer = _layer(packed, dtype, device)
    _compare(layer, list(STEPS.values()), device, tol=1e-2 if dtype == torch.float32 else 5e-2)  # (fla: tf32 dots)
