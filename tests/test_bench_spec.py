"""`outrider bench spec` on the CPU: both sources (random-weights presets with controlled acceptance, and a real
checkpoint with its drafter) print their lines and write JSON whose numbers agree with each other and with the
workload; the controlled drafter keeps each position with the asked probability."""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import time

import pytest

from outrider import bench, demo
from outrider.bench import spec
from outrider.bench.controlled import ControlledDrafter
from outrider.bench.profile import patched
from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.speculative.drafter import Proposals

GEN, REQUESTS, REPEATS = 9, 2, 2


def _results(path) -> list[dict]:
    return json.loads(path.read_text())["results"]


def _check_timed(row: dict, clocked: bool = False) -> None:
    """Both sides generated the whole workload in every timed pass, speculation changed no token, each side's
    best pass is the one reported, and every timed step was timed."""
    assert row["requests"] == math.ceil(REQUESTS / row["batch"]) * row["batch"]  # whole waves
    assert row["tokens"] == row["requests"] * GEN
    assert row["identical"] == row["requests"]
    repeats = row["repeats"]
    assert len(row["plain_pass_s"]) == len(row["spec_pass_s"]) == repeats
    assert row["plain_tok_s"] == pytest.approx(row["tokens"] / min(row["plain_pass_s"]))
    assert row["spec_tok_s"] == pytest.approx(row["tokens"] / min(row["spec_pass_s"]))
    assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"])
    ratios = [p / s for p, s in zip(row["plain_pass_s"], row["spec_pass_s"])]  # (the same tokens each pass)
    assert row["paired_speedup"] == pytest.approx(statistics.median(ratios))
    for side, passes in (("plain_steps", row["plain_pass_s"]), ("spec_steps", row["spec_pass_s"])):
        steps = row[side]
        assert len(steps["slow"]) == repeats
        assert 0 < steps["median_ms"] <= steps["max_ms"] and 0 < steps["prefill_median_ms"] <= steps["max_ms"]
        # where a pass went: every step under what it committed (the slow ones under their kind as well), its
        # steps' time within the pass's
        kinds = {kind: entry for kind, entry in steps["split"].items() if not kind.startswith("slow ")}
        assert set(kinds) <= {"prompt", "round", "decode"} and kinds["prompt"][0] >= 1
        assert ("round" in kinds) == (side == "spec_steps" and row["rounds"] > 0)
        assert sum(ms for _, ms in kinds.values()) <= 1e3 * statistics.mean(passes)
        for kind, (n, ms) in steps["split"].items():
            if kind.startswith("slow "):
                assert 0 < n <= kinds[kind[5:]][0] and 0 < ms <= kinds[kind[5:]][1]
    if not clocked:
        assert row["plain_clock_mhz"] is None and row["spec_clock_mhz"] is None  # no GPU clock on the CPU
    plain = row["plain_decode_step"]
    assert plain["steps"] > 0 and plain["mean_ms"] > 0 and plain["median_ms"] > 0


def _check_workload(row: dict) -> None:
    """_check_timed, and the profiled pass split its rounds."""
    _check_timed(row)
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
            "--prompt-len", "10", "--repeats", str(REPEATS), "--json", str(out)]
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
    assert printed.count(f"best of {REPEATS}; speedup") == 4 and printed.count("slow steps (> 20x") == 4


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
        assert row["repeats"] == 3  # the default
        assert row["kind"] == "draft" and row["acceptance"] is None and row["tau_theory"] is None
        assert row["tau"] > 1.0  # the trained draft model gets drafts accepted
        # (positions up to the longest draft made: the cap of 4, or a shorter length the policy kept, KEEP_MARGIN)
        assert 1 <= len(row["accepted_by_position"]) <= 4 and all(0 <= a <= 1 for a in row["accepted_by_position"])
    assert "theory" not in printed


