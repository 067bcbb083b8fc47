"""Which checkpoint weights stay quantized, reading them, and the modules that hold them.

A weight stays quantized when the checkpoint stores it in a format we serve (formats.py) and it belongs to a whole
module we can swap: a projection, a packed projection all of whose parts are quantized, or the embedding table
(GGUF formats). Everything else goes through the loader's dense path, dequantized at load time.

Sources: GGUF files (the tensor types of formats.GGUF_FORMATS), Hugging Face checkpoints whose config has a
`quantization_config` (quant_method "fp8": float8_e4m3fn weights with `weight_scale_inv` per 128 x 128 block or
`weight_scale` per channel or tensor; "awq" (version gemm) and "gptq" 4-bit, repacked to the INT4 layout), and
dense checkpoints quantized at load time to FP8 with a scale per output channel (`--quantization fp8`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from outrider.layers.linear import MergedLinear
from outrider.quant.formats import GGUF_FORMATS, FP8Format, Int4Format, QuantFormat
from outrider.quant.layers import QuantizedEmbedding, QuantizedLinear
from outrider.quant.tensor import QuantizedTensor, quantize_fp8
from outrider.quant.weight import QuantizedWeight

log = logging.getLogger("outrider.models")

# --quantization: "auto" (quantized weights stay quantized on CUDA; on the CPU, which has no quantized kernels, they
# are dequantized at load time), "keep" (quantized on every device; the CPU dequantizes a layer per product),
# "none" (dequantized at load time) and "fp8" (a dense checkpoint's projections quantized at load time).
QUANTIZATION_CHOICES = ("auto", "keep", "none", "fp8")


def serves_dense(quantization: str, device: torch.device) -> bool:
    """Whether quantized checkpoint weights are dequantized at load time."""
    return quantization == "none" or (quantization == "auto" and device.type != "cuda")


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's gemm packing: nibble i of a word holds column 8c + AWQ_ORDER[i]
_DENSE_GGUF = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class QuantPlan:
    """What stays quantized: checkpoint weight name -> its format, and the modules (by name) that hold them."""

    method: str  # "gguf", "fp8", "awq", "gptq", "fp8-at-load", or "" (nothing quantized)
    formats: dict[str, QuantFormat] = field(default_factory=dict)
    modules: dict[str, list[str]] = field(default_factory=dict)  # module name -> its checkpoint weight names
    dequantized: dict[str, str] = field(default_factory=dict)  # quantized weight left dense -> its format's name


def _targets(model: nn.Module, packed: bool) -> dict[str, tuple[list[str], list[int], int]]:
    """Swappable modules: name -> (checkpoint weight names, their rows, K). `packed`: the checkpoint stores packed
    projections whole (registry.Architecture.packed_projections)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MergedLinear) and not packed:
            parent = name.rpartition(".")[0]
            prefix = f"{parent}." if parent else ""
            out[name] = ([f"{prefix}{p}.weight" for p in m.parts], list(m.parts.values()), m.in_features)
        elif isinstance(m, nn.Linear):
            out[name] = ([f"{name}.weight"], [m.out_features], m.in_features)
        elif isinstance(m, nn.Embedding):
            out[name] = ([f"{name}.weight"], [m.num_embeddings], m.embedding_dim)
    return out


def make_plan(model: nn.Module, method: str, offered: dict[str, QuantFormat],
              dequantized: dict[str, str] | None = None, packed: bool = False) -> QuantPlan:
    """The modules whose weights are all `offered` (and storable in their format) stay quantized; offered weights
    of other modules join `dequantized`."""
    formats, modules, left = {}, {}, dict(dequantized or {})
    for name, (weights, rows, k) in _targets(model, packed).items():
        if weights and all(w in offered and offered[w].supports(r, k) for w, r in zip(weights, rows)):
            if isinstance(model.get_submodule(name), nn.Embedding) and offered[weights[0]].kind != "gguf":
                continue
            modules[name] = weights
            formats.update({w: offered[w] for w in weights})
    left.update({w: f.name for w, f in offered.items() if w not in formats})
    return QuantPlan(method if formats else "", formats, modules, left)


def gguf_plan(model: nn.Module, tensors: Iterable[Any], packed: bool = False) -> QuantPlan:
    """GGUF: the tensors (gguf.HFTensor) of the served types stay quantized, unless the architecture converts
    their values on load (registry.Architecture.gguf_tensor); other quantized ones are dequantized."""
    offered, other = {}, {}
    for t in tensors:
        kind = t.ggml.tensor_type.name
        if len(t.shape) == 2 and kind in GGUF_FORMATS and t.convert is None:
            offered[t.name] = GGUF_FORMATS[kind]
        elif kind not in _DENSE_GGUF:
            other[t.name] = kind
    return make_plan(model, "gguf", offered, other, packed)


