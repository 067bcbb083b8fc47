"""Load a checkpoint into our model: a Hugging Face directory (config.json + safetensors), a GGUF file (or a
directory holding one), or a hub repo id."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from outrider.config import ModelConfig, RopeOverride
from outrider.layers.linear import MergedLinear
from outrider.models import gguf, registry, torch_weights
from outrider.quant import checkpoint as quant

log = logging.getLogger("outrider.models")

# Tensors that the target model does not own but that may ship in its checkpoint.
MTP_PREFIXES = ("mtp.", "model.mtp_layers.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # stale buffers saved by old transformers versions
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(path_or_repo: str | os.PathLike, offline: bool = False) -> Path:
    """A local checkpoint directory as is, a GGUF file (the first part of a split one) or the GGUF model a directory
    holds; anything else is a hub repo id, `user/repo[:QUANT]` (models/hub.py)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return gguf.find_in_directory(path) or path
    if path.is_file() and gguf.is_gguf(path):
        return gguf.split_files(path)[0]
    if path.is_file():
        raise ValueError(f"{path} is not a model: give a checkpoint directory, a .gguf file or a hub repo id")
    from outrider.models.hub import resolve_hub_model

    return resolve_hub_model(str(path_or_repo), offline=offline)


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
        raise ValueError(f"no .safetensors (or pytorch_model.bin / .pth / .pt) files in {path}")
    return files


@dataclass(frozen=True)
class SafetensorsTensor:
    """A tensor of an open safetensors file, read on demand (the interface of gguf.HFTensor)."""

    name: str
    shape: tuple[int, ...]
    source: str
    file: Any  # the safe_open handle

    def read(self) -> torch.Tensor:
        return self.file.get_tensor(self.name)


def safetensors_tensors(path: Path) -> Iterator[SafetensorsTensor | torch_weights.PickledTensor]:
    """Every tensor of the checkpoint directory, each readable while the iteration is at it (from torch.save files,
    read safely, when the directory has no safetensors: models/torch_weights.py)."""
    from safetensors import safe_open

    if not any(path.glob("*.safetensors")) and torch_weights.weight_files(path):
        yield from torch_weights.pickled_tensors(path)
        return
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield SafetensorsTensor(name, tuple(f.get_slice(name).get_shape()), file.name, f)


def read_tensors(path: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """All CPU tensors of the checkpoint at `path` whose names start with `prefix` (names kept whole)."""
    return {t.name: t.read() for t in safetensors_tensors(resolve_model_path(path)) if t.name.startswith(prefix)}


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


def checkpoint_layout(model: torch.nn.Module, packed: bool = False) -> dict[str, CheckpointSlot]:
    """Hugging Face tensor name -> its slot, for every parameter: a packed MergedLinear tensor (e.g.
    self_attn.qkv_proj.weight) is filled from its parts (self_attn.q_proj.weight, ...) stacked in order, or, where
    the checkpoint stores it `packed` as we do (Phi-3), read whole; a module with `checkpoint_slots` (stacked MoE
    experts, layers/moe.py) names its own parts."""
    layout = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "checkpoint_slots"):
            for part, (param, row, shape) in module.checkpoint_slots().items():
                layout[f"{module_name}.{part}"] = CheckpointSlot(f"{module_name}.{param}", row, torch.Size(shape))
    for name, p in model.named_parameters():  # a tied lm_head is not listed
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, "checkpoint_slots"):
            continue
        if packed or not isinstance(module, MergedLinear):
            layout[name] = CheckpointSlot(name, 0, p.shape)
            continue
        parent, row = module_name.rpartition(".")[0], 0
        for part, rows in module.parts.items():
            layout[f"{parent}.{part}.{kind}"] = CheckpointSlot(name, row, torch.Size((rows, *p.shape[1:])))
            row += rows
    return layout