def test_a_disturbed_timed_step_is_counted_slow_and_the_best_pass_is_the_undisturbed_one(tmp_path, capsys,
                                                                                           monkeypatch):
    """One step of the first timed speculative pass sleeps 100x the steps before it; and the plain engine, sharing
    the model with a DFlash engine, taps no layers for a drafter in its forwards, as it would alone."""
    decode = spec._decode
    spec_passes, aux, slept = [], {"plain": set(), "spec": set()}, []

    def disturb_once(step):
        took = []

        def step_timed():
            if len(took) == 2:  # a decode step (the first commits the prompts)
                slept.append(100 * max(took))
                time.sleep(slept[0])
            t = time.perf_counter()
            step()
            took.append(time.perf_counter() - t)

        return step_timed

    def watched(engine, *args, **kwargs):
        side = "spec" if engine.speculation is not None else "plain"
        aux[side].add(engine.runner.aux_layer_ids)  # (what every forward of this engine taps)
        if side == "spec":
            spec_passes.append(engine)
            if len(spec_passes) == 2:  # warm-up, then the first timed pass (the profiled pass comes last)
                with patched((engine, "step", disturb_once)):
                    return decode(engine, *args, **kwargs)
        return decode(engine, *args, **kwargs)

    monkeypatch.setattr(spec, "_decode", watched)
    out = tmp_path / "spec.json"
    argv = ["spec", "--random-weights", "tiny-qwen3", "--spec-type", "dflash", "--acceptance", "1", "--device", "cpu",
            "--batch", "2", "--gen", str(GEN), "--num-requests", str(REQUESTS), "--draft-n-max", "3",
            "--prompt-len", "10", "--repeats", str(REPEATS), "--json", str(out)]
    assert bench.main(argv) == 0
    (row,) = _results(out)
    _check_workload(row)
    assert len(spec_passes) == 2 + REPEATS and len(slept) == 1
    assert row["spec_steps"]["slow"][0] >= 1 and row["spec_steps"]["max_ms"] >= 1e3 * slept[0]
    slow_ms = sum(ms for kind, (_, ms) in row["spec_steps"]["split"].items() if kind.startswith("slow "))
    assert slow_ms >= 1e3 * slept[0] / REPEATS  # (a mean over the passes)
    assert row["spec_pass_s"][0] > slept[0]  # the best pass is the other one
    assert row["spec_tok_s"] == pytest.approx(row["tokens"] / row["spec_pass_s"][1])
    printed = capsys.readouterr().out
    reported = re.search(r"speculative (\d+) \(slowest ([\d.]+) ms\)", printed)
    assert int(reported[1]) == sum(row["spec_steps"]["slow"]) and float(reported[2]) >= 1e3 * slept[0]
    assert aux["plain"] == {()} and len(aux["spec"]) == 1 and () not in aux["spec"]


def test_a_drafter_that_drafts_nothing_reports_its_undrafted_step_beside_the_plain_decode_step(tmp_path, capsys,
                                                                                              monkeypatch):
    """N-gram lookup that never finds enough earlier occurrences: every decode step of the speculative engine is
    undrafted, and its synchronised cost is set beside the plain engine's decode step. (And the GPU clock read
    around each timed pass, here a stand-in for NVML's, reaches the JSON and the line.)"""
    readings = iter(range(1000, 2000, 10))
    monkeypatch.setattr(spec, "_sm_clock", lambda device: next(readings))
    out = tmp_path / "spec.json"
    argv = ["spec", "--model", str(demo.demo_path("target")), "--spec-type", "ngram",
            "--spec-ngram-simple-min-hits", "100000", "--device", "cpu", "--batch", "2", "--gen", str(GEN),
            "--num-requests", str(REQUESTS), "--repeats", str(REPEATS), "--json", str(out)]
    assert bench.main(argv) == 0
    (row,) = _results(out)
    _check_timed(row, clocked=True)
    assert row["rounds"] == 0 and row["split"]["steps"] == 0
    # Every step of the profiled pass but the first (it carries the prompts), on each side: one wave of GEN tokens
    undrafted, plain = row["undrafted_step"], row["plain_decode_step"]
    assert undrafted["steps"] == plain["steps"] == GEN - 1
    assert undrafted["mean_ms"] > 0 and undrafted["median_ms"] > 0
    printed = capsys.readouterr().out
    assert (f"speculative {undrafted['mean_ms']:.3f} / {undrafted['median_ms']:.3f} over {GEN - 1} steps"
            in printed)
    clocks = {side: row[f"{side}_clock_mhz"] for side in ("plain", "spec")}
    assert all(len(c) == REPEATS and all(start < end for start, end in c) for c in clocks.values())
    for name, side in (("plain", "plain"), ("speculative", "spec")):
        readings = [mhz for pair in clocks[side] for mhz in pair]
        assert f"{name} {min(readings)}-{max(readings)} MHz" in printed


