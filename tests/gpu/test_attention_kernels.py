"""Triton KV store and paged attention against the CPU reference backend (the oracle)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from outrider.attention import KVCache, QKNormRope
from outrider.attention.torch_ref import TorchReferenceBackend
from tests.gpu.conftest import make_meta


def _identity_rope(t, head_dim, device):
    """Position 0 and no q/k norm: RoPE is exactly the identity, so these tests see attention and the store alone
    (test_fused_ops checks the q/k preparation)."""
    return QKNormRope(torch.zeros(t, dtype=torch.int64, device=device), torch.ones(head_dim // 2, device=device),
                      None, None, 1e-6)


def _to_cpu_meta(meta):
    return dataclasses.replace(meta, **{f: getattr(meta, f).cpu() for f in
                                        ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})


def _run_both(q_lens, seq_lens, *, n_heads=8, n_kv=2, head_dim=64, block_size=16, dtype,
              causal=True, max_seq_len=None, device, seed=0, window=0):
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
    out = TritonAttentionBackend().forward(q.to(device), k.to(device), v.to(device), gpu_cache, 0, meta, scale,
                                           _identity_rope(t, head_dim, device), window)
    if device.type == "cuda":
        torch.cuda.synchronize()

    ref_cache = KVCache(k=[k_hist.float()], v=[v_hist.float()])  # the oracle in float32
    ref = TorchReferenceBackend().forward(q.float(), k.float(), v.float(), ref_cache, 0, _to_cpu_meta(meta), scale,
                                          _identity_rope(t, head_dim, "cpu"), window)
    return out.float().cpu(), ref, gpu_cache, ref_cache, meta


# What CUDA graphs are captured with (the model's context limit): the launch is sized for it, whatever the
# actual lengths, so every split that the grid holds must cope with having few keys or none.
CAPTURE_MAX_SEQ_LEN = 40960


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


@pytest.mark.parametrize("window", [37, 300])
@pytest.mark.parametrize("max_seq_len", [None, CAPTURE_MAX_SEQ_LEN], ids=["exact", "capture"])
def test_sliding_window_matches_reference(max_seq_len, window, device, half):
    """A decode batch (its 700-key row's window spread over several splits under a capture-sized grid), then a mixed
    batch: decode rows, a verify row, a prompt longer than the window and a chunked-prefill continuation."""
    for q_lens, seq_lens, long_row in (([1, 1], [700, 40], 0), ([1, 1, 5, 70, 33], [20, 700, 260, 70, 100], 1)):
        out, ref, *_ = _run_both(q_lens, seq_lens, max_seq_len=max_seq_len, window=window, dtype=half, device=device)
        full, *_ = _run_both(q_lens, seq_lens, max_seq_len=max_seq_len, dtype=half, device=device)
        assert torch.isfinite(out).all()
        assert _rel_err(out, ref) < 1e-2
        assert _rel_err(out[long_row], full[long_row]) > 0.1  # (the window changes the long row: the test sees it)
    if max_seq_len == CAPTURE_MAX_SEQ_LEN:
        assert _capture_plan(2).splits > 1


def test_float32_is_close_to_exact(device):
    out, ref, *_ = _run_both([3, 1], [50, 20], dtype=torch.float32, device=device)
    assert _rel_err(out, ref) < 1e-5


def test_kv_store_matches_reference(device, half):
    _, _, gpu_cache, ref_cache, _ = _run_both([4, 1], [20, 9], dtype=half, device=device)
    assert torch.equal(gpu_cache.k[0].float().cpu(), ref_cache.k[0])
    assert torch.equal(gpu_cache.v[0].float().cpu(), ref_cache.v[0])


@pytest.mark.parametrize("max_seq_len", [None, CAPTURE_MAX_SEQ_LEN], ids=["exact", "capture"])
def test_padding_rows_are_ignored(max_seq_len, device, half):
    """CUDA-graph padding: extra sequences with q_len 1, seq_len 0, slot -1 write nothing and output zeros."""
    from outrider.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(3)
    meta, t = make_meta([1, 1], [30, 7], 16, 8, device, gen=gen, max_seq_len=max_seq_len)
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
    out = TritonAttentionBackend().forward(q, kv, kv, cache, 0, meta, 0.125, _identity_rope(4, 64, device))
    assert torch.isfinite(out.float()).all()
    assert out[2:].float().abs().max().item() == 0.0
    changed = (cache.k[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
    real_blocks = set(meta.block_tables[:2].flatten().tolist()) - {0}
    assert set(changed) <= real_blocks


def test_backends_agree_on_prepare_store_attend(device, half):
    """Real q/k preparation (Qwen3 q/k norm, GQA 16/8 x 128) through both backends: same outputs and caches."""
    from outrider.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(7)
    t, hq, hk, d = 4, 16, 8, 128
    q, k, v = (torch.randn(t, h, d, generator=gen).to(half) for h in (hq, hk, hk))
    qw, kw = (torch.randn(d, generator=gen).to(half) for _ in range(2))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.tensor([8, 17, 18, 19])  # a decode row, then a 3-token extend: seq_lens 9 and 20
    outs, caches = [], []
    for backend, dev in ((TorchReferenceBackend(), torch.device("cpu")), (TritonAttentionBackend(), device)):
        meta, _ = make_meta([1, 3], [9, 20], 16, 6, dev, gen=torch.Generator().manual_seed(1))  # same blocks
        cache = KVCache.allocate(1, 6, 16, hk, d, half, dev)
        rope = QKNormRope(pos.to(dev), inv_freq.to(dev), qw.to(dev), kw.to(dev), 1e-6)
        outs.append(backend.forward(q.to(dev), k.to(dev), v.to(dev), cache, 0, meta, d ** -0.5, rope).float().cpu())
        caches.append(cache)
    assert _rel_err(outs[1], outs[0]) < 1e-2
    assert _rel_err(caches[1].k[0].float().cpu(), caches[0].k[0].float()) < 1e-2
    assert torch.equal(caches[1].v[0].cpu(), caches[0].v[0])


def _live_splits(seq_len: int, plan) -> int:
    """How many of a launch's splits the kernel gives keys to (its per-sequence split rule, restated): whole
    tiles of plan.block_n keys, at least plan.min_split a split."""

    def cdiv(a, b):
        return -(-a // b)

    per_split = max(cdiv(cdiv(seq_len, plan.splits), plan.block_n) * plan.block_n, plan.min_split)
    return max(cdiv(seq_len, per_split), 1)


def _capture_plan(num_seqs, n_kv=2, q_len=1, group=4):
    from outrider.kernels.attention import plan_launch

    return plan_launch(num_seqs, n_kv, group, q_len, CAPTURE_MAX_SEQ_LEN, 132)


def _assert_counters_rearmed(device):
    """The last split of a tile re-arms its arrival counter: the next launch or graph replay starts from zero."""
    from outrider.kernels import attention

    counters = [c for d, c in attention._ARRIVALS.items() if d.type == device.type]  # keyed by cuda:N
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)


def test_short_and_long_contexts_share_a_capture_sized_launch(device, half):
    # One batch under a capture-sized grid: contexts that fit one split (written directly, no merge) next to
    # ones spread over a few splits and one over every split (merged by the last split to finish).
    seq_lens = [1, 100, 128, 129, 300, 5000]
    plan = _capture_plan(len(seq_lens))
    assert (plan.splits, plan.block_n) == (32, 128)
    assert [_live_splits(n, plan) for n in seq_lens] == [1, 1, 1, 2, 3, 20]
    out, ref, *_ = _run_both([1] * len(seq_lens), seq_lens, max_seq_len=CAPTURE_MAX_SEQ_LEN, dtype=half,
                             device=device)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) < 1e-2
    _assert_counters_rearmed(device)


@pytest.mark.parametrize("seq_len", [127, 128, 129, 32 * 128, 32 * 128 + 1])
def test_split_boundaries(seq_len, device, half):
    # Around MIN_SPLIT_KEYS (one split -> two) and where all 32 splits are live (4096 keys) until one more key
    # makes each split a tile longer and fewer of them live (4097: 17 splits of 256).
    plan = _capture_plan(2)
    assert (plan.splits, plan.block_n) == (32, 128)
    assert [_live_splits(n, plan) for n in (127, 128, 129, 4096, 4097)] == [1, 1, 2, 32, 17]
    out, ref, *_ = _run_both([1, 1], [seq_len, 3], max_seq_len=CAPTURE_MAX_SEQ_LEN, dtype=half, device=device,
                             head_dim=32, n_heads=4, n_kv=2)
    assert _rel_err(out, ref) < 1e-2
    _assert_counters_rearmed(device)


@pytest.mark.parametrize("q_len", [5, 16])
def test_verify_shape_split_matches_reference(q_len, device, half):
    # q_len * group rows > 16: the merge runs over several 16-row slices of the tile. With 1025 keys the last
    # split holds only the last query token's key, so the other tokens' rows see none there (lse = -inf).
    seq_lens = [q_len, 1025, 700, 3000]
    plan = _capture_plan(len(seq_lens), q_len=q_len)
    assert [_live_splits(n, plan) for n in seq_lens] == [1, 2, 1, 3]
    out, ref, *_ = _run_both([q_len] * len(seq_lens), seq_lens, max_seq_len=CAPTURE_MAX_SEQ_LEN, dtype=half,
                             device=device)
    assert _rel_err(out, ref) < 1e-2
    _assert_counters_rearmed(device)


def test_non_causal_split_matches_reference(device, half):
    out, ref, *_ = _run_both([8, 3], [40, 2500], causal=False, max_seq_len=CAPTURE_MAX_SEQ_LEN, dtype=half,
                             device=device)
    assert _rel_err(out, ref) < 1e-2
    _assert_counters_rearmed(device)


def test_split_launch_replays_identically(device, half):
    """Run twice over the same inputs (as graph replays do): same output, the counters re-armed each time."""
    from outrider.kernels.attention import paged_attention

    gen = torch.Generator().manual_seed(5)
    meta, t = make_meta([1, 1, 1], [700, 40, 0], 16, 64, device, gen=gen, max_seq_len=CAPTURE_MAX_SEQ_LEN)
    kc = torch.randn(64, 16, 2, 64, generator=gen).to(half).to(device)
    vc = torch.randn(64, 16, 2, 64, generator=gen).to(half).to(device)
    q = torch.randn(t, 8, 64, generator=gen).to(half).to(device)
    first = paged_attention(q, kc, vc, meta, 0.125)
    second = paged_attention(q, kc, vc, meta, 0.125)
    assert torch.equal(first, second)
    assert first[2].float().abs().max().item() == 0.0
    _assert_counters_rearmed(device)


@pytest.mark.cuda_only
def test_pdl_launch_with_kv_prefetch_equals_eager():
    """Captured under ops.graph_capture (PDL on Hopper: metadata read and K/V prefetched before the wait), a
    decode launch over split and unsplit sequences, and padding, gives the eager result."""
    from outrider.kernels import ops
    from outrider.kernels.attention import paged_attention

    gen = torch.Generator().manual_seed(6)
    meta, t = make_meta([1] * 5, [700, 40, 0, 129, 1], 16, 80, torch.device("cuda"), gen=gen,
                        max_seq_len=CAPTURE_MAX_SEQ_LEN)
    kc = torch.randn(80, 16, 2, 128, generator=gen).to(torch.bfloat16).cuda()
    vc = torch.randn(80, 16, 2, 128, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(t, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    eager = paged_attention(q, kc, vc, meta, 0.125)
    out = torch.empty_like(eager)
    with ops.graph_capture():
        paged_attention(q, kc, vc, meta, 0.125, out=out)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(q, kc, vc, meta, 0.125, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    _assert_counters_rearmed(torch.device("cuda"))


@pytest.mark.cuda_only
@pytest.mark.parametrize("n_heads, head_dim", [(4, 64), (32, 128)])
def test_eager_launches_after_the_warm_up_compile_nothing(n_heads, head_dim):
    """After compile_eager_variants, eager batches of any query heights (ragged: a verify whose requests draft
    different lengths) over short and long contexts launch kernels that are all compiled: serving never stalls on
    a compile (it did for 0.8-2.5 s at batch 8 on the demo target)."""
    from triton import knobs

    from outrider.kernels.attention import compile_eager_variants, paged_attention

    gen = torch.Generator().manual_seed(9)
    n_kv, page, blocks, max_len = 2 if n_heads == 4 else 8, 16, 400, 4000
    kc = torch.randn(blocks, page, n_kv, head_dim, generator=gen).to(torch.bfloat16).cuda()
    vc = torch.randn(blocks, page, n_kv, head_dim, generator=gen).to(torch.bfloat16).cuda()
    compile_eager_variants(kc, vc, n_heads, max_len)
    compiled = []
    knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["fn"].name) and False
    try:
        for q_lens, seq_lens in (([1] * 8, [150 + 7 * i for i in range(8)]), ([4, 1, 8, 2], [300, 40, 1500, 2100]),
                                 ([3, 5], [20, 3000]), ([16 // (n_heads // n_kv)], [1800]),
                                 ([32 // (n_heads // n_kv)], [2500]), ([1], [5])):
            meta, t = make_meta(q_lens, seq_lens, page, blocks, torch.device("cuda"), gen=gen)
            q = torch.randn(t, n_heads, head_dim, generator=gen).to(torch.bfloat16).cuda()
            paged_attention(q, kc, vc, meta, 0.125)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = None
    assert compiled == []


def test_plan_launch_grid_stays_within_the_counters():
    from outrider.kernels.attention import _PROGRAMS_PER_SM, plan_launch

    for num_seqs in (1, 2, 3, 16, 33, 64, 256):
        for q_len in (1, 4, 16, 100):
            plan = plan_launch(num_seqs, 8, 4, q_len, CAPTURE_MAX_SEQ_LEN, 132)
            m_blocks, splits = plan.m_blocks, plan.splits
            if splits > 1:  # one tile per (sequence, KV head), each with its own counter
                assert m_blocks == 1
                assert num_seqs * 8 * splits <= _PROGRAMS_PER_SM * 132
    assert plan_launch(1, 8, 4, 1, 300, 132).splits == 3  # the host's bound: no more splits than 128-key pieces
    assert plan_launch(1, 8, 4, 16, 3000, 132).splits == 3  # verify tiles: 1024-key pieces
