"""The `outrider` command: `serve` (llama-server's flags), `generate` (one prompt, offline) and `bench`.
`outrider-server` is `outrider serve`. EngineConfig and ServerConfig are built from the flags here, once."""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import sys
from pathlib import Path

from outrider import __version__
from outrider.chat_templates import BUILTIN_TEMPLATES
from outrider.config import EngineConfig, NgramConfig, RopeOverride
from outrider.params import SamplingParams
from outrider.request_fields import SUPPORTED
from outrider.sampler_chain import SamplerChainError, parse_chars, parse_names, restrict
from outrider.server import flags
from outrider.server.settings import ServerConfig, default_params
from outrider.speculative.kinds import KINDS as DRAFTER_KINDS
# llama-server's --spec-type names, and our own -> EngineConfig.spec_type
SPEC_TYPES = {**{k.llama_name: k.name for k in DRAFTER_KINDS}, **{k.name: k.name for k in DRAFTER_KINDS}}
# llama-server's other kinds, refused by name (docs/speculative.md, "N-gram lookup", says why)
SPEC_TYPES_REFUSED = {
    "draft-dspark": "DSpark drafters are not supported",
    "ngram-map-k": "not supported; ngram-simple with --spec-ngram-simple-min-hits drafts from repeated keys",
    "ngram-map-k4v": "not supported (experimental in llama-server); use ngram-simple",
    "ngram-mod": "its hash pool shared across requests is not supported; use ngram-simple",
    "ngram-cache": "n-gram statistics files are not supported; use ngram-simple",
}
MODEL_KINDS = tuple(k.name for k in DRAFTER_KINDS if k.weights)  # at most one, beside n-gram lookup


def parse(groups: list[list[flags.Opt]], argv: list[str], prog: str = "outrider serve",
          description: str = "") -> argparse.Namespace:
    """Flags (llama-server spellings), then LLAMA_ARG_* variables, then defaults. Without a model, the bundled
    demo family is used (with the drafter --demo-draft names)."""
    parser = flags.Parser(prog=prog, description=description, allow_abbrev=False)
    for opts in groups:
        flags.add_options(parser, opts)
    flags.add_llama_compat(parser)
    ns = parser.parse_args(argv)
    flags.apply_env_and_defaults(parser, ns, [o for g in groups for o in g])
    if ns.pooling not in (None, "mean", "cls", "last", "none"):
        parser.error(f"--pooling {ns.pooling}: one of mean, cls, last, none (rank: reranking is not supported)")
    if ns.hf_token:  # every hub download of this process (model, drafter, tokenizer) reads it
        os.environ["HF_TOKEN"] = ns.hf_token
    # Asked for on the command line (not the demo's default drafter, not a detected MTP head).
    ns.spec_required = ns.spec_type != "none" and (ns.spec_type is not None or bool(ns.model_draft))
    if not ns.model and not ns.hf_repo:
        _use_demo(parser, ns)
    return ns


