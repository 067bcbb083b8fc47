"""`bench quant`: quantized weights against bf16 on one model shape with random weights, each format written to
a checkpoint as its tools write it (GGUF in llama.cpp's type mixes, FP8 with 128 x 128 block scales, AWQ and
GPTQ 4-bit) and loaded through the ordinary loader: batch-1 decode tok/s, batch-B throughput, TTFT at a long
prompt, and the GPU memory the weights take after load against the checkpoint's tensor bytes."""

from __future__ import annotations

import copy
import gc
import itertools
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from outrider.bench.engine_setup import build_engine
from outrider.bench.kernels import cold_copies
from outrider.bench.latency import run_batch
from outrider.bench.report import Reporter
from outrider.bench.shapes import RANDOM_MODELS
from outrider.models import load_model
from outrider.quant.writers import GGUF_MIXES, write_random_checkpoint, write_random_gguf

if TYPE_CHECKING:
    from outrider.kernels.quant_blocks import QuantGemmConfig

def write_checkpoint(name: str, fmt: str, root: Path) -> tuple[Path, int]:
    """The random checkpoint of shape `name` in format `fmt` under `root` (kept: written once), and its tensor
    bytes."""
    config = RANDOM_MODELS[name]
    root.mkdir(parents=True, exist_ok=True)
    if fmt in GGUF_MIXES:
        path = root / f"{name}-{fmt}.gguf"
        if not path.is_file():
            write_random_gguf(path, config, fmt)
        from outrider.models.gguf import open_gguf

        return path, sum(int(t.n_bytes) for t in open_gguf(path).tensors.values())
    path = root / f"{name}-{fmt}"
    if not (path / "model.safetensors").is_file():
        write_random_checkpoint(config, path, fmt)
    file = path / "model.safetensors"
    with file.open("rb") as f:  # the data after safetensors' header (8 bytes of length, then JSON)
        header = int.from_bytes(f.read(8), "little")
    return path, file.stat().st_size - 8 - header


def run(args, reporter: Reporter) -> None:
    if args.kernels:
        run_kernels(args, reporter)
        return
    if not args.random_weights:
        raise SystemExit("bench quant writes its checkpoints: give --random-weights NAME")
    root = Path(args.checkpoint_dir)
    device = torch.device(args.device)
    results = {}
    for fmt in args.weights_format:
        path, tensor_bytes = write_checkpoint(args.random_weights, fmt, root)
        model, cfg, weights = _load_measured(path, device)
        reporter.note(f"quant {fmt} weights", f"{weights / 2**30:.2f} GiB on the {device.type} after load, "
                      f"checkpoint tensors {tensor_bytes / 2**30:.2f} GiB ({weights / tensor_bytes:.3f}x)", format=fmt,
                      loaded_bytes=weights, tensor_bytes=tensor_bytes, device=device.type)
        max_len = max(args.prompt_len + args.gen, args.ttft_prompt_len + 2) + 16
        engine = build_engine(args, max_num_seqs=args.batch, max_model_len=max_len,
                              max_num_batched_tokens=max(2048, args.batch * args.prompt_len, args.ttft_prompt_len),
                              preloaded=(model, cfg))
        rng = random.Random(args.seed)
        prompt = lambda n: [rng.randrange(cfg.vocab_size) for _ in range(n)]  # noqa: E731
        row = {}
        for batch in (1, args.batch):
            run_batch(engine, [prompt(args.prompt_len) for _ in range(batch)], 8)  # warm-up (compiles)
            run = run_batch(engine, [prompt(args.prompt_len) for _ in range(batch)], args.gen)
            row[f"bs{batch}_tok_s"] = run.tok_s * batch
            reporter.note(f"quant {fmt} bs={batch} in={args.prompt_len} out={args.gen}",
                          f"{run.tok_s * batch:.1f} tok/s total ({1e3 / run.tok_s:.2f} ms/step)", format=fmt,
                          batch=batch, tok_s=run.tok_s * batch)
        row["ttft_s"] = min(run_batch(engine, [prompt(args.ttft_prompt_len)], 2).ttft_s for _ in range(3))
        reporter.note(f"quant {fmt} ttft in={args.ttft_prompt_len}", f"{row['ttft_s'] * 1e3:.1f} ms (best of 3)",
                      format=fmt, ttft_s=row["ttft_s"])
        results[fmt] = row
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    if "bf16" in results:
        base = results["bf16"]
        for fmt, row in results.items():
            reporter.note(f"quant {fmt} vs bf16", f"batch 1 {row['bs1_tok_s'] / base['bs1_tok_s']:.2f}x, batch "
                          f"{args.batch} {row[f'bs{args.batch}_tok_s'] / base[f'bs{args.batch}_tok_s']:.2f}x, TTFT "
                          f"{row['ttft_s'] / base['ttft_s']:.2f}x", format=fmt)