def quantization_config(path: Path) -> dict[str, Any] | None:
    config = path / "config.json"
    return json.loads(config.read_text()).get("quantization_config") if config.is_file() else None


def hf_plan(model: nn.Module, path: Path, names: dict[str, tuple[int, ...]], quantization: str,
            packed: bool = False) -> QuantPlan:
    """A Hugging Face checkpoint (its tensor names, as our model names them -> shapes): per its
    quantization_config, or quantized at load. Quantized weights skip the architecture's from_checkpoint (which
    converts norms and other dense tensors)."""
    qc = quantization_config(path)
    if qc is None:
        if quantization != "fp8":
            return QuantPlan("")
        offered = {n: FP8Format(1, 0) for n, shape in names.items() if n.endswith(".weight") and len(shape) == 2}
        plan = make_plan(model, "fp8-at-load", offered, packed=packed)
        # Only projections: the embedding and LM head stay as they are, as vLLM's fp8 does.
        modules = {m: w for m, w in plan.modules.items() if m != "lm_head" and not m.endswith("embed_tokens")}
        return QuantPlan(plan.method, {w: plan.formats[w] for ws in modules.values() for w in ws}, modules)
    method = qc.get("quant_method")
    if quantization == "fp8":
        raise ValueError(f"--quantization fp8 quantizes a dense checkpoint; {path} is already quantized ({method})")
    if method == "fp8":
        block = qc.get("weight_block_size")
        offered = {}
        for n in names:
            if n.endswith(".weight_scale_inv") or n.endswith(".weight_scale"):
                weight = n.rsplit(".", 1)[0] + ".weight"
                offered[weight] = FP8Format(*block) if block and n.endswith("_inv") else FP8Format(1, 0)
        return _all_served(make_plan(model, "fp8", offered, packed=packed), path)
    if method in ("awq", "gptq"):
        if qc.get("bits", 4) != 4:
            raise ValueError(f"{path}: {method} with {qc.get('bits')} bits; outrider serves 4-bit {method}")
        if method == "awq" and qc.get("version", "gemm").lower() != "gemm":
            raise ValueError(f"{path}: AWQ version {qc.get('version')!r}; outrider reads AWQ's gemm packing")
        fmt = Int4Format(int(qc.get("group_size", 128)), method.upper())
        offered = {n.removesuffix(".qweight") + ".weight": fmt for n in names if n.endswith(".qweight")}
        return _all_served(make_plan(model, method, offered, packed=packed), path)
    raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not supported; outrider serves fp8, "
                     "awq and gptq checkpoints")


def _all_served(plan: QuantPlan, path: Path) -> QuantPlan:
    """A safetensors checkpoint's quantized weights have no dense form to fall back to: each must be served."""
    if plan.dequantized:
        name, fmt = next(iter(plan.dequantized.items()))
        raise ValueError(f"{path}: {name} is stored in {fmt} but cannot be served so (the shape does not fit the "
                         "format, or its packed projection has parts that are not quantized)")
    return plan


