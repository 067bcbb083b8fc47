"""`outrider bench latency|throughput|serve` end to end on the CPU, on tiny checkpoints: every line is printed, the
JSON rows agree with it, the throughput run generates exactly the workload's output tokens, TTFT is measured on
a request of two tokens, `--compare hf` runs transformers in processes of its own at our batch size, and `serve`
counts tokens, not chunks."""

from __future__ import annotations

import json
import os
import random

import pytest

from e2e_harness import ServerProcess
from outrider import bench, demo
from outrider.bench import hf_worker, latency


def _rows(path) -> dict[str, dict]:
    return {row["label"].split()[0]: row for row in json.loads(path.read_text())}


def test_latency_bench_prints_decode_profile_and_ttft(tiny_checkpoint, tmp_path, capsys):
    model, out = tiny_checkpoint("qwen3"), tmp_path / "latency.json"
    argv = ["latency", "--model", str(model), "--device", "cpu", "--prompt-len", "8", "--gen", "6",
            "--ttft-prompt-len", "20", "--profile", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {"latency", "profile", "ttft"}
    assert rows["latency"]["tok_s"] > 0 and rows["latency"]["ttft_s"] > 0 and rows["ttft"]["ttft_s"] > 0
    # The profile timed every engine step of the profiled run (5 decode steps after a prefill at least).
    assert rows["profile"]["step (all)"] > 0 and "schedule" in rows["profile"]
    assert printed.count(" TB/s") == 3


def test_throughput_bench_generates_the_whole_workload(tiny_checkpoint, tmp_path, capsys):
    model, out = tiny_checkpoint("qwen3"), tmp_path / "throughput.json"
    n, lo, hi, seed = 6, 4, 12, 3
    argv = ["throughput", "--model", str(model), "--device", "cpu", "--num-requests", str(n), "--min-len", str(lo),
            "--max-len", str(hi), "--max-num-seqs", "4", "--seed", str(seed), "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    rng = random.Random(seed)  # the workload: (input, output) lengths uniform in [lo, hi], drawn in this order
    wanted = sum([rng.randint(lo, hi), rng.randint(lo, hi)][1] for _ in range(n))
    assert f"({wanted} tokens in " in printed
    assert _rows(out)["throughput"]["steps"] >= -(-wanted // 4)  # at most 4 sequences a step
    assert "throughput steps: steps with prompt tokens:" in printed


def test_ttft_line_measures_a_request_of_two_tokens(tiny_checkpoint, monkeypatch, capsys):
    """With max_tokens 1 a request ends with its first token, so whatever delays the first token behind the next
    step (overlap scheduling) would never show in the TTFT line."""
    calls = []
    real = latency.run_batch

    def spy(engine, prompts, gen, *rest):
        calls.append((len(prompts[0]), gen))
        return real(engine, prompts, gen, *rest)

    monkeypatch.setattr(latency, "run_batch", spy)
    argv = ["latency", "--model", str(tiny_checkpoint("qwen3")), "--device", "cpu", "--prompt-len", "8", "--gen", "4",
            "--ttft-prompt-len", "20"]
    assert bench.main(argv) == 0
    assert [gen for n, gen in calls if n == 20] == [2, 2, 2]
    assert "best of 3, max_tokens 2" in capsys.readouterr().out


@pytest.mark.slow  # a transformers process starts (imports) on a busy CPU
def test_compare_hf_runs_transformers_in_a_process_of_its_own_at_our_batch_size(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["latency", "--model", str(tiny_checkpoint("qwen3")), "--device", "cpu", "--prompt-len", "8", "--gen", "6",
            "--batch", "2", "--ttft-prompt-len", "0", "--compare", "hf", "--hf-configs", "generate", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    ours, hf_row = _rows(out)["latency"], _rows(out)["hf-transformers"]
    assert hf_row["config"] == "generate" and hf_row["batch"] == 2 and hf_row["tok_s"] > 0
    assert hf_row["pid"] not in (None, os.getpid())
    assert hf_row["ratio"] == pytest.approx(2 * ours["tok_s"] / hf_row["tok_s"])
    assert "hf-transformers generate " in printed and "bs=2" in printed and "sdpa attention, dynamic cache" in printed


def test_an_hf_configuration_that_cannot_run_is_reported_by_name_with_its_error(tiny_checkpoint, capsys):
    argv = ["--model", str(tiny_checkpoint("qwen3")), "--config", "static-compile", "--device", "cpu", "--batch", "2",
            "--prompt-len", "4", "--gen", "3"]
    assert hf_worker.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["config"] == "static-compile" and result["batch"] == 2 and result["tok_s"] is None
    assert result["detail"] == ("RuntimeError: transformers compiled nothing on cpu: it compiles generate on "
                                "accelerators only")


@pytest.mark.slow  # a server process starts
def test_serve_counts_tokens_not_chunks_when_speculation_sends_several_a_chunk(tmp_path, capsys):
    out = tmp_path / "serve.json"
    srv = ServerProcess(["-m", str(demo.demo_path("target")), "--model-draft", str(demo.demo_path("draft")),
                         "-c", "256", "-np", "2", "--spec-draft-n-max", "4"])
    try:
        argv = ["serve", "--url", srv.url, "--concurrency", "2", "--num-requests", "4", "--prompt-len", "8", "--gen",
                "24", "--vocab", "300", "--json", str(out)]
        assert bench.main(argv) == 0
    finally:
        srv.stop()
    row = _rows(out)["serve"]
    assert row["tokens"] == 4 * 24  # every request's tokens, however they were framed
    assert row["chunks"] < row["tokens"]  # some chunks carried several tokens (accepted drafts)
    assert f"({row['tokens']} tokens in {row['chunks']} chunks)" in capsys.readouterr().out


def test_json_schema_runs_the_same_workload_constrained_and_free(tiny_checkpoint, tmp_path, capsys):
    model, out, schema = tiny_checkpoint("qwen3"), tmp_path / "latency.json", tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 3}))
    argv = ["latency", "--model", str(model), "--device", "cpu", "--prompt-len", "8", "--gen", "12", "--batch", "2",
            "--ttft-prompt-len", "0", "--json-schema", str(schema), "--json", str(out)]
    assert bench.main(argv) == 0
    rows = _rows(out)
    assert rows["json-schema"]["tok_s"] > 0 and rows["json-schema"]["free_tok_s"] == rows["latency"]["tok_s"]
    # how long the host waited for the GPU, per step, in each run: what says which side sets the pace
    assert rows["json-schema"]["free_blocked_ms_per_step"] == rows["latency"]["blocked_ms_per_step"] >= 0
    assert rows["json-schema"]["blocked_ms_per_step"] >= 0
    assert "tok/s/seq constrained vs" in capsys.readouterr().out
    argv = ["throughput", "--model", str(model), "--device", "cpu", "--num-requests", "3", "--min-len", "4",
            "--max-len", "10", "--max-num-seqs", "4", "--json-schema", str(schema), "--json", str(out)]
    assert bench.main(argv) == 0
    rows = _rows(out)
    assert rows["json-schema"]["tok_s"] > 0 and rows["json-schema"]["free_tok_s"] == rows["throughput"]["tok_s"]


def test_quant_bench_writes_each_format_at_its_size_and_runs_it_beside_bf16(tmp_path):
    """`bench quant` end to end on a shape every format's blocks fit: each checkpoint is written in its format at
    about its bits a weight, loads through the ordinary loader, decodes at batch 1 and 2, and is compared with
    bf16 (on the CPU the quantized layers are dequantized, so the loaded bytes are bf16's)."""
    out = tmp_path / "quant.json"
    argv = ["quant", "--random-weights", "tiny-qwen3-256", "--device", "cpu", "--weights-format", "bf16", "q4_k_m",
            "q8_0", "fp8", "awq", "--checkpoint-dir", str(tmp_path / "ckpt"), "--gen", "4", "--prompt-len", "8",
            "--ttft-prompt-len", "16", "--batch", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    tensor_bytes = {r["format"]: r["tensor_bytes"] for r in rows if r["label"].endswith(" weights")}
    bf16 = tensor_bytes["bf16"]
    # Bytes a weight against bf16's two: Q4_K_M ~4.9 bits (its Q6_K tensors included), Q8_0 8.5, FP8 8 + scales,
    # AWQ 4 + group scales and zeros.
    assert 0.25 < tensor_bytes["q4_k_m"] / bf16 < 0.4 and 0.5 < tensor_bytes["q8_0"] / bf16 < 0.6
    assert 0.5 <= tensor_bytes["fp8"] / bf16 < 0.6 and 0.25 < tensor_bytes["awq"] / bf16 < 0.4
    assert all(r["loaded_bytes"] > 0 for r in rows if "loaded_bytes" in r)
    speeds = {(r["format"], r["batch"]) for r in rows if r.get("tok_s", 0) > 0}
    assert speeds == {(f, b) for f in tensor_bytes for b in (1, 2)}
    assert {r["format"] for r in rows if r["label"].endswith("vs bf16")} == set(tensor_bytes)