def _use_demo(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Point -m (and the drafter, unless one was given) at the demo family shipped in the package."""
    from outrider import demo

    if not demo.is_available():
        parser.error("a model is required: -m PATH or -hf REPO (the bundled demo model is not installed)")
    if ns.demo_draft not in ("none", *demo.DRAFTER_KINDS):
        parser.error(f"--demo-draft {ns.demo_draft!r}: one of none, {', '.join(demo.DRAFTER_KINDS)}")
    ns.model = str(demo.demo_path("target"))
    if ns.model_draft is None and ns.spec_type is None:
        if ns.demo_draft == "none":
            ns.spec_type = "none"
        elif ns.demo_draft != "mtp":  # MTP lives in the target checkpoint and is detected from it
            ns.model_draft = str(demo.demo_path(ns.demo_draft))


def model_path(ns: argparse.Namespace) -> str:
    """-m wins; -hf user/repo[:QUANT] (or its --hf-file) is fetched now, before the server listens, from the cache
    only with --offline."""
    if ns.model:
        return ns.model
    from outrider.models.hub import resolve_hub_model

    return str(resolve_hub_model(ns.hf_repo, offline=ns.offline, filename=ns.hf_file))


def _chat_template(ns: argparse.Namespace) -> str | None:
    if ns.chat_template_file:
        return Path(ns.chat_template_file).read_text(encoding="utf-8")
    # As llama-server: a built-in name picks that template; anything else is Jinja source.
    return BUILTIN_TEMPLATES.get(ns.chat_template, ns.chat_template)


def _spec_type(ns: argparse.Namespace) -> tuple[str | None, str | None]:
    """(spec_type, draft model) for EngineConfig; `none` turns drafting off even when -md is given."""
    if ns.spec_type is None:
        return None, ns.model_draft
    if ns.spec_type == "none":
        return "none", None
    kinds = []
    for name in ns.spec_type.split(","):
        if name in SPEC_TYPES_REFUSED:
            raise SystemExit(f"error: --spec-type {name}: {SPEC_TYPES_REFUSED[name]}")
        if name not in SPEC_TYPES:
            raise SystemExit(f"error: --spec-type {name!r} is not supported; "
                             f"one of: none, {', '.join(k for k in SPEC_TYPES if '-' in k)} (comma-separated)")
        kinds.append(SPEC_TYPES[name])
    models = [k for k in kinds if k in MODEL_KINDS]
    if len(set(kinds)) < len(kinds) or len(models) > 1:
        raise SystemExit(f"error: --spec-type {ns.spec_type}: each kind once, and at most one drafter with weights")
    if ns.model_draft and not models:
        raise SystemExit(f"error: --spec-type {ns.spec_type} reads no draft model; drop -md or add its kind")
    return ",".join(kinds), ns.model_draft


def _ngram(ns: argparse.Namespace) -> NgramConfig:
    try:
        return NgramConfig(size_n=ns.spec_ngram_size_n, size_m=ns.spec_ngram_size_m, min_hits=ns.spec_ngram_min_hits)
    except ValueError as e:
        raise SystemExit(f"error: --spec-ngram-simple-*: {e}") from e


AUTO_SLOTS = 4  # llama-server's -np auto


def slots_and_context(ns: argparse.Namespace, model: str) -> tuple[int, int]:
    """(slots, context of each sequence) as llama-server derives them from -np, -c and --kv-unified: -np auto is
    4 slots with a unified KV cache; a unified cache lets every sequence use the whole -c, otherwise -c is split
    evenly across the slots (-c 0: the model's training context). A context of 0 leaves it to the engine (the
    model's)."""
    if ns.parallel == 0 or ns.parallel < -1:
        raise SystemExit(f"error: -np {ns.parallel}: give a number of slots >= 1, or -1 (auto)")
    auto = ns.parallel == -1
    slots = AUTO_SLOTS if auto else ns.parallel
    unified = auto if ns.kv_unified is None else ns.kv_unified
    if unified or slots == 1:
        return slots, ns.ctx_size
    from outrider.models import registry  # (torch loads only when needed)

    n_ctx = ns.ctx_size or registry.load_config(_local_path(model)).max_position_embeddings
    if n_ctx < slots:
        raise SystemExit(f"error: -c {n_ctx} is smaller than -np {slots}: each slot needs a context")
    return slots, n_ctx // slots


def _local_path(model: str) -> Path:
    from outrider.models import resolve_model_path

    return resolve_model_path(model)


def _device(name: str) -> str:
    """llama-server's device names (none, CUDA0, ...) or ours (auto, cpu, cuda, cuda:N)."""
    if name in ("auto", "cpu", "cuda") or name.startswith("cuda:"):
        return name
    if name == "none":
        return "cpu"
    if "," in name:
        raise SystemExit(f"error: --device {name!r}: outrider runs on one device")
    if name.upper().startswith("CUDA") and name[4:].isdigit():
        return f"cuda:{name[4:]}"
    raise SystemExit(f"error: --device {name!r}: one of auto, cpu, cuda, cuda:N, none, CUDA<N>")


def _rope(ns: argparse.Namespace) -> RopeOverride | None:
    """--rope-scaling/--rope-scale/--rope-freq-scale/--rope-freq-base over the checkpoint's RoPE."""
    if ns.rope_scaling not in (None, "none", "linear"):
        raise SystemExit(f"error: --rope-scaling {ns.rope_scaling!r}: outrider supports none and linear")
    factor = ns.rope_scale or (1 / ns.rope_freq_scale if ns.rope_freq_scale else None)
    if factor is not None and factor <= 0:
        raise SystemExit("error: --rope-scale/--rope-freq-scale must be > 0")
    if ns.rope_scaling is None and factor is None and ns.rope_freq_base is None:
        return None
    try:
        return RopeOverride(scaling=ns.rope_scaling or ("linear" if factor else None), factor=factor,
                            freq_base=ns.rope_freq_base)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """The flags' EngineConfig fields (those left at None keep EngineConfig's defaults)."""
    spec_type, draft = _spec_type(ns)
    model = model_path(ns)
    slots, context = slots_and_context(ns, model)
    kwargs = dict(
        model=model, dtype=ns.dtype, quantization=ns.quantization, device=_device(ns.device), max_model_len=context,
        seed=ns.seed,
        enable_prefix_caching=ns.cache_prompt, enforce_eager=ns.enforce_eager, draft_model=draft,
        spec_type=spec_type, spec_required=ns.spec_required, chat_template=_chat_template(ns), tokenizer=ns.tokenizer,
        max_num_seqs=slots, max_num_batched_tokens=ns.batch_size, rope=_rope(ns),
        block_size=ns.block_size, num_kv_blocks=ns.num_kv_blocks, kv_cache_memory_gib=ns.kv_cache_gib,
        gpu_memory_utilization=ns.gpu_memory_utilization, spec_draft_n_max=ns.spec_draft_n_max,
        spec_draft_n_min=ns.spec_draft_n_min, draft_p_min=ns.draft_p_min, spec_ngram=_ngram(ns),
        spec_token_map=ns.spec_token_map,
        overlap_schedule=False if ns.no_overlap_schedule else None,
        prefill_graph_tokens=ns.prefill_graph_tokens,
        spec_measured_costs=False if ns.no_spec_measured_costs else None,
        spec_device_round=False if ns.no_spec_device_round else None,
        # Every core computing leaves none for the HTTP side, which on a small box costs more than it gives.
        cpu_threads=ns.threads if ns.threads > 0 else max(1, (os.cpu_count() or 2) - 1),
    )
    return {k: v for k, v in kwargs.items() if v is not None}


def sampling_defaults(ns: argparse.Namespace) -> SamplingParams:
    """The request defaults: the request fields' flags (request_fields.SUPPORTED), -n and --cache-prompt."""
    fields = {f.name: getattr(ns, f.name) for f in SUPPORTED if f.flag}
    for f in SUPPORTED:  # a list flag's values (it holds the default's tuple when not given)
        if f.flag and isinstance(fields[f.name], list):
            fields[f.name] = () if fields[f.name] == ["none"] else tuple(fields[f.name])
    try:
        params = default_params(max_tokens=ns.n_predict, cache_prompt=ns.cache_prompt, n_keep=ns.n_keep, **fields)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    try:
        if ns.samplers is not None:
            return restrict(params, parse_names([n for n in ns.samplers.split(";") if n]))
        if ns.sampling_seq is not None:
            return restrict(params, parse_chars(ns.sampling_seq))
    except SamplerChainError as e:
        raise SystemExit(f"error: {'--samplers' if ns.samplers is not None else '--sampling-seq'}: {e}") from e
    return params


def api_keys(ns: argparse.Namespace) -> tuple[str, ...]:
    """--api-key is a CSV row (quotes allowed, no trimming); --api-key-file has one key a line, # comments."""
    keys = next(csv.reader([ns.api_key])) if ns.api_key else []
    if ns.api_key_file:
        for line in Path(ns.api_key_file).read_text(encoding="utf-8").splitlines():
            if line and not line.startswith("#"):
                keys.append(line)
    keys = [k for k in keys if k]
    if (ns.api_key or ns.api_key_file) and not keys:
        raise SystemExit("error: --api-key/--api-key-file given but no key found")
    return tuple(keys)


def model_name(ns: argparse.Namespace, model: str) -> str:
    """The name reported without --alias: `outrider-demo` for the bundled demo, else the -hf repo id or the model
    directory's name."""
    from outrider import demo

    if demo.is_demo_target(model):
        return demo.SERVED_NAME
    return ns.hf_repo if not ns.model and ns.hf_repo else Path(model).name or model


def server_config(ns: argparse.Namespace, model: str) -> ServerConfig:
    aliases = tuple(a for a in (ns.alias or "").split(",") if a)
    return ServerConfig(
        model_name=model_name(ns, model), aliases=aliases,
        host=ns.host, port=ns.port, api_keys=api_keys(ns), endpoint_metrics=ns.metrics, endpoint_slots=ns.slots,
        endpoint_props=ns.props, timeout=ns.timeout, sse_ping_interval=ns.sse_ping_interval,
        max_body_bytes=ns.max_body_size, max_queue=ns.max_queue, defaults=sampling_defaults(ns), webui=ns.webui,
        cors_origins=_cors_origins(ns.cors_origins), tags=tuple(t for t in (ns.tags or "").split(",") if t),
        prefill_assistant=ns.prefill_assistant, verbose=ns.verbose, log_disable=ns.log_disable,
        log_file=ns.log_file, slots_debug=ns.slots_debug, shutdown_timeout=ns.shutdown_timeout,
        exit_on_engine_failure=ns.exit_on_engine_failure, stall_timeout=ns.engine_stall_timeout, **chat_settings(ns),
        embeddings=ns.embedding, pooling=ns.pooling, context_shift=ns.context_shift,
    )


def _cors_origins(value: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    if not origins:
        raise SystemExit("error: --cors-origins: give *, localhost, or origins such as https://app.example")
    return origins


def chat_settings(ns: argparse.Namespace) -> dict:
    """ServerConfig's chat fields from --reasoning-format, --chat-template-kwargs, --reasoning-budget, --jinja."""
    from outrider.structured.reasoning import FORMATS

    if ns.reasoning_format not in FORMATS:
        raise SystemExit(f"error: --reasoning-format {ns.reasoning_format!r}: one of {', '.join(FORMATS)}")
    try:
        kwargs = json.loads(ns.chat_template_kwargs) if ns.chat_template_kwargs else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --chat-template-kwargs: invalid JSON: {e}") from e
    if not isinstance(kwargs, dict):
        raise SystemExit("error: --chat-template-kwargs: expected a JSON object")
    if ns.reasoning_budget not in (-1, 0):  # llama-server's two budgets; a token count would need forced tags
        raise SystemExit("error: --reasoning-budget: -1 (unrestricted) or 0 (thinking off)")
    if ns.reasoning_budget == 0:
        kwargs = {**kwargs, "enable_thinking": False}
    return dict(reasoning_format=ns.reasoning_format, chat_template_kwargs=kwargs, jinja=ns.jinja)


# --- subcommands ---
SERVE_GROUPS = [flags.MODEL, flags.SAMPLING, flags.SERVER, flags.CHAT]
GENERATE_GROUPS = [flags.MODEL, flags.SAMPLING, [flags.Opt(("-p", "--prompt"), "prompt", help="the prompt text")]]


def serve(argv: list[str], prog: str = "outrider serve") -> int:
    ns = parse(SERVE_GROUPS, argv, prog, "Serve a model over llama-server's and OpenAI's HTTP APIs.")
    engine_config = EngineConfig(**engine_kwargs(ns))
    from outrider.server.run import run_server  # uvicorn and the engine load only when serving

    return run_server(engine_config, server_config(ns, engine_config.model))


def generate(argv: list[str]) -> int:
    ns = parse(GENERATE_GROUPS, argv, "outrider generate", "Generate from one prompt offline and print the text.")
    if ns.prompt is None:
        raise SystemExit("error: -p/--prompt is required")
    from outrider.llm import LLM

    kwargs = engine_kwargs(ns)
    out = LLM(kwargs.pop("model"), **kwargs).generate([ns.prompt], sampling_defaults(ns))[0]
    sys.stdout.write(out.text + "\n")
    t = out.timing.to_timings()
    print(f"prompt: {t['prompt_n']} tokens in {t['prompt_ms']:.1f} ms; predicted: {t['predicted_n']} tokens in "
          f"{t['predicted_ms']:.1f} ms ({t['predicted_per_second']:.1f} tokens/s); stop: {out.stop_type}",
          file=sys.stderr)
    return 0


def bench(argv: list[str]) -> int:
    return importlib.import_module("outrider.bench").main(argv)  # GPU-side tooling, imported only when asked


COMMANDS = {"serve": serve, "generate": generate, "bench": bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-v"]):
        print(f"outrider {__version__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: outrider {{{','.join(COMMANDS)}}} ...  (outrider COMMAND -h for its options)",
              file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:]) or 0


def server_main(argv: list[str] | None = None) -> int:
    return serve(sys.argv[1:] if argv is None else argv, prog="outrider-server")


if __name__ == "__main__":
    sys.exit(main())
