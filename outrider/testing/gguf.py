"""Write GGUF files from tiny Hugging Face checkpoints (testing/checkpoints.py) as llama.cpp's converter does:
ggml's own tensor names (gguf.TensorNameMap), Llama's Q/K rows permuted, norms kept in F32, the tokenizer's
tokens, merges and token types as metadata."""

from __future__ import annotations

import json
import re
from pathlib import Path
import numpy as np
import torch

from outrider.config import ModelConfig
from outrider.layers.rotary import rope_inv_freq
from outrider.models import registry
from outrider.models.loader import read_tensors

# Quant types gguf cannot produce in Python: their blocks are random bytes below 0x7C, so every f16 scale is finite.
RANDOM_BLOCK_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def write_gguf(checkpoint: str | Path, path: str | Path, *, quant: str = "F32", arch: str | None = None,
               pre: str = "gpt2", tokenizer_model: str = "gpt2", split_max_tensors: int = 0, seed: int = 0) -> Path:
    """Convert `checkpoint` into `path` (split into parts of `split_max_tensors` tensors when > 0): matrices in
    `quant`, 1-D tensors in F32. `arch` overrides general.architecture (to write one we refuse). Returns the path
    of the file (of the first part when split)."""
    import gguf

    checkpoint, path = Path(checkpoint), Path(path)
    cfg = registry.load_config(checkpoint)
    adapter = registry.of(cfg)
    ggml_arch = adapter.gguf_writes
    if ggml_arch is None:
        raise ValueError(f"llama.cpp has no GGUF architecture for {cfg.architecture}")
    writer = gguf.GGUFWriter(path, arch or ggml_arch, split_max_tensors=split_max_tensors)
    add_hparams(writer, cfg)
    writer.add_file_type(_file_type(quant))
    if (checkpoint / "tokenizer.json").is_file():
        _add_tokenizer(writer, checkpoint, pre, tokenizer_model)

    qtype = gguf.GGMLQuantizationType[quant]
    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[ggml_arch]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    tensors = _stack_experts(read_tensors(checkpoint))
    if adapter.gguf_write:
        tensors = adapter.gguf_write(writer, cfg, tensors)
    if "num_experts" in cfg.raw:
        writer.add_expert_count(cfg.raw["num_experts"])
        writer.add_expert_used_count(cfg.raw["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg.raw["moe_intermediate_size"])
    if cfg.rope_scaling and not adapter.gguf_write:  # llama.cpp stores Llama 3's rule as per-frequency divisors
        base = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None, cfg.max_position_embeddings)
        scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy())
    for hf_name, t in tensors.items():
        if adapter.gguf_permutes_qk and ".self_attn." in hf_name and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            t = _permute(t, cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if t.dim() > 1 and not name.endswith((".weight", ".bias")):  # (fused experts: named as weights)
            name += ".weight"
        data = t.float().numpy()
        if data.ndim == 1 or quant == "F32":
            writer.add_tensor(name, data)
        elif quant == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif quant in RANDOM_BLOCK_TYPES:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if data.shape[1] % block:
                raise ValueError(f"{quant} needs rows of a multiple of {block} values; {hf_name} has {data.shape[1]}")
            blocks = rng.integers(0, 0x7C, (data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]


def add_hparams(writer, cfg: ModelConfig) -> None:
    """The model shape every llama.cpp decoder file carries (gguf.GGUFWriter)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As llama.cpp's converter: each layer's per-expert `mlp.experts.{e}.<proj>.weight` stacked into one
    `mlp.experts.<proj>.weight` [E, rows, cols] (the name gguf's tensor map knows)."""
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(\w+\.weight)$", name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
        else:
            out[name] = t
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter: each head's two rotary halves interleaved row by row (GGML's RoPE pairs neighbours)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _file_type(quant: str) -> int:
    import gguf

    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q3_K": "MOSTLY_Q3_K_M",
             "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "MXFP4": "MOSTLY_MXFP4_MOE"}
    return int(gguf.LlamaFileType[names.get(quant, f"MOSTLY_{quant}")])


def _add_tokenizer(writer, checkpoint: Path, pre: str, model: str) -> None:
    """tokenizer.json's vocabulary, merges and added tokens (special: CONTROL, else USER_DEFINED), the special ids
    and the chat template of tokenizer_config.json."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    added = {a["content"]: a["special"] for a in tok["added_tokens"]}
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([(3 if added[t] else 4) if t in added else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(bool(config.get("add_bos_token")))
    writer.add_chat_template(config["chat_template"])