def _load_measured(path: Path, device: torch.device) -> tuple[torch.nn.Module, object, int]:
    """(model, config, the bytes its load took): on CUDA what the allocator handed out, elsewhere the bytes of the
    model's parameters and buffers."""
    if device.type != "cuda":
        model, cfg = load_model(path, dtype="bfloat16", device=device)
        return model, cfg, sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    model, cfg = load_model(path, dtype="bfloat16", device=device)
    torch.cuda.synchronize(device)
    return model, cfg, torch.cuda.memory_allocated(device) - before


# Qwen3-8B's projections as [N, K]: qkv_proj, o_proj, gate_up_proj, down_proj.
KERNEL_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def _kernel_format(name: str):
    from outrider.quant.formats import GGUF_FORMATS, FP8Format, Int4Format

    return {"FP8": FP8Format(128, 128), "INT4": Int4Format(128, "AWQ")}.get(name) or GGUF_FORMATS[name]


def _random_part(fmt, n: int, k: int):
    """A random quantized [n, k] weight: GGUF blocks drawn directly (quantizing a large weight in numpy is slow)."""
    import numpy as np

    from outrider.quant.formats import GGUFFormat
    from outrider.quant.tensor import QuantizedTensor
    from outrider.quant.writers import random_gguf_blocks, random_quantized

    if isinstance(fmt, GGUFFormat):
        blocks = random_gguf_blocks(fmt.name, n, k, np.random.default_rng(0))
        return QuantizedTensor(fmt, (n, k), torch.from_numpy(blocks))
    return random_quantized(fmt, n, k)[0]