def assign_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Fill every parameter of `model` (built on "meta") from HF-named `tensors` through checkpoint_layout (packed
    projections, stacked experts), strictly: a missing, unexpected or misshapen tensor is an error naming it."""
    layout = checkpoint_layout(model)
    unexpected = sorted(set(tensors) - set(layout))
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} in {source}")
    missing = sorted(set(layout) - set(tensors))
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in {source}")
    params = {name: torch.empty(p.shape, dtype=tensors[next(iter(tensors))].dtype)
              for name, p in model.named_parameters()}
    for name, slot in layout.items():
        value = tensors[name]
        if _squeezed(value.shape) != _squeezed(slot.shape):
            raise ValueError(f"shape mismatch for {name!r} in {source}: expected {tuple(slot.shape)}, got "
                             f"{tuple(value.shape)}")
        value = value.reshape(-1, *params[slot.param].shape[1:])
        params[slot.param][slot.row:slot.row + value.shape[0]].copy_(value)
    model.load_state_dict(params, strict=True, assign=True)


def quant_plan(model: torch.nn.Module, arch: registry.Architecture, checkpoint: gguf.GGUFCheckpoint | None,
               cfg: ModelConfig, path: Path, quantization: str, device: torch.device) -> quant.QuantPlan:
    """Which weights are read quantized (outrider.quant.checkpoint.QUANTIZATION_CHOICES): the checkpoint's own
    quantization, or FP8 made at load time ("fp8"). A GGUF served dense takes the dequantizing path of
    models/gguf.py (an empty plan); other quantized checkpoints are read quantized and dequantized after."""
    if quantization not in quant.QUANTIZATION_CHOICES:
        raise ValueError(f"unsupported quantization {quantization!r}; use {', '.join(quant.QUANTIZATION_CHOICES)}")
    if checkpoint:
        if quantization == "fp8":
            raise ValueError(f"--quantization fp8 quantizes a dense checkpoint; {checkpoint.name} is a GGUF file")
        if quant.serves_dense(quantization, device):
            return quant.QuantPlan("")
        return quant.gguf_plan(model, gguf.hf_tensors(checkpoint, cfg), arch.packed_projections)
    names = {arch.checkpoint_name(t.name): t.shape for t in safetensors_tensors(path)}
    return quant.hf_plan(model, path, names, quantization, arch.packed_projections)


def _squeezed(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def load_model(path_or_repo: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               rope: RopeOverride | None = None,
               quantization: str = "auto") -> tuple[torch.nn.Module, ModelConfig]:
    """Build the model for the checkpoint's architecture (safetensors or GGUF) and load its weights strictly, in
    eval mode; `rope` overrides the checkpoint's RoPE settings. The config returned announces an MTP head whenever
    the checkpoint ships one. Quantized weights stay quantized where outrider
    serves their format on the device (`quantization`: outrider.quant.checkpoint.QUANTIZATION_CHOICES)."""
    path = resolve_model_path(path_or_repo)
    checkpoint = gguf.open_gguf(path) if gguf.is_gguf(path) else None
    cfg = gguf.model_config(checkpoint) if checkpoint else registry.load_config(path)
    if rope is not None:
        cfg = rope.apply(cfg)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, cfg, device)
    arch = registry.of(cfg)
    with torch.device("meta"):  # no random init: every parameter is assigned from the checkpoint
        model = arch.model(cfg)
    plan = quant_plan(model, arch, checkpoint, cfg, path, quantization, device)
    reader = quant.QuantizedReader(plan, gptq_v2=(quant.quantization_config(path) or {}).get(
        "checkpoint_format") == "gptq_v2")
    layout = {n: slot for n, slot in checkpoint_layout(model, arch.packed_projections).items()
              if n not in plan.formats}
    # Each tensor is copied straight into its rows of the final parameter: packing needs no extra copy.
    params = {name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in model.named_parameters()
              if name.rpartition(".")[0] not in plan.modules or not name.endswith(".weight")}
    loaded = set()
    ships_mtp = False
    for t in gguf.hf_tensors(checkpoint, cfg) if checkpoint else safetensors_tensors(path):
        name = arch.checkpoint_name(t.name)
        if reader.take(t, name):
            continue
        if name not in layout:
            ships_mtp = ships_mtp or name.startswith(MTP_PREFIXES)
            if name.startswith(MTP_PREFIXES + arch.ignored_prefixes) or name.endswith(_IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            raise ValueError(f"unexpected tensor {t.name!r} in {t.source} for {cfg.architecture}")
        slot = layout[name]
        if _squeezed(t.shape) != _squeezed(slot.shape):  # (GGUF drops unit dimensions, e.g. a conv's groups)
            raise ValueError(f"shape mismatch for {t.name!r}: expected {tuple(slot.shape)}, got {t.shape} in "
                             f"{t.source}")
        value = t.read()
        if arch.from_checkpoint and not checkpoint:  # (GGUF tensors are converted by models/gguf.py)
            value = arch.from_checkpoint(name, value)
        param = params[slot.param]
        value = value.reshape(-1, *param.shape[1:])  # (a fused expert tensor [E, rows, cols] fills E * rows rows)
        param[slot.row:slot.row + value.shape[0]].copy_(value)
        loaded.add(name)
    missing = [n for n in layout if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor {missing[0]!r}{more} in checkpoint {path}")
    model.load_state_dict(params, strict=False, assign=True)  # not strict: the state dict lists a tied lm_head
    quant.install(model, plan, reader.finish(), dtype)
    if plan.method != "fp8-at-load" and quant.serves_dense(quantization, device):
        quant.dequantize_modules(model)
    model.tie_weights()
    model = model.to(device).eval().requires_grad_(False)
    if ships_mtp and not cfg.mtp_num_hidden_layers and not checkpoint:
        # Qwen3-Next's release ships mtp.* with no config key announcing it: the tensors are the announcement (the
        # engine drafts with a target's MTP head by default, speculative/mtp.py reads its layer 0).
        cfg = replace(cfg, mtp_num_hidden_layers=1)
    if checkpoint:
        gguf.log_weights(checkpoint, quant.summarize(model), plan.dequantized)
    elif plan.method:
        summary = quant.summarize(model)
        log.info("%s: weights %s (%s): %.1f MiB in memory", path.name, summary.describe(), plan.method,
                 summary.nbytes / 2**20)
    return model, cfg
