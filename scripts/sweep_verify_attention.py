"""Tile and split choices of the paged attention kernel at the speculative shapes, timed on the GPU.

Each variant replaces `plan_launch`'s answer for one Qwen3-8B-shaped layer (a verify step's k + 1 queries per
sequence, a DFlash block's 16 without causality) and is timed from CUDA-graph replays; its output is checked
against the default plan's. Prints one line per (shape, variant), fastest first within a shape.

    python scripts/sweep_verify_attention.py [--shapes verify5 verify16 block16 verify16-b8]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from outrider.bench.kernels import _step_meta, _time_ms
from outrider.kernels import attention as ka

SHAPES = {  # name: (batch, ctx, queries per sequence, causal)
    "verify5": (1, 300, 5, True),
    "verify16": (1, 300, 16, True),
    "verify16-1k": (1, 1024, 16, True),
    "block16": (1, 300, 16, False),
    "verify16-b8": (8, 300, 16, True),
    "verify5-b32": (32, 300, 5, True),
}


def variants(rows: int):
    """(block_m, block_n, warps, stages, splits): splits 0 = the default plan's count."""
    block_ms = [bm for bm in (16, 32, 64) if bm <= max(16, triton.next_power_of_2(rows))]  # (taller: idle rows)
    for bm, bn, w, st, sp in itertools.product(block_ms, (32, 64, 128), (4, 8), (1, 2), (0, 1, 4, 16)):
        if bm * bn > 64 * 128 and w == 4:
            continue  # too many registers per thread
        yield bm, bn, w, st, sp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["verify16", "block16", "verify5", "verify16-b8"])
    ap.add_argument("--bound", type=int, default=40960, help="the max_seq_len launches are planned for")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n_heads, n_kv, head_dim, page = 32, 8, 128, 16
    default_plan = ka.plan_launch
    for name in args.shapes:
        batch, ctx, q_len, causal = SHAPES[name]
        blocks = batch * -(-ctx // page)
        kc = torch.randn(blocks, page, n_kv, head_dim, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(batch * q_len, n_heads, head_dim, device=dev, dtype=torch.bfloat16)
        meta = _step_meta(batch, ctx, page, dev, args.bound, q_len, causal)
        ka.plan_launch = default_plan
        want = ka.paged_attention(q, kc, vc, meta, head_dim ** -0.5)
        base = default_plan(batch, n_kv, n_heads // n_kv, q_len, args.bound, ka._num_sms(dev))
        results = []
        for bm, bn, w, st, sp in variants(q_len * n_heads // n_kv):
            m_blocks = triton.cdiv(q_len * n_heads // n_kv, bm)
            splits = sp or base.splits
            if bm != base.block_m and sp == 0:
                splits = max(1, min(4 * ka._num_sms(dev) // (batch * n_kv * m_blocks), 32))
            plan = ka.LaunchPlan(bm, bn, w, st, m_blocks, splits)
            if splits > 1 and m_blocks > 1:
                continue  # the kernel merges splits only for single-m-block tiles
            ka.plan_launch = lambda *a, plan=plan: plan
            try:
                got = ka.paged_attention(q, kc, vc, meta, head_dim ** -0.5)
                err = (got.float() - want.float()).abs().max().item()
                torch.cuda.synchronize()
                us = _time_ms(lambda: ka.paged_attention(q, kc, vc, meta, head_dim ** -0.5)) * 1e3
            except Exception as e:  # a config that fails to compile (registers, shared memory) is just skipped
                print(f"  {name} {plan} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            results.append((us, plan, err))
        ka.plan_launch = default_plan
        torch.cuda.synchronize()
        base_us = _time_ms(lambda: ka.paged_attention(q, kc, vc, meta, head_dim ** -0.5)) * 1e3
        print(f"sweep {name} bs={batch} ctx={ctx} q={q_len} causal={causal}: default {base} {base_us:.1f} us")
        for us, plan, err in sorted(results, key=lambda r: r[0])[:12]:
            print(f"  {us:7.1f} us  bm={plan.block_m} bn={plan.block_n} warps={plan.num_warps} "
                  f"stages={plan.num_stages} splits={plan.splits}  max|err|={err:.2e}")


if __name__ == "__main__":
    main()
