"""GGUF checkpoints (llama.cpp's model files), read with ggml's own `gguf` package.

A GGUF file carries the model's shape, its tokenizer and its tensors under llama.cpp's names. We map the shape to
a ModelConfig and the tensors to Hugging Face names, so the rest of outrider sees an ordinary checkpoint.
Tensors of the quant types outrider serves (outrider.quant.formats.GGUF_FORMATS) stay quantized, their blocks as the
file stores them; other quant types are dequantized at load time to the serving dtype. The Q/K rows that
llama.cpp's converter interleaves for Llama are put back in Hugging Face's order (whole rows of blocks, for a
quantized tensor).
"""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from outrider.config import ModelConfig
from outrider.models import registry

log = logging.getLogger("outrider.models")

QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {  # blk.N.<key>.{weight,bias} -> model.layers.N.<value>.{weight,bias}; architectures add theirs
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")  # (a few, e.g. ssm_a, have no suffix)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE frequency factors, read into the config
CONFIG_TENSORS = "rope_"  # RoPE factors (rope_freqs, Phi-3's rope_factors_long/short): config, not weights
# general.file_type -> the dtype the weights were stored in before quantization, for dtype "auto"
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def split_names(name: str) -> list[str]:
    """All parts of the model file `name` belongs to, in order: `m-00001-of-00003.gguf`, ... or the name alone."""
    m = _SPLIT.match(name)
    if not m:
        return [name]
    count = int(m["count"])
    return [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def split_files(path: Path) -> list[Path]:
    """split_names for a local file; a missing part is an error that names it."""
    parts = [path.with_name(n) for n in split_names(path.name)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"GGUF model {path.name} is split in {len(parts)} files; missing {', '.join(missing)}")
    return parts


def model_files(names: list[str]) -> list[str]:
    """The GGUF models among file names: each split model once (its first part), vision projectors left out."""
    out = []
    for name in sorted(names):
        m = _SPLIT.match(Path(name).name)
        if is_gguf(name) and "mmproj" not in Path(name).name.lower() and (not m or int(m["no"]) == 1):
            out.append(name)
    return out


def find_in_directory(directory: Path) -> Path | None:
    """The GGUF model a directory holds when it is not a Hugging Face checkpoint (no config.json)."""
    if (directory / "config.json").is_file():
        return None
    found = model_files([p.name for p in directory.iterdir() if p.is_file()])
    if len(found) > 1:
        raise ValueError(f"{directory} holds several GGUF models ({', '.join(found)}); pass the file with -m")
    return directory / found[0] if found else None


@dataclass(frozen=True)
class GGUFCheckpoint:
    """An opened GGUF model: the first part's metadata and every part's tensors (memory-mapped, not read)."""

    files: tuple[Path, ...]
    metadata: Mapping[str, Any]  # key -> value as Python (strings, numbers, lists)
    tensors: Mapping[str, Any]  # llama.cpp tensor name -> gguf.ReaderTensor
    tensor_files: Mapping[str, str]  # llama.cpp tensor name -> the name of the part holding it

    @property
    def name(self) -> str:
        return self.files[0].name

    @property
    def arch(self) -> str:
        return self.value("general.architecture", "")

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    files = tuple(split_files(Path(path)))
    return _open(files, tuple(f.stat().st_mtime_ns for f in files))


@functools.lru_cache(maxsize=2)
def _open(files: tuple[Path, ...], stamps: tuple[int, ...]) -> GGUFCheckpoint:
    """Cached (by the files and their modification times): the engine reads the model and then the tokenizer from
    one file, and parsing the metadata (a vocabulary of ~100k strings) takes seconds. The metadata is kept as
    plain values: the reader's own fields hold a numpy view per string, hundreds of MiB for a large vocabulary."""
    from gguf import GGUFReader

    readers = {f.name: GGUFReader(f) for f in files}
    metadata = {key: field.contents() for key, field in readers[files[0].name].fields.items()}
    tensors = {t.name: t for r in readers.values() for t in r.tensors}
    tensor_files = {t.name: name for name, r in readers.items() for t in r.tensors}
    return GGUFCheckpoint(files, metadata, tensors, tensor_files)


def model_config(ck: GGUFCheckpoint) -> ModelConfig:
    """The ModelConfig of a GGUF file whose architecture is registered (others are refused by name)."""
    arch = ck.arch
    try:
        adapter = registry.by_gguf_name(arch)
    except ValueError as e:
        raise ValueError(f"{e} ({ck.name})") from None

    def hparam(key: str, default: Any = None) -> Any:
        value = ck.value(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF {ck.name} lacks {arch}.{key}")
        return value

    n_heads = hparam("attention.head_count")
    hidden = hparam("embedding_length")
    eos = [i for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (i := ck.value(f"tokenizer.ggml.{k}")) is not None]
    config = {
        "architectures": [adapter.hf_names[0]],
        "vocab_size": int(ck.tensors["token_embd.weight"].shape[1]),  # ggml lists dimensions innermost first
        "hidden_size": hidden,
        "intermediate_size": hparam("feed_forward_length"),
        "num_hidden_layers": hparam("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": hparam("attention.head_count_kv", n_heads),
        "head_dim": hparam("attention.key_length", hidden // n_heads),
        "max_position_embeddings": hparam("context_length"),
        "rms_norm_eps": hparam("attention.layer_norm_rms_epsilon"),
        "rope_theta": hparam("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(ck),
        "tie_word_embeddings": "output.weight" not in ck.tensors,
        "attention_bias": "blk.0.attn_q.bias" in ck.tensors,
        **(adapter.gguf_config(hparam, functools.partial(_values, ck)) if adapter.gguf_config else {}),
        "torch_dtype": _FILE_DTYPES.get(ck.value("general.file_type"), "bfloat16"),
        "bos_token_id": ck.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    return registry.model_config(config)


def _values(ck: GGUFCheckpoint, name: str) -> list[float] | None:
    return _dequantize(ck.tensors[name]).reshape(-1).tolist() if name in ck.tensors else None


def _rope_scaling(ck: GGUFCheckpoint) -> dict[str, Any] | None:
    """Llama 3's frequency factors (a tensor in GGUF), or the scaling the metadata names; unknown kinds are left
    for the model to refuse by name."""
    if ROPE_FREQS in ck.tensors:
        return {"rope_type": "freq_factors", "factors": _values(ck, ROPE_FREQS)}
    kind = ck.value(f"{ck.arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": ck.value(f"{ck.arch}.rope.scaling.factor", 1.0)}
    original = ck.value(f"{ck.arch}.rope.scaling.original_context_length")
    return scaling if original is None else {**scaling, "original_max_position_embeddings": original}


@dataclass(frozen=True)
class HFTensor:
    """A GGUF tensor under its Hugging Face name, in Hugging Face's layout; `read` dequantizes it to float32."""

    name: str
    shape: tuple[int, ...]
    source: str  # the GGUF tensor and file, for messages
    ggml: Any  # gguf.ReaderTensor
    unpermute_heads: int = 0  # Llama q/k: the converter interleaved each head's rotary halves (0: as stored)
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None  # the architecture's gguf_tensor, if any
    expert: int | None = None  # a stacked MoE tensor (`stack`): this expert's row of its first axis
    stack: StackedExperts | None = None

    def read(self) -> torch.Tensor:
        if self.stack is not None:
            return self.stack.value[self.expert]
        w = _dequantize(self.ggml).reshape(self.shape)
        w = torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors are views of the read-only map
        w = unpermute_rows(w, self.unpermute_heads) if self.unpermute_heads else w
        return self.convert(w) if self.convert else w

    def read_quantized(self) -> torch.Tensor:
        """The blocks as stored: uint8 [rows, bytes per row], rows in Hugging Face's order."""
        raw = torch.from_numpy(self.ggml.data.copy()).view(torch.uint8).reshape(self.shape[0], -1)
        return unpermute_rows(raw, self.unpermute_heads) if self.unpermute_heads else raw


def hf_tensors(ck: GGUFCheckpoint, cfg: ModelConfig) -> Iterator[HFTensor]:
    """Every weight of the model, Hugging Face named; refuses quant types we cannot dequantize before any is read."""
    unsupported = Counter(t.tensor_type.name for t in ck.tensors.values() if t.tensor_type.name not in QUANT_TYPES)
    if unsupported:
        found = ", ".join(f"{q} ({n} tensors)" for q, n in unsupported.items())
        raise ValueError(f"GGUF {ck.name} has quant types outrider cannot load: {found}; supported: "
                         f"{', '.join(QUANT_TYPES)}")
    arch = registry.of(cfg)
    layer_names = {**_LAYER_NAMES, **arch.gguf_layer_tensors}
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for name, t in ck.tensors.items():
        if name.startswith(CONFIG_TENSORS):
            continue
        layer = _LAYER_TENSOR.match(name)
        suffix = f".{layer[3]}" if layer and layer[3] else ""
        if layer and int(layer[1]) >= cfg.num_hidden_layers:  # the nextn (MTP) blocks llama.cpp appends
            hf_name = f"mtp.<GGUF tensor {name}>"  # (not the target's: the loader skips MTP tensors)
        elif layer and f"{layer[2]}{suffix}" in layer_names:  # a whole parameter name, e.g. ssm_dt.bias
            hf_name = f"model.layers.{layer[1]}.{layer_names[layer[2] + suffix]}"
        elif layer and layer[2] in layer_names:
            hf_name = f"model.layers.{layer[1]}.{layer_names[layer[2]]}{suffix}"
        else:
            hf_name = _GLOBAL_NAMES.get(name, f"<GGUF tensor {name}>")  # the loader refuses names it does not know
        shape = tuple(int(d) for d in reversed(t.shape))
        source = f"{name} in {ck.tensor_files[name]}"
        if "{e}" in hf_name:  # every expert of a layer in one tensor [E, rows, cols]: one HF tensor per expert
            stack = StackedExperts(t, shape)
            for e in range(shape[0]):
                yield HFTensor(hf_name.format(e=e), shape[1:], source, t, expert=e, stack=stack)
            continue
        unpermute = heads.get(layer[2], 0) if arch.gguf_permutes_qk and layer else 0
        convert = functools.partial(arch.gguf_tensor, hf_name, cfg=cfg) if arch.gguf_tensor else None
        yield HFTensor(hf_name, shape, source, t, unpermute, convert)


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Llama q/k permutation: within each head it stores the rotary pairs interleaved
    (x0, x_half, x1, x_half+1, ...); Hugging Face keeps the two halves apart, as our RoPE does."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class StackedExperts:
    """A GGUF tensor holding every expert of a layer, dequantized once on the first expert's read (and freed with
    the last HFTensor that refers to it)."""

    def __init__(self, ggml: Any, shape: tuple[int, ...]) -> None:
        self.ggml, self.shape = ggml, shape

    @functools.cached_property
    def value(self) -> torch.Tensor:
        return torch.from_numpy(_dequantize(self.ggml).reshape(self.shape).copy())


def _dequantize(t: Any) -> Any:
    from gguf import quants

    return quants.dequantize(t.data, t.tensor_type)


def log_weights(ck: GGUFCheckpoint, summary: Any, dequantized: Mapping[str, str]) -> None:
    """Say what the weights are in memory (formats, size) against the file, and which quantized tensors were
    dequantized at load time (types without kernels)."""
    stored = sum(int(t.n_bytes) for t in ck.tensors.values())
    log.info("GGUF %s: weights %s: %.1f MiB in memory (%.1f MiB in the file)", ck.name, summary.describe(),
             summary.nbytes / 2**20, stored / 2**20)
    if dequantized:
        kinds = Counter(dequantized.values())
        log.info("GGUF %s: %d tensors dequantized at load time (%s): %s", ck.name, len(dequantized),
                 ", ".join(f"{q} ({n})" for q, n in kinds.items()), ", ".join(dequantized))
