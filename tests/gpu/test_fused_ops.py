"""Triton fused ops against their torch definitions in outrider.kernels.ops."""

from __future__ import annotations

import pytest
import torch

from outrider.attention import KVCache
from outrider.attention.torch_ref import store_kv
from outrider.kernels import ops


def _close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(residual, device, half):
    from outrider.kernels import fused

    x = torch.randn(7, 1000, dtype=half)
    r = torch.randn(7, 1000, dtype=half) if residual else None
    w = torch.randn(1000, dtype=half)
    ref, ref_sum = ops.torch_rms_norm(x, w, 1e-6, r)
    out, out_sum = fused.rms_norm(x.to(device), w.to(device), 1e-6, r.to(device) if residual else None)
    _close(out, ref, half)
    if residual:
        assert torch.equal(out_sum.cpu(), ref_sum)
    else:
        assert out_sum is None


def test_silu_mul_on_packed_halves(device, half):
    from outrider.kernels import fused

    gu = torch.randn(5, 2 * 1500, dtype=half)
    gate, up = gu.to(device).chunk(2, dim=-1)
    _close(fused.silu_mul(gate, up), ops.torch_silu_mul(*gu.chunk(2, dim=-1)), half)


@pytest.mark.parametrize("t", [1, 5])
def test_sigmoid_gate_on_the_gate_halves_of_query_gate_heads(t, device, half):
    """The gated attention's output gate, one launch: o * sigmoid(gate) with gate the second half of each head's
    [query | gate] in a packed projection (a strided view), as torch computes it from the same view."""
    from outrider.kernels import fused

    heads, d = 16, 128
    qkv = torch.randn(t, heads * 2 * d + 512, dtype=half)
    gate = qkv[:, : heads * 2 * d].view(t, heads, 2 * d)[..., d:]
    o = torch.randn(t, heads, d, dtype=half)
    got = fused.sigmoid_gate(o.to(device), qkv.to(device)[:, : heads * 2 * d].view(t, heads, 2 * d)[..., d:])
    _close(got, o * torch.sigmoid(gate), half)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("t,hq,hk,d", [(6, 12, 4, 64), (1, 32, 8, 128), (3, 6, 3, 80)],
                         ids=["ragged-heads", "qwen3-8b-decode", "odd-head-dim"])
def test_qk_norm_rope(norm, t, hq, hk, d, device, half):
    from outrider.kernels import fused

    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=half)
    q = qkv[:, : hq * d].view(t, hq, d)  # strided views, as a packed QKV projection produces
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    pos = torch.tensor([0, 1, 2, 700, 4095, 31])[-t:]
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    qw = torch.randn(d, dtype=half) if norm else None
    kw = torch.randn(d, dtype=half) if norm else None
    ref_q, ref_k = ops.torch_qk_norm_rope(q, k, pos, inv_freq, qw, kw, 1e-6)
    dev = lambda x: x.to(device) if x is not None else None  # noqa: E731
    out_q, out_k = fused.qk_norm_rope(dev(q), dev(k), dev(pos), dev(inv_freq), dev(qw), dev(kw), 1e-6)
    _close(out_q, ref_q, half)
    _close(out_k, ref_k, half)


def _qkv(t, hq, hk, d, dtype, norm, gen):
    """Strided q/k/v views of one packed QKV row per token (as the model passes them), positions, RoPE inputs."""
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    pos = torch.randint(0, 8192, (t,), generator=gen)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    qw = torch.randn(d, generator=gen).to(dtype) if norm else None
    kw = torch.randn(d, generator=gen).to(dtype) if norm else None
    return q, k, v, pos, inv_freq, qw, kw


@pytest.mark.parametrize("ordered", [False, True], ids=["in-order", "partial-rope-order"])
@pytest.mark.parametrize("norm", [False, True], ids=["qwen2-no-qk-norm", "qwen3-qk-norm"])
@pytest.mark.parametrize("t,hq,hk,d", [(1, 32, 8, 128), (2, 16, 8, 128), (5, 12, 4, 64), (3, 6, 3, 80)],
                         ids=["32/8x128-decode", "16/8x128-bs2", "ragged-heads", "odd-head-dim"])
def test_qk_norm_rope_store_kv(t, hq, hk, d, norm, ordered, model_dtype, device):
    """The fused prep + KV store equals the reference backend's steps: ops.torch_qk_norm_rope, then its store_kv;
    with an order (partial RoPE's, models/hybrid.py), of q, k and the norm weights read in that order first.

    The last row has slot -1 (CUDA-graph padding): it writes nothing, though its q is still prepared."""
    from outrider.kernels import fused
    from outrider.models.hybrid import partial_rope_order

    gen = torch.Generator().manual_seed(t * 1000 + d)
    q, k, v, pos, inv_freq, qw, kw = _qkv(t, hq, hk, d, model_dtype, norm, gen)
    order = partial_rope_order(d, d // 4) if ordered else None
    num_blocks, page = 4, 4
    slots = torch.randperm(num_blocks * page, generator=gen)[:t]
    slots[-1] = -1
    history = KVCache.allocate(1, num_blocks, page, hk, d, model_dtype, "cpu")
    for c in (history.k[0], history.v[0]):
        c.copy_(torch.randn(c.shape, generator=gen).to(model_dtype))  # untouched slots must keep it

    ref = KVCache(k=[history.k[0].clone()], v=[history.v[0].clone()])
    ref_q, ref_k = ops.qk_norm_rope(q, k, pos, inv_freq, qw, kw, 1e-6, order)  # (the torch path on the CPU)
    store_kv(ref_k, v, ref, 0, slots)

    dev = lambda x: x.to(device) if x is not None else None  # noqa: E731
    k_cache, v_cache = dev(history.k[0].clone()), dev(history.v[0].clone())
    out_q = fused.qk_norm_rope_store_kv(dev(q), dev(k), dev(v), dev(pos), dev(inv_freq), dev(qw), dev(kw), 1e-6,
                                        k_cache, v_cache, dev(slots), dev(order))
    _close(out_q, ref_q, model_dtype)
    _close(k_cache, ref.k[0], model_dtype)
    assert torch.equal(v_cache.cpu(), ref.v[0])  # v is copied, not computed
    kept = torch.ones(num_blocks * page, dtype=torch.bool)
    kept[slots[:-1]] = False
    assert torch.equal(k_cache.cpu().flatten(0, 1)[kept], history.k[0].flatten(0, 1)[kept])



@pytest.mark.parametrize("rows,n", [(16, 151_936), (1, 4096), (3, 5000), (0, 100)],
                         ids=["dflash-block", "one-tile", "ragged-tail", "no-rows"])
def test_argmax_confidence_matches_softmax(rows, n, device, model_dtype):
    from outrider.kernels import fused

    logits = (torch.randn(rows, n + 7) * 4).to(model_dtype)[:, :n]  # a strided slice, as greedy_drafts passes
    if rows > 1:
        logits[1, 10] = logits[1, n - 1] = logits[1].max() + 1  # a tie across tiles: the first column wins
    tokens, conf = fused.argmax_confidence(logits.to(device))
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(tokens.cpu(), logits.float().argmax(dim=-1))
    torch.testing.assert_close(conf.cpu(), probs.max(dim=-1).values, rtol=1e-4, atol=1e-7)  # (sums in another order)


def test_argmax_confidence_torch_definition_matches_softmax():
    logits = torch.randn(4, 1000) * 6
    tokens, conf = ops.torch_argmax_confidence(logits)
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(tokens, probs.argmax(dim=-1))
    torch.testing.assert_close(conf, probs.max(dim=-1).values)
