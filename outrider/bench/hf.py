"""HF transformers on the same shapes and the same weights, for `--compare hf`."""

from __future__ import annotations

import time

import torch

from outrider.bench.shapes import RANDOM_MODELS
from outrider.config import ModelConfig


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


def ours_sharing_weights(hf_model, cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """Our model over the HF model's parameter tensors (HF names; shared, except the packed q/k/v and gate/up
    projections, which are copies), so both decode the same net."""
    from outrider.models.registry import model_class

    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    state = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    missing, _ = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    left = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if left:
        raise ValueError(f"HF state dict lacks {left[:3]}")
    return model.to(device).eval().requires_grad_(False)


@torch.inference_mode()
def hf_decode_rate(model, prompt_len: int, gen: int, vocab: int, device: torch.device) -> tuple[float, float]:
    """(decode tok/s, TTFT s) of HF generate at batch 1, greedy, from two runs: gen tokens and 1 token."""
    ids = torch.randint(0, vocab, (1, prompt_len), device=device)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(4)  # warm-up
    t1, tn = timed(1), timed(gen)
    return (gen - 1) / (tn - t1), t1
