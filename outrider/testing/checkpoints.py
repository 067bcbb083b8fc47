"""Write tiny, genuine Hugging Face checkpoint directories with random weights for tests and benchmarks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from outrider.models import registry
from outrider.models.loader import checkpoint_layout

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DEFAULT_VOCAB_SIZE = 512


def write_tiny_checkpoint(path: str | Path, arch: str = "qwen3", *, vocab_size: int | None = None,
                          hidden_size: int = 64, intermediate_size: int | None = None, layers: int = 2,
                          heads: int = 4, kv_heads: int = 2, head_dim: int | None = None, tie: bool = False,
                          dtype: torch.dtype = torch.float32, seed: int = 0, shards: int = 1,
                          rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
                          max_position_embeddings: int = 2048, tokenizer: bool = True,
                          extra_config: dict[str, Any] | None = None,
                          extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json, generation_config.json, safetensors (sharded when shards > 1) and, with `tokenizer`,
    the tiny tokenizer into `path`. `arch` is a registered architecture's short name (models/registry.py);
    `extra_config`/`extra_tensors` add e.g. MTP fields and weights."""
    adapter = registry.by_name(arch)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bos, eos = None, None
    if tokenizer:
        from outrider.testing.tokenizer import write_tiny_tokenizer

        n_tokens = write_tiny_tokenizer(path)
        if vocab_size is not None and vocab_size < n_tokens:
            raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {n_tokens} tokens")
        vocab_size = vocab_size or n_tokens
        bos, eos = _special_token_ids(path)
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
    head_dim = head_dim or hidden_size // heads
    config = {
        "architectures": [adapter.hf_names[0]],
        "model_type": adapter.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "transformers_version": "4.51.0",  # the transformers-4 layout most hub checkpoints still have
    }
    config.update(adapter.tiny_config)
    config.update(extra_config or {})
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json",
                {"bos_token_id": bos, "eos_token_id": eos, "transformers_version": "4.51.0"})
    tensors = {**random_weights(config, seed), **(extra_tensors or {})}
    _write_safetensors(path, {n: t.to(dtype).contiguous() for n, t in tensors.items()}, shards)
    return path


def write_multimodal_release(text: str | Path, path: str | Path) -> Path:
    """The tiny text-only Qwen3.5 checkpoint at `text` in its release's layout at `path`:
    Qwen3_5ForConditionalGeneration, the decoder's keys under text_config and its weights under model.language_model., a (tiny) vision tower
    beside it; top-level tensors (the MTP head's mtp.*, lm_head) stay where they are."""
    from safetensors.torch import load_file, save_file

    text, path = Path(text), Path(path)
    config = json.loads((text / "config.json").read_text())
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {**config, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1},
        "tie_word_embeddings": config["tie_word_embeddings"]})
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(text / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, path / "model.safetensors")
    return path


def random_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF names, scaled so tiny models give varied, well-separated greedy tokens."""
    cfg = registry.model_config(config)
    with torch.device("meta"):
        model = registry.build_model(cfg)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (_, _, shape) in checkpoint_layout(model, registry.of(cfg).packed_projections).items():  # HF names; a tied lm_head is not listed
        if name.endswith("norm.weight"):  # random signs decorrelate a tied head from the input embedding
            t = torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
            t = t / t.norm(dim=1, keepdim=True) * math.sqrt(shape[1])  # equal norms: no "hub" tokens
        else:
            # Strong residual branches, so the token's own embedding does not dominate (tied heads repeat it).
            gain = 4.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            # (divided by the fan-in: a depthwise conv's is its kernel)
            t = gain * torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
        out[name] = t
    return out


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    from safetensors.torch import save_file

    if shards <= 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _special_token_ids(path: Path) -> tuple[int | None, int | None]:
    """(bos, eos) ids named by tokenizer_config.json, looked up in tokenizer.json's added tokens."""
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    added = {t["content"]: t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]}
    return added.get(tok_cfg.get("bos_token")), added.get(tok_cfg.get("eos_token"))


def _write_json(file: Path, obj: dict[str, Any]) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")
