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
_QWEN3_5 = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, head_dim=256,
                max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
                full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
                linear_value_head_dim=128, partial_rotary_factor=0.25,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
                torch_dtype="bfloat16")
# HF config.json fields of the public checkpoints, less their token ids: the stub tokenizer's EOS ends generation.
RANDOM_MODELS: dict[str, dict] = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      hidden_act="silu", attention_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # Qwen3.5 (hybrid: Gated DeltaNet and gated full attention 3:1) as the text model of each release's config.json
    # (text_config, served text only; its MTP head is the "mtp" drafter preset's, bench/drafter_shapes.py):
    # Qwen/Qwen3.5-4B (the seed's target), Qwen/Qwen3.5-27B, and the MoE
    # Qwen/Qwen3.5-35B-A3B, the one Qwen3.5 MoE that fits one 80 GB GPU in bf16 (~70 GB of weights, little room
    # for KV: run it on an H200 where there is one).
    "qwen3.5-4b": {**_QWEN3_5, "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_value_heads": 32,
                   "tie_word_embeddings": True},
    "qwen3.5-27b": {**_QWEN3_5, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
                    "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48,
                    "tie_word_embeddings": False},
    "qwen3.5-35b-a3b": {**_QWEN3_5, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                        "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "linear_num_value_heads": 32, "num_experts": 256,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False},
    # Qwen/Qwen3-30B-A3B (Qwen3-Coder-30B-A3B has the same shape): Qwen3 attention, 128 experts, top 8.
    "qwen3-30b-a3b": {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False},
    # HuggingFaceTB/SmolLM2-135M-Instruct, the one real target the tests have (as a GGUF): its shape with random
    # weights, for the host-bound regime of a small model with a drafter (the "dflash" preset: the trained one's).
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         hidden_act="silu", attention_bias=False, tie_word_embeddings=True, torch_dtype="bfloat16"),
    # Tiny Qwen3 / Qwen3.5 shapes (no public checkpoint): the benchmarks' code paths in seconds on a CPU.
    "tiny-qwen3": {**_QWEN3, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False, "torch_dtype": "float32"},
    # Every dimension a multiple of 256: each quantized format's blocks fit (bench quant on a CPU in seconds).
    "tiny-qwen3-256": {**_QWEN3, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                       "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float32"},
    "tiny-qwen3.5": {**_QWEN3_5, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "max_position_embeddings": 2048, "tie_word_embeddings": True,
                     "torch_dtype": "float32"},
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


def _meta_model(cfg: ModelConfig) -> torch.nn.Module:
    """The model of cfg's architecture with no storage: its parameters' shapes, whatever its size."""
    from outrider.models.registry import build_model

    with torch.device("meta"):
        return build_model(cfg)


def config_weight_bytes(cfg: ModelConfig, elem: int, batch: int = 1) -> int:
    """Bytes of weights one decode step of `batch` sequences must stream: every weight once, except the embedding
    (one row is read) unless it doubles as the LM head, and of a MoE block's routed experts only those the step's
    tokens pick. Each token picks top_k of E experts: at batch 1 exactly top_k are read (the active weights: attention
    or linear attention, router, shared expert, top-k experts, embedding row and LM head); at batch B, assuming
    uniform routing [est], E (1 - (1 - top_k / E)^B) of them."""
    from outrider.layers.moe import SparseMoe

    model = _meta_model(cfg)
    total = sum(p.numel() for p in model.parameters())  # (a tied LM head is the embedding: counted once)
    if not cfg.tie_word_embeddings:
        total -= model.model.embed_tokens.weight.numel() - cfg.hidden_size
    for module in model.modules():
        if isinstance(module, SparseMoe):
            experts = module.experts
            read = 1 - (1 - module.top_k / experts.num_experts) ** batch
            total -= round(sum(p.numel() for p in experts.parameters()) * (1 - read))
    return elem * total


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """Bytes of linear-attention state one decode step reads and writes per sequence (0: no such layers)."""
    from outrider.engine.state_pool import StateLayout

    model = _meta_model(cfg)
    if not getattr(model, "num_linear_layers", 0):
        return 0
    return 2 * StateLayout.of(model.linear_config, model.num_linear_layers).bytes_per_slot


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV bytes per cached token: of the full-attention layers only in a hybrid model."""
    layers = getattr(_meta_model(cfg), "num_kv_layers", cfg.num_hidden_layers)
    return kv_block_bytes((layers, cfg.num_key_value_heads, cfg.head_dim), 1, dtype)


def random_model(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    """Our model with the named shape and random weights, built directly on the device (never a host copy: a 30B
    MoE is ~60 GB). Every parameter is drawn here, as nn.Linear would (uniform, 1/sqrt(fan_in)), norms at one:
    modules that hold raw storage (stacked experts, linear-attention parameters) would otherwise keep whatever the
    allocator left, and NaNs in the router would send every token to the same experts."""
    return random_model_of(RANDOM_MODELS[name], device, dtype, seed)


def random_model_of(config: dict, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    """random_model for a config.json's fields."""
    from outrider.models.registry import build_model, model_config

    cfg = model_config(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                bound = p.shape[-1] ** -0.5
                p.uniform_(-bound, bound, generator=gen)
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
    cost of every step, stay as they were. With the LM head tied to the embedding (Qwen3.5-4B) the scaled embedding
    alone does it: each token's greedy successor is itself."""
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if head is emb:
        with torch.no_grad():
            emb.mul_(gain)
        return
    successor = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
    with torch.no_grad():
        unit = emb.float() / emb.float().norm(dim=1, keepdim=True)
        head.index_copy_(0, successor, unit.to(head.dtype))
        emb.mul_(gain)
