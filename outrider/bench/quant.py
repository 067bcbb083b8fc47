"""`bench quant`: quantized weights against bf16 on one model shape with random weights, each format written to
a checkpoint as its tools write it (GGUF in llama.cpp's type mixes, FP8 with 128 x 128 block scales, AWQ and
GPTQ 4-bit) and loaded through the ordinary loader: batch-1 decode tok/s, batch-B throughput, TTFT at a long
prompt, and the GPU memory the weights take after load against the checkpoint's tensor bytes."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import torch

from outrider.bench.engine_setup import build_engine
from outrider.bench.latency import run_batch
from outrider.bench.report import Reporter
from outrider.bench.shapes import RANDOM_MODELS
from outrider.models import load_model
from outrider.quant.writers import GGUF_MIXES, write_random_checkpoint, write_random_gguf

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
    if not args.random_weights:
        raise SystemExit("bench quant writes its checkpoints: give --random-weights NAME")
    root = Path(args.checkpoint_dir)
    device = torch.device(args.device)
    results = {}
    for fmt in args.weights_format:
        path, tensor_bytes = write_checkpoint(args.random_weights, fmt, root)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        model, cfg = load_model(path, dtype="bfloat16", device=device)
        torch.cuda.synchronize(device)
        weights = torch.cuda.memory_allocated(device) - before
        reporter.note(f"quant {fmt} weights", f"{weights / 2**30:.2f} GiB on the GPU after load, checkpoint tensors "
                      f"{tensor_bytes / 2**30:.2f} GiB ({weights / tensor_bytes:.3f}x)", format=fmt,
                      gpu_bytes=weights, tensor_bytes=tensor_bytes)
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
