"""HF transformers on the same shape and batch, for `bench latency --compare hf`.

Each configuration runs in a process of its own (bench/hf_worker.py), so nothing of ours (allocator state,
loaded weights, compiled kernels, Python's heap) shares its process or its GPU memory:
  generate        `model.generate` as a user calls it: dynamic cache, the default attention implementation;
  static-compile  `cache_implementation="static"`, with which generate compiles its decode step itself
                  (torch.compile, mode reduce-overhead: HF's documented fast path). HF compiles only on an
                  accelerator, so on a CPU this configuration reports that as its error.
Random weights are drawn in that process (their values do not change the speed). It is measured as `bench
latency` measures ours: `batch` prompts of random ids (with their attention mask), greedy, exactly `gen` new
tokens each, after two untimed calls of the same shape (compilation, CUDA graph recording). A streamer stamps
each step's tokens when they reach the host: TTFT is the first stamp; decode tok/s = batch x (gen - 1) / (last
stamp - first stamp).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
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


def compare(source: list[str], configs: list[str], device: str, batch: int, prompt_len: int, gen: int, seed: int,
            timeout_s: float) -> list[HFResult]:
    """Run the configurations, each in a fresh process. `source`: ["--model", PATH] or ["--random-weights", NAME]."""
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds the outrider package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    results = []
    for config in configs:
        cmd = [sys.executable, "-m", "outrider.bench.hf_worker", *source, "--config", config, "--device", device,
               "--batch", str(batch), "--prompt-len", str(prompt_len), "--gen", str(gen), "--seed", str(seed)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            results.append(HFResult(config, batch, None, None, f"did not finish in {timeout_s:g} s", None))
            continue
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
