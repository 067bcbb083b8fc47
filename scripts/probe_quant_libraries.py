"""Kernel libraries for the quantized formats against bf16 cuBLAS at Qwen3-8B's projection shapes (issue 39 asks
which library fits before we write kernels): gemlite's 4-bit group-128 kernel (AWQ's and GPTQ's layout,
W = (q - z) s), gemlite's FP8 kernel with 128 x 128 block scales (the HF FP8 checkpoints' layout; x quantized per
token and 128 columns inside the call), and torch's FP8 `scaled_mm` with row-wise and block-wise scales (x
quantized by torch ops). Each product is timed as CUDA-graph replays cycling four weight sets; one line per
(kernel, projection, rows). CUDA only; gemlite from the `gpu` extra.

    python scripts/probe_quant_libraries.py [--rows 1 16 32 1024] [--gemlite-seconds 80]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
WEIGHT_SETS = 4
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128


def graph_us(calls: list[Callable[[], torch.Tensor]]) -> float:
    """us a call: the calls (one per weight set) replayed as one CUDA graph, as `bench quant --kernels` times them
    (triton's do_bench_cudagraph runs them once before capturing: library autotuning stays outside the graph)."""
    return 1e3 * triton.testing.do_bench_cudagraph(lambda: [call() for call in calls]) / len(calls)


def per_row_fp8(weights: list[torch.Tensor], x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    scales = [w.abs().amax(1, keepdim=True).float() / FP8_MAX for w in weights]  # [N, 1]
    quantized = [(w / s).to(FP8) for w, s in zip(weights, scales)]

    def call(i: int) -> torch.Tensor:
        xs = x.abs().amax(1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # [M, 1]
        return torch._scaled_mm((x / xs).to(FP8), quantized[i].t(), scale_a=xs, scale_b=scales[i].t(),
                                 out_dtype=torch.bfloat16)

    return [lambda i=i: call(i) for i in range(len(weights))]


def block_fp8(weights: list[torch.Tensor], x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """x's scales 1 x 128, W's 128 x 128 (torch's ScalingType.BlockWise1x128 / BlockWise128x128)."""
    from torch.nn.functional import ScalingType

    m, k = x.shape
    n = weights[0].shape[0]
    blocks = [w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK) for w in weights]
    w_scales = [b.abs().amax((1, 3)) / FP8_MAX for b in blocks]  # [N / 128, K / 128]
    quantized = [(b / s[:, None, :, None]).to(FP8).view(n, k) for b, s in zip(blocks, w_scales)]
    x_scale = torch.empty_strided((m, k // BLOCK), (1, m), dtype=torch.float32, device=x.device)  # M's stride 1

    def call(i: int) -> torch.Tensor:
        xv = x.float().view(m, k // BLOCK, BLOCK)
        x_scale.copy_(xv.abs().amax(2).clamp(min=1e-12) / FP8_MAX)
        xq = (xv / x_scale[..., None]).to(FP8).view(m, k)
        # (W's scales as [K / 128, N / 128] with K's stride 1)
        return F.scaled_mm(xq, quantized[i].t(), x_scale, ScalingType.BlockWise1x128, w_scales[i].t(),
                           ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

    return [lambda i=i: call(i) for i in range(len(weights))]


def gemlite_int4(weights: list[torch.Tensor], x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    from gemlite.helper import A16Wn

    n, k = weights[0].shape
    layers = []
    for _ in weights:
        q = torch.randint(0, 16, (n, k), device=x.device, dtype=torch.uint8)
        scales = torch.rand(n, k // 128, device=x.device, dtype=torch.bfloat16) * 0.01
        zeros = torch.full((n, k // 128), 8.0, device=x.device, dtype=torch.bfloat16)
        layers.append(A16Wn(device=x.device, dtype=torch.bfloat16).from_weights(q, scales, zeros, W_nbits=4,
                                                                               group_size=128))
    return [lambda layer=layer: layer(x) for layer in layers]


def gemlite_fp8_blocks(weights: list[torch.Tensor], x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    from gemlite.helper import A8W8_dynamic

    layers = [A8W8_dynamic(device=x.device, dtype=torch.bfloat16, fp8=FP8, block_quant=True).from_weights(w.clone())
              for w in weights]
    return [lambda layer=layer: layer(x) for layer in layers]


KERNELS: dict[str, Callable] = {"scaled_mm FP8 per row": per_row_fp8, "scaled_mm FP8 blocks": block_fp8,
                                "gemlite 4-bit g128": gemlite_int4, "gemlite FP8 blocks": gemlite_fp8_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 1024])
    ap.add_argument("--gemlite-seconds", type=float, default=float("inf"),
                    help="stop trying gemlite's kernels (whose first calls autotune) after this long")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    torch.manual_seed(0)
    t0 = time.monotonic()
    for shape, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(WEIGHT_SETS)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = graph_us([lambda w=w: x @ w.t() for w in weights])
            print(f"{'bf16 cuBLAS':24s} {shape:8s} rows {m:5d}: {base:8.1f} us", flush=True)
            for name, make in KERNELS.items():
                if name.startswith("gemlite") and time.monotonic() - t0 > args.gemlite_seconds:
                    continue
                try:
                    us = graph_us(make(weights, x))
                    print(f"{name:24s} {shape:8s} rows {m:5d}: {us:8.1f} us  {base / us:5.2f}x cuBLAS", flush=True)
                except Exception as exc:  # noqa: BLE001 (a kernel a library lacks at this shape is a row, not the end)
                    print(f"{name:24s} {shape:8s} rows {m:5d}: failed: {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)


if __name__ == "__main__":
    main()
