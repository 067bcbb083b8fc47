"""Triton KV store and paged attention against the CPU reference backend (the oracle)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from outrider.attention import KVCache
from outrider.attention.torch_ref import TorchReferenceBackend
from tests.gpu.conftest import make_meta


def _to_cpu_meta(meta):
    return dataclasses.replace(meta, **{f: getattr(meta, f).cpu() for f in
                                        ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})


def _run_both(q_lens, seq_lens, *, n_heads=8, n_kv=2, head_dim=64, block_size=16, dtype,
              causal=True, max_seq_len=None, device, seed=0):
    """Returns (gpu_out, ref_out, gpu_cache, ref_cache, meta); the cache is pre-filled with random history."""
    from outrider.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    meta, t = make_meta(q_lens, seq_lens, block_size, num_blocks, device, causal=causal, gen=gen,
                        max_seq_len=max_seq_len)
    shape = (num_blocks, block_size, n_kv, head_dim)
    k_hist = torch.randn(shape, generator=gen).to(dtype)
    v_hist = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(t, n_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, n_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, n_kv, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5

    gpu_cache = KVCache(k=[k_hist.clone().to(device)], v=[v_hist.clone().to(device)])
    out = TritonAttentionBackend().forward(q.to(device), k.to(device), v.to(device), gpu_cache, 0, meta, scale)
    if device.type == "cuda":
        torch.cuda.synchronize()

    ref_cache = KVCache(k=[k_hist.float()], v=[v_hist.float()])  # the oracle in float32
    ref = TorchReferenceBackend().forward(q.float(), k.float(), v.float(), ref_cache, 0, _to_cpu_meta(meta), scale)
    return out.float().cpu(), ref, gpu_cache, ref_cache, meta


def _rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("seq_lens", [[1], [17, 300], [5, 64, 129, 1000]])
def test_decode_matches_reference(seq_lens, device, half):
    out, ref, *_ = _run_both([1] * len(seq_lens), seq_lens, dtype=half, device=device)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) < 1e-2


def test_decode_split_kv_matches_reference(device, half):
    # max_seq_len is only an upper bound: a capture-time value forces many splits, most of them empty.
    out, ref, *_ = _run_both([1, 1, 1], [40, 700, 3], max_seq_len=8192, dtype=half, device=device)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(128, 16, 8), (64, 4, 4), (32, 12, 2)])
def test_prefill_and_extend_match_reference(head_dim, n_heads, n_kv, device, half):
    # Mixed batch: a fresh prompt, a chunked-prefill continuation over a cached prefix, and a decode row.
    out, ref, *_ = _run_both([70, 33, 1], [70, 100, 45], n_heads=n_heads, n_kv=n_kv, head_dim=head_dim,
                             dtype=half, device=device)
    assert _rel_err(out, ref) < 1e-2


def test_verify_shape_matches_reference(device, half):
    out, ref, *_ = _run_both([5, 5, 5, 5], [5, 37, 260, 90], dtype=half, device=device)
    assert _rel_err(out, ref) < 1e-2


def test_non_causal_block_matches_reference(device, half):
    out, ref, *_ = _run_both([8, 16], [40, 16], causal=False, dtype=half, device=device)
    assert _rel_err(out, ref) < 1e-2


def test_float32_is_close_to_exact(device):
    out, ref, *_ = _run_both([3, 1], [50, 20], dtype=torch.float32, device=device)
    assert _rel_err(out, ref) < 1e-5


def test_kv_store_matches_reference(device, half):
    _, _, gpu_cache, ref_cache, _ = _run_both([4, 1], [20, 9], dtype=half, device=device)
    assert torch.equal(gpu_cache.k[0].float().cpu(), ref_cache.k[0])
    assert torch.equal(gpu_cache.v[0].float().cpu(), ref_cache.v[0])


def test_padding_rows_are_ignored(device, half):
    """CUDA-graph padding: extra sequences with q_len 1, seq_len 0, slot -1 write nothing and output zeros."""
    from outrider.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(3)
    meta, t = make_meta([1, 1], [30, 7], 16, 8, device, gen=gen)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((2,), -1, dtype=torch.int64, device=device)])
    meta.query_start_loc = torch.arange(5, dtype=torch.int32, device=device)
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(2, dtype=torch.int32, device=device)])
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables)])
    cache = KVCache.allocate(1, 8, 16, 2, 64, half, device)
    for c in (cache.k[0], cache.v[0]):
        c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))
    before = cache.k[0].clone()
    q = torch.randn(4, 8, 64, generator=gen).to(half).to(device)
    kv = torch.randn(4, 2, 64, generator=gen).to(half).to(device)
    out = TritonAttentionBackend().forward(q, kv, kv, cache, 0, meta, 0.125)
    assert torch.isfinite(out.float()).all()
    assert out[2:].float().abs().max().item() == 0.0
    changed = (cache.k[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
    real_blocks = set(meta.block_tables[:2].flatten().tolist()) - {0}
    assert set(changed) <= real_blocks
