"""The command line in llama-server's spellings: one table of options with their LLAMA_ARG_* variables,
GGML-only flags (accepted with a warning), and flags llama-server itself removed (an error).

A flag on the command line wins over its environment variable, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from outrider.config import PREFILL_GRAPH_TOKENS_DEFAULT
from outrider.request_fields import CHAIN, SUPPORTED, Field
from outrider.sampler_chain import LETTERS
from outrider.speculative.kinds import KINDS as DRAFTER_KINDS


@dataclass(frozen=True)
class Opt:
    flags: tuple[str, ...]
    dest: str
    env: str | None = None
    type: Callable[[str], Any] | None = str  # None: a switch (True when given)
    default: Any = None
    help: str = ""
    negative: tuple[str, ...] = ()  # spellings that set a switch to False
    repeated: bool = False  # each use adds a value (a list)


def _env_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "on", "enabled"):
        return True
    if v in ("false", "0", "off", "disabled"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


MODEL = [
    Opt(("-m", "--model"), "model", "LLAMA_ARG_MODEL",
        help="checkpoint directory (HF safetensors), .gguf file (or a directory holding one) or hub repo id"),
    Opt(("-hf", "-hfr", "--hf-repo"), "hf_repo", "LLAMA_ARG_HF_REPO",
        help="Hugging Face repo, user/repo[:QUANT]: that quant's GGUF (default Q4_K_M), else the safetensors"),
    Opt(("-hff", "--hf-file"), "hf_file", "LLAMA_ARG_HF_FILE", help="the GGUF file of the -hf repo to load"),
    Opt(("-hft", "--hf-token"), "hf_token", "HF_TOKEN", help="Hugging Face access token for every hub download"),
    Opt(("--offline",), "offline", "LLAMA_OFFLINE", None, False, "use the local hub cache only"),
    Opt(("-c", "--ctx-size"), "ctx_size", "LLAMA_ARG_CTX_SIZE", int, 0,
        "context length of each sequence (0 = the model's)"),
    Opt(("-np", "--parallel"), "parallel", "LLAMA_ARG_N_PARALLEL", int, -1,
        "slots: sequences decoded together (-1 = auto: 4, with a unified KV cache)"),
    Opt(("-kvu", "--kv-unified"), "kv_unified", "LLAMA_ARG_KV_UNIFIED", None, None,
        "every slot may use the whole -c (default: on when -np is auto; off: -c is split across the slots)",
        negative=("-no-kvu", "--no-kv-unified")),
    Opt(("-t", "--threads"), "threads", "LLAMA_ARG_THREADS", int, -1,
        "CPU device: compute threads (-1 = all cores but one, which the HTTP side keeps)"),
    Opt(("-b", "--batch-size"), "batch_size", "LLAMA_ARG_BATCH", int, None, "token budget of one step"),
    Opt(("-s", "--seed"), "seed", None, int, -1, "default seed (-1 = random per request)"),
    Opt(("--cache-prompt",), "cache_prompt", "LLAMA_ARG_CACHE_PROMPT", None, True, "reuse cached prompt prefixes",
        negative=("--no-cache-prompt",)),
    Opt(("--demo-draft",), "demo_draft", None, str, "mtp",
        f"without -m/-hf: the bundled demo model's drafter: {' | '.join(k.name for k in DRAFTER_KINDS if k.weights)}"
        " | none"),
    Opt(("-md", "--model-draft", "--spec-draft-model"), "model_draft", "LLAMA_ARG_SPEC_DRAFT_MODEL",
        help="draft model for speculative decoding"),
    Opt(("--spec-type",), "spec_type", "LLAMA_ARG_SPEC_TYPE",
        help=f"none | {' | '.join(k.llama_name for k in DRAFTER_KINDS)}, or n-gram lookup and one drafter with "
             "weights comma-separated, e.g. ngram-simple,draft-simple (default: detect)"),
    Opt(("--spec-ngram-simple-size-n",), "spec_ngram_size_n", None, int, 12,
        "ngram-simple: length of the n-gram looked up"),
    Opt(("--spec-ngram-simple-size-m",), "spec_ngram_size_m", None, int, 48,
        "ngram-simple: most tokens drafted from a match (--spec-draft-n-max caps them too)"),
    Opt(("--spec-ngram-simple-min-hits",), "spec_ngram_min_hits", None, int, 1,
        "ngram-simple: earlier occurrences an n-gram needs before it drafts"),
    Opt(("--spec-draft-n-max",), "spec_draft_n_max", "LLAMA_ARG_SPEC_DRAFT_N_MAX", int, None,
        "max drafted tokens (default: the drafter's own: DFlash its block - 1, n-gram lookup 16, others 4)"),
    Opt(("--spec-draft-n-min",), "spec_draft_n_min", "LLAMA_ARG_SPEC_DRAFT_N_MIN", int, None, "min drafted tokens"),
    Opt(("--spec-draft-p-min", "--draft-p-min"), "draft_p_min", "LLAMA_ARG_SPEC_DRAFT_P_MIN", float, None,
        "min draft probability to keep drafting"),
    Opt(("--spec-token-map", "--speculative-token-map"), "spec_token_map", None,
        help="JSON list (or torch-saved tensor) of the token ids MTP and DFlash drafts may propose: their LM head "
             "reads those rows only (a frequency-ranked 32k of a 150-250k vocabulary cuts most of a draft's cost)"),
    Opt(("--no-spec-measured-costs",), "no_spec_measured_costs", None, None, False,
        "choose draft lengths from the drafter's fixed cost estimate, not measured step costs (the CPU default)"),
    Opt(("--no-spec-device-round",), "no_spec_device_round", None, None, False,
        "GPU: a request decoding alone, greedy, runs its rounds step by step, not as one captured graph each"),
    Opt(("--chat-template",), "chat_template", "LLAMA_ARG_CHAT_TEMPLATE",
        help="a built-in template name (llama-server's: chatml, llama3, gemma, ...) or Jinja source"),
    Opt(("--chat-template-file",), "chat_template_file", "LLAMA_ARG_CHAT_TEMPLATE_FILE", help="Jinja template file"),
    Opt(("--jinja",), "jinja", "LLAMA_ARG_JINJA", None, True,
        "Jinja chat templates (always rendered with Jinja; --no-jinja refuses tools, as llama-server does)",
        negative=("--no-jinja",)),
    # outrider's own
    Opt(("--dtype",), "dtype", "OUTRIDER_DTYPE", str, "auto", "auto | float32 | float16 | bfloat16"),
    Opt(("--quantization",), "quantization", "OUTRIDER_QUANTIZATION", str, None,
        "auto: quantized weights stay quantized on the GPU, dequantized at load on the CPU | keep: quantized on "
        "every device | none: dequantized at load | fp8: a dense checkpoint's projections quantized to FP8 at load "
        "(default: auto)"),
    Opt(("-dev", "--device"), "device", "OUTRIDER_DEVICE", str, "auto",
        "auto | cpu | cuda[:N], or llama-server's names: none (the CPU), CUDA0, CUDA1, ..."),
    Opt(("--rope-scaling",), "rope_scaling", "LLAMA_ARG_ROPE_SCALING_TYPE",
        help="none | linear (default: the model's)"),
    Opt(("--rope-scale",), "rope_scale", "LLAMA_ARG_ROPE_SCALE", float, None,
        "linear RoPE scaling: context expanded by this factor"),
    Opt(("--rope-freq-scale",), "rope_freq_scale", "LLAMA_ARG_ROPE_FREQ_SCALE", float, None,
        "linear RoPE scaling: context expanded by 1/this"),
    Opt(("--rope-freq-base",), "rope_freq_base", "LLAMA_ARG_ROPE_FREQ_BASE", float, None,
        "RoPE base frequency (default: the model's)"),
    Opt(("--context-shift",), "context_shift", "LLAMA_ARG_CONTEXT_SHIFT", None, False,
        "a request that fills its context discards half of it after the BOS and goes on (recomputed)",
        negative=("--no-context-shift",)),
    Opt(("--embedding", "--embeddings"), "embedding", "LLAMA_ARG_EMBEDDINGS", None, False,
        "serve /embedding, /embeddings and /v1/embeddings (pooled from the same engine)"),
    Opt(("--pooling",), "pooling", "LLAMA_ARG_POOLING", help="embeddings: mean | cls | last | none (default: the "
        "model's sentence-transformers pooling config, else mean)"),
    Opt(("--tokenizer",), "tokenizer", None, help="tokenizer directory (default: the model's)"),
    Opt(("--block-size",), "block_size", None, int, None, "KV block size in tokens"),
    Opt(("--num-kv-blocks",), "num_kv_blocks", None, int, None, "KV blocks (default: sized from memory)"),
    Opt(("--kv-cache-gib",), "kv_cache_gib", None, float, None, "memory for the KV cache (default: CPU 1 GiB; GPU from --gpu-memory-utilization)"),
    Opt(("--gpu-memory-utilization",), "gpu_memory_utilization", None, float, None, "GPU: fraction of the free memory for the KV pools, after a measured step's needs"),
    Opt(("--enforce-eager",), "enforce_eager", None, None, False, "GPU: no CUDA graphs"),
    Opt(("--no-overlap-schedule",), "no_overlap_schedule", None, None, False,
        "GPU: wait for each step's tokens before launching the next"),
    Opt(("--prefill-graph-tokens",), "prefill_graph_tokens", None, int, None,
        "GPU: a lone prefill chunk of up to N tokens replays a CUDA graph (padded) instead of running eager "
        f"(default {PREFILL_GRAPH_TOKENS_DEFAULT}; 0: eager)"),
]

def _field_opt(field: Field) -> Opt:
    """A request field's server-wide default (request_fields.FIELDS); a list takes one value per use, "none" for
    none."""
    kind = {bool: None, tuple: str}.get(field.type, field.type)
    many = field.type is tuple
    return Opt((field.flag,), field.name, field.env, kind, field.default,
               f"{field.help} (once per value; 'none': no values)" if many else field.help, repeated=many)


SAMPLING = [
    Opt(("-n", "--predict", "--n-predict"), "n_predict", "LLAMA_ARG_N_PREDICT", int, -1,
        "tokens to predict (-1 = until a stop); caps every request"),
    Opt(("--keep",), "n_keep", None, int, 0,
        "default n_keep: prompt tokens kept after the BOS on a context shift (-1 = the whole prompt)"),
    *(_field_opt(f) for f in SUPPORTED if f.flag),
    Opt(("--samplers",), "samplers", None, str, None,
        f"samplers in order, ';'-separated: a subset of {';'.join(CHAIN)} in this order"),
    Opt(("--sampling-seq", "--sampler-seq"), "sampling_seq", None, str, None,
        "--samplers as letters: " + ", ".join(f"{c} ({name})" for c, name in LETTERS.items() if name in CHAIN)),
]

SERVER = [
    Opt(("--host",), "host", "LLAMA_ARG_HOST", str, "127.0.0.1", "address to listen on (*.sock = UNIX socket)"),
    Opt(("--port",), "port", "LLAMA_ARG_PORT", int, 8080, "port (0 = any free port)"),
    Opt(("-a", "--alias"), "alias", "LLAMA_ARG_ALIAS", help="model name(s) to report, comma-separated"),
    Opt(("--api-key",), "api_key", "LLAMA_API_KEY", help="API key(s), comma-separated"),
    Opt(("--api-key-file",), "api_key_file", "LLAMA_ARG_API_KEY_FILE", help="file with one API key per line"),
    Opt(("--metrics",), "metrics", "LLAMA_ARG_ENDPOINT_METRICS", None, False, "enable /metrics"),
    Opt(("--slots",), "slots", "LLAMA_ARG_ENDPOINT_SLOTS", None, True, "enable /slots", negative=("--no-slots",)),
    Opt(("--props",), "props", "LLAMA_ARG_ENDPOINT_PROPS", None, False, "allow POST /props"),
    Opt(("--ui", "--webui"), "webui", "LLAMA_ARG_UI", None, True, "serve the built-in web page at /",
        negative=("--no-ui", "--no-webui")),
    Opt(("-to", "--timeout"), "timeout", "LLAMA_ARG_TIMEOUT", int, 3600, "idle connection timeout, seconds"),
    Opt(("--sse-ping-interval",), "sse_ping_interval", "LLAMA_ARG_SSE_PING_INTERVAL", float, 30.0,
        "seconds of stream silence before a keep-alive comment (-1 = off)"),
    Opt(("--cors-origins",), "cors_origins", "LLAMA_ARG_CORS_ORIGINS", str, "*",
        "origins allowed by CORS, comma-separated: * (any), localhost (loopback, any port), or URLs"),
    Opt(("--tags",), "tags", "LLAMA_ARG_TAGS", help="model tags /models lists, comma-separated"),
    Opt(("--prefill-assistant",), "prefill_assistant", "LLAMA_ARG_PREFILL_ASSISTANT", None, True,
        "a final assistant message is a prefill the reply continues", negative=("--no-prefill-assistant",)),
    Opt(("-v", "--verbose", "--log-verbose"), "verbose", None, None, False,
        "debug logging, and `__verbose` in every response"),
    Opt(("--log-disable",), "log_disable", None, None, False, "no log output"),
    Opt(("--log-file",), "log_file", None, help="log to this file too"),
    Opt(("--max-queue",), "max_queue", "OUTRIDER_MAX_QUEUE", int, 256,
        "requests that may wait for a slot; more get 503"),
    Opt(("--max-body-size",), "max_body_size", "OUTRIDER_MAX_BODY_SIZE", int, 32 << 20, "request body limit, bytes"),
    Opt(("--slots-debug",), "slots_debug", "LLAMA_SERVER_SLOTS_DEBUG", None, False,
        "/slots shows each slot's prompt and generated text"),
    Opt(("--shutdown-timeout",), "shutdown_timeout", "OUTRIDER_SHUTDOWN_TIMEOUT", float, 30.0,
        "on SIGTERM/SIGINT: seconds requests in flight may run on before they are ended"),
    Opt(("--exit-on-engine-failure",), "exit_on_engine_failure", "OUTRIDER_EXIT_ON_ENGINE_FAILURE", None, True,
        "exit with status 1 when the engine fails (after a short grace)", negative=("--no-exit-on-engine-failure",)),
    Opt(("--engine-stall-timeout",), "engine_stall_timeout", "OUTRIDER_ENGINE_STALL_TIMEOUT", float, 60.0,
        "/health answers 503 after this many seconds without engine progress while requests wait (0 = off)"),
]

CHAT = [
    Opt(("--reasoning-format",), "reasoning_format", "LLAMA_ARG_THINK", str, "auto",
        "none | auto | deepseek | deepseek-legacy: where a reply's <think> text goes (reasoning_content)"),
    Opt(("--chat-template-kwargs",), "chat_template_kwargs", "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", str, None,
        'JSON object of template variables for every chat request, e.g. {"enable_thinking": false}'),
    Opt(("--reasoning-budget",), "reasoning_budget", "LLAMA_ARG_THINK_BUDGET", int, -1,
        "-1: unrestricted thinking; 0: thinking off (enable_thinking false for the template)"),
]

# GGML/llama.cpp-only knobs: accepted so existing command lines run, with a one-line warning. True = takes a value.
GGML_ONLY = {
    ("-ngl", "--gpu-layers", "--n-gpu-layers"): True, ("-fa", "--flash-attn"): True,
    ("-ctk", "--cache-type-k"): True, ("-ctv", "--cache-type-v"): True,
    ("-tb", "--threads-batch"): True, ("-ub", "--ubatch-size"): True, ("-sm", "--split-mode"): True,
    ("-ts", "--tensor-split"): True, ("-mg", "--main-gpu"): True,
    ("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"): True, ("-devd", "--device-draft"): True,
    ("-ctkd", "--cache-type-k-draft"): True, ("-ctvd", "--cache-type-v-draft"): True, ("--numa",): True,
    ("-cram", "--cache-ram"): True, ("--threads-http",): True, ("-C", "--cpu-mask"): True,
    ("-Cr", "--cpu-range"): True, ("--prio",): True, ("--poll",): True, ("-ot", "--override-tensor"): True,
    ("--cache-reuse",): True, ("-cd", "--ctx-size-draft"): True,
    ("--mlock",): False, ("--no-mmap",): False, ("--mmap",): False, ("-cb", "--cont-batching"): False,
    ("-nocb", "--no-cont-batching"): False, ("-bs", "--backend-sampling", "--backend_sampling"): False,
    ("-nkvo", "--no-kv-offload"): False, ("--no-warmup",): False, ("--warmup",): False, ("--swa-full",): False,
    ("--check-tensors",): False, ("--no-op-offload",): False, ("--no-repack",): False, ("--tools",): True,
}
# Why a flag is ignored, where "only applies to GGML backends" is not the reason.
ON_DEVICE = "outrider always samples on the device"
IGNORED_BECAUSE = {"-bs": ON_DEVICE, "--backend-sampling": ON_DEVICE, "--backend_sampling": ON_DEVICE,
                   "--tools": "enables the web UI's server-side tools (/tools), which outrider does not serve; "
                              "request tools reach the model through the chat, Responses and Messages routes"}
# Flags for features outrider lacks: an error that says so.
REFUSED = {("--lora", "--lora-scaled"): "LoRA adapters are not supported",
           ("--mmproj", "-mm", "--mmproj-url", "-mmu"): "multimodal projectors are not supported",
           ("--rerank", "--reranking"): "reranking is not supported",
           ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m", "--spec-ngram-map-k-min-hits",
            "--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m", "--spec-ngram-map-k4v-min-hits",
            "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-match"):
               "only the ngram-simple n-gram kind (--spec-ngram-simple-*) is supported"}
REMOVED = ("--draft", "--draft-n", "--draft-max", "--draft-min")
REMOVED_ENV = ("LLAMA_ARG_DRAFT_MAX", "LLAMA_ARG_DRAFT_MIN")


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching, for single-dash flags too (llama-server matches flags exactly: `-dev`
    must never become `-devd`)."""

    def _get_option_tuples(self, option_string):
        return []


