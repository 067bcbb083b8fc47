"""Quantized weight formats: what each stores and how much, declared once for the dequantizers, the kernels, the
loaders and the memory accounting.

Every format quantizes a weight [N, K] along K, row by row, so a row of the stored tensor is a row of the weight and
packed projections (qkv_proj, gate_up_proj) can stack parts by rows.

- GGUF block formats (llama.cpp's): each row is a run of blocks of `block` values in `type_size` bytes, stored as the
  file stores them (uint8 [N, K / block * type_size]), except that Q8_0's and Q6_K's blocks (34 and 210 bytes: only
  2-byte aligned) are split once, where the tensor is made (quant/tensor.py), into two planes of the same bytes: the
  blocks without their float16 d (uint8 [N, K / block * (type_size - 2)]: runs of 32 and 208 bytes, 16-byte
  aligned, so the kernels read them in wide loads) and the d's (float16 [N, K / block]).
- FP8: float8_e4m3fn [N, K] and a float32 scale per `block_n` x `block_k` tile ([ceil(N/bn), ceil(K/bk)]); a scale
  per output channel is the tile 1 x K. Hugging Face's fp8 checkpoints (block 128 x 128) and `--quantization fp8`.
- INT4: AWQ's and GPTQ's 4-bit group-wise weights, repacked once at load into one layout: uint8 [N, K / 2] where the
  byte l of group g holds value l of the group (low nibble) and value l + group / 2 (high nibble), a float16 scale
  and a uint8 zero point per group ([N, K / group]): w = (q - zero) * scale.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFFormat:
    name: str  # ggml's type name, e.g. "Q4_K"
    block: int  # values per block
    type_size: int  # bytes per block
    d_at: int | None = None  # the byte of a block its float16 d starts at, where the d's are a plane of their own

    @property
    def stored_block(self) -> int:
        """Bytes a block keeps in the (first) plane."""
        return self.type_size - (2 if self.d_at is not None else 0)

    @property
    def kind(self) -> str:
        return "gguf"

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.type_size

    def nbytes(self, n: int, k: int) -> int:
        return n * self.row_bytes(k)

    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block

    def supports(self, n: int, k: int) -> bool:
        return k % self.block == 0


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


@dataclass(frozen=True)
class FP8Format:
    block_n: int  # rows per scale (1: a scale per output channel)
    block_k: int  # columns per scale (0: the whole row)

    @property
    def kind(self) -> str:
        return "fp8"

    @property
    def name(self) -> str:
        return "FP8" if self.block_k == 0 else f"FP8 ({self.block_n}x{self.block_k} blocks)"

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        bk = self.block_k or k
        return -(-n // self.block_n), -(-k // bk)

    def nbytes(self, n: int, k: int) -> int:
        rows, cols = self.scale_shape(n, k)
        return n * k + 4 * rows * cols

    def bits_per_weight(self) -> float:
        return 8.0

    def supports(self, n: int, k: int) -> bool:
        """The kernels walk K in 128-column tiles, each inside one scale block."""
        return k % 128 == 0 and self.block_k % 128 == 0


@dataclass(frozen=True)
class Int4Format:
    group: int  # values per scale and zero point
    source: str  # "AWQ" or "GPTQ": where the weights came from (the layout is the same)

    @property
    def kind(self) -> str:
        return "int4"

    @property
    def name(self) -> str:
        return f"{self.source} 4-bit (group {self.group})"

    def nbytes(self, n: int, k: int) -> int:
        return n * k // 2 + 3 * n * (k // self.group)

    def bits_per_weight(self) -> float:
        return 4 + 24 / self.group

    def supports(self, n: int, k: int) -> bool:
        return k % self.group == 0 and self.group % 32 == 0


QuantFormat = GGUFFormat | FP8Format | Int4Format

# ggml's type name -> the format; the types served quantized (others are dequantized at load time).
GGUF_FORMATS: dict[str, GGUFFormat] = {f.name: f for f in (
    GGUFFormat("Q8_0", 32, 34, d_at=0), GGUFFormat("Q4_0", 32, 18), GGUFFormat("Q4_1", 32, 20), GGUFFormat("Q5_0", 32, 22),
    GGUFFormat("Q5_1", 32, 24), GGUFFormat("Q4_K", 256, 144), GGUFFormat("Q5_K", 256, 176),
    GGUFFormat("Q6_K", 256, 210, d_at=208))}
