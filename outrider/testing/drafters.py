"""Write tiny random drafter checkpoints in their real on-disk formats.

- draft model: any tiny causal LM, `write_tiny_checkpoint` (same vocabulary as the target);
- MTP: a target checkpoint that also carries `mtp.*` (Qwen3-Next / Qwen3.5) or `model.mtp_layers.0.*` (MiMo)
  tensors and the matching config key;
- DFlash: a `DFlashDraftModel` directory sized for a given target;
- EAGLE-3: a head for a given target in the EAGLE reference's or vLLM speculators' layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from outrider.models import registry
from outrider.models.loader import checkpoint_layout
from outrider.testing.checkpoints import write_tiny_checkpoint

_MTP = {  # layout -> (default target arch, config key announcing the head)
    "qwen": ("qwen3", "mtp_num_hidden_layers"),
    "mimo": ("qwen2", "num_nextn_predict_layers"),
}


def random_params(module: nn.Module, prefix: str = "", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors for every parameter of `module` (may live on "meta") under its checkpoint names,
    keeping activations O(1)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (_, _, shape) in checkpoint_layout(module).items():
        if len(shape) == 1:  # norm weights (and biases): near one / near zero
            t = (1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        out[prefix + name] = t
    return out


def write_mtp_checkpoint(path: str | Path, layout: str = "qwen", *, seed: int = 0, fused_experts: bool = False,
                         **kwargs: Any) -> Path:
    """A target checkpoint (write_tiny_checkpoint kwargs) with a random MTP head in `layout` ("qwen" | "mimo");
    `fused_experts`: a MoE head's experts stored fused, as Qwen3.5-MoE's release stores them."""
    from outrider.speculative.mtp import LAYOUTS

    arch, key = _MTP[layout]
    kwargs = {"arch": arch, **kwargs, "extra_config": {**kwargs.get("extra_config", {}), key: 1}}
    path = write_tiny_checkpoint(path, seed=seed, **kwargs)  # first pass: the config the head is shaped by
    cls = LAYOUTS[layout]
    with torch.device("meta"):
        head = cls(registry.load_config(path), fused_experts=fused_experts)
    extra = random_params(head, cls.prefix, seed + 1)
    return write_tiny_checkpoint(path, seed=seed, **kwargs, extra_tensors=extra)


def write_dflash_checkpoint(path: str | Path, target: str | Path, *, layers: int = 2, block_size: int = 4,
                            mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                            sliding_window: int = 0, config: dict[str, Any] | None = None, seed: int = 0,
                            dtype: torch.dtype = torch.float32) -> Path:
    """A DFlash drafter for the target checkpoint at `target`: its hidden size, heads and vocabulary unless `config`
    says otherwise (a release's own attention shape). With `sliding_window`, the newer z-lab layout (Qwen3.5 drafters): the block size under dflash_config, every layer but
    the last a sliding-window one, rope_parameters."""
    from safetensors.torch import save_file

    from outrider.speculative.dflash import DFlashConfig, DFlashModel, default_target_layers

    tcfg = json.loads((Path(target) / "config.json").read_text())
    n_target = tcfg["num_hidden_layers"]
    rope_theta = registry.model_config(tcfg).rope_theta  # (rope_theta, or under rope_parameters)
    taps = target_layer_ids if target_layer_ids is not None else default_target_layers(n_target, layers)
    dflash = {"mask_token_id": tcfg["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
              "target_layer_ids": taps}
    if sliding_window:
        layout = {"dflash_config": {**dflash, "block_size": block_size}, "use_sliding_window": True,
                  "sliding_window": sliding_window,
                  "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
                  "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"}}
    else:
        layout = {"block_size": block_size, "dflash_config": dflash, "rope_theta": rope_theta}
    config = {
        **{k: tcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings")},
        **(config or {}),
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "num_target_layers": n_target,
        **layout,
        "num_hidden_layers": layers,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "use_cache": False,
        "is_causal": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cfg = DFlashConfig.from_dict(config, n_target).layers
    with torch.device("meta"):
        model = DFlashModel(cfg, len(taps) * tcfg["hidden_size"])
    tensors = {n: t.to(dtype).contiguous() for n, t in random_params(model, seed=seed).items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def write_eagle3_checkpoint(path: str | Path, target: str | Path, *, draft_ids: list[int] | None = None,
                            aux_layer_ids: list[int] | None = None, layout: str = "eagle", seed: int = 0,
                            dtype: torch.dtype = torch.float32) -> Path:
    """A random EAGLE-3 head for the target checkpoint at `target`, in a published layout: "eagle" (the EAGLE
    reference's: architectures LlamaForCausalLMEagle3, tensors under `midlayer.`, taps in `eagle_config`) or
    "speculators" (vLLM speculators': Eagle3Speculator, the layer's config under `transformer_layer_config`,
    tensors under `layers.0.`). `draft_ids`: the target ids of its reduced vocabulary (default: a random half);
    `aux_layer_ids`: the taps as layer inputs (vLLM's convention; default: absent, the loader's default)."""
    from safetensors.torch import save_file

    from outrider.speculative.eagle3 import Eagle3Model

    tcfg = json.loads((Path(target) / "config.json").read_text())
    vocab = tcfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    if draft_ids is None:
        draft_ids = sorted(torch.randperm(vocab, generator=gen)[: vocab // 2].tolist())
    layer = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        **{k: tcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")},
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    taps = {} if aux_layer_ids is None else {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    if layout == "eagle":
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(draft_ids),
                  **({"eagle_config": {"use_aux_hidden_state": True, **taps}} if taps else {})}
        prefix = "midlayer."
    elif layout == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, "draft_vocab_size": len(draft_ids),
                  "norm_before_residual": False, "target_hidden_size": tcfg["hidden_size"],
                  "speculators_config": {"algorithm": "eagle3"}, **taps}
        prefix = "layers.0."
    else:
        raise ValueError(f"unknown EAGLE-3 layout {layout!r}: eagle | speculators")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cfg = registry.model_config(layer)
    with torch.device("meta"):
        model = Eagle3Model(cfg, tcfg["hidden_size"], 3, len(draft_ids))
    tensors = {n.replace("layers.0.", prefix, 1): t.to(dtype) for n, t in random_params(model, seed=seed).items()}
    ids = torch.tensor(draft_ids, dtype=torch.int64)
    tensors["d2t"] = ids - torch.arange(len(draft_ids))
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path
