"""HF transformers on the same shape and batch, for `bench latency --compare hf`.

Each configuration runs in a process of its own (`python -m outrider.bench.hf`), so nothing of ours (allocator
state, loaded weights, compiled kernels) shares its process or its GPU memory:
  generate        `model.generate` as a user calls it: dynamic cache, the default attention implementation;
  static-compile  a static cache and `model.forward` compiled with torch.compile(mode="reduce-overhead",
                  fullgraph=True), the recipe HF documents for fast generation.
Random weights are drawn in that process (the values do not change the speed). It is measured as `bench latency`
measures ours: `batch` prompts of random ids, greedy, exactly `gen` new tokens each, after two untimed calls of
the same shape (compilation, CUDA graph recording). A streamer stamps each step's tokens when they reach the host:
TTFT is the first stamp; decode tok/s = batch x (gen - 1) / (last stamp - first stamp).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from outrider.bench.shapes import RANDOM_MODELS

CONFIGS = ("generate", "static-compile")


@dataclass(frozen=True)
class HFResult:
    config: str  # one of CONFIGS
    batch: int
    tok_s: float | None  # decode tok/s over the batch; None: it failed
    ttft_s: float | None
    detail: str  # the attention implementation and cache, or the error that stopped the configuration
    pid: int | None  # the process it ran in


def compare(source: list[str], configs: list[str], device: str, batch: int, prompt_len: int, gen: int,
            seed: int) -> list[HFResult]:
    """Run the configurations, each in a fresh process. `source`: ["--model", PATH] or ["--random-weights", NAME]."""
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds the outrider package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    results = []
    for config in configs:
        cmd = [sys.executable, "-m", "outrider.bench.hf", *source, "--config", config, "--device", device,
               "--batch", str(batch), "--prompt-len", str(prompt_len), "--gen", str(gen), "--seed", str(seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and rows:
            results.append(HFResult(**json.loads(rows[-1])))
        else:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results.append(HFResult(config, batch, None, None, f"process exited {proc.returncode}: {last}", None))
    return results


def hf_random_model(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """An HF AutoModelForCausalLM with the named shape and random weights, on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(RANDOM_MODELS[name])
    fields.pop("architectures")
    fields.pop("torch_dtype")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


class _Stamps:
    """A generate streamer that records when each step's tokens reach the host (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def measure(model, config: str, batch: int, prompt_len: int, gen: int, seed: int) -> HFResult:
    device = model.device
    gen_cfg = model.generation_config
    gen_cfg.pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    cache = "dynamic cache"
    if config == "static-compile":
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        kwargs.update(cache_implementation="static", disable_compile=True)  # (compiled here, not by generate)
        cache = "static cache, torch.compile reduce-overhead"
    gen_ids = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen_ids).to(device)
    mask = torch.ones_like(ids)
    for _ in range(2):  # compilation and graph recording happen in these
        model.generate(ids, attention_mask=mask, **kwargs)
    stamps = _Stamps()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, streamer=stamps, **kwargs)
    if out.shape[1] != prompt_len + gen:
        raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} tokens, not {gen}")
    first, last = stamps.times[1], stamps.times[-1]
    attn = getattr(model.config, "_attn_implementation", None) or "default"
    return HFResult(config, batch, batch * (gen - 1) / (last - first), first - t0, f"{attn} attention, {cache}",
                    os.getpid())


def main(argv: list[str] | None = None) -> int:
    from outrider.models.loader import resolve_dtype

    p = argparse.ArgumentParser(prog="python -m outrider.bench.hf", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--random-weights", choices=sorted(RANDOM_MODELS))
    p.add_argument("--config", choices=CONFIGS, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    from outrider.config import ModelConfig

    if args.random_weights:
        dtype = resolve_dtype("auto", ModelConfig.from_dict(RANDOM_MODELS[args.random_weights]), device)
        model = hf_random_model(args.random_weights, device, dtype)
    else:
        from transformers import AutoModelForCausalLM

        from outrider.models import resolve_model_path

        path = resolve_model_path(args.model)
        dtype = resolve_dtype("auto", ModelConfig.from_path(path), device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    try:
        result = measure(model, args.config, args.batch, args.prompt_len, args.gen, args.seed)
    except Exception as exc:  # the comparison reports what stopped a configuration
        why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        result = HFResult(args.config, args.batch, None, None, why, os.getpid())
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
