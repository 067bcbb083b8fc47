"""Quantizers and checkpoint writers for tests and benchmarks: every format from dense weights (numpy), random
quantized weights of a model shape, GGUF files in llama.cpp's per-tensor type mixes, and FP8 / AWQ / GPTQ
safetensors checkpoints as their tools write them.

The GGUF legacy types use ggml's own quantizer (`gguf.quants.quantize`); the K-quants, which it lacks, use
llama.cpp's block layouts with a plain min/max fit of each sub-block (llama.cpp searches scales iteratively for a
smaller error; the layout, which is all a reader sees, is the same).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from outrider.quant.checkpoint import AWQ_ORDER, pack_int4
from outrider.quant.formats import GGUF_FORMATS, FP8Format, Int4Format
from outrider.quant.tensor import QuantizedTensor, quantize_fp8



def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float values [B] or [B, 1] -> uint8 [B, 2]."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _fit(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x: (scale, min) with x ~ scale * q - min, q in 0..levels, min >= 0."""
    lo = np.minimum(x.min(axis=-1), 0)
    scale = (x.max(axis=-1) - lo) / levels
    return scale, -lo


def _k_scales_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [B, 8] -> Q4_K/Q5_K's 12 bytes [B, 12]."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    b = np.empty((sc.shape[0], 12), dtype=np.uint8)
    b[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    b[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    b[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return b


def _k_affine(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: blocks [B, 256] -> (d, dmin as stored, 6-bit scales, 6-bit mins [B, 8], q [B, 256])."""
    sub = blocks.reshape(-1, 8, 32)
    scale, mins = _fit(sub, levels)
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.clip(np.round(scale / d[:, None]), 0, 63))
        mn = np.nan_to_num(np.clip(np.round(mins / dmin[:, None]), 0, 63))
        q = np.nan_to_num(np.round((sub + (dmin[:, None] * mn)[..., None]) / (d[:, None] * sc)[..., None]))
    return d, dmin, sc, mn, np.clip(q, 0, levels).astype(np.uint8).reshape(-1, 256)


def _pack_k_nibbles(q: np.ndarray) -> np.ndarray:
    """q [B, 256] -> 128 bytes: byte 32c + j holds value 64c + j (low nibble) and 64c + 32 + j (high)."""
    q = q.reshape(-1, 4, 2, 32) & 15
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(blocks, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales_bytes(sc, mn), _pack_k_nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(blocks, 31)
    high = (q.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]  # bit s of qh[j]
    qh = np.bitwise_or.reduce(high, axis=1).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales_bytes(sc, mn), qh, _pack_k_nibbles(q)],
                          axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    scale = amax / 31
    d = (scale.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.clip(np.round(scale / d[:, None]), -128, 127))
        q = np.nan_to_num(np.round(sub / (d[:, None] * sc)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [half, quarter, j]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=-1)  # per half: bytes 0-31 then 32-63
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=1)


_K_QUANTIZERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_gguf(w: np.ndarray, kind: str) -> np.ndarray:
    """float32 [N, K] -> the blocks of GGUF type `kind`, uint8 [N, K / block * type_size]."""
    import gguf

    if kind not in _K_QUANTIZERS:
        return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])
    fmt = GGUF_FORMATS[kind]
    blocks = w.astype(np.float32).reshape(-1, fmt.block)
    return _K_QUANTIZERS[kind](blocks).reshape(w.shape[0], -1)


def random_gguf_blocks(kind: str, n: int, k: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """Random blocks of GGUF type `kind` for a [n, k] weight of about `std` (quicker than quantizing: benchmark
    weights of a large model): random bytes with each block's float16 scales set to fit."""
    fmt = GGUF_FORMATS[kind]
    blocks = rng.integers(0, 256, (n * k // fmt.block, fmt.type_size), dtype=np.uint8)
    steps = {"Q8_0": 127, "Q4_0": 8, "Q4_1": 8, "Q5_0": 16, "Q5_1": 16, "Q4_K": 8 * 32, "Q5_K": 16 * 32,
             "Q6_K": 32 * 64}  # the quant range times the sub-block scale's range: values of about std
    d = np.full(len(blocks), 2 * std / steps[kind], dtype=np.float32)
    at = 208 if kind == "Q6_K" else 0
    blocks[:, at:at + 2] = _f16_bytes(d)
    # Zero-mean values: the min (Q4_1, Q5_1) or dmin (Q4_K, Q5_K) cancels the mean of the unsigned quants.
    mean_q = {"Q4_1": 7.5, "Q5_1": 15.5, "Q4_K": 7.5, "Q5_K": 15.5}
    if kind in mean_q:
        blocks[:, 2:4] = _f16_bytes(d * (-mean_q[kind] if kind.endswith("_1") else mean_q[kind]))
    return blocks.reshape(n, -1)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of `group` along K: w [N, K] -> (q [N, K] uint8, zero [N, K / group] uint8,
    scale [N, K / group] float16), w ~ (q - zero) * scale."""
    g = w.float().unflatten(1, (-1, group))
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    zero = (-lo / scale.float()).round().clamp(0, 15)
    q = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15)
    return q.flatten(1).to(torch.uint8), zero.to(torch.uint8), scale


def pack_awq(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """(q [N, K], zero, scale [N, K / group]) -> AWQ gemm tensors: qweight [K, N / 8], qzeros [K / group, N / 8]
    int32, scales [K / group, N] float16."""
    return {"qweight": _pack_columns(q.t()), "qzeros": _pack_columns(zero.t()), "scales": scale.t().contiguous()}


def pack_gptq(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """-> GPTQ (v1) tensors: qweight [K / 8, N] packed along K, qzeros [K / group, N / 8] holding zero - 1, scales
    [K / group, N], g_idx [K]."""
    qt = q.t().to(torch.int64).unflatten(0, (-1, 8))  # [K/8, 8, N]
    words = sum(qt[:, j] << (4 * j) for j in range(8))
    zeros = _pack_columns((zero.to(torch.int64) - 1).t() & 15, order=tuple(range(8)))
    k = q.shape[1]
    return {"qweight": _int32(words), "qzeros": zeros, "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def _pack_columns(v: torch.Tensor, order: tuple[int, ...] = AWQ_ORDER) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, C / 8]: nibble i of word c holds column 8c + order[i]."""
    cols = v.to(torch.int64).unflatten(1, (-1, 8))
    return _int32(sum(cols[..., order[i]] << (4 * i) for i in range(8)))


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) -> int32 with the same bits."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def random_quantized(fmt: Any, n: int, k: int, seed: int = 0, std: float = 0.05) -> tuple[QuantizedTensor,
                                                                                          torch.Tensor]:
    """A QuantizedTensor of format `fmt` quantizing a random normal [n, k] weight, and that weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * std
    if isinstance(fmt, FP8Format):
        return quantize_fp8(w, fmt), w
    if isinstance(fmt, Int4Format):
        return pack_int4(fmt, *quantize_int4(w, fmt.group)), w
    data = torch.from_numpy(quantize_gguf(w.numpy(), fmt.name))
    return QuantizedTensor(fmt, (n, k), data), w


# --- checkpoints ---------------------------------------------------------------------------------------------------

BENCH_FORMATS = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "fp8", "awq", "gptq", "bf16")
GGUF_MIXES = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
              "q5_0": "Q5_0", "q5_1": "Q5_1"}  # llama.cpp's file types -> their base tensor type


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_tensor_type(mix: str, hf_name: str, layers: int) -> str:
    """The type llama.cpp's quantizer gives a matrix in file type `mix`: the base type, the LM head in Q6_K (Q8_0
    files keep Q8_0), and in the _M mixes v_proj and down_proj in Q6_K on the layers _more_bits picks."""
    base = GGUF_MIXES[mix]
    if hf_name == "lm_head.weight":
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    if mix.endswith("_m") and hf_name.endswith(("v_proj.weight", "down_proj.weight")):
        layer = int(hf_name.split(".")[2])
        return "Q6_K" if _more_bits(layer, layers) else base
    return base


def checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for the model a config.json describes (built on the meta device)."""
    from outrider.models import registry
    from outrider.models.loader import checkpoint_layout

    cfg = registry.model_config(config)
    arch = registry.of(cfg)
    with torch.device("meta"):
        model = arch.model(cfg)
    return {name: tuple(slot.shape) for name, slot in checkpoint_layout(model, arch.packed_projections).items()}


def write_random_gguf(path: str | Path, config: dict[str, Any], mix: str, seed: int = 0) -> Path:
    """A GGUF file of the model `config` describes (a Hugging Face config.json's fields), random weights in the
    file type `mix` (GGUF_MIXES; norms in F32), no tokenizer."""
    import gguf
    from outrider.models import registry
    from outrider.testing.gguf import add_hparams

    cfg = registry.model_config(config)
    adapter = registry.of(cfg)
    writer = gguf.GGUFWriter(path, adapter.gguf_writes)
    add_hparams(writer, cfg)
    if adapter.gguf_write:  # its metadata (its value conversions are moot for random blocks)
        adapter.gguf_write(writer, cfg, {})
    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[adapter.gguf_writes]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    for hf_name, shape in checkpoint_shapes(config).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            continue
        kind = gguf_tensor_type(mix, hf_name, cfg.num_hidden_layers)
        writer.add_tensor(name, random_gguf_blocks(kind, *shape, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _projection(name: str) -> bool:
    """A decoder layer's projection: what FP8, AWQ and GPTQ checkpoints quantize."""
    return ".layers." in name and name.endswith("_proj.weight")


def quantized_tensors(name: str, w: torch.Tensor, method: str, group: int = 128,
                      block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """One projection's tensors as a `method` checkpoint stores them ("fp8": block-wise scales, "awq", "gptq")."""
    module = name.removesuffix(".weight")
    if method == "fp8":
        part = quantize_fp8(w, FP8Format(*block))
        return {f"{module}.weight": part.data, f"{module}.weight_scale_inv": part.scale}
    q, zero, scale = quantize_int4(w, group)
    packed = pack_awq(q, zero, scale) if method == "awq" else pack_gptq(q, zero, scale, group)
    return {f"{module}.{kind}": t for kind, t in packed.items()}


def quantization_config(method: str, group: int = 128, block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """The quantization_config a `method` checkpoint's config.json carries."""
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    config = {"quant_method": method, "bits": 4, "group_size": group}
    return {**config, "version": "gemm", "zero_point": True} if method == "awq" else {**config, "desc_act": False,
                                                                                    "sym": False}


def write_quantized_checkpoint(config: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]], out: Path,
                               method: str, group: int = 128) -> Path:
    """A Hugging Face checkpoint of `method` ("fp8", "awq", "gptq") in `out`: config.json with its
    quantization_config, the projections quantized and the other tensors as given."""
    stored = {}
    for name, w in tensors:
        stored.update(quantized_tensors(name, w, method, group) if _projection(name) else {name: w})
    return _write(config, stored, out, quantization_config(method, group))


def _write(config: dict[str, Any], tensors: dict[str, torch.Tensor], out: Path,
           qconfig: dict[str, Any] | None) -> Path:
    """config.json (with `qconfig` as its quantization_config) and model.safetensors in `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    extra = {"quantization_config": qconfig} if qconfig else {}
    (out / "config.json").write_text(json.dumps({**config, **extra}))
    return out


def random_checkpoint_tensors(config: dict[str, Any], method: str, seed: int = 0,
                              std: float = 0.02) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors of a `method` ("fp8", "awq", "gptq", "bf16") checkpoint of the model `config` describes, random
    and drawn directly in the stored form (quicker than quantizing a large model): projections quantized, the rest
    bfloat16 (norms one)."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in checkpoint_shapes(config).items():
        if len(shape) == 1:
            yield name, torch.ones(shape, dtype=torch.bfloat16)
        elif not _projection(name) or method == "bf16":
            yield name, (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
        else:
            yield from _random_quantized(name.removesuffix(".weight"), shape, method, gen, std).items()


def _random_quantized(module: str, shape: tuple[int, ...], method: str, gen: torch.Generator,
                      std: float) -> dict[str, torch.Tensor]:
    n, k = shape
    bits = lambda *s: torch.randint(-2**31, 2**31, s, generator=gen, dtype=torch.int64).to(torch.int32)  # noqa: E731
    if method == "fp8":  # sign, exponent <= 7 (|v| < 2), any mantissa: no NaN; the block scale brings it to std
        raw = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8) & 0xBF
        scale = torch.full((-(-n // 128), -(-k // 128)), std, dtype=torch.float32)
        return {f"{module}.weight": raw.view(torch.float8_e4m3fn), f"{module}.weight_scale_inv": scale}
    scales = torch.full((k // 128, n), std / 4, dtype=torch.float16)
    if method == "awq":
        return {f"{module}.qweight": bits(k, n // 8), f"{module}.qzeros": bits(k // 128, n // 8),
                f"{module}.scales": scales}
    return {f"{module}.qweight": bits(k // 8, n), f"{module}.qzeros": bits(k // 128, n // 8),
            f"{module}.scales": scales,
            f"{module}.g_idx": (torch.arange(k) // 128).to(torch.int32)}


def write_random_checkpoint(config: dict[str, Any], out: Path, method: str, seed: int = 0) -> Path:
    """A random `method` checkpoint (random_checkpoint_tensors) in `out`: config.json (with the quantization_config)
    and one safetensors file."""
    return _write(config, dict(random_checkpoint_tensors(config, method, seed)), out,
                  None if method == "bf16" else quantization_config(method))


def quantize_projections_randomly(model: torch.nn.Module, config: dict[str, Any], fmt: str, seed: int = 0,
                                  std: float = 0.02) -> None:
    """Swap a random-weights model's decoder projections, in place, for random quantized ones in `fmt` (a
    GGUF_MIXES file type, "fp8" or "awq"), on the model's device; the embedding and LM head stay as they are (a
    benchmark may have fixed their values: bench.shapes.fix_successors)."""
    from outrider.quant.checkpoint import install, make_plan

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    layers = config["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (n, k) in ((n, s) for n, s in checkpoint_shapes(config).items() if _projection(n)):
        if fmt in GGUF_MIXES:
            kind = gguf_tensor_type(fmt, name, layers)
            part = QuantizedTensor(GGUF_FORMATS[kind], (n, k), torch.from_numpy(random_gguf_blocks(kind, n, k, rng)))
        elif fmt == "fp8":
            raw = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8) & 0xBF
            scale = torch.full((-(-n // 128), -(-k // 128)), std, dtype=torch.float32)
            part = QuantizedTensor(FP8Format(128, 128), (n, k), raw.view(torch.float8_e4m3fn), scale)
        else:
            groups = k // 128
            data = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
            zero = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
            part = QuantizedTensor(Int4Format(128, fmt.upper()), (n, k), data,
                                   torch.full((n, groups), std / 4, dtype=torch.float16), zero)
        tensors[name] = part.to(device)
    plan = make_plan(model, fmt, {name: t.format for name, t in tensors.items()})
    install(model, plan, tensors, dtype)