def test_requests_leaving_the_recording_are_counted_per_timed_pass_not_summed_over_repeats(tmp_path, monkeypatch):
    """A recording that is wrong from the first generated token on: in every timed pass every request leaves it
    (the target still commits its own tokens, so the outputs stay identical)."""
    expect = ControlledDrafter.expect

    def wrong_recording(self, request_id, sequence, stream):
        prompt = len(sequence) - GEN
        expect(self, request_id, sequence[:prompt] + [(t + 1) % self.vocab_size for t in sequence[prompt:]], stream)

    monkeypatch.setattr(ControlledDrafter, "expect", wrong_recording)
    out = tmp_path / "spec.json"
    argv = ["spec", "--random-weights", "tiny-qwen3", "--spec-type", "draft", "--acceptance", "1", "--device", "cpu",
            "--batch", "2", "--gen", str(GEN), "--num-requests", str(REQUESTS), "--draft-n-max", "3",
            "--prompt-len", "10", "--repeats", "3", "--json", str(out)]
    assert bench.main(argv) == 0
    (row,) = _results(out)
    assert row["off_script"] == row["identical"] == row["requests"] == REQUESTS


@pytest.mark.parametrize("argv, why", [
    (["--random-weights", "tiny-qwen3", "--spec-type", "draft"], "--acceptance"),
    (["--random-weights", "tiny-qwen3", "--acceptance", "1"], "--spec-type"),
    (["--random-weights", "tiny-qwen3", "--spec-type", "draft", "--acceptance", "1.5"], "[0, 1]"),
    (["--random-weights", "qwen3-0.6b", "--spec-type", "mtp", "--acceptance", "1"], "no drafter preset"),
    (["--model", "x", "--prompt-len", "5"], "--prompt-len needs --random-weights"),
    (["--model", "x", "--repeats", "0"], "--repeats must be >= 1"),
    (["--model", "x", "--gpu-memory-utilization", "0.5"], "sized to hold the workload"),
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


def test_controlled_drafter_realises_the_acceptance_law_within_a_few_hundred_rounds():
    """One request's rounds are stratified: 300 of them keep each leading position as often as α^j says, to within
    a few rounds (independent draws stray by about sqrt(300 p (1 - p)), 7 rounds at p = 0.5)."""
    alpha, k, vocab, rounds = 0.8, 4, 50, 300
    script = list(range(1, 40))
    for stream in range(10):
        ctl = ControlledDrafter(_FixedLengthDrafter(), alpha, vocab, seed=0)
        req = Request(script[:20], SamplingParams(max_tokens=20))
        ctl.expect(req.request_id, script, stream=stream)
        at_least = [0] * (k + 1)
        for _ in range(rounds):
            drafts = ctl.propose([req], [k]).tokens[0]
            n = next((j for j, (d, t) in enumerate(zip(drafts, script[20:])) if d != t), k)
            for j in range(n + 1):
                at_least[j] += 1
        for j in range(1, k + 1):
            assert abs(at_least[j] - rounds * alpha ** j) <= 3, (stream, j, at_least)


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_hybrid_target_presets_run_controlled_acceptance(kind, tmp_path):
    """The Qwen3.5 presets' code paths at a tiny shape: a tied hybrid target, its own MTP head (mtp.*, the gated
    full-attention layer) or a DFlash drafter in the newer layout (sliding layers), every draft kept or none."""
    out = tmp_path / "spec.json"
    argv = ["spec", "--random-weights", "tiny-qwen3.5", "--spec-type", kind, "--acceptance", "0", "1", "--device",
            "cpu", "--batch", "2", "--gen", str(GEN), "--num-requests", "2", "--draft-n-max", "3",
            "--prompt-len", "10", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = _results(out)
    assert [r["acceptance"] for r in rows] == [0.0, 1.0]
    for row in rows:
        assert row["kind"] == kind and row["off_script"] == 0
    assert rows[1]["accepted_by_position"] == [1.0] * 3 and rows[0]["tau"] == 1.0
