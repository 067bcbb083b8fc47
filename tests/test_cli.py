"""The command line: llama-server spellings, LLAMA_ARG_* variables, GGML-only and removed flags, config building."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from outrider import cli
from outrider.config import EngineConfig, NgramConfig

SERVE = cli.SERVE_GROUPS


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("LLAMA_", "OUTRIDER_")):
            monkeypatch.delenv(name)


def serve_ns(*argv):
    return cli.parse(SERVE, ["-m", "/models/x", *argv])


def test_llama_server_spellings_build_the_engine_config():
    ns = serve_ns("-c", "1024", "-np", "3", "-b", "256", "--seed", "7", "-md", "/models/draft",
                  "--spec-type", "draft-simple", "--spec-draft-n-max", "6", "--spec-draft-n-min", "1",
                  "--draft-p-min", "0.5", "--no-cache-prompt", "--block-size", "32", "--device", "cpu")
    cfg = EngineConfig(**cli.engine_kwargs(ns))
    assert (cfg.model, cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.seed) == \
        ("/models/x", 1024 // 3, 3, 256, 7)
    assert (cfg.draft_model, cfg.spec_type, cfg.spec_draft_n_max, cfg.spec_draft_n_min, cfg.draft_p_min) == \
        ("/models/draft", "draft", 6, 1, 0.5)
    assert cfg.enable_prefix_caching is False and cfg.block_size == 32 and cfg.device == "cpu"
    plain = EngineConfig(**cli.engine_kwargs(serve_ns()))
    assert plain.max_num_seqs == cli.AUTO_SLOTS and plain.spec_draft_n_max == EngineConfig(model="m").spec_draft_n_max


def test_env_vars_fill_what_flags_leave_and_flags_win(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "512")
    monkeypatch.setenv("LLAMA_ARG_N_PARALLEL", "2")
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_METRICS", "on")
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_SLOTS", "disabled")
    monkeypatch.setenv("LLAMA_ARG_PORT", "9999")
    ns = serve_ns("-np", "5")
    assert ns.ctx_size == 512 and ns.parallel == 5 and ns.metrics is True and ns.slots is False and ns.port == 9999
    monkeypatch.setenv("LLAMA_ARG_MODEL", "/from/env")
    assert cli.parse(SERVE, []).model == "/from/env"
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_PROPS", "maybe")
    with pytest.raises(SystemExit):
        serve_ns()


def test_bool_flag_pairs():
    assert serve_ns().slots is True and serve_ns("--no-slots").slots is False
    assert serve_ns().cache_prompt is True and serve_ns("--no-cache-prompt").cache_prompt is False
    assert serve_ns("--metrics", "--props").metrics is True


def test_ggml_only_flags_warn_and_unknown_flags_fail(capsys):
    ns = serve_ns("-ngl", "99", "-fa", "on", "-ctk", "q8_0", "-tb", "4", "--mlock", "-cb", "-c", "64")
    assert ns.ctx_size == 64
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: {f} only applies to GGML backends; ignored"
                   for f in ("-ngl", "-fa", "-ctk", "-tb", "--mlock", "-cb")]


def test_threads_set_the_cpu_compute_threads():
    assert EngineConfig(**cli.engine_kwargs(serve_ns("-t", "3"))).cpu_threads == 3
    assert EngineConfig(**cli.engine_kwargs(serve_ns())).cpu_threads == max(1, (os.cpu_count() or 2) - 1)
    assert EngineConfig(model="m").cpu_threads == 0  # offline use leaves torch's setting alone
    with pytest.raises(SystemExit) as e:
        serve_ns("--no-such-flag")
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        serve_ns("--ctx")  # no abbreviations: llama-server has none


def test_removed_draft_flags_are_errors(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        serve_ns("--draft-max", "8")
    assert "the argument has been removed. use --spec-draft-n-max" in capsys.readouterr().err
    monkeypatch.setenv("LLAMA_ARG_DRAFT_MAX", "8")
    with pytest.raises(SystemExit):
        serve_ns()


def test_spec_type_names():
    assert cli.engine_kwargs(serve_ns("--spec-type", "draft-mtp"))["spec_type"] == "mtp"
    off = cli.engine_kwargs(serve_ns("-md", "/d", "--spec-type", "none"))
    assert "draft_model" not in off and off["spec_type"] == "none"
    assert cli.engine_kwargs(serve_ns("--spec-type", "draft-eagle3", "-md", "/e"))["spec_type"] == "eagle3"
    both = cli.engine_kwargs(serve_ns("--spec-type", "ngram-simple,draft-simple", "-md", "/d"))
    assert both["spec_type"] == "ngram,draft" and both["draft_model"] == "/d"
    for refused in ("ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache", "draft-dspark"):
        with pytest.raises(SystemExit, match=f"--spec-type {refused}: .*not supported"):
            cli.engine_kwargs(serve_ns("--spec-type", f"ngram-simple,{refused}"))
    for bad in ("draft-simple,draft-eagle3", "ngram-simple,ngram-simple", "ngram-simple,foo"):
        with pytest.raises(SystemExit, match="--spec-type"):
            cli.engine_kwargs(serve_ns("--spec-type", bad, "-md", "/d"))
    with pytest.raises(SystemExit, match="reads no draft model"):  # -md would be ignored
        cli.engine_kwargs(serve_ns("--spec-type", "ngram-simple", "-md", "/d"))


def test_ngram_flags():
    assert cli.engine_kwargs(serve_ns("--spec-type", "ngram-simple"))["spec_ngram"] == NgramConfig(12, 48, 1)
    ngram = cli.engine_kwargs(serve_ns("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                                       "--spec-ngram-simple-size-m", "16", "--spec-ngram-simple-min-hits", "2"))
    assert ngram["spec_ngram"] == NgramConfig(size_n=4, size_m=16, min_hits=2)
    with pytest.raises(SystemExit, match="ngram size n"):
        cli.engine_kwargs(serve_ns("--spec-ngram-simple-size-n", "0"))
    with pytest.raises(SystemExit):
        serve_ns("--spec-ngram-mod-n-match", "16")


def test_speculation_is_required_only_when_asked_for_on_the_command_line():
    def required(*argv):
        return cli.engine_kwargs(serve_ns(*argv))["spec_required"]

    assert required("-md", "/d") and required("--spec-type", "draft-mtp")
    assert not required() and not required("-md", "/d", "--spec-type", "none")
    demo = cli.parse(SERVE, ["--demo-draft", "draft"])  # the bundled drafter is the demo's default, not a request
    assert demo.model_draft and not cli.engine_kwargs(demo)["spec_required"]


def test_reliability_flags(monkeypatch):
    cfg = cli.server_config(serve_ns("--shutdown-timeout", "5", "--no-exit-on-engine-failure",
                                     "--engine-stall-timeout", "0"), "/m")
    assert (cfg.shutdown_timeout, cfg.exit_on_engine_failure, cfg.stall_timeout, cfg.slots_debug) == (5, False, 0, False)
    plain = cli.server_config(serve_ns(), "/m")
    assert (plain.shutdown_timeout, plain.exit_on_engine_failure, plain.stall_timeout) == (30, True, 60)
    monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")
    assert cli.server_config(serve_ns(), "/m").slots_debug is True


def test_server_config(tmp_path, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nfile-key\n\nsecond\n")
    ns = serve_ns("--api-key", 'k1,"k,2"', "--api-key-file", str(keys), "-a", "zeta,alpha", "-n", "64",
                  "--temp", "0.5", "--top-k", "7", "--timeout", "30", "--max-queue", "3")
    cfg = cli.server_config(ns, "/models/x")
    assert cfg.api_keys == ("k1", "k,2", "file-key", "second")
    assert cfg.model_alias == "alpha" and cfg.model_name == "x" and cfg.timeout == 30 and cfg.max_queue == 3
    assert (cfg.defaults.max_tokens, cfg.defaults.temperature, cfg.defaults.top_k) == (64, 0.5, 7)
    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    assert cli.server_config(serve_ns(), "/m").api_keys == ("from-env",)
    monkeypatch.delenv("LLAMA_API_KEY")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(SystemExit, match="no key"):
        cli.server_config(serve_ns("--api-key-file", str(empty)), "/m")


def test_chat_template_sources(tmp_path):
    from outrider.chat_templates import BUILTIN_TEMPLATES

    for name in ("chatml", "llama3", "gemma", "mistral-v7", "phi3", "command-r", "deepseek3"):
        assert cli.engine_kwargs(serve_ns("--chat-template", name))["chat_template"] == BUILTIN_TEMPLATES[name]
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert cli.engine_kwargs(serve_ns("--chat-template", source))["chat_template"] == source
    f = tmp_path / "t.jinja"
    f.write_text(source)
    assert cli.engine_kwargs(serve_ns("--chat-template-file", str(f)))["chat_template"] == source
    # Anything that is not a built-in name is Jinja source, as in llama-server.
    assert cli.engine_kwargs(serve_ns("--chat-template", "plain text"))["chat_template"] == "plain text"


def test_without_a_model_the_demo_family_is_served(capsys, monkeypatch):
    from outrider import demo

    ns = cli.parse(SERVE, [])
    assert ns.model == str(demo.demo_path("target")) and ns.model_draft is None  # MTP: detected in the target
    for kind in ("draft", "dflash", "eagle3"):
        assert cli.parse(SERVE, ["--demo-draft", kind]).model_draft == str(demo.demo_path(kind))
    assert cli.engine_kwargs(cli.parse(SERVE, ["--demo-draft", "none"]))["spec_type"] == "none"
    with pytest.raises(SystemExit):
        cli.parse(SERVE, ["--demo-draft", "eagle"])
    assert cli.server_config(ns, ns.model).model_alias == "outrider-demo"
    assert cli.server_config(cli.parse(SERVE, ["-a", "mine"]), ns.model).model_alias == "mine"
    monkeypatch.setattr(demo, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        cli.parse(SERVE, [])
    assert "a model is required" in capsys.readouterr().err


def test_main_dispatch(monkeypatch, capsys):
    seen = []
    monkeypatch.setitem(sys.modules, "outrider.bench", types.SimpleNamespace(main=lambda argv: seen.append(argv)))
    assert cli.main(["bench", "latency", "--batch", "4"]) == 0 and seen == [["latency", "--batch", "4"]]
    assert cli.main(["--version"]) == 0 and "outrider" in capsys.readouterr().out
    assert cli.main([]) == 2 and cli.main(["nope"]) == 2


def test_serve_exits_1_when_the_model_fails_to_load(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "outrider.cli", "serve", "-m", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "failed to load the model" in proc.stderr


def test_outrider_server_builds_both_configs_and_runs(monkeypatch):
    import outrider.server.run as run

    seen = {}
    monkeypatch.setattr(run, "run_server", lambda engine, server: seen.update(engine=engine, server=server) or 0)
    assert cli.server_main(["-m", "/models/x", "-c", "512", "-np", "2", "--port", "0", "--no-cache-prompt",
                            "-n", "9"]) == 0
    engine, server = seen["engine"], seen["server"]
    assert isinstance(engine, EngineConfig) and (engine.max_num_seqs, engine.max_model_len) == (2, 256)
    assert engine.enable_prefix_caching is False
    assert server.port == 0 and server.defaults.max_tokens == 9 and server.defaults.cache_prompt is False


@pytest.mark.parametrize("argv, slots, context", [
    (["-c", "8192", "-np", "4"], 4, 2048),  # split across the slots
    (["-c", "8192", "-np", "4", "-kvu"], 4, 8192),  # unified: every slot may use it all
    (["-c", "8192", "-np", "4", "--kv-unified"], 4, 8192),
    (["-c", "8192"], 4, 8192),  # -np auto: 4 slots, unified
    (["-c", "8192", "-np", "-1", "--no-kv-unified"], 4, 2048),
    (["-c", "8192", "-np", "-1", "-no-kvu"], 4, 2048),
    (["-c", "4096", "-np", "1"], 1, 4096),
    (["-c", "1000", "-np", "3"], 3, 333),
    ([], 4, 0),  # 0: the engine takes the model's context, for every slot
])
def test_context_per_slot_follows_llama_server(argv, slots, context):
    cfg = EngineConfig(**cli.engine_kwargs(serve_ns(*argv)))
    assert (cfg.max_num_seqs, cfg.max_model_len) == (slots, context)


def test_context_per_slot_from_the_model_and_the_environment(tiny_checkpoint, monkeypatch):
    ckpt = str(tiny_checkpoint("qwen3", max_position_embeddings=1024))
    cfg = EngineConfig(**cli.engine_kwargs(cli.parse(SERVE, ["-m", ckpt, "-np", "4"])))
    assert (cfg.max_num_seqs, cfg.max_model_len) == (4, 256)  # -c 0: the model's 1024, split
    monkeypatch.setenv("LLAMA_ARG_KV_UNIFIED", "1")
    assert EngineConfig(**cli.engine_kwargs(serve_ns("-c", "800", "-np", "2"))).max_model_len == 800
    for bad in (["-np", "0"], ["-c", "3", "-np", "4", "--no-kv-unified"]):
        monkeypatch.delenv("LLAMA_ARG_KV_UNIFIED", raising=False)
        with pytest.raises(SystemExit):
            cli.engine_kwargs(serve_ns(*bad))


def test_single_dash_flags_are_matched_exactly(capsys):
    assert cli.engine_kwargs(serve_ns("-dev", "CUDA0"))["device"] == "cuda:0"
    assert cli.engine_kwargs(serve_ns("-dev", "none"))["device"] == "cpu"
    assert cli.engine_kwargs(serve_ns("--device", "cpu"))["device"] == "cpu"
    assert "-devd" not in capsys.readouterr().err  # -dev was never taken for -devd
    for argv in (["-de", "x"], ["-ng", "99"], ["-dev"], ["--cache-typ", "q8_0"]):
        with pytest.raises(SystemExit) as e:
            serve_ns(*argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit, match="one device"):
        cli.engine_kwargs(serve_ns("-dev", "CUDA0,CUDA1"))


def test_sampling_flags_set_the_request_defaults():
    ns = serve_ns("--temp", "0.3", "--top-k", "7", "--dry-multiplier", "0.8", "--dry-base", "2",
                  "--dry-allowed-length", "3", "--dry-penalty-last-n", "128", "--dry-sequence-breaker", "\n",
                  "--dry-sequence-breaker", "###", "--xtc-probability", "0.5", "--xtc-threshold", "0.2", "--ignore-eos")
    d = cli.server_config(ns, "/m").defaults
    assert (d.temperature, d.top_k, d.ignore_eos) == (0.3, 7, True)
    assert (d.dry_multiplier, d.dry_base, d.dry_allowed_length, d.dry_penalty_last_n) == (0.8, 2.0, 3, 128)
    assert d.dry_sequence_breakers == ("\n", "###") and (d.xtc_probability, d.xtc_threshold) == (0.5, 0.2)
    plain = cli.server_config(serve_ns(), "/m").defaults
    assert plain.dry_sequence_breakers == ("\n", ":", '"', "*") and plain.dry_multiplier == 0.0
    assert cli.server_config(serve_ns("--dry-sequence-breaker", "none"), "/m").defaults.dry_sequence_breakers == ()
    assert cli.server_config(serve_ns("--samplers", "dry;temperature"), "/m").defaults.samplers == ("dry",
                                                                                                  "temperature")
    with pytest.raises(SystemExit, match="xtc_probability"):
        cli.server_config(serve_ns("--xtc-probability", "2"), "/m")


def test_flags_llama_server_has_are_applied(monkeypatch, tmp_path):
    ns = serve_ns("-v", "--log-file", str(tmp_path / "log.txt"), "--cors-origins", "localhost,https://app.example/",
                  "--tags", "chat,small", "--samplers", "penalties;top_k;temperature", "--no-prefill-assistant")
    cfg = cli.server_config(ns, "/models/x")
    assert cfg.verbose and cfg.log_file == str(tmp_path / "log.txt") and not cfg.log_disable
    assert cfg.cors_origins == ("localhost", "https://app.example") and cfg.tags == ("chat", "small")
    assert cfg.prefill_assistant is False
    d = cfg.defaults
    assert d.samplers == ("penalties", "top_k", "temperature")
    assert (d.top_p, d.min_p, d.typical_p, d.top_k) == (1.0, 0.0, 1.0, 40)  # the samplers left out are off
    assert cli.server_config(serve_ns("--log-disable"), "/m").log_disable
    assert cli.server_config(serve_ns("--sampling-seq", "kt"), "/m").defaults.samplers == ("top_k", "temperature")
    with pytest.raises(SystemExit, match="order"):
        cli.server_config(serve_ns("--samplers", "temperature;top_k"), "/m")
    with pytest.raises(SystemExit, match="unknown sampler"):
        cli.server_config(serve_ns("--samplers", "top_k;mirostat"), "/m")
    rope = EngineConfig(**cli.engine_kwargs(serve_ns("--rope-scaling", "linear", "--rope-scale", "4",
                                                     "--rope-freq-base", "500000"))).rope
    assert (rope.scaling, rope.factor, rope.freq_base) == ("linear", 4, 500000)
    assert cli.engine_kwargs(serve_ns("--rope-freq-scale", "0.5"))["rope"].factor == 2
    with pytest.raises(SystemExit, match="none and linear"):
        cli.engine_kwargs(serve_ns("--rope-scaling", "yarn"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    serve_ns("-hft", "hf_secret")
    assert os.environ.pop("HF_TOKEN") == "hf_secret"


def test_flags_for_features_we_lack_say_why(capsys):
    for argv, why in ((["--lora", "a.gguf"], "LoRA"),
                      (["--reranking"], "reranking"), (["--pooling", "rank"], "reranking is not supported"),
                      (["--mmproj", "p.gguf"], "multimodal")):
        with pytest.raises(SystemExit) as e:
            serve_ns(*argv)
        assert e.value.code == 2 and why in capsys.readouterr().err
    assert cli.sampling_defaults(serve_ns("--keep", "16")).n_keep == 16  # the requests' default n_keep
    serve_ns("--no-context-shift", "--backend-sampling")  # what we do anyway: accepted
    assert "always samples on the device" in capsys.readouterr().err
    assert serve_ns("--context-shift").context_shift and not serve_ns("--no-context-shift").context_shift
    serve_ns("--backend_sampling", "--tools", "all")  # (the spellings llama-server's own tests start it with)
    err = capsys.readouterr().err
    assert "--backend_sampling outrider always samples on the device" in err and "--tools enables the web UI" in err


def test_rope_overrides_change_the_loaded_model(tiny_checkpoint):
    import torch

    from outrider.config import RopeOverride
    from outrider.models import load_model

    ckpt = tiny_checkpoint("qwen3")
    plain = load_model(ckpt)[0].model.rotary_emb.inv_freq
    _, cfg = load_model(ckpt, rope=RopeOverride(scaling="linear", factor=4.0, freq_base=20000.0))
    assert cfg.rope_theta == 20000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    model = load_model(ckpt, rope=RopeOverride(scaling="linear", factor=4.0))[0]
    assert torch.allclose(model.model.rotary_emb.inv_freq, plain / 4)


# Command lines copied verbatim from llama.cpp's README and tools/server/README.md (after `llama-server`).
README_LINES = {
    "-m model.gguf --port 8080": dict(model="model.gguf", port=8080),
    "-m model.gguf -c 16384 -np 4": dict(slots=4, context=4096),  # "up to 4 concurrent requests, each 4096"
    "-m model.gguf -md draft.gguf": dict(model_draft="draft.gguf"),
    "-m models/7B/ggml-model.gguf -c 2048": dict(slots=4, context=2048),
    "-m models/7B/ggml-model.gguf -c 512 --host 0.0.0.0 --port 8080": dict(host="0.0.0.0", context=512),
    "-m models/7B/ggml-model.gguf -c 512 --host 0.0.0.0 --port 8080 --n-gpu-layers 99": dict(port=8080, context=512),
    "--jinja -fa -m model.gguf": dict(model="model.gguf", jinja=True),
    "--jinja -fa -hf bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M":
        dict(hf_repo="bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M", jinja=True),
    "--jinja -fa -hf bartowski/Llama-3.3-70B-Instruct-GGUF:Q4_K_M": dict(jinja=True),
    "--jinja -fa -hf bartowski/phi-4-GGUF:Q4_0": dict(hf_repo="bartowski/phi-4-GGUF:Q4_0"),
    "-hf ggml-org/gemma-3-4b-it-GGUF": dict(hf_repo="ggml-org/gemma-3-4b-it-GGUF"),
    "-m model.gguf --embedding --pooling cls -ub 8192": dict(embedding=True, pooling="cls"),
    "-m model.gguf --reranking": "reranking",
}


@pytest.mark.parametrize("line", README_LINES)
def test_llama_server_readme_command_lines(line, capsys):
    want = README_LINES[line]
    if isinstance(want, str):  # a feature we lack: exit 2 with the reason
        with pytest.raises(SystemExit) as e:
            cli.parse(SERVE, line.split())
        assert e.value.code == 2 and want in capsys.readouterr().err
        return
    ns = cli.parse(SERVE, line.split())
    got = {k: getattr(ns, k) for k in want if k not in ("slots", "context")}
    assert got == {k: v for k, v in want.items() if k not in ("slots", "context")}
    if ns.hf_repo is None:  # (-hf would download; the rest builds both configs without touching the disk)
        cfg = EngineConfig(**cli.engine_kwargs(ns))
        cli.server_config(ns, cfg.model)
        assert cfg.max_num_seqs == want.get("slots", cli.AUTO_SLOTS)
        assert cfg.max_model_len == want.get("context", 0)


def test_logging_flags(tmp_path):
    import logging

    from outrider.server.run import configure_logging
    from outrider.server.settings import ServerConfig

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    log_file = tmp_path / "server.log"
    try:
        configure_logging(ServerConfig(model_name="m", verbose=True, log_file=str(log_file)))
        logging.getLogger("outrider.test").debug("deep detail")
        configure_logging(ServerConfig(model_name="m", log_file=str(log_file)))
        logging.getLogger("outrider.test").debug("hidden without -v")
        configure_logging(ServerConfig(model_name="m", log_disable=True, log_file=str(log_file)))
        logging.getLogger("outrider.test").error("silenced")
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    text = log_file.read_text()
    assert "deep detail" in text and "hidden without -v" not in text and "silenced" not in text
