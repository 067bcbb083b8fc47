"""The in-place decode / verify kernels of Gated DeltaNet (kernels/delta_rule.py) against the torch reference
(layers/gated_deltanet.causal_conv, recurrent_delta_rule): ragged queries, slots out of order, both modes."""

from __future__ import annotations

import pytest
import torch

from outrider.layers.gated_deltanet import causal_conv, recurrent_delta_rule

LENS = [1, 4, 3]  # a decode row among verify rows of different lengths
SLOTS = [5, 1, 3]


def _qsl(device):
    qsl = [0]
    for n in LENS:
        qsl.append(qsl[-1] + n)
    return qsl, torch.tensor(qsl, device=device), torch.tensor(SLOTS, device=device)


@pytest.mark.parametrize("verify", [False, True], ids=["advance", "verify"])
def test_conv_step_matches_the_reference(verify, device):
    from outrider.kernels.delta_rule import causal_conv_step

    gen = torch.Generator().manual_seed(0)
    c = 300  # more than one block of channels
    qsl, qsl_dev, slots = _qsl(device)
    x = torch.randn(qsl[-1], c + 7, generator=gen)[:, :c]  # strided rows, as a split projection gives
    weight, state = torch.randn(c, 4, generator=gen), torch.randn(6, c, 4, generator=gen)
    verify_rows = torch.zeros(3, 5, c, 4)
    to = dict(device=device)
    state_dev, verify_dev = state.clone().to(**to), verify_rows.to(**to)  # (own copies: the kernel writes)
    out = causal_conv_step(x.to(**to), weight.to(**to), state_dev, qsl_dev, slots, max(LENS),
                           verify_dev if verify else None)
    for i, (a, b) in enumerate(zip(qsl, qsl[1:])):
        ref, windows = causal_conv(x[a:b], weight, state[SLOTS[i]])
        torch.testing.assert_close(out[a:b].cpu(), ref, atol=1e-5, rtol=1e-5)
        if verify:
            torch.testing.assert_close(verify_dev[i, :b - a].cpu(), windows)
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), state[SLOTS[i]])  # untouched
        else:
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), windows[-1])


@pytest.mark.parametrize("verify", [False, True], ids=["advance", "verify"])
def test_recurrent_step_matches_the_reference(verify, device):
    from outrider.kernels.delta_rule import recurrent_step

    gen = torch.Generator().manual_seed(1)
    hv, dk, dv = 3, 16, 64  # two blocks of value dims
    qsl, qsl_dev, slots = _qsl(device)
    t = qsl[-1]
    q = torch.nn.functional.normalize(torch.randn(t, hv, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hv, dk, generator=gen), dim=-1)
    v, beta, g = torch.randn(t, hv, dv, generator=gen), torch.rand(t, hv, generator=gen), -torch.rand(t, hv, generator=gen)
    state, verify_rows = torch.randn(6, hv, dk, dv, generator=gen), torch.zeros(3, 5, hv, dk, dv)
    to = dict(device=device)
    state_dev, verify_dev = state.clone().to(**to), verify_rows.to(**to)  # (own copies: the kernel writes)
    out = recurrent_step(*(x.to(**to) for x in (q, k, v, g, beta)), state_dev, qsl_dev, slots, max(LENS),
                         verify_dev if verify else None)
    for i, (a, b) in enumerate(zip(qsl, qsl[1:])):
        ref, states = recurrent_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[SLOTS[i]])
        torch.testing.assert_close(out[a:b].cpu(), ref, atol=1e-4, rtol=1e-4)
        if verify:
            torch.testing.assert_close(verify_dev[i, :b - a].cpu(), states, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), state[SLOTS[i]])
        else:
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), states[-1], atol=1e-4, rtol=1e-4)
