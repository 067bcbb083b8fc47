"""The command line: llama-server spellings, LLAMA_ARG_* variables, GGML-only and removed flags, config building."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from outrider import cli
from outrider.config import EngineConfig

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
        ("/models/x", 1024, 3, 256, 7)
    assert (cfg.draft_model, cfg.spec_type, cfg.spec_draft_n_max, cfg.spec_draft_n_min, cfg.draft_p_min) == \
        ("/models/draft", "draft", 6, 1, 0.5)
    assert cfg.enable_prefix_caching is False and cfg.block_size == 32 and cfg.device == "cpu"
    defaults = EngineConfig(model="m")
    plain = EngineConfig(**cli.engine_kwargs(serve_ns()))
    assert plain.max_num_seqs == defaults.max_num_seqs and plain.spec_draft_n_max == defaults.spec_draft_n_max


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
    with pytest.raises(SystemExit, match="ngram-simple"):
        cli.engine_kwargs(serve_ns("--spec-type", "ngram-simple"))


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
    assert cli.engine_kwargs(serve_ns("--chat-template", "chatml"))["chat_template"] == cli.CHATML
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert cli.engine_kwargs(serve_ns("--chat-template", source))["chat_template"] == source
    f = tmp_path / "t.jinja"
    f.write_text(source)
    assert cli.engine_kwargs(serve_ns("--chat-template-file", str(f)))["chat_template"] == source
    with pytest.raises(SystemExit, match="chatml"):
        cli.engine_kwargs(serve_ns("--chat-template", "llama3"))


def test_without_a_model_the_demo_family_is_served(capsys, monkeypatch):
    from outrider import demo

    ns = cli.parse(SERVE, [])
    assert ns.model == str(demo.demo_path("target")) and ns.model_draft is None  # MTP: detected in the target
    assert cli.parse(SERVE, ["--demo-draft", "dflash"]).model_draft == str(demo.demo_path("dflash"))
    assert cli.engine_kwargs(cli.parse(SERVE, ["--demo-draft", "none"]))["spec_type"] == "none"
    with pytest.raises(SystemExit):
        cli.parse(SERVE, ["--demo-draft", "eagle"])
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
    assert cli.server_main(["-m", "/models/x", "-np", "2", "--port", "0", "--no-cache-prompt", "-n", "9"]) == 0
    engine, server = seen["engine"], seen["server"]
    assert isinstance(engine, EngineConfig) and engine.max_num_seqs == 2 and engine.enable_prefix_caching is False
    assert server.port == 0 and server.defaults.max_tokens == 9 and server.defaults.cache_prompt is False
