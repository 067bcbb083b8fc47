"""Triton fused ops against their torch definitions in outrider.kernels.ops."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("t,hq,hk,d", [(6, 12, 4, 64), (1, 32, 8, 128)], ids=["ragged-heads", "qwen3-8b-decode"])
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
