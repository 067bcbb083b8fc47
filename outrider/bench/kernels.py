"""`bench kernels`: the Triton kernels alone (attention decode, fused ops) against torch, with bandwidth."""

from __future__ import annotations

import time

import torch

from outrider.attention import AttentionMetadata
from outrider.bench.report import Reporter


def _time_ms(fn) -> float:
    """GPU time per call (median), from replays of a CUDA graph of the call: launch overhead excluded."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def _eager_us(fn, n: int = 200) -> float:
    """Wall time per call when launched eagerly back to back: max(host launch cost, GPU time)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _decode_meta(batch: int, ctx: int, page: int, device: torch.device) -> AttentionMetadata:
    per_seq = -(-ctx // page)
    tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=1, max_seq_len=ctx)


def attention(reporter: Reporter, device: torch.device, n_heads=32, n_kv=8, head_dim=128, page=16) -> None:
    """Decode attention over one layer of a Qwen3-8B-shaped cache: bytes = the K and V it must read."""
    from outrider.kernels.attention import paged_attention

    for batch, ctx in ((1, 1024), (1, 8192), (1, 32768), (32, 1024), (64, 4096), (256, 1024)):
        blocks = batch * -(-ctx // page)
        kc = torch.randn(blocks, page, n_kv, head_dim, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(batch, n_heads, head_dim, device=device, dtype=torch.bfloat16)
        meta = _decode_meta(batch, ctx, page, device)
        fn = lambda: paged_attention(q, kc, vc, meta, head_dim ** -0.5)  # noqa: E731
        torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream: the inputs must be ready
        ms, eager = _time_ms(fn), _eager_us(fn)
        moved = 2 * batch * ctx * n_kv * head_dim * 2
        reporter.line(f"kernel decode-attention bs={batch} ctx={ctx}",
                      f"{ms * 1e3:.1f} us GPU (eager {eager:.0f} us/call)", moved, ms / 1e3, us=ms * 1e3,
                      eager_us=eager)
        del kc, vc


def fused(reporter: Reporter, device: torch.device, hidden=4096, inter=12288, n_heads=32, n_kv=8,
          head_dim=128) -> None:
    """Each fused op vs its torch definition at decode (T=1) and prefill-chunk (T=2048) sizes."""
    from outrider.kernels import fused as tk
    from outrider.kernels import ops

    bf = dict(device=device, dtype=torch.bfloat16)
    for t in (1, 2048):
        x, r, w = torch.randn(t, hidden, **bf), torch.randn(t, hidden, **bf), torch.randn(hidden, **bf)
        gu = torch.randn(t, 2 * inter, **bf)
        q, k = torch.randn(t, n_heads, head_dim, **bf), torch.randn(t, n_kv, head_dim, **bf)
        qw, kw = torch.randn(head_dim, **bf), torch.randn(head_dim, **bf)
        pos = torch.arange(t, device=device) + 100
        inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        cases = {
            "add+rmsnorm": (lambda: tk.rms_norm(x, w, 1e-6, r), lambda: ops.torch_rms_norm(x, w, 1e-6, r),
                            4 * t * hidden * 2),
            "silu*mul": (lambda: tk.silu_mul(*gu.chunk(2, -1)), lambda: ops.torch_silu_mul(*gu.chunk(2, -1)),
                         3 * t * inter * 2),
            "qknorm+rope": (lambda: tk.qk_norm_rope(q, k, pos, inv, qw, kw, 1e-6),
                            lambda: ops.torch_qk_norm_rope(q, k, pos, inv, qw, kw, 1e-6),
                            2 * t * (n_heads + n_kv) * head_dim * 2),
        }
        torch.cuda.synchronize()
        for name, (fast, ref, moved) in cases.items():
            ms, ms_ref = _time_ms(fast), _time_ms(ref)
            reporter.line(f"kernel {name} T={t}", f"{ms * 1e3:.1f} us GPU (torch {ms_ref * 1e3:.1f} us, "
                          f"{ms_ref / ms:.1f}x; eager {_eager_us(fast):.0f} us/call)", moved, ms / 1e3,
                          us=ms * 1e3, torch_us=ms_ref * 1e3)


def run(args, reporter: Reporter) -> None:
    device = torch.device(args.device)
    attention(reporter, device)
    fused(reporter, device)
