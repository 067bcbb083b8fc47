"""`bench kernels`: the Triton kernels alone (attention decode, fused ops, skinny GEMM) against torch, with
bandwidth."""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn.functional as F

from outrider.attention import AttentionMetadata
from outrider.bench.report import Reporter
from outrider.bench.shapes import RANDOM_MODELS


def cold_copies(device: torch.device, nbytes: int) -> int:
    """Copies of a weight of nbytes that overflow the device's L2 four times over: a benchmark cycling through them
    reads each from HBM, as a decode step streams each layer's weights once (back-to-back products of one small
    weight would time L2)."""
    return -(-4 * torch.cuda.get_device_properties(device).L2_cache_size // nbytes)


def _time_ms(fn, rep: int = 50) -> float:
    """GPU time per call (median), from replays of a CUDA graph of the call: launch overhead excluded."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def _eager_us(fn, n: int = 200) -> float:
    """Wall time per call when launched eagerly back to back: max(host launch cost, GPU time)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _step_meta(batch: int, ctx: int, page: int, device: torch.device, bound: int = 0, q_len: int = 1,
               causal: bool = True) -> AttentionMetadata:
    """Each of `batch` sequences attends q_len new queries over ctx keys (decode: 1; a verify step: k + 1; a
    DFlash block: its size, not causal). `bound`: the max_seq_len the launch is planned for (0: ctx; CUDA graphs
    plan for the model's limit)."""
    per_seq = -(-ctx // page)
    tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.full((batch * q_len,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=q_len, max_seq_len=bound or ctx, causal=causal)


def attention(reporter: Reporter, device: torch.device, n_heads=32, n_kv=8, head_dim=128, page=16) -> None:
    """Attention over one layer of a Qwen3-8B-shaped cache, at decode and at the speculative shapes (a verify
    step's k + 1 queries per sequence, a DFlash block's 16 without causality): bytes = the K and V it must read."""
    from outrider.kernels.attention import paged_attention

    # (batch, ctx, planned bound, queries per sequence, causal): the engine's graphs plan every launch for the
    # context limit (40960).
    decode = [(1, 128, 40960), (1, 300, 40960), (1, 1024, 0), (1, 1024, 40960), (1, 8192, 0), (1, 32768, 0),
              (32, 1024, 0), (64, 4096, 0), (256, 1024, 0)]
    spec = [(1, 300, 40960, 5, True), (1, 300, 40960, 16, True), (1, 1024, 40960, 16, True),
            (8, 300, 40960, 16, True), (1, 300, 40960, 16, False)]
    for batch, ctx, bound, q_len, causal in [(*c, 1, True) for c in decode] + spec:
        blocks = batch * -(-ctx // page)
        kc = torch.randn(blocks, page, n_kv, head_dim, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(batch * q_len, n_heads, head_dim, device=device, dtype=torch.bfloat16)
        meta = _step_meta(batch, ctx, page, device, bound, q_len, causal)
        fn = lambda: paged_attention(q, kc, vc, meta, head_dim ** -0.5)  # noqa: E731
        torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream: the inputs must be ready
        ms, eager = _time_ms(fn), _eager_us(fn)
        moved = 2 * batch * ctx * n_kv * head_dim * 2
        name = "decode-attention" if q_len == 1 else f"{'verify' if causal else 'dflash-block'}-attention q={q_len}"
        reporter.line(f"kernel {name} bs={batch} ctx={ctx}" + (f" (planned for {bound})" if bound else ""),
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


def _gemm_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of one decoder layer's projections, packed as in models/decoder.py, and of the LM head."""
    c = RANDOM_MODELS[name]
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * c["intermediate_size"], h),
            "down": (h, c["intermediate_size"]), "lm_head": (c["vocab_size"], h)}


def gemm(reporter: Reporter, device: torch.device, models=("qwen3-0.6b", "qwen3-8b"), rows=(1, 2, 5, 16)) -> None:
    """Decode and verify projections (bf16, M rows: 1-2 the CUDA-core kernel, 5 and 16 the tensor-core one): cuBLAS
    (F.linear) vs the skinny Triton GEMM in every candidate config.

    Successive calls cycle through copies of the weight (cold_copies). Each config is checked against cuBLAS
    first. The `best` line is what to put in gemm.DEFAULT_TABLE (DOT_CONFIG)."""
    from outrider.kernels import gemm as tg

    for model in models:
        for proj, (n, k) in _gemm_shapes(model).items():
            w_bytes = n * k * 2
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16).mul_(k ** -0.5)  # outputs ~N(0, 1)
                       for _ in range(cold_copies(device, w_bytes))]
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                ref = F.linear(x, weights[0])
                moved = w_bytes + 2 * m * (n + k)
                label = f"kernel gemm {model} {proj} {k}->{n} M={m}"

                def timed(fn) -> float:
                    cycle = itertools.cycle(weights)
                    return _time_ms(lambda: fn(x, next(cycle)), rep=20)

                torch.cuda.synchronize()
                ms_ref = timed(F.linear)
                reporter.line(f"{label} cuBLAS", f"{ms_ref * 1e3:.1f} us GPU (eager "
                              f"{_eager_us(lambda: F.linear(x, weights[0])):.0f} us/call)", moved, ms_ref / 1e3,
                              us=ms_ref * 1e3)
                default = tg.default_config(n, m)
                times: dict[tg.GemmConfig, float] = {}
                for cfg in dict.fromkeys((default, *tg.candidates(m))):
                    err = (tg.skinny_gemm(x, weights[0], None, cfg).float() - ref.float()).abs().max().item()
                    if err > 0.05:  # bf16 rounding of outputs ~N(0, 1) stays near 0.01
                        print(f"{label} triton {cfg}: WRONG, max error {err:.3g} vs cuBLAS", flush=True)
                        continue
                    times[cfg] = timed(lambda x_, w_, cfg=cfg: tg.skinny_gemm(x_, w_, None, cfg))
                best = min(times, key=times.get)
                roles = {cfg: role for role, cfg in (("default", default), ("best", best)) if cfg in times}
                if best == default:
                    roles[best] = "default = best"
                for cfg, role in roles.items():
                    ms = times[cfg]
                    eager = f"; eager {_eager_us(lambda: tg.skinny_gemm(x, weights[0], None, cfg)):.0f} us/call" \
                        if role.startswith("default") else ""
                    reporter.line(f"{label} triton {cfg} ({role})",
                                  f"{ms * 1e3:.1f} us GPU ({ms_ref / ms:.2f}x cuBLAS{eager})", moved, ms / 1e3,
                                  us=ms * 1e3, cublas_us=ms_ref * 1e3, config=str(cfg),
                                  all_us={str(c): t * 1e3 for c, t in times.items()})
                print(f"{label} all configs (us): " + ", ".join(
                    f"{c} {t * 1e3:.1f}" for c, t in sorted(times.items(), key=lambda kv: kv[1])), flush=True)
            del weights


def run(args, reporter: Reporter) -> None:
    device = torch.device(args.device)
    attention(reporter, device)
    fused(reporter, device)
    gemm(reporter, device)
