"""Real model shapes with random weights, and the byte counts that define the decode roofline."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from outrider.config import ModelConfig
from outrider.engine.memory import kv_block_bytes

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, num_key_value_heads=8,
              head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
              hidden_act="silu", attention_bias=False, torch_dtype="bfloat16")
RANDOM_MODELS: dict[str, dict] = {  # HF config.json fields of the public checkpoints
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      hidden_act="silu", attention_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # Tiny Qwen3 shapes (no public checkpoint): the benchmarks' code paths in seconds on a CPU.
    "tiny-qwen3": {**_QWEN3, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False, "torch_dtype": "float32"},
    "tiny-qwen3-draft": {**_QWEN3, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                         "max_position_embeddings": 2048, "tie_word_embeddings": True, "torch_dtype": "float32"},
}

# Spec HBM bandwidth by device name (anchors: % of roofline is against the spec of the GPU measured on).
_SPEC_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12}


def spec_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in _SPEC_BW.items() if key in name), None)


def config_weight_bytes(cfg: ModelConfig, elem: int) -> int:
    """Bytes one decode step must stream: every weight once, except the embedding (one row is read) unless
    it doubles as the LM head. Biases are ignored (under 0.01%)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_layer = attn + 3 * h * cfg.intermediate_size + 2 * h + (2 * d if cfg.qk_norm else 0)
    return elem * (cfg.num_hidden_layers * per_layer + h + cfg.vocab_size * h)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return kv_block_bytes((cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), 1, dtype)


def random_model(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    """Our model with the named shape and random weights, built directly on the device."""
    from outrider.models import registry

    cfg = registry.model_config(RANDOM_MODELS[name])
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = registry.build_model(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(device).eval().requires_grad_(False), cfg


def write_stub_checkpoint(name: str, path: Path, full_vocab: bool = False, **extra_config) -> Path:
    """config.json (the named shape's, plus `extra_config`) + a test tokenizer: enough for Engine to start when
    the model is handed in. The tiny one (512 tokens), or with `full_vocab` one trained on Python sources to about
    the model's vocabulary size (a minute or so), for costs that grow with it (grammar masks)."""
    from outrider.testing.tokenizer import python_sources, write_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    if full_vocab:
        # Trained once per machine and vocabulary size: a second bench process on the box reuses it.
        vocab = RANDOM_MODELS[name]["vocab_size"] - 256
        cache = Path(tempfile.gettempdir()) / f"outrider-bench-tokenizer-{vocab}"
        if not (cache / "tokenizer_config.json").is_file():
            size = write_tiny_tokenizer(cache, vocab, corpus=python_sources())
            print(f"bench: trained a {size}-token tokenizer on Python sources ({cache})", flush=True)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(cache / file, path / file)
    else:
        write_tiny_tokenizer(path)
    (path / "config.json").write_text(json.dumps({**RANDOM_MODELS[name], **extra_config}))
    return path


def write_random_checkpoint(name: str, path: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """A loadable checkpoint of the named shape: the stub plus random weights in `dtype` (a draft model that
    really runs)."""
    from safetensors.torch import save_file

    from outrider.testing.checkpoints import random_weights

    write_stub_checkpoint(name, path)
    tensors = {n: t.to(dtype).contiguous() for n, t in random_weights(RANDOM_MODELS[name], seed).items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def fix_successors(model: torch.nn.Module, seed: int = 0, gain: float = 100.0) -> None:
    """Make greedy decoding of a random-weights model decisive, in place. Random weights give near-ties between
    the top tokens, so runs that batch a step differently (a plain and a speculative one, in bf16) soon commit
    different tokens. Here every token's embedding is scaled up `gain` times, so the last layer's residual stream
    keeps its direction, and the LM head's row for a fixed successor (a random permutation) is that direction:
    the greedy next token is the current token's successor, by a margin no rounding flips. Shapes, and so the
    cost of every step, stay as they were. The LM head must not be tied to the embedding."""
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if head is emb:
        raise ValueError("fix_successors needs an LM head of its own (tie_word_embeddings is set)")
    successor = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
    with torch.no_grad():
        unit = emb.float() / emb.float().norm(dim=1, keepdim=True)
        head.index_copy_(0, successor, unit.to(head.dtype))
        emb.mul_(gain)
