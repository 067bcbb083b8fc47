"""`outrider bench latency|throughput` end to end on the CPU, on a tiny checkpoint: every line is printed, the
JSON rows agree with it, and the throughput run generates exactly the workload's output tokens."""

from __future__ import annotations

import json
import random

from outrider import bench


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


def test_json_schema_runs_the_same_workload_constrained_and_free(tiny_checkpoint, tmp_path, capsys):
    model, out, schema = tiny_checkpoint("qwen3"), tmp_path / "latency.json", tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 3}))
    argv = ["latency", "--model", str(model), "--device", "cpu", "--prompt-len", "8", "--gen", "12", "--batch", "2",
            "--ttft-prompt-len", "0", "--json-schema", str(schema), "--json", str(out)]
    assert bench.main(argv) == 0
    rows = _rows(out)
    assert rows["json-schema"]["tok_s"] > 0 and rows["json-schema"]["free_tok_s"] == rows["latency"]["tok_s"]
    assert "tok/s/seq constrained vs" in capsys.readouterr().out
    argv = ["throughput", "--model", str(model), "--device", "cpu", "--num-requests", "3", "--min-len", "4",
            "--max-len", "10", "--max-num-seqs", "4", "--json-schema", str(schema), "--json", str(out)]
    assert bench.main(argv) == 0
    rows = _rows(out)
    assert rows["json-schema"]["tok_s"] > 0 and rows["json-schema"]["free_tok_s"] == rows["throughput"]["tok_s"]