class _GgmlOnly(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        why = IGNORED_BECAUSE.get(option_string, "only applies to GGML backends")
        print(f"warning: {option_string} {why}; ignored", file=sys.stderr)


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        why = next(reason for names, reason in REFUSED.items() if option_string in names)
        parser.error(f"{option_string}: {why} by outrider")


class _Removed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: the argument has been removed. use --spec-draft-n-max or --spec-draft-n-min")


def add_options(parser: argparse.ArgumentParser, opts: list[Opt]) -> None:
    for o in opts:
        if o.type is None:
            parser.add_argument(*o.flags, dest=o.dest, action="store_const", const=True, default=None,
                                help=f"{o.help} (env {o.env})" if o.env else o.help)
            if o.negative:
                parser.add_argument(*o.negative, dest=o.dest, action="store_const", const=False,
                                    help=argparse.SUPPRESS)
        else:
            parser.add_argument(*o.flags, dest=o.dest, type=o.type, default=None, metavar=o.dest.upper(),
                                action="append" if o.repeated else "store",
                                help=f"{o.help} (env {o.env})" if o.env else o.help)


def add_llama_compat(parser: argparse.ArgumentParser) -> None:
    for flags, takes_value in GGML_ONLY.items():
        # (a value is optional: llama.cpp's docs write a bare `-fa` from when it was a switch)
        parser.add_argument(*flags, action=_GgmlOnly, nargs="?" if takes_value else 0, help=argparse.SUPPRESS)
    parser.add_argument(*REMOVED, action=_Removed, nargs="?", help=argparse.SUPPRESS)
    for names in REFUSED:
        parser.add_argument(*names, action=_Refused, nargs="?", help=argparse.SUPPRESS)


def apply_env_and_defaults(parser: argparse.ArgumentParser, ns: argparse.Namespace, opts: list[Opt]) -> None:
    """Fill what the command line left unset: from the option's environment variable, else its default."""
    for name in REMOVED_ENV:
        if name in os.environ:
            parser.error(f"{name}: the argument has been removed. use LLAMA_ARG_SPEC_DRAFT_N_MAX/_N_MIN")
    for o in opts:
        if getattr(ns, o.dest) is not None:
            continue
        raw = os.environ.get(o.env) if o.env else None
        if raw is None:
            setattr(ns, o.dest, o.default)
            continue
        try:
            setattr(ns, o.dest, _env_bool(raw) if o.type is None else o.type(raw))
        except ValueError as e:
            parser.error(f"{o.env}: {e}")
