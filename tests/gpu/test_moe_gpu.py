"""The fused MoE experts (kernels/moe.py) against the torch reference (layers/moe.torch_experts)."""

from __future__ import annotations

import pytest
import torch

from outrider.layers.moe import torch_experts, torch_route


def _problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
             device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    router = torch.randn(experts, hidden, generator=gen)
    routing = torch_route(x @ router.T, top_k, normalize=True)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), gate_up.to(**to), down.to(**to), routing._replace(
        ids=routing.ids.to(device), weights=routing.weights.to(device))


def _check_experts(experts_fn, tokens, experts, top_k, hidden, inter, model_dtype, device):
    x, gate_up, down, routing = _problem(tokens, experts, top_k, hidden, inter, model_dtype, device)
    got = experts_fn(x, gate_up, down, routing.ids, routing.weights)
    ref = torch_experts(x.float(), gate_up.float(), down.float(), routing._replace(
        weights=routing.weights.float()))
    tol = 1e-4 if model_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [1, 3, 40, 130])  # decode, verify, prefill-sized (both block sizes)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4)])
def test_fused_experts_match_the_torch_reference(tokens, experts, top_k, model_dtype, device):
    from outrider.kernels.moe import fused_experts

    _check_experts(fused_experts, tokens, experts, top_k, 48, 40, model_dtype, device)


@pytest.mark.parametrize("tokens", [1, 2, 4, 6, 8])  # (pairs sharing an expert from 2 on)
@pytest.mark.parametrize("hidden,inter,tiles", [(48, 40, None), (96, 512, None), (96, 136, (16, 32, 64)),
                                                (64, 16, (8, 8, 16))])
def test_both_expert_paths_match_the_torch_reference_for_few_tokens(tokens, hidden, inter, tiles, model_dtype,
                                                                      device):
    """The per-pair GEMVs and the sorted grouped GEMMs, each on its own (fused_experts picks one by T), with
    column and reduction tiles that do and do not divide the sizes."""
    from outrider.kernels import moe

    pair = moe.pair_experts if tiles is None else (
        lambda *a: moe.pair_experts(*a, tiles=moe.GemvTiles(*tiles)))
    for fn in (pair, moe.sorted_experts):
        _check_experts(lambda x, gu, d, ids, w: fn(x, gu, d, ids, w.float()), tokens, 16, 4, hidden, inter,
                       model_dtype, device)


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


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (3, 16, 4), (8, 128, 8), (6, 512, 10), (2, 5, 2)])
def test_one_launch_layout_equals_the_sorting_layout(tokens, experts, top_k, device):
    from outrider.kernels import moe

    gen = torch.Generator().manual_seed(tokens * experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[-1] = ids[0]  # (two tokens, or one token's pairs, share experts)
    ids = ids.to(device)
    got = moe.block_layout(ids, experts, block_m=16)
    small, moe.SMALL_PAIRS = moe.SMALL_PAIRS, 0
    try:
        want = moe.block_layout(ids, experts, block_m=16)
    finally:
        moe.SMALL_PAIRS = small
    assert ids.numel() <= small
    assert got.sorted_pairs.tolist() == want.sorted_pairs.tolist()
    assert got.block_expert.tolist() == want.block_expert.tolist()


@pytest.mark.parametrize("tokens,experts,top_k,normalize", [(1, 128, 8, True), (5, 512, 10, True), (3, 60, 4, False),
                                                             (2, 8, 1, True)])
def test_one_launch_routing_equals_the_torch_reference(tokens, experts, top_k, normalize, model_dtype, device):
    from outrider.kernels.moe import route

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)).to(device, model_dtype)
    ids, weights = route(logits, top_k, normalize)
    ref = torch_route(logits.float().cpu(), top_k, normalize)
    torch.testing.assert_close(weights.cpu(), ref.weights, atol=1e-6, rtol=1e-5)  # (both in descending order)
    # The same experts, but for the order among equal logits (half precision has ties), which torch leaves open.
    assert all(len(set(row)) == top_k for row in ids.tolist())
    assert torch.equal(logits.cpu().gather(1, ids.cpu()), logits.cpu().gather(1, ref.ids))


@pytest.mark.cuda_only
@pytest.mark.parametrize("tokens", [2, 6])  # (each path)
def test_fused_experts_replay_in_a_cuda_graph(tokens, device):
    from outrider.kernels.moe import fused_experts

    x, gate_up, down, routing = _problem(tokens, 16, 4, 64, 64, torch.bfloat16, device)
    out = fused_experts(x, gate_up, down, routing.ids, routing.weights)  # warm-up compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, gate_up, down, routing.ids, routing.weights)
    x2, *_ = _problem(tokens, 16, 4, 64, 64, torch.bfloat16, device, seed=1)
    x.copy_(x2)
    graph.replay()
    torch.testing.assert_close(out, fused_experts(x2, gate_up, down, routing.ids, routing.weights))
