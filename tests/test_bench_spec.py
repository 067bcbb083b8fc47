"""`outrider bench spec` on the CPU: both sources (random-weights presets with controlled acceptance, and a real
checkpoint with its drafter) print their lines and write JSON whose numbers agree with each other and with the
workload; the controlled drafter keeps each position with the asked probability."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from outrider import bench, demo
from outrider.bench.controlled import ControlledDrafter
from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.speculative import Proposals

GEN, REQUESTS = 9, 2


def _results(path) -> list[dict]:
    return json.loads(path.read_text())["results"]


def _check_workload(row: dict) -> None:
    """Both passes generated the whole workload, speculation changed no token, and the speedup is the ratio."""
    assert row["requests"] == math.ceil(REQUESTS / row["batch"]) * row["batch"]  # whole waves
    assert row["tokens"] == row["requests"] * GEN
    assert row["identical"] == row["requests"]
    assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"])
    split = row["split"]
    assert split["steps"] > 0 and split["draft_ms"] > 0 and split["verify_ms"] > 0 and split["host_ms"] >= 0
    # On the CPU no CUDA graph exists: every verify forward of the profiled pass ran eager, and it has at least
    # one per profiled round (a round's verify is one forward)
    assert split["verify_eager"] >= split["steps"] and split["draft_graph"] is None and split["draft_eager"] is None


@pytest.mark.parametrize("kind", ["draft", "mtp", "dflash", "eagle3"])
def test_controlled_acceptance_one_accepts_every_draft_and_zero_none(kind, tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = ["spec", "--random-weights", "tiny-qwen3", "--spec-type", kind, "--acceptance", "0", "1", "--device",
            "cpu", "--batch", "1", "2", "--gen", str(GEN), "--num-requests", str(REQUESTS), "--draft-n-max", "3",
            "--prompt-len", "10", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    rows = _results(out)
    assert [(r["batch"], r["acceptance"]) for r in rows] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
    for row in rows:
        _check_workload(row)
        assert row["kind"] == kind and row["off_script"] == 0 and row["draft_n_max"] == 3
        if row["acceptance"] == 1.0:  # every draft kept: k + 1 tokens every round, as the formula says
            assert row["rounds"] > 0 and row["accepted_by_position"] == [1.0] * 3
            assert row["tau"] == pytest.approx(row["mean_k"] + 1) == pytest.approx(row["tau_theory"])
            assert row["tau_theory_n_max"] == 4.0
        else:  # nothing kept: one token a round
            assert row["tau"] == row["tau_theory"] == row["tau_theory_n_max"] == 1.0
            assert set(row["accepted_by_position"]) <= {0.0}
    assert printed.count(f"spec {kind} bs=") == 4 and printed.count("round ms: draft ") == 4


def test_random_weights_commit_the_same_tokens_plain_and_speculative_in_bfloat16(tmp_path):
    """Random weights leave near-ties that bf16 rounding resolves differently in a verify step than in a plain
    one; the presets' target has a decisive successor per token, so the recording stays the target's choice."""
    out = tmp_path / "spec.json"
    argv = ["spec", "--random-weights", "tiny-qwen3", "--spec-type", "dflash", "--acceptance", "1", "--device", "cpu",
            "--dtype", "bfloat16", "--batch", "4", "--gen", "33", "--num-requests", "4", "--draft-n-max", "3",
            "--prompt-len", "16", "--json", str(out)]
    assert bench.main(argv) == 0
    (row,) = _results(out)
    assert row["identical"] == 4 and row["off_script"] == 0 and row["tau"] == 4.0


def test_checkpoint_with_its_drafter_on_the_demo_prompts(tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = ["spec", "--model", str(demo.demo_path("target")), "--draft-model", str(demo.demo_path("draft")),
            "--device", "cpu", "--batch", "1", "2", "--gen", str(GEN), "--num-requests", str(REQUESTS),
            "--draft-n-max", "4", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    rows = _results(out)
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        _check_workload(row)
        assert row["kind"] == "draft" and row["acceptance"] is None and row["tau_theory"] is None
        assert row["tau"] > 1.0  # the trained draft model gets drafts accepted
        assert len(row["accepted_by_position"]) == 4 and all(0 <= a <= 1 for a in row["accepted_by_position"])
    assert "theory" not in printed


@pytest.mark.parametrize("argv, why", [
    (["--random-weights", "tiny-qwen3", "--spec-type", "draft"], "--acceptance"),
    (["--random-weights", "tiny-qwen3", "--acceptance", "1"], "--spec-type"),
    (["--random-weights", "tiny-qwen3", "--spec-type", "draft", "--acceptance", "1.5"], "[0, 1]"),
    (["--random-weights", "qwen3-0.6b", "--spec-type", "mtp", "--acceptance", "1"], "no drafter preset"),
    (["--model", "x", "--prompt-len", "5"], "--prompt-len needs --random-weights"),
])
def test_misused_flags_are_refused_before_anything_loads(argv, why):
    with pytest.raises(SystemExit, match=re.escape(why)):
        bench.main(["spec", "--device", "cpu", *argv])


class _FixedLengthDrafter:
    """The wrapped drafter: proposes ks[i] arbitrary tokens (what they are does not matter, only how many)."""

    kind = "draft"

    def propose(self, requests, ks):
        return Proposals([[7] * k for k in ks], [[0.5] * k for k in ks])


def test_controlled_drafter_keeps_each_position_with_probability_alpha():
    alpha, k, vocab, trials = 0.6, 4, 50, 3000
    rng = random.Random(1)
    script = [rng.randrange(vocab) for _ in range(40)]
    ctl = ControlledDrafter(_FixedLengthDrafter(), alpha, vocab, seed=3)
    kept = [0] * (k + 1)
    for i in range(trials):
        req = Request(script[:20], SamplingParams(max_tokens=20))
        ctl.expect(req.request_id, script, stream=i)
        drafts = ctl.propose([req], [k]).tokens[0]
        truth = script[20:20 + k]
        n = next((j for j, (d, t) in enumerate(zip(drafts, truth)) if d != t), k)
        assert len(drafts) == k and all(d != t for d, t in zip(drafts[n:], truth[n:]))  # every later slot misses
        kept[n] += 1
    for n in range(k + 1):  # P(first n kept, then a miss) = alpha^n (1 - alpha), and alpha^k for all kept
        p = alpha ** n * (1 - alpha if n < k else 1)
        assert abs(kept[n] / trials - p) < 4 * math.sqrt(p * (1 - p) / trials)
    assert not ctl.off_script and ctl.kind == "draft"  # the wrapped drafter's members show through
