"""The in-place decode / verify kernels of Gated DeltaNet (kernels/delta_rule.py) against the torch reference
(layers/gated_deltanet.causal_conv, recurrent_delta_rule): ragged queries, slots out of order, both modes."""

from __future__ import annotations

import pytest
import torch

from outrider.layers.gated_deltanet import (QWEN3_5_PROJECTIONS, GatedDeltaNet, GatedDeltaNetConfig, GatedRMSNorm,
                                            causal_conv, recurrent_delta_rule)

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
    verify_rows = torch.zeros(3, 5, c)
    to = dict(device=device)
    state_dev, verify_dev = state.clone().to(**to), verify_rows.to(**to)  # (own copies: the kernel writes)
    out = causal_conv_step(x.to(**to), weight.to(**to), state_dev, qsl_dev, slots, max(LENS),
                           verify_dev if verify else None)
    for i, (a, b) in enumerate(zip(qsl, qsl[1:])):
        ref, windows = causal_conv(x[a:b], weight, state[SLOTS[i]])
        torch.testing.assert_close(out[a:b].cpu(), ref, atol=1e-5, rtol=1e-5)
        if verify:
            torch.testing.assert_close(verify_dev[i, :b - a].cpu(), windows[:, :, -1])  # (each position's input)
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), state[SLOTS[i]])  # untouched
        else:
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), windows[-1])


def _heads_layer(hk: int, hv: int, dk: int, dv: int) -> GatedDeltaNet:
    cfg = GatedDeltaNetConfig(hidden_size=32, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                              conv_kernel=4, rms_norm_eps=1e-6, projections=QWEN3_5_PROJECTIONS)
    layer = GatedDeltaNet(cfg, 0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer.A_log.copy_(torch.randn(hv, generator=gen))
        layer.dt_bias.copy_(torch.randn(hv, generator=gen) * 4)  # (softplus' large, small and middle ranges)
    return layer


@pytest.mark.parametrize("verify", [False, True], ids=["advance", "verify"])
def test_recurrent_step_matches_the_reference(verify, device):
    from outrider.kernels.delta_rule import recurrent_step

    gen = torch.Generator().manual_seed(1)
    hk, hv, dk, dv = 1, 3, 16, 64  # value heads sharing a key head; two blocks of value dims
    layer = _heads_layer(hk, hv, dk, dv)
    qsl, qsl_dev, slots = _qsl(device)
    t = qsl[-1]
    conv_out = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen)
    ba = torch.randn(t, 2 * hv + 3, generator=gen) * 8  # strided rows, as a split projection gives
    b, a = ba[:, :hv], ba[:, hv:2 * hv]
    q, k, v, g, beta = layer.heads(conv_out, b, a)
    state, verify_rows = torch.randn(6, hv, dk, dv, generator=gen), torch.zeros(3, 5, hv, dk + dv + 1)
    to = dict(device=device)
    state_dev, verify_dev = state.clone().to(**to), verify_rows.to(**to)  # (own copies: the kernel writes)
    ba_dev = ba.to(**to)
    out = recurrent_step(conv_out.to(**to), ba_dev[:, :hv], ba_dev[:, hv:2 * hv], layer.A_log.detach().to(**to),
                         layer.dt_bias.detach().to(**to), state_dev, qsl_dev, slots, max(LENS),
                         verify_dev if verify else None)
    for i, (a, b) in enumerate(zip(qsl, qsl[1:])):
        ref, states, updates = recurrent_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[SLOTS[i]])
        torch.testing.assert_close(out[a:b].cpu(), ref, atol=1e-4, rtol=1e-4)
        if verify:
            torch.testing.assert_close(verify_dev[i, :b - a].cpu(), updates, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), state[SLOTS[i]])
        else:
            torch.testing.assert_close(state_dev[SLOTS[i]].cpu(), states[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_heads_kernel_matches_the_layers_heads(dtype, device):
    """A prompt's heads for fla (kernels/delta_rule.heads, one launch) against GatedDeltaNet.heads: q, k of each
    value head's key head normalised (q scaled) in the conv output's dtype, v a view, g and beta float32."""
    from outrider.kernels.delta_rule import heads

    gen = torch.Generator().manual_seed(3)
    hk, hv, dk, dv = 2, 6, 16, 8  # three value heads a key head
    layer = _heads_layer(hk, hv, dk, dv)
    t = 5
    conv_out = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    ba = torch.randn(t, 2 * hv + 3, generator=gen) * 8  # strided rows, as a split projection gives
    ref = layer.heads(conv_out, ba[:, :hv], ba[:, hv:2 * hv])
    to = dict(device=device)
    ba_dev = ba.to(**to)
    got = heads(conv_out.to(**to), ba_dev[:, :hv], ba_dev[:, hv:2 * hv], layer.A_log.detach().to(**to),
                layer.dt_bias.detach().to(**to), dk, dv)
    for name, r, g in zip("qkvgb", ref, got):
        want_dtype = dtype if name in "qkv" else torch.float32
        assert g.dtype == want_dtype, name
        tol = dict(atol=1e-5, rtol=1e-5) if want_dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(g.cpu().float(), r.to(want_dtype).float(), **tol, msg=name)


def test_commit_replays_each_rows_updates_up_to_its_accepted_position(device):
    from outrider.engine.state_pool import StateLayout, StatePool
    from outrider.kernels.delta_rule import commit_updates

    gen = torch.Generator().manual_seed(4)
    pool = StatePool(StateLayout(2, (12, 4), (3, 16, 64)), num_slots=6, verify_rows=4, verify_positions=5)
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=gen))
    pool.verify_updates.copy_(torch.randn(pool.verify_updates.shape, generator=gen) * 0.5)
    slots, rows, accepted = [5, 1, 3, 2], [2, 0, 3, 1], [4, 0, 2, 3]  # rows need not follow slots
    state = pool.recurrent.to(device)
    commit_updates(state, pool.verify_updates.to(device), *(torch.tensor(x, device=device) for x in (slots, rows,
                                                                                                    accepted)))
    pool.commit_verify(torch.tensor(slots), torch.tensor(rows), torch.tensor(accepted))  # (the CPU reference)
    torch.testing.assert_close(state.cpu(), pool.recurrent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gated_norm_matches_the_reference_roundings(dtype, device):
    from outrider.kernels.delta_rule import gated_norm

    gen = torch.Generator().manual_seed(3)
    t, hv, dv = 5, 3, 64
    norm = GatedRMSNorm(dv, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dv, generator=gen))
    norm = norm.to(dtype)
    core = torch.randn(t, hv, dv, generator=gen) * 3
    z = torch.randn(t, hv * dv + 7, generator=gen).to(dtype)[:, 3:3 + hv * dv].reshape(t, hv, dv)  # strided rows
    want = norm(core, z, dtype)
    got = gated_norm(core.to(device), z.to(device), norm.weight.detach().to(device), norm.eps, dtype)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # (bfloat16: a rounding step apart where a sum rounds differently)
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
