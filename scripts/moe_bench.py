"""The MoE experts for a few tokens at the 30B-A3B and 35B-A3B expert shapes: the sorted path, the per-pair GEMVs
at moe.pair_tiles' choice, and the per-pair GEMVs at each swept tile (pair_tiles picks from these). Each is timed
as CUDA-graph replays cycling four weight sets (so the experts come from memory, not L2); printed in us a call,
with GB/s of the experts' weights read. Needs CUDA.

    python scripts/moe_bench.py
"""

from __future__ import annotations

from typing import Callable

import torch

from outrider.kernels import moe

SHAPES = {"30b-a3b": (128, 2048, 768), "35b-a3b": (256, 2048, 512)}  # experts, hidden, intermediate
TOP_K = 8
TOKENS = (1, 2, 4, 8)
TILES = [moe.GemvTiles(*t) for t in ((8, 8, 256), (16, 16, 256), (32, 32, 256), (16, 8, 256), (8, 8, 512),
                                     (16, 16, 512), (32, 32, 512), (16, 16, 128), (16, 8, 256, 2), (16, 8, 256, 8),
                                     (32, 16, 256, 8), (32, 16, 512, 8), (16, 16, 512, 2), (16, 16, 512, 8),
                                     (8, 8, 256, 2), (64, 32, 128, 8))]
WEIGHT_SETS = 4
REPLAYS = 40


def us_per_call(calls: list[Callable[[], torch.Tensor]]) -> float:
    """Mean us of one call, the calls captured into one CUDA graph and replayed."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS / len(calls)


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for name, (experts, hidden, inter) in SHAPES.items():
        sets = [(torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02,
                 torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02)
                for _ in range(WEIGHT_SETS)]
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
            ids = [torch.stack([torch.randperm(experts, device=dev)[:TOP_K] for _ in range(tokens)])
                   for _ in range(WEIGHT_SETS)]
            weights = torch.softmax(torch.randn(tokens, TOP_K, device=dev), -1)
            experts_read = sum(len(set(i.flatten().tolist())) for i in ids) / WEIGHT_SETS
            gb = experts_read * 3 * hidden * inter * 2 / 1e9

            def calls(fn) -> list[Callable[[], torch.Tensor]]:
                return [lambda j=j: fn(x, *sets[j], ids[j], weights) for j in range(WEIGHT_SETS)]

            ref = moe.sorted_experts(x, *sets[0], ids[0], weights).float()
            sorted_us = us_per_call(calls(moe.sorted_experts))
            chosen_us = us_per_call(calls(moe.pair_experts))
            swept = []
            for tiles in TILES:
                def pair(*args, tiles=tiles):
                    return moe.pair_experts(*args, tiles=tiles)
                err = (pair(x, *sets[0], ids[0], weights).float() - ref).abs().max().item()
                swept.append((us_per_call(calls(pair)), tuple(tiles), err))
            best = min(swept)
            print(f"{name} T={tokens}: sorted {sorted_us:.1f} us ({gb / sorted_us * 1e6:.0f} GB/s); "
                  f"pair_tiles {chosen_us:.1f} us ({gb / chosen_us * 1e6:.0f} GB/s); best swept {best[0]:.1f} us "
                  f"{best[1]} (max err against sorted {best[2]:.1e})", flush=True)
            print("   ", " ".join(f"{tiles}:{us:.1f}" for us, tiles, _ in swept), flush=True)


if __name__ == "__main__":
    main()
