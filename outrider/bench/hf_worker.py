"""One HF configuration of `bench latency --compare hf`, in a process of its own (bench/hf.py says what each
configuration is and how it is measured). Prints one JSON line: the HFResult."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch

from outrider.bench.hf import CONFIGS, HFResult, hf_random_model
from outrider.bench.shapes import RANDOM_MODELS


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
        # generate compiles the decode step itself (torch.compile, mode reduce-overhead) when the cache is static.
        kwargs.update(cache_implementation="static")
        cache = "static cache, decode compiled by generate"
    gen_ids = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen_ids).to(device)
    mask = torch.ones_like(ids)
    for _ in range(2):  # compilation and graph recording happen in these
        model.generate(ids, attention_mask=mask, **kwargs)
    if config == "static-compile" and not hasattr(model, "_compiled_call"):  # (set by get_compiled_call)
        raise RuntimeError(f"transformers compiled nothing on {device.type}: it compiles generate on accelerators only")
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

    p = argparse.ArgumentParser(prog="python -m outrider.bench.hf_worker", description=__doc__)
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
    from outrider.models import registry

    if args.random_weights:
        dtype = resolve_dtype("auto", registry.model_config(RANDOM_MODELS[args.random_weights]), device)
        model = hf_random_model(args.random_weights, device, dtype)
    else:
        from transformers import AutoModelForCausalLM

        from outrider.models import resolve_model_path

        path = resolve_model_path(args.model)
        dtype = resolve_dtype("auto", registry.load_config(path), device)
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
