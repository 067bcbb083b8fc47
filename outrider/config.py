"""Frozen configuration: the model's shape (from config.json) and the engine's limits."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """The subset of an HF `config.json` that our decoder-only models need: the fields all architectures share, then
    those an architecture's config adapter sets. Parsed by the architecture registry (`registry.model_config`,
    `registry.load_config`): this module knows no architecture."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections
    o_proj_bias: bool = False  # bias on the output projection
    qk_norm: bool = False  # RMSNorm on q and k per head
    hidden_act: str = "silu"  # the gated MLP's activation (layers/mlp.py)
    # Per-layer kind, HF's `layer_types` ("full_attention", "sliding_attention", ...); () = all full attention.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a "sliding_attention" layer's query sees (its own included)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # MTP layers shipped in the checkpoint (0 = none); their layout name, if any.
    mtp_num_hidden_layers: int = 0
    mtp_layout: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers; the model has {self.num_hidden_layers}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding_attention layers need sliding_window > 0")

    def layer_type(self, layer_idx: int) -> str:
        return self.layer_types[layer_idx] if self.layer_types else "full_attention"


@dataclass(frozen=True)
class RopeOverride:
    """llama-server's --rope-* flags over the checkpoint's RoPE: scaling "none" (plain RoPE) or "linear" (None:
    the checkpoint's), the linear factor, and the base frequency (None: the checkpoint's)."""

    scaling: str | None = None
    factor: float | None = None
    freq_base: float | None = None

    def __post_init__(self) -> None:
        if self.scaling not in (None, "none", "linear"):
            raise ValueError(f"RoPE scaling {self.scaling!r}: supported are none and linear")
        if self.scaling == "linear" and not (self.factor and self.factor > 0):
            raise ValueError("linear RoPE scaling needs a factor > 0 (--rope-scale N or --rope-freq-scale 1/N)")

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        changes: dict[str, Any] = {}
        if self.freq_base is not None:
            changes["rope_theta"] = self.freq_base
        if self.scaling == "none":
            changes["rope_scaling"] = None
        elif self.scaling == "linear":
            changes["rope_scaling"] = {"rope_type": "linear", "factor": self.factor}
        return replace(cfg, **changes)


@dataclass(frozen=True)
class NgramConfig:
    """N-gram (prompt lookup) drafting, llama-server's ngram-simple: look up the last `size_n` tokens, draft up to
    `size_m` tokens that followed their newest earlier occurrence, once the n-gram occurred `min_hits` times."""

    size_n: int = 12  # --spec-ngram-simple-size-n
    size_m: int = 48  # --spec-ngram-simple-size-m (drafts are also capped by --spec-draft-n-max)
    min_hits: int = 1  # --spec-ngram-simple-min-hits

    def __post_init__(self) -> None:
        if not 1 <= self.size_n <= 1024 or self.size_m < 1 or self.min_hits < 1:
            raise ValueError("need 1 <= ngram size n <= 1024, ngram size m >= 1 and ngram min hits >= 1")


# EngineConfig.prefill_graph_tokens by default. Past a few hundred tokens a 16-bit model's eager prefill is
# GPU-bound and a graph gains little against its padding; a quantized model's stays host-bound (each projection
# launches a dequantization and a GEMM, or an FP8 quantization and a scaled GEMM) to 1,024 tokens and beyond
# (docs/benchmarks.md, "Quantized weights").
PREFILL_GRAPH_TOKENS = 256
QUANTIZED_PREFILL_GRAPH_TOKENS = 1024


# The flags' words for that default (the server's and the benchmarks' --prefill-graph-tokens)
PREFILL_GRAPH_TOKENS_DEFAULT = f"{PREFILL_GRAPH_TOKENS}, {QUANTIZED_PREFILL_GRAPH_TOKENS} where weights stay quantized"


