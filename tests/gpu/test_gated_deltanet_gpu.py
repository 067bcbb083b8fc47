"""Gated DeltaNet on CUDA (kernels/gated_deltanet.py, fla's kernels) against the torch reference: a ragged
prefill, decode steps and a ragged verify, state slots included."""

from __future__ import annotations

import pytest
import torch

from outrider.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, LayerState, StateBatch

pytest.importorskip("fla")
pytestmark = pytest.mark.cuda_only

RAW = {"hidden_size": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
       "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6}


def _layer(packed: bool, dtype: torch.dtype) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(GatedDeltaNetConfig.from_dict(RAW, packed), 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 2.0))
    return layer.to("cuda", dtype).eval()


def _state(cfg: GatedDeltaNetConfig) -> LayerState:
    def zeros(*shape):
        return torch.zeros(*shape, device="cuda")

    return LayerState(zeros(6, *cfg.conv_state_shape), zeros(6, *cfg.recurrent_state_shape),
                      zeros(3, 5, *cfg.conv_state_shape), zeros(3, 5, *cfg.recurrent_state_shape))


def _step(layer, x, state, lens, slots, verify=False, cuda=True):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    batch = StateBatch(qsl, torch.tensor(slots, device="cuda"), slots, verify)
    with torch.no_grad():
        if cuda:
            return layer(x, state, batch)
        mixed = layer.split(x)
        core = layer.torch_mix(mixed, state, batch)
        return layer.out_proj(layer.norm(core.to(x.dtype), mixed.z).flatten(1))


@pytest.mark.parametrize("packed", [True, False], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fla_path_matches_the_torch_reference(packed, dtype):
    layer = _layer(packed, dtype)
    fast, ref = _state(layer.cfg), _state(layer.cfg)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    steps = [([70, 5, 130], [4, 0, 2], False),  # ragged prefill past one chunk
             ([1, 1, 1], [4, 0, 2], False),  # decode
             ([4, 2, 5], [4, 0, 2], True)]  # ragged verify
    for lens, slots, verify in steps:
        x = torch.randn(sum(lens), RAW["hidden_size"], device="cuda", generator=gen).to(dtype)
        got = _step(layer, x, fast, lens, slots, verify)
        want = _step(layer, x, ref, lens, slots, verify, cuda=False)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        for a, b in zip(fast, ref):
            torch.testing.assert_close(a, b, **tol)
