"""The architectures outrider serves, each declared once by its own module under outrider/models/architectures/.

A module there builds one `Architecture` and passes it to `register`; nothing else lists architectures. The
config parser (`model_config`, below), the loaders (models/loader.py, models/gguf.py), the test checkpoint writers
(testing/checkpoints.py, testing/gguf.py) and the drafters (`decoder_layer`) all read this registry. Modules are
discovered on first use, so adding an architecture is adding its module.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outrider.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn


def _no_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Architecture:
    """What outrider knows of one architecture.

    name: the short name (the module's; `write_tiny_checkpoint(arch=...)`).
    hf_names: config.json `architectures[0]` values it serves.
    model_type: config.json `model_type` of the checkpoints we write for tests.
    model: builds the model from its ModelConfig (the model contract: docs/architecture.md, Contracts).
    decoder_layer: builds decoder layer i for a config of this architecture: what drafters (MTP heads, DFlash)
        stack, so they never import a model module's classes.
    config: this architecture's ModelConfig fields from its config.json (after the fields all share).
    config_defaults: values transformers gives keys a config.json leaves out (released multimodal configs list
        only what differs from them), applied before any field is read.
    text_config: the decoder's keys sit under `text_config` (a multimodal checkpoint served as text only).
    tensor_renames: (checkpoint prefix, our prefix) pairs, e.g. a multimodal checkpoint's language model.
    ignored_prefixes: checkpoint tensors that are not the decoder's (a vision tower), skipped on load.
    packed_projections: the checkpoint stores q/k/v and gate/up packed as our model does (qkv_proj, gate_up_proj:
        Phi-3), rather than as their parts.
    from_checkpoint: HF-named safetensors tensor -> the value of our parameter (e.g. Gemma's norms store w for
        (1 + w)); GGUF tensors go through gguf_tensor instead.
    gguf_names: llama.cpp `general.architecture` values it reads.
    gguf_export: the `general.architecture` llama.cpp's converter writes for it (default gguf_names[0]; Mistral:
        "llama").
    gguf_config: HF config.json keys from a GGUF file's metadata, beyond those all share; called with
        `hparam(key, default)` over `<gguf arch>.<key>` and `values(name)`, a config tensor's values (a list, or
        None where the file lacks it: llama.cpp stores e.g. RoPE factors as `rope_*` tensors).
    gguf_layer_tensors: `blk.N.<ggml name>` -> `model.layers.N.<HF name>` beyond the shared map.
    gguf_tensor: (HF name, tensor read from GGUF, config) -> our parameter's value (default: as read; llama.cpp's
        converter has often done from_checkpoint's work already, e.g. Gemma's 1 + w).
    gguf_write: what llama.cpp's converter does for it beyond renaming, for testing/gguf.py (which writes the test
        files): called with (gguf.GGUFWriter, ModelConfig, HF-named tensors), it adds its metadata and returns the
        tensors as the converter stores them (e.g. Gemma's norms as 1 + w).
    gguf_permutes_qk: the converter interleaves each q/k head's rotary halves (Llama), undone on load.
    tiny_config: config.json keys tiny test checkpoints of this architecture carry (transformers reads them).
    """

    name: str
    hf_names: tuple[str, ...]
    model_type: str
    model: Callable[[ModelConfig], nn.Module]
    decoder_layer: Callable[[ModelConfig, int], nn.Module]
    config: Callable[[dict[str, Any]], dict[str, Any]] = _no_fields
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    text_config: bool = False
    tensor_renames: tuple[tuple[str, str], ...] = ()
    ignored_prefixes: tuple[str, ...] = ()
    packed_projections: bool = False
    from_checkpoint: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    gguf_names: tuple[str, ...] = ()
    gguf_export: str | None = None
    gguf_config: Callable[[Callable[..., Any], Callable[[str], list[float] | None]], dict[str, Any]] | None = None
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_tensor: Callable[[str, torch.Tensor, ModelConfig], torch.Tensor] | None = None
    gguf_write: Callable[[Any, ModelConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    gguf_permutes_qk: bool = False
    tiny_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gguf_writes(self) -> str | None:
        """The `general.architecture` a converted file of this architecture carries (None: llama.cpp has none)."""
        return self.gguf_export or (self.gguf_names[0] if self.gguf_names else None)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in our model (tensor_renames applied)."""
        for old, new in self.tensor_renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name


_REGISTRY: dict[str, Architecture] = {}
_discovered = False


def register(arch: Architecture) -> Architecture:
    """Declare an architecture (at import of its module); each HF and GGUF name belongs to one architecture."""
    for other in _REGISTRY.values():
        clash = (set(arch.hf_names) & set(other.hf_names)) | (set(arch.gguf_names) & set(other.gguf_names))
        if other.name != arch.name and clash:
            raise ValueError(f"architecture {arch.name!r} claims {sorted(clash)}, already {other.name!r}'s")
    _REGISTRY[arch.name] = arch
    return arch


def architectures() -> tuple[Architecture, ...]:
    """Every architecture, its module imported on first use."""
    global _discovered
    if not _discovered:
        from outrider.models import architectures as package

        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
        _discovered = True
    return tuple(_REGISTRY.values())


def _find(kind: str, names: Callable[[Architecture], tuple[str, ...]], value: str) -> Architecture:
    found = [a for a in architectures() if value in names(a)]
    if not found:
        supported = sorted(n for a in architectures() for n in names(a))
        raise ValueError(f"unsupported {kind} {value!r}; supported: {', '.join(supported)}")
    return found[0]


def by_name(name: str) -> Architecture:
    return _find("architecture short name", lambda a: (a.name,), name)


def by_hf_name(name: str) -> Architecture:
    return _find("architecture", lambda a: a.hf_names, name)


def by_gguf_name(name: str) -> Architecture:
    return _find("GGUF architecture", lambda a: a.gguf_names, name)


def of(cfg: ModelConfig) -> Architecture:
    return by_hf_name(cfg.architecture)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model for cfg's architecture (weights uninitialised where the caller's device is meta)."""
    return of(cfg).model(cfg)


def decoder_layer(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Decoder layer `layer_idx` of cfg's architecture: the target interface drafters build their layers from."""
    return of(cfg).decoder_layer(cfg, layer_idx)


def model_config(raw: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of an HF `config.json`'s dict: the fields all architectures share, then those its
    architecture's `config` adapter sets."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    adapter = by_hf_name(arch)
    text = raw.get("text_config") or {} if adapter.text_config else {}  # a multimodal checkpoint's decoder
    cfg = {**adapter.config_defaults, **raw, **text, "architectures": archs}
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    mtp_layers = int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    layer_types = _layer_types(cfg)
    common = ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0),  # (0: no dense MLP, e.g. Qwen3.5-MoE)
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        hidden_act=cfg.get("hidden_act") or "silu",
        layer_types=layer_types,
        sliding_window=cfg.get("sliding_window") if "sliding_attention" in layer_types else None,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos_ids,
        mtp_num_hidden_layers=mtp_layers,
        raw=cfg,
    )
    return replace(common, **adapter.config(cfg))


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint directory `path` (its config.json)."""
    with open(Path(path) / "config.json") as f:
        return model_config(json.load(f))


def _layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    """HF's `layer_types`, or those of the older `use_sliding_window` / `max_window_layers` keys (Qwen2, Qwen3:
    layers from max_window_layers on slide)."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    n = cfg["num_hidden_layers"]
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first = cfg.get("max_window_layers", n)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    return ()


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """`rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) with `rope_type` set; None = plain RoPE."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return None if rope_type == "default" else {**scaling, "rope_type": rope_type}