class QuantizedReader:
    """Takes the checkpoint tensors that make up planned weights, while the loader iterates the checkpoint, and
    assembles each weight's QuantizedTensor."""

    def __init__(self, plan: QuantPlan, gptq_v2: bool = False) -> None:
        self.plan = plan
        self.gptq_v2 = gptq_v2
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.done: dict[str, QuantizedTensor] = {}

    def take(self, t: Any, name: str) -> bool:
        """Whether tensor `t` (gguf.HFTensor or loader.SafetensorsTensor; `name` in our model) belongs to a planned
        weight (now read)."""
        if not self.plan.formats:
            return False
        module, _, kind = name.rpartition(".")
        weight = f"{module}.weight"
        fmt = self.plan.formats.get(weight)
        if fmt is None or kind == "bias":
            return False
        if self.plan.method == "gguf":
            self.done[weight] = QuantizedTensor(fmt, t.shape, t.read_quantized())
        elif self.plan.method == "fp8-at-load":
            self.done[weight] = quantize_fp8(t.read())
        else:
            parts = self.pending.setdefault(weight, {})
            parts[kind] = t.read()
            if self._complete(parts):
                self.done[weight] = self._assemble(fmt, self.pending.pop(weight))
        return True

    def _complete(self, parts: dict[str, torch.Tensor]) -> bool:
        if self.plan.method == "fp8":
            return "weight" in parts and ("weight_scale_inv" in parts or "weight_scale" in parts)
        return {"qweight", "qzeros", "scales"} <= parts.keys() and ("g_idx" in parts or self.plan.method == "awq")

    def _assemble(self, fmt: QuantFormat, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
        if self.plan.method == "fp8":
            w = parts["weight"]
            scale = parts.get("weight_scale_inv", parts.get("weight_scale")).float()
            if fmt.block_k == 0:  # per channel [N, 1], or per tensor: one scale for every row
                scale = scale.reshape(-1, 1).expand(w.shape[0], 1).contiguous()
            return QuantizedTensor(fmt, tuple(w.shape), w.view(torch.float8_e4m3fn), scale)
        if self.plan.method == "awq":
            q = _unpack_columns(parts["qweight"], AWQ_ORDER).t()  # [K, N] -> [N, K]
            zero = _unpack_columns(parts["qzeros"], AWQ_ORDER).t()
        else:
            q = _unpack_rows(parts["qweight"]).t()
            zero = _unpack_columns(parts["qzeros"], tuple(range(8))).t() + (0 if self.gptq_v2 else 1)
            groups = torch.arange(q.shape[1]) // fmt.group
            if not torch.equal(parts["g_idx"].long(), groups):
                raise ValueError("GPTQ with act-order (desc_act, a permuted g_idx) is not supported")
        return pack_int4(fmt, q, zero.to(torch.uint8), parts["scales"].t().to(torch.float16))

    def finish(self) -> dict[str, QuantizedTensor]:
        missing = [w for w in self.plan.formats if w not in self.done]
        if missing:
            raise ValueError(f"quantized weight {missing[0]!r} is incomplete or missing in the checkpoint")
        return self.done


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C / 8] with nibble i of word c holding column 8c + order[i] -> uint8 [R, C]."""
    words = packed.to(torch.int64)
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [R, C/8, 8] by nibble
    cols = torch.empty_like(nibbles)
    cols[..., list(order)] = nibbles
    return cols.flatten(-2).to(torch.uint8)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ's int32 [K / 8, N], nibble j of row i holding row 8i + j -> uint8 [K, N]."""
    words = packed.to(torch.int64)
    return torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=1).flatten(0, 1).to(torch.uint8)


def pack_int4(fmt: Int4Format, q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> QuantizedTensor:
    """Values q [N, K] (0-15), zero points [N, K / group] and scales -> the INT4 layout (formats.py)."""
    n, k = q.shape
    halves = q.to(torch.uint8).view(n, k // fmt.group, 2, fmt.group // 2)
    data = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
    return QuantizedTensor(fmt, (n, k), data.contiguous(), scale.contiguous(), zero.contiguous())


def dequantize_modules(model: nn.Module) -> None:
    """Every quantized module back to its dense twin (Linear, MergedLinear, nn.Embedding) with the dequantized
    weight; call model.tie_weights() after."""
    from outrider.layers.linear import Linear

    for name, m in list(model.named_modules()):
        if isinstance(m, QuantizedLinear):
            n, k = m.weight.shape
            with torch.device("meta"):  # parameters assigned below
                dense = MergedLinear(k, m.parts, m.bias is not None) if m.parts else Linear(k, n, m.bias is not None)
            dense.weight = nn.Parameter(m.weight.dequantize(), requires_grad=False)
            if m.bias is not None:
                dense.bias = m.bias
        elif isinstance(m, QuantizedEmbedding):
            dense = nn.Embedding(*m.weight.shape, _weight=m.weight.dequantize(), _freeze=True)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, dense)


def install(model: nn.Module, plan: QuantPlan, tensors: dict[str, QuantizedTensor], dtype: torch.dtype) -> None:
    """Swap every planned module for its quantized twin (a packed one keeps its parts' rows), keeping biases; a
    tied LM head shares a quantized embedding."""
    for name, weights in plan.modules.items():
        old = model.get_submodule(name)
        weight = QuantizedWeight([tensors[w] for w in weights], dtype)
        if isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(weight)
        else:
            new = QuantizedLinear(weight, old.bias, old.parts if isinstance(old, MergedLinear) else None)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    embed = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    if getattr(model.config, "tie_word_embeddings", False) and isinstance(embed, QuantizedEmbedding):
        model.lm_head = QuantizedLinear(embed.weight)


@dataclass(frozen=True)
class WeightsSummary:
    """The weights' formats and size, for the log and /props."""

    formats: dict[str, int]  # format name -> number of weights (whole tensors) in it
    nbytes: int  # bytes of all parameters and quantized weights (a shared tensor once)
    quantized: bool  # some weights stay quantized (QuantizedWeight)

    def describe(self) -> str:
        return ", ".join(f"{f} ({n})" for f, n in self.formats.items())


def summarize(model: nn.Module) -> WeightsSummary:
    kinds: Counter[str] = Counter()
    quantized = [m for m in model.modules() if isinstance(m, QuantizedWeight)]  # a shared one (a tied head) once
    for m in quantized:
        kinds.update(m.format_names())
    kinds.update(str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.dim() == 2)
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return WeightsSummary(dict(kinds), nbytes, bool(quantized))
