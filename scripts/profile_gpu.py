"""Where a decode step's GPU time goes: kernel table from torch.profiler over engine decode steps (GPU only).

For each --random-weights shape and batch size, runs `--steps` decode steps of the real engine (CUDA graphs on,
unless --eager) under torch.profiler and prints: wall ms/step, GPU-busy ms/step (sum of kernel and copy times),
the gap between the two (host work the GPU waits for), and the kernels by total time. --timeline N lists the
last step's first N GPU events in start order, each with its start, duration and the gap since the previous
one ended (negative: they overlapped, as PDL allows).

    python scripts/profile_gpu.py --model qwen3-0.6b --batch 1 [--eager] [--top 25] [--timeline 30]

With --prefills N it profiles N lone prompts of --prompt-len tokens instead (each a new request of one output
token, run to its end), per prompt: where a prompt's time goes, and how often the host waits for the device.

    python scripts/profile_gpu.py --model qwen3.5-4b --prefills 8 --timeline 40

With --spec-type KIND (a drafter preset of bench/drafter_shapes.py, random weights) every decode step drafts
--k tokens per request (the policy bypassed; the random drafts are mostly rejected, which changes acceptance,
not what a round of k drafts costs), or with --k 0 none: the cost of having the drafter loaded.

    python scripts/profile_gpu.py --model qwen3-8b --batch 1 --spec-type dflash --k 0|15

With --weights-format FMT the shape's weights are `bench quant`'s random checkpoint in that format (a GGUF mix,
fp8 or awq; written to --checkpoint-dir once, or read from there) loaded as that benchmark loads it; with
--spec-type, the target's projections are quantized in place as `bench spec --weights-format` does.

    python scripts/profile_gpu.py --model qwen3-8b --batch 1 --weights-format q4_k_m --checkpoint-dir /tmp/oq
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from outrider.bench.engine_setup import build_engine, engine_config
from outrider.engine import builder
from outrider.engine.engine import Engine
from outrider.engine.request import Request
from outrider.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeline", type=int, default=0, metavar="N")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spec-type", choices=["draft", "mtp", "dflash", "eagle3"], help="load this drafter preset")
    ap.add_argument("--k", type=int, default=0, help="with --spec-type: drafts per request every decode step")
    ap.add_argument("--prefills", type=int, default=0, metavar="N", help="profile N lone prompts, not decode steps")
    ap.add_argument("--weights-format", help="bench quant's checkpoint of the shape in this format")
    ap.add_argument("--checkpoint-dir", default="/tmp/oq", help="where --weights-format's checkpoint is kept")
    a = ap.parse_args()
    args = SimpleNamespace(random_weights=a.model, model=None, device=a.device, eager=a.eager, dtype="auto",
                           gpu_memory_utilization=0.9, no_overlap=a.no_overlap,
                           prefill_graph_tokens=0)
    limits = dict(max_num_seqs=a.batch, max_model_len=a.prompt_len + (4 + a.k) * a.steps + 64,
                  max_num_batched_tokens=max(2048, a.batch * a.prompt_len))
    if a.spec_type:
        engine = drafting_engine(args, a, limits)
    elif a.weights_format:
        from outrider.bench.quant import write_checkpoint
        from outrider.models import load_model

        path, _ = write_checkpoint(a.model, a.weights_format, Path(a.checkpoint_dir))
        engine = build_engine(args, **limits, preloaded=load_model(path, dtype="bfloat16", device=a.device))
    else:
        engine = build_engine(args, **limits)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4 * a.steps, temperature=a.temperature, seed=0, ignore_eos=True)
    for b in range(a.batch):
        engine.add_request(Request([(7 * b + i) % vocab for i in range(a.prompt_len)], params), lambda out: None)
    for _ in range(a.steps):  # prefill, then decode steps to warm everything up
        engine.step()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    if a.spec_type and not a.prefills:
        host_split(engine, a.steps, sync)
    prompts = iter(range(1, 1 << 30))

    def prefill() -> None:  # one lone prompt (a fresh one: no prefix hit), to its one output token
        done = []
        first = next(prompts)
        engine.add_request(Request([(first * 131 + 7 * i) % vocab for i in range(a.prompt_len)],
                                   SamplingParams(max_tokens=1, temperature=0.0)), done.append)
        while not any(out.finished for out in done):
            engine.step()

    units = a.prefills or a.steps
    work = prefill if a.prefills else engine.step
    if a.prefills:
        while engine.has_work():
            engine.step()
        for _ in range(2):
            prefill()
        sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(units):
            work()
        sync()
        wall = (time.perf_counter() - t0) / units
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy = 0.0
    gpu_events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    for ev in gpu_events:
        t = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        by_name[ev.name][0] += t
        by_name[ev.name][1] += 1
        busy += t
    busy_ms = busy / 1e3 / units
    drafting = f" {a.spec_type} k={a.k}" if a.spec_type else ""
    unit = f"prompt of {a.prompt_len}" if a.prefills else "step"
    print(f"== {a.model}{drafting} bs={a.batch} {'eager' if a.eager else 'graphs'} T={a.temperature}: wall "
          f"{wall * 1e3:.3f} ms/{unit}, GPU busy {busy_ms:.3f} ms/{unit}, "
          f"host gap {wall * 1e3 - busy_ms:.3f} ms/{unit}")
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]
    for name, (tot, cnt) in rows:
        print(f"  {tot / 1e3 / units:8.4f} ms/{unit}  {cnt / units:6.1f}/{unit}  {tot / max(cnt, 1):8.2f} us/call  "
              f"{name[:110]}")
    host_calls(prof.events(), units)
    if a.timeline:
        idle_gaps(gpu_events, units)
        timeline(gpu_events, units, a.timeline)


def drafting_engine(args, a, limits: dict) -> Engine:
    """The shape's random-weights target with a drafter preset loaded, drafting a.k tokens per decoding request
    at every step (the policy's choice replaced)."""
    from outrider.bench.drafter_shapes import preset, write_preset
    from outrider.bench.shapes import random_model

    dtype = torch.bfloat16
    shape = preset(a.model, a.spec_type)
    paths = write_preset(a.model, shape, Path(tempfile.mkdtemp(prefix="outrider-profile-")), dtype, 0)
    model = random_model(a.model, torch.device(a.device), dtype)
    if a.weights_format:  # as bench spec quantizes its target: the decoder's projections, in place
        from outrider.bench.shapes import RANDOM_MODELS
        from outrider.quant.writers import quantize_projections_randomly

        quantize_projections_randomly(model[0], RANDOM_MODELS[a.model], a.weights_format)
        torch.cuda.empty_cache()
    engine = builder.build_engine(engine_config(args, str(paths.target), spec_type=shape.kind,
                                                spec_draft_n_max=max(a.k, 1),
                                                draft_model=str(paths.draft) if paths.draft else None, **limits),
                                  preloaded=model)
    # (the policy's decision, which drafting ahead takes too, not the speculator's)
    engine.speculation.policy.draft_lengths = lambda requests, drafter, in_flight=None, explore=True: [a.k] * len(requests)
    return engine


def host_split(engine: Engine, steps: int, sync) -> None:
    """Host wall time of each phase of `steps` engine steps, timed without synchronising: where the host's time
    goes, and how long it waits for the device (`settle`: the verdict's copy; `ready`: a plain step's)."""
    from outrider.speculative import verify

    spent: dict[str, float] = defaultdict(float)

    def timed(owner, name: str, label: str):
        inner, original = getattr(owner, name), owner.__dict__.get(name)  # (None: an instance's bound method)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t
        setattr(owner, name, wrapper)
        return lambda: delattr(owner, name) if original is None else setattr(owner, name, original)

    spec = engine.speculation.speculator
    undo = [timed(engine.runner, "launch", "runner.launch"), timed(engine.runner, "sample", "runner.sample"),
            timed(engine, "deliver", "engine.deliver"),
            timed(engine.scheduler, "schedule", "scheduler.schedule"),
            timed(spec, "draft_lengths", "speculator.draft_lengths"), timed(spec, "propose", "speculator.propose"),
            timed(spec, "draft_ahead", "speculator.draft_ahead"), timed(spec, "learn", "speculator.learn"),
            timed(verify.PendingVerdict, "settle", "PendingVerdict.settle (waits)")]
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall = time.perf_counter() - t0
    for u in reversed(undo):
        u()
    print(f"== host split, unprofiled (ms/step of {wall * 1e3 / steps:.3f}; nested phases overlap)")
    for label, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {sec * 1e3 / steps:8.4f}  {label}")


def host_calls(events, steps: int) -> None:
    """The CUDA runtime calls by host time: where the host blocks (synchronisations, pageable copies)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CUDA and ev.name.startswith("cuda"):
            totals[ev.name][0] += ev.cpu_time_total
            totals[ev.name][1] += 1
    print("== CUDA runtime calls on the host (ms/step, calls/step)")
    for name, (tot, cnt) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"  {tot / 1e3 / steps:8.4f} ms/step  {cnt / steps:6.1f}/step  {name[:80]}")


def idle_gaps(events, steps: int, top: int = 12) -> None:
    """Where the GPU sat idle over the profiled steps: the total of gaps by size, and the longest gaps with the
    events on either side (what the device finished, and what it waited to start)."""
    events = sorted(events, key=lambda ev: ev.time_range.start)
    gaps = []
    end = events[0].time_range.end
    for before, ev in zip(events, events[1:]):
        gap = ev.time_range.start - end
        if gap > 0:
            gaps.append((gap, before.name, ev.name))
        end = max(end, ev.time_range.end)
    small = sum(g for g, _, _ in gaps if g < 10)
    print(f"== GPU idle per step: {sum(g for g, _, _ in gaps) / 1e3 / steps:.3f} ms, of which gaps under 10 us "
          f"{small / 1e3 / steps:.3f} ms ({sum(1 for g, _, _ in gaps if g < 10) / steps:.0f} of them); longest:")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap:9.1f} us  after {before[:50]}  before {after[:50]}")


def timeline(events, steps: int, n: int) -> None:
    """The first n GPU events of the last profiled step (events split evenly over the steps), in start order."""
    events = sorted(events, key=lambda ev: ev.time_range.start)
    last = events[len(events) - len(events) // steps:][:n]
    print(f"== timeline of the last step's first {len(last)} GPU events (us: start, duration, gap since the "
          "previous one ended)")
    t0 = prev_end = last[0].time_range.start
    for ev in last:
        start, end = ev.time_range.start, ev.time_range.end
        print(f"  {start - t0:9.2f} {end - start:8.2f} {start - prev_end:+8.2f}  {ev.name[:90]}")
        prev_end = max(prev_end, end)


if __name__ == "__main__":
    main()
