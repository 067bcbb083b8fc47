"""Load a Hugging Face checkpoint directory (or hub repo id) into our model: config.json + safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from outrider.config import ModelConfig, RopeOverride
from outrider.layers.linear import MergedLinear
from outrider.models.registry import model_class

# Tensors that the target model does not own but that may ship in its checkpoint.
MTP_PREFIXES = ("mtp.", "model.mtp_layers.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # stale buffers saved by old transformers versions
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]  # config, weights, tokenizer
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(path_or_repo: str | os.PathLike, offline: bool = False) -> Path:
    """A local directory as is; anything else is a hub repo id fetched (or found in the cache) by huggingface_hub."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path_or_repo), allow_patterns=_HUB_FILES, local_files_only=offline))
    except Exception as e:  # hub errors are many types; the caller wants one clear message
        raise ValueError(f"cannot find model {str(path_or_repo)!r} locally or on the Hugging Face hub: {e}") from e


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those named by model.safetensors.index.json, else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    return files


def read_tensors(path: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """All CPU tensors of the checkpoint at `path` whose names start with `prefix` (names kept whole)."""
    from safetensors import safe_open

    out = {}
    for file in safetensors_files(resolve_model_path(path)):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    out[name] = f.get_tensor(name)
    return out


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """A torch dtype, a name, or "auto": the checkpoint's torch_dtype on accelerators, float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return _DTYPES.get(cfg.torch_dtype, torch.bfloat16) if device.type != "cpu" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class CheckpointSlot(NamedTuple):
    """Where a checkpoint tensor lives in the model: rows row:row + shape[0] of parameter `param`."""

    param: str
    row: int
    shape: torch.Size


def checkpoint_layout(model: torch.nn.Module) -> dict[str, CheckpointSlot]:
    """Hugging Face tensor name -> its slot, for every parameter: a packed MergedLinear tensor (e.g.
    self_attn.qkv_proj.weight) is filled from its parts (self_attn.q_proj.weight, ...) stacked in order."""
    layout = {}
    for name, p in model.named_parameters():  # a tied lm_head is not listed
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        if not isinstance(module, MergedLinear):
            layout[name] = CheckpointSlot(name, 0, p.shape)
            continue
        parent, row = module_name.rpartition(".")[0], 0
        for part, rows in module.parts.items():
            layout[f"{parent}.{part}.{kind}"] = CheckpointSlot(name, row, torch.Size((rows, *p.shape[1:])))
            row += rows
    return layout


def load_model(path_or_repo: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               rope: RopeOverride | None = None) -> tuple[torch.nn.Module, ModelConfig]:
    """Build the model for the checkpoint's architecture and load its weights strictly, in eval mode; `rope`
    overrides the checkpoint's RoPE settings."""
    from safetensors import safe_open

    path = resolve_model_path(path_or_repo)
    cfg = ModelConfig.from_path(path)
    if rope is not None:
        cfg = rope.apply(cfg)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):  # no random init: every parameter is assigned from the checkpoint
        model = model_class(cfg)(cfg)
    layout = checkpoint_layout(model)
    # Each tensor is copied straight into its rows of the final parameter: packing needs no extra copy.
    params = {name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in model.named_parameters()}
    loaded = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name not in layout:
                    if name.startswith(MTP_PREFIXES) or name.endswith(_IGNORED_SUFFIXES) or (
                            name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    raise ValueError(f"unexpected tensor {name!r} in {file.name} for {cfg.architecture}")
                slot = layout[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(slot.shape):
                    raise ValueError(f"shape mismatch for {name!r}: expected {tuple(slot.shape)}, "
                                     f"got {shape} in {file.name}")
                params[slot.param][slot.row:slot.row + shape[0]].copy_(f.get_tensor(name))
                loaded.add(name)
    missing = [n for n in layout if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor {missing[0]!r}{more} in checkpoint {path}")
    model.load_state_dict(params, strict=False, assign=True)  # not strict: the state dict lists a tied lm_head
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False), cfg
