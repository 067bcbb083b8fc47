"""The `outrider` command: `serve` (llama-server's flags), `generate` (one prompt, offline) and `bench`.
`outrider-server` is `outrider serve`. EngineConfig and ServerConfig are built from the flags here, once."""

from __future__ import annotations

import argparse
import csv
import importlib
import os
import sys
from pathlib import Path

from outrider import __version__
from outrider.config import EngineConfig
from outrider.params import SamplingParams
from outrider.server import flags
from outrider.server.settings import ServerConfig, default_params

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# llama-server's --spec-type names -> EngineConfig.spec_type
SPEC_TYPES = {"draft-simple": "draft", "draft-mtp": "mtp", "draft-dflash": "dflash",
              "draft": "draft", "mtp": "mtp", "dflash": "dflash"}


def parse(groups: list[list[flags.Opt]], argv: list[str], prog: str = "outrider serve",
          description: str = "") -> argparse.Namespace:
    """Flags (llama-server spellings), then LLAMA_ARG_* variables, then defaults. Without a model, the bundled
    demo family is used (with the drafter --demo-draft names)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    for opts in groups:
        flags.add_options(parser, opts)
    flags.add_llama_compat(parser)
    ns = parser.parse_args(argv)
    flags.apply_env_and_defaults(parser, ns, [o for g in groups for o in g])
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
    """-m wins; -hf is fetched now (before the server listens), from the cache only with --offline."""
    if ns.model:
        return ns.model
    from outrider.models import resolve_model_path

    if ns.hf_file:
        print("warning: --hf-file picks a GGUF file; outrider loads the repository's safetensors", file=sys.stderr)
    return str(resolve_model_path(ns.hf_repo, offline=ns.offline))


def _chat_template(ns: argparse.Namespace) -> str | None:
    if not ns.jinja:
        print("warning: --no-jinja: chat templates are always rendered with Jinja", file=sys.stderr)
    if ns.chat_template_file:
        return Path(ns.chat_template_file).read_text(encoding="utf-8")
    source = ns.chat_template
    if source is None or "{{" in source or "{%" in source:
        return source
    if source == "chatml":
        return CHATML
    raise SystemExit(f"error: --chat-template {source!r}: give Jinja source or 'chatml' (the one built-in name)")


def _spec_type(ns: argparse.Namespace) -> tuple[str | None, str | None]:
    """(spec_type, draft model) for EngineConfig; `none` turns drafting off even when -md is given."""
    if ns.spec_type is None:
        return None, ns.model_draft
    if ns.spec_type == "none":
        return "none", None
    if ns.spec_type not in SPEC_TYPES:
        raise SystemExit(f"error: --spec-type {ns.spec_type!r} is not supported; "
                         f"one of: none, {', '.join(k for k in SPEC_TYPES if '-' in k)}")
    return SPEC_TYPES[ns.spec_type], ns.model_draft


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """The flags' EngineConfig fields (those left at None keep EngineConfig's defaults)."""
    spec_type, draft = _spec_type(ns)
    kwargs = dict(
        model=model_path(ns), dtype=ns.dtype, device=ns.device, max_model_len=ns.ctx_size, seed=ns.seed,
        enable_prefix_caching=ns.cache_prompt, enforce_eager=ns.enforce_eager, draft_model=draft,
        spec_type=spec_type, spec_required=ns.spec_required, chat_template=_chat_template(ns), tokenizer=ns.tokenizer,
        max_num_seqs=ns.parallel if ns.parallel > 0 else None, max_num_batched_tokens=ns.batch_size,
        block_size=ns.block_size, num_kv_blocks=ns.num_kv_blocks, kv_cache_memory_gib=ns.kv_cache_gib,
        gpu_memory_utilization=ns.gpu_memory_utilization, spec_draft_n_max=ns.spec_draft_n_max,
        spec_draft_n_min=ns.spec_draft_n_min, draft_p_min=ns.draft_p_min,
        overlap_schedule=False if ns.no_overlap_schedule else None,
        # Every core computing leaves none for the HTTP side, which on a small box costs more than it gives.
        cpu_threads=ns.threads if ns.threads > 0 else max(1, (os.cpu_count() or 2) - 1),
    )
    return {k: v for k, v in kwargs.items() if v is not None}


def sampling_defaults(ns: argparse.Namespace) -> SamplingParams:
    return default_params(max_tokens=ns.n_predict, temperature=ns.temp, top_k=ns.top_k, top_p=ns.top_p,
                          min_p=ns.min_p, typical_p=ns.typical_p, repeat_penalty=ns.repeat_penalty,
                          repeat_last_n=ns.repeat_last_n, presence_penalty=ns.presence_penalty,
                          frequency_penalty=ns.frequency_penalty, ignore_eos=ns.ignore_eos,
                          cache_prompt=ns.cache_prompt)


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


def server_config(ns: argparse.Namespace, model: str) -> ServerConfig:
    aliases = tuple(a for a in (ns.alias or "").split(",") if a)
    return ServerConfig(
        model_name=ns.hf_repo if not ns.model and ns.hf_repo else Path(model).name or model, aliases=aliases,
        host=ns.host, port=ns.port, api_keys=api_keys(ns), endpoint_metrics=ns.metrics, endpoint_slots=ns.slots,
        endpoint_props=ns.props, timeout=ns.timeout, sse_ping_interval=ns.sse_ping_interval,
        max_body_bytes=ns.max_body_size, max_queue=ns.max_queue, defaults=sampling_defaults(ns),
        slots_debug=ns.slots_debug, shutdown_timeout=ns.shutdown_timeout,
        exit_on_engine_failure=ns.exit_on_engine_failure, stall_timeout=ns.engine_stall_timeout,
    )


# --- subcommands ---
SERVE_GROUPS = [flags.MODEL, flags.SAMPLING, flags.SERVER]
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
