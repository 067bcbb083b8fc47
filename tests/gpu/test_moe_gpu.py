"""The fused MoE experts (kernels/moe.py) against the torch reference (layers/moe.torch_experts)."""

from __future__ import annotations

import pytest
import torch

from outrider.layers.moe import route, torch_experts


def _problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
             device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    router = torch.randn(experts, hidden, generator=gen)
    routing = route(x @ router.T, top_k, normalize=True)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), gate_up.to(**to), down.to(**to), routing._replace(
        ids=routing.ids.to(device), weights=routing.weights.to(device))


@pytest.mark.parametrize("tokens", [1, 3, 40, 130])  # decode, verify, prefill-sized (both block sizes)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4)])
def test_fused_experts_match_the_torch_reference(tokens, experts, top_k, model_dtype, device):
    from outrider.kernels.moe import fused_experts

    x, gate_up, down, routing = _problem(tokens, experts, top_k, 48, 40, model_dtype, device)
    got = fused_experts(x, gate_up, down, routing.ids, routing.weights)
    ref = torch_experts(x.float(), gate_up.float(), down.float(), routing._replace(
        weights=routing.weights.float()))
    tol = 1e-4 if model_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_block_layout_puts_every_pair_once_in_its_experts_block(device):
    from outrider.kernels.moe import block_layout

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]], device=device)
    layout = block_layout(ids, num_experts=5, block_m=16)
    pairs, owner = layout.sorted_pairs.view(-1, 16), layout.block_expert
    flat = ids.flatten()
    seen = []
    for block, e in zip(pairs.tolist(), owner.tolist()):
        real = [p for p in block if p < flat.numel()]
        if e < 0:
            assert not real
            continue
        assert real and all(int(flat[p]) == e for p in real)
        seen += real
    assert sorted(seen) == list(range(flat.numel()))


@pytest.mark.cuda_only
def test_fused_experts_replay_in_a_cuda_graph(device):
    from outrider.kernels.moe import fused_experts

    x, gate_up, down, routing = _problem(2, 16, 4, 64, 64, torch.bfloat16, device)
    out = fused_experts(x, gate_up, down, routing.ids, routing.weights)  # warm-up compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, gate_up, down, routing.ids, routing.weights)
    x2, *_ = _problem(2, 16, 4, 64, 64, torch.bfloat16, device, seed=1)
    x.copy_(x2)
    graph.replay()
    torch.testing.assert_close(out, fused_experts(x2, gate_up, down, routing))