def default_prefill_graph_tokens(quantized: bool) -> int:
    """EngineConfig.prefill_graph_tokens where it is None: for a model whose weights are (partly) quantized, or not."""
    return QUANTIZED_PREFILL_GRAPH_TOKENS if quantized else PREFILL_GRAPH_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    """Limits and knobs of one engine instance. Built from the CLI in one place (cli.py)."""

    model: str
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    # auto | keep | none | fp8: whether quantized weights stay quantized (outrider/quant/checkpoint.py)
    quantization: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_num_seqs: int = 16  # concurrent sequences (llama-server: --parallel)
    max_num_batched_tokens: int = 2048  # token budget of one step (llama-server: --batch-size)
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = size from memory (kv_cache_memory_gib, else gpu_memory_utilization on CUDA)
    kv_cache_memory_gib: float = 0.0  # memory for the KV pools when num_kv_blocks == 0 (0 = CPU: 1 GiB; CUDA: below)
    gpu_memory_utilization: float = 0.90  # CUDA without kv_cache_memory_gib: this share of free memory, less a step
    enable_prefix_caching: bool = True
    seed: int = -1  # default seed for requests that give none (-1 = random per request)
    enforce_eager: bool = False  # GPU: disable CUDA graphs
    cpu_threads: int = 0  # CPU device: torch's compute threads (process-wide; 0 = leave torch's setting)
    # Launch step n+1 before step n's tokens reach the host, so host work hides behind GPU work (None: on for
    # CUDA; on the CPU the forward is synchronous and overlap would only delay each token by a step).
    overlap_schedule: bool | None = None
    # GPU: a prefill chunk that runs alone (no other sequence in its step) and has at most this many tokens
    # replays a CUDA graph captured for the next power of two, padded, instead of an eager forward: a short
    # prompt's eager forward is launch-bound (several times the graph's time to first token). 0: eager. None:
    # default_prefill_graph_tokens.
    prefill_graph_tokens: int | None = None
    # Speculative decoding
    draft_model: str | None = None
    spec_type: str | None = None  # None = detect: draft | mtp | dflash | eagle3; comma-separated kinds combine
    spec_ngram: NgramConfig = field(default_factory=NgramConfig)  # the ngram kind's settings
    spec_draft_n_max: int | None = None  # None: the drafter's natural length (DFlash: block - 1; n-gram: 16; else 4)
    spec_draft_n_min: int = 0
    draft_p_min: float = 0.0
    # A file of the token ids that drafters sharing the target's LM head (MTP, DFlash) may propose; their logits
    # cover those rows only (speculative/token_map.py). None: the whole vocabulary.
    spec_token_map: str | None = None
    # Choose draft lengths from measured step costs (None: on for CUDA; on the CPU, where costs vary with the
    # machine's load, the drafter's fixed cost estimate keeps tests deterministic).
    spec_measured_costs: bool | None = None
    # A request that decodes alone, greedy, runs whole rounds on the device (speculative/device_round.py: on CUDA
    # each draft length's round is one captured graph), the host replaying a round and reading its verdict: what a
    # launch-bound target needs (docs/speculative.md, "Device rounds"). Drafters with weights (DFlash, MTP, EAGLE-3,
    # draft model). None: on where CUDA graphs are captured (eager, a round saves nothing).
    spec_device_round: bool | None = None
    # The user asked for speculation (-md / --spec-type): a drafter that fails to load or is refused stops the
    # start. Otherwise (detected, e.g. an MTP head) the engine serves without it and says why.
    spec_required: bool = False
    tokenizer: str | None = None  # defaults to the model directory
    chat_template: str | None = None  # overrides the checkpoint's template (jinja source)
    rope: RopeOverride | None = None  # overrides the checkpoint's RoPE

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise ValueError("prefill_graph_tokens must be >= 0")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.kv_cache_memory_gib < 0 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("need kv_cache_memory_gib >= 0 and 0 < gpu_memory_utilization <= 1")
        if not 0 <= self.spec_draft_n_min <= (self.spec_draft_n_max if self.spec_draft_n_max is not None else 1 << 30):
            raise ValueError("need 0 <= spec_draft_n_min <= spec_draft_n_max")