def _candidates(m: int, block: int, n: int, k: int, int8_x: QuantGemmConfig | None, wide: QuantGemmConfig | None,
                dp4a: bool = False, group_steps: tuple[int, ...] = (1,)):
    """Configs `--tune` tries around the default: on an Int8X x (int8_x: its default config) one row's tile rows,
    warps, K splits and (group_steps: INT4's) groups a step, more rows' tile rows, x rows and K splits (dp4a: a
    dp4a rows kernel's tile rows, warps and K splits); on the wide rows kernel (wide: its default
    config) tile rows, K splits and pipeline depth; otherwise tile rows, K per step, warps, pipeline depth and
    (rows on the CUDA cores) K splits."""
    from outrider.kernels.quant_blocks import QuantGemmConfig
    from outrider.kernels.quant_gemm import FMA_MAX_M, default_config

    if wide is not None:
        configs = [QuantGemmConfig(block_n, wide.block_m, 1, 8 if block_n * wide.block_m >= 64 * 64 else 4, stages,
                                   split)
                   for block_n in (32, 64, 128) for split in (1, 2, 4, 8) for stages in (2, 3, 4)]
        return [wide] + [c for c in configs if c != wide]
    if int8_x is not None and m == 1:
        return [int8_x] + [QuantGemmConfig(block_n, 1, nb, warps, 2, split) for block_n in (16, 32, 64)
                           for warps in (2, 4, 8) for split in (1, 2, 4, 8) for nb in group_steps
                           if QuantGemmConfig(block_n, 1, nb, warps, 2, split) != int8_x
                           and block_n * 32 * nb >= 128 * warps]
    if int8_x is not None and dp4a:  # x's rows in one tile (few_rows_config)
        return [int8_x] + [QuantGemmConfig(block_n, int8_x.block_m, 1, warps, 2, split) for block_n in (16, 32, 64)
                           for warps in (4, 8) for split in (1, 2, 4, 8)
                           if QuantGemmConfig(block_n, int8_x.block_m, 1, warps, 2, split) != int8_x]
    if int8_x is not None:
        return [int8_x] + [QuantGemmConfig(block_n, block_m, 1, 4, 2, split) for block_n in (32, 64, 128)
                           for block_m in (16, 32) for split in (1, 2, 4, 8)
                           if block_m <= max(16, m) and QuantGemmConfig(block_n, block_m, 1, 4, 2, split) != int8_x]
    base = default_config(m, block, n, k)
    fma = base.block_m <= FMA_MAX_M.value
    out = [base]
    for block_n in (16, 32, 64):
        for steps in (128, 256, 512):
            for warps in (4, 8):
                for stages in (2, 4):
                    for split in (1, 2, 4) if fma else (1,):
                        cfg = QuantGemmConfig(block_n, base.block_m, max(1, steps // block), warps, stages, split)
                        fits = block_n * steps * (base.block_m if fma else 1) <= 64 * 32 * warps
                        if cfg not in out and fits:
                            out.append(cfg)
    return out


def run_kernels(args, reporter: Reporter) -> None:
    """Each format's product against bf16 cuBLAS at Qwen3-8B's projection shapes (CUDA-graph replays, so launch
    overhead is left out, cycling through copies of each weight: cold_copies) at the default config and, with
    --tune, the fastest of _candidates up to 64 rows; where an Int8X product of several rows has wide tiles too,
    also those at their default config and, with --tune, the fastest of them (which kernel should take these
    rows)."""
    import triton

    from outrider.kernels.quant_blocks import FUSED_MAX_ROWS
    from outrider.kernels.quant_gemm import (fused_linear, has_wide_tiles, quantized_linear, takes_few_rows,
                                             takes_int8_x, takes_wide_rows)
    from outrider.kernels.quant_int8x import int8_x_config
    from outrider.kernels.quant_wide import wide_linear, wide_rows_config
    from outrider.quant.weight import QuantizedWeight

    device = torch.device(args.device)
    for shape_name, (n, k) in KERNEL_SHAPES.items():
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                 for _ in range(cold_copies(device, 2 * n * k))]
        for m in args.kernel_rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w = itertools.cycle(dense)
            base_us = 1e3 * triton.testing.do_bench_cudagraph(lambda: torch.mm(x, next(w).t()))
            reporter.note(f"quant-kernel bf16 {shape_name} m={m}", f"{base_us:.1f} us (cuBLAS)", shape=shape_name,
                          m=m, format="bf16", us=base_us)
            for fmt_name in args.kernel_formats:
                fmt = _kernel_format(fmt_name)
                part = _random_part(fmt, n, k)
                weights = [QuantizedWeight([copy.deepcopy(part).to(device)], torch.bfloat16)  # (Module.to moves)
                           for _ in range(cold_copies(device, part.nbytes))]
                weight = weights[0]
                parts = itertools.cycle([w.parts[0] for w in weights])  # (each graph-captured call: the next copy)
                y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
                us = 1e3 * triton.testing.do_bench_cudagraph(lambda: quantized_linear(x, [next(parts)], out=y))
                best = ""
                also_wide = takes_int8_x(x, weight.parts[0]) and has_wide_tiles(weight.parts[0])
                if m > 1 and also_wide:
                    wide_us = 1e3 * triton.testing.do_bench_cudagraph(lambda: wide_linear(x, next(parts), None, y))
                    best = f"; wide tiles {wide_us:.1f} us"
                if args.tune and m <= FUSED_MAX_ROWS:
                    block = getattr(fmt, "block", None) or getattr(fmt, "group", 128)
                    timed = [(1e3 * triton.testing.do_bench_cudagraph(
                        lambda c=c: fused_linear(x, next(parts), None, y, c)), c)
                        for c in _candidates(m, block, n, k, int8_x_config(m, weight.parts[0])
                                             if takes_int8_x(x, weight.parts[0]) else None,
                                             wide_rows_config(m, weight.parts[0]) if takes_wide_rows(x, weight.parts[0])
                                             else None, takes_few_rows(x, weight.parts[0]),
                                             (1, 2, 4) if fmt_name == "INT4" else (1,))]
                    t, cfg = min(timed, key=lambda tc: tc[0])
                    best += f"; best {t:.1f} us with {cfg}"
                    if also_wide:
                        wide = [(1e3 * triton.testing.do_bench_cudagraph(
                            lambda c=c: wide_linear(x, next(parts), None, y, c)), c)
                            for c in _candidates(m, block, n, k, None, wide_rows_config(m, weight.parts[0]))]
                        t, cfg = min(wide, key=lambda tc: tc[0])
                        best += f"; wide tiles best {t:.1f} us with {cfg}"
                gbs = weight.nbytes / (us * 1e-6) / 1e9
                reporter.note(f"quant-kernel {fmt_name} {shape_name} m={m}",
                              f"{us:.1f} us ({base_us / us:.2f}x bf16, {gbs:.0f} GB/s of quantized weight){best}",
                              shape=shape_name, m=m, format=fmt_name, us=us, speedup=base_us / us)
