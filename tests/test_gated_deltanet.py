"""Gated DeltaNet (layers/gated_deltanet.py) against transformers' Qwen3-Next / Qwen3.5 linear-attention layers,
and its state handling: chunked = whole, ragged batches, verify rows = the states of shorter runs, padded chunks (a
prefill graph's) = their real rows."""

from __future__ import annotations

import pytest
import torch

from outrider.layers.gated_deltanet import (QWEN3_5_PROJECTIONS, QWEN3_NEXT_PROJECTIONS, GatedDeltaNet,
                                            GatedDeltaNetConfig, LayerState, StateBatch, apply_updates,
                                            causal_conv, chunked_delta_rule, recurrent_delta_rule)
from outrider.layers.gated_deltanet_cuda import conv_window_at, real_rows, still_gates

transformers = pytest.importorskip("transformers")

RAW = {"hidden_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
       "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6}


def hf_layer(packed: bool, seed: int = 0):
    if packed:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        config = transformers.Qwen3NextConfig(**RAW, num_hidden_layers=1, layer_types=["linear_attention"])
        layer = m.Qwen3NextGatedDeltaNet(config, 0)
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        config = transformers.Qwen3_5TextConfig(**RAW, num_hidden_layers=1, layer_types=["linear_attention"])
        layer = m.Qwen3_5GatedDeltaNet(config, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name in ("A_log", "dt_bias") else 1.0)
                    / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0))
    return layer.eval()


def ours_from(hf, packed: bool) -> GatedDeltaNet:
    projections = QWEN3_NEXT_PROJECTIONS if packed else QWEN3_5_PROJECTIONS
    layer = GatedDeltaNet(GatedDeltaNetConfig.from_dict(RAW, projections), 0)
    layer.load_state_dict(hf.state_dict())
    return layer.eval()


def new_state(cfg: GatedDeltaNetConfig, slots: int = 4, rows: int = 4, positions: int = 8) -> LayerState:
    return LayerState(torch.zeros(slots, *cfg.conv_state_shape), torch.zeros(slots, *cfg.recurrent_state_shape),
                      torch.zeros(rows, positions, cfg.conv_dim),
                      torch.zeros(rows, positions, cfg.num_v_heads, cfg.head_k_dim + cfg.head_v_dim + 1))


def run(layer, x: torch.Tensor, state: LayerState, chunks: list[list[int]], slots: list[int],
        verify: bool = False) -> list[torch.Tensor]:
    """One ragged step: sequence i feeds rows chunks[i] of x from state slot slots[i]."""
    qsl = [0]
    for c in chunks:
        qsl.append(qsl[-1] + len(c))
    rows = torch.cat([x[c] for c in chunks])
    batch = StateBatch(qsl, torch.tensor(slots), slots, verify)
    with torch.no_grad():
        out = layer(rows, state, batch)
    return [out[a:b] for a, b in zip(qsl, qsl[1:])]


@pytest.fixture(params=[True, False], ids=["qwen3_next", "qwen3_5"])
def pair(request):
    hf = hf_layer(request.param)
    return hf, ours_from(hf, request.param)


def test_layer_matches_transformers_over_more_than_one_chunk(pair):
    hf, ours = pair
    x = torch.randn(1, 150, RAW["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x)[0]
    got = run(ours, x[0], new_state(ours.cfg), [list(range(150))], [2])[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_chunked_prefill_and_decode_carry_the_state(pair):
    hf, ours = pair
    x = torch.randn(1, 100, RAW["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(x)[0]
    state = new_state(ours.cfg)
    cuts = [0, 3, 70, 71, 72, 100]  # a short chunk, one past CHUNK, decode steps, the rest
    got = torch.cat([run(ours, x[0], state, [list(range(a, b))], [1])[0] for a, b in zip(cuts, cuts[1:])])
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_a_ragged_batch_equals_each_sequence_alone(pair):
    _, ours = pair
    x = torch.randn(80, RAW["hidden_size"], generator=torch.Generator().manual_seed(3))
    chunks, slots = [list(range(0, 5)), list(range(5, 75)), list(range(75, 76))], [3, 0, 2]
    together = run(ours, x, new_state(ours.cfg), chunks, slots)
    for chunk, slot, got in zip(chunks, slots, together):
        alone = run(ours, x, new_state(ours.cfg), [chunk], [slot])[0]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_verify_rows_hold_what_gives_the_state_after_each_position(pair):
    """Verifying k + 1 tokens leaves the slot as it was; the slot's conv window followed by the row's inputs 0..j,
    and the row's recurrent updates 0..j replayed on the slot, are the state after j + 1 of them, what a plain forward of those j + 1 tokens reaches:
    a rollback to j accepted drafts re-runs nothing."""
    _, ours = pair
    x = torch.randn(20, RAW["hidden_size"], generator=torch.Generator().manual_seed(4))
    state = new_state(ours.cfg)
    run(ours, x, state, [list(range(12)), list(range(12, 15))], [0, 1])  # two prefixes
    before = state.recurrent.clone(), state.conv.clone()
    verify_out = run(ours, x, state, [list(range(15, 20)), [3]], [0, 1], verify=True)
    torch.testing.assert_close(state.recurrent, before[0], rtol=0, atol=0)
    torch.testing.assert_close(state.conv, before[1], rtol=0, atol=0)
    for j in range(5):
        plain = LayerState(before[1].clone(), before[0].clone())
        out = run(ours, x, plain, [list(range(15, 16 + j))], [0])[0]
        replayed = before[0][0]
        for i in range(j + 1):
            replayed = apply_updates(replayed, state.verify_updates[0, i])
        torch.testing.assert_close(replayed, plain.recurrent[0], rtol=1e-5, atol=1e-6)
        window = torch.cat([before[1][0], state.verify_inputs[0, :j + 1].T], dim=-1)[:, -before[1].shape[-1]:]
        torch.testing.assert_close(window, plain.conv[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(verify_out[0][:j + 1], out, rtol=1e-5, atol=1e-5)


def test_chunked_rule_equals_the_recurrence_with_a_state():
    gen = torch.Generator().manual_seed(5)
    n, h, dk, dv = 150, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1)
    v, beta = torch.randn(n, h, dv, generator=gen), torch.rand(n, h, generator=gen)
    g, s0 = -torch.rand(n, h, generator=gen), torch.randn(h, dk, dv, generator=gen)
    o_rec, states, _ = recurrent_delta_rule(q, k, v, g, beta, s0)
    o_chunk, final = chunked_delta_rule(q, k, v, g, beta, s0, chunk=32)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, states[-1], atol=1e-4, rtol=1e-4)


def padded_chunk(layer, x: torch.Tensor, length: int, conv: torch.Tensor,
                 recurrent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gated_deltanet_cuda._padded's rule on the torch reference: rows x [T, H] of which the first `length` are
    real, from one slot's states -> (the delta rule's output [T, Hv, Dv], the conv state, the recurrent state)."""
    with torch.no_grad():
        mixed = layer.split(x)
        n = torch.tensor([length])
        real = real_rows(x.shape[0], n)
        qkv = mixed.qkv.where(real, 0)
        conv_out, _ = causal_conv(qkv, layer.conv1d.weight[:, 0], conv)
        q, k, v, g, beta = layer.heads(conv_out, mixed.b, mixed.a)
        g, beta = still_gates(g, beta, real)
        out, final = chunked_delta_rule(q, k, v, g, beta, recurrent)
        return out, conv_window_at(conv, qkv, n), final


@pytest.mark.parametrize("length,rows", [(2, 8), (5, 8), (70, 128), (64, 64)])
@pytest.mark.parametrize("prefix", [0, 9], ids=["cold", "continued"])
def test_padded_rows_with_still_gates_leave_the_states_and_real_outputs_of_the_real_rows(pair, length, rows,
                                                                                         prefix):
    """Pad rows (garbage, even non-finite) after a chunk's `length` real ones, with beta = g = 0 and the conv
    window taken at the real end: the real rows' outputs and both final states are the unpadded chunk's, cold or
    continuing a slot (the window then spans the slot's previous inputs when the chunk is shorter than it)."""
    _, ours = pair
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(prefix + length, RAW["hidden_size"], generator=gen)
    state = new_state(ours.cfg)
    if prefix:
        run(ours, x, state, [list(range(prefix))], [1])
    conv, recurrent = state.conv[1].clone(), state.recurrent[1].clone()
    pad = torch.randn(rows - length, RAW["hidden_size"], generator=gen) * 1e3
    pad[:1] = float("inf")
    out, conv_after, recurrent_after = padded_chunk(ours, torch.cat([x[prefix:], pad]), length, conv, recurrent)
    with torch.no_grad():
        want = ours.torch_mix(ours.split(x[prefix:]), state, StateBatch([0, length], torch.tensor([1]), [1]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:length], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_after, state.conv[1], atol=1e-6, rtol=1e-6)  # (the projection of more rows)
    torch.testing.assert_close(recurrent_after, state.recurrent[1], atol=1e-5, rtol=1e-5)
