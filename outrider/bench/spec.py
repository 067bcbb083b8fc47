"""`bench spec`: speculative against plain decoding in one run, on the same prompts and seeds.

Sources:
- a checkpoint and its drafter (`--model` with `--draft-model` and/or `--spec-type`), on text prompts (default:
  the demo family's held-out prompts);
- a random-weights shape and a drafter preset of a stated shape (`--random-weights` with `--spec-type`,
  bench/drafter_shapes.py) on random prompts, with controlled acceptance (`--acceptance`, bench/controlled.py).
  `--acceptance` applies to a checkpoint's drafter too.

Both engines are built up front and stay alive together: the plain one (no drafter) and the speculative one
share the preloaded target weights, and each KV pool is sized to hold the workload and no more, so both fit on one
GPU. (Which target layers a forward taps for the drafter is the runner's, passed per call: the plain engine runs
as it would alone.)

Per batch size, the plain engine runs the workload once to warm up and record every request's output. Per
acceptance, the speculative engine warms up on one wave (at the first acceptance), then --repeats rounds of one
timed pass per side, the order alternating (plain first, then speculative first, ...) so that a drift does not
favour one side, then each engine runs a profiled pass, back to back (speculative: rounds counted; synchronising
timers split each round into draft, verify and host; these slower steps do not feed the policy's measured costs,
and coming last, they see the policy as the timed passes left it, not as warm-up did). Each side's best pass is
reported, speedup = best rate over best rate, with the median ratio of the paired passes beside it; every pass's
seconds go to the JSON. A workload is --num-requests requests (rounded up to a multiple of the batch size) of
--gen tokens each, greedy with ignore_eos, in waves of batch-size requests; tok/s is every generated token over a
timed pass's wall time, prefill included.

What disturbs a host-bound target shows instead of becoming a speedup: every Engine.step of the timed passes is
timed, and a step slower than SLOW_FACTOR x the median of its kind (steps that commit a prompt's first token, and
the rest) counts as slow (a JIT compile, a GC pause, a graph recapture); on CUDA the SM clock (NVML) is read at
the start and the end of each timed pass. And what a step costs with a drafter loaded that drafts nothing: both
profiled passes time each pure decode step (no prefill, no drafts in the plan launched) with the same
synchronising timer as the round split, so the speculative engine's undrafted step is set beside the plain
engine's decode step measured the same way. (Not from the timed passes: with overlap scheduling an unsynchronised
step's wall time holds part of the step before it.) The timed passes do say where their time went by what each step
committed (a prompt's first token, else a verify round, else plain tokens), the slow steps' share beside: read
from the wave's request timings around each step, the same few additions on both sides.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from outrider.bench.controlled import ControlledDrafter, RoundScript
from outrider.bench.engine_setup import engine_config
from outrider.bench.profile import PhaseTimer, patched
from outrider.config import EngineConfig, NgramConfig
from outrider.graphs import CudaGraphRunner
from outrider.engine.builder import build_engine, device_rounds_for
from outrider.engine.engine import Engine
from outrider.engine.request import Request
from outrider.params import SamplingParams
from outrider.speculative.device_round import DeviceRound
from outrider.speculative.drafter import expected_tokens


SLOW_FACTOR = 20  # a timed step this many times its kind's median was disturbed
STEP_KINDS = ("prompt", "round", "decode")  # a step committed a prompt's first token, else a verify round, else neither


@dataclass(frozen=True)
class Pass:
    """One run of a workload."""

    outputs: list[list[int]]  # per request, in workload order
    request_ids: list[int]  # in workload order
    seconds: float
    steps: int  # engine steps launched
    step_s: list[float]  # the wall time of every Engine.step call
    prefill: list[bool]  # per call: it committed a prompt's first token (the prompt's device time is in it)
    rounds: list[bool]  # per call: it committed a verify round of some request (and no prompt's first token)
    clock_mhz: tuple[int, int] | None  # the GPU's SM clock at the start and the end; None: not CUDA, or no NVML

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


@dataclass(frozen=True)
class StepTimes:
    """One side's Engine.step wall times over its timed passes. A step that commits a prompt's first token (it
    carries the prefill) is judged against the median of such steps, any other step against the median of the
    others; slower than SLOW_FACTOR x that median, it is slow: its pass was disturbed."""

    median_ms: float  # of the steps that commit no prompt
    prefill_median_ms: float
    slow: list[int]  # per timed pass
    max_ms: float  # the slowest step of any pass
    # Where a pass's time went, by what its steps committed (STEP_KINDS), mean of the timed passes: [steps, ms]; the
    # slow steps' share as well, under "slow KIND"
    split: dict[str, list[float]]

    @classmethod
    def of(cls, passes: Sequence[Pass]) -> StepTimes:
        median = {kind: statistics.median(s for p in passes for s, f in zip(p.step_s, p.prefill) if f == kind)
                  for kind in (False, True)}
        slow = [sum(s > SLOW_FACTOR * median[f] for s, f in zip(p.step_s, p.prefill)) for p in passes]
        split: dict[str, list[float]] = {}
        for p in passes:
            for s, f, r in zip(p.step_s, p.prefill, p.rounds):
                kind = STEP_KINDS[0 if f else 1 if r else 2]
                for key in (kind, f"slow {kind}") if s > SLOW_FACTOR * median[f] else (kind,):
                    entry = split.setdefault(key, [0.0, 0.0])
                    entry[0] += 1 / len(passes)
                    entry[1] += 1e3 * s / len(passes)
        order = [*STEP_KINDS, *(f"slow {kind}" for kind in STEP_KINDS)]
        return cls(1e3 * median[False], 1e3 * median[True], slow, 1e3 * max(max(p.step_s) for p in passes),
                   {key: split[key] for key in order if key in split})


@dataclass(frozen=True)
class RoundSplit:
    """The mean ms of one round: an engine step that verifies drafts (for every request of the batch at once; no
    prefill in it), measured with synchronising timers. draft = the drafter's propose (or stage) and on_commit,
    verify = the runner's launch, sample (the acceptance test) and collect, host = the rest of Engine.step."""

    draft_ms: float
    verify_ms: float
    host_ms: float
    steps: int
    verify_eager: int  # rounds whose target forward ran eager (no captured verify graph fitted)
    # The drafter's forwards that replayed one of its CUDA graphs / ran eager (both None: it has no graphs)
    draft_graph: int | None
    draft_eager: int | None

    @property
    def total_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.host_ms


@dataclass(frozen=True)
class StepCost:
    """The synchronised ms of an engine's pure decode steps that carried no drafts (no prefill, no draft token in
    the step launched), in its profiled pass. The median beside the mean: one stalled step moves only the mean."""

    mean_ms: float
    median_ms: float
    steps: int


@dataclass(frozen=True)
class Rounds:
    """What the target verified: (drafts k, accepted m) per request and round (a request round)."""

    rounds: list[tuple[int, int]]
    undrafted: int  # decode steps of a request that carried no drafts (the policy chose k = 0)

    @property
    def tau(self) -> float:
        """Tokens committed per round: 1 + accepted drafts."""
        return 1.0 + sum(m for _, m in self.rounds) / len(self.rounds) if self.rounds else 1.0

    @property
    def mean_k(self) -> float:
        return sum(k for k, _ in self.rounds) / len(self.rounds) if self.rounds else 0.0

    def accepted_by_position(self) -> list[float]:
        """[j]: of the rounds that drafted a token at position j+1, the fraction whose draft there was accepted."""
        depth = max((k for k, _ in self.rounds), default=0)
        return [sum(m > j for _, m in self.rounds) / sum(k > j for k, _ in self.rounds) for j in range(depth)]

    def tau_theory(self, alpha: float) -> float:
        """E[tau] at per-position acceptance alpha, for the k each round drafted."""
        return sum(expected_tokens(alpha, k) for k, _ in self.rounds) / len(self.rounds) if self.rounds else 1.0


@dataclass(frozen=True)
class SpecResult:
    kind: str  # the drafter's kind
    batch: int
    acceptance: float | None  # controlled alpha; None: the drafter's own proposals
    draft_n_max: int  # the engine's draft length cap (--draft-n-max, else the drafter's default)
    requests: int
    tokens: int  # generated tokens, in each plain and each speculative timed pass
    plain_tok_s: float  # each side's best timed pass
    spec_tok_s: float
    speedup: float  # spec_tok_s / plain_tok_s
    plain_step_ms: float  # wall time per engine step of each side's best timed pass
    spec_step_ms: float
    tau: float  # tokens per request round
    tau_theory: float | None  # controlled: E[tau] at alpha for the k each round drafted
    tau_theory_n_max: float | None  # controlled: (1 - alpha^(k+1)) / (1 - alpha) at k = draft_n_max
    mean_k: float
    rounds: int  # request rounds
    undrafted: int
    accepted_by_position: list[float]
    split: RoundSplit
    identical: int  # requests whose speculative output equals the plain output, in the worst timed pass
    off_script: int  # controlled: requests whose commits left the plain run's recording, in the worst timed pass
    repeats: int  # timed passes per side
    plain_pass_s: list[float]  # every timed pass's seconds, in the order run
    spec_pass_s: list[float]
    paired_speedup: float  # the median over rounds of the round's speculative rate / plain rate
    plain_steps: StepTimes
    spec_steps: StepTimes
    # The GPU's SM clock (MHz) at the start and the end of each timed pass; None: not CUDA, or NVML unavailable
    plain_clock_mhz: list[tuple[int, int]] | None
    spec_clock_mhz: list[tuple[int, int]] | None
    plain_decode_step: StepCost  # the plain engine's decode step
    undrafted_step: StepCost | None  # the speculative engine's decode step without drafts; None: every one drafted
    # What DraftPolicy had measured of a step at this batch size after the timed passes, ms by draft length (0: a
    # plain step); empty where it chooses from estimates (the CPU's default)
    policy_ms: dict[int, float]


@dataclass(frozen=True)
class Setup:
    """What both engines run: the target (path and preloaded weights), the drafter settings, the prompts."""

    name: str
    target: str  # model path for EngineConfig
    preloaded: tuple[torch.nn.Module, object]
    drafter: dict  # spec_type / draft_model fields for the speculative engine
    prompts: list[list[int]]


def run(args) -> list[SpecResult]:
    _check(args)
    with tempfile.TemporaryDirectory(prefix="outrider-bench-spec-") as root:
        setup = _setup(args, Path(root))
        batches = sorted(set(args.batch))
        workloads = {b: _workload(setup.prompts, b, args.num_requests) for b in batches}
        longest = max(len(p) for p in setup.prompts)
        max_model_len = longest + args.gen + 32
        # Every sequence at full length, and the null block: the engine wants no more (builder._num_kv_blocks),
        # and each engine taking a share of the free GPU memory would leave none for the other.
        blocks = batches[-1] * -(-max_model_len // EngineConfig.block_size) + 1
        limits = dict(max_num_seqs=batches[-1], max_model_len=max_model_len, num_kv_blocks=blocks,
                      max_num_batched_tokens=max(2048, batches[-1] * longest))
        plain = build_engine(engine_config(args, setup.target, spec_type="none", **limits), preloaded=setup.preloaded)
        spec = build_engine(engine_config(args, setup.target, spec_draft_n_max=args.draft_n_max,
                                          spec_device_round=False if args.no_device_round else None,
                                          spec_token_map=args.spec_token_map, **setup.drafter, **limits),
                            preloaded=setup.preloaded)
        if spec.speculation is None:
            raise SystemExit("the speculative engine has no drafter (see the log above for why)")
        print(f"spec: {setup.name}, drafter {spec.drafter_kind}, draft length <= {spec.config.spec_draft_n_max}, "
              f"{args.gen} tokens per request, greedy, device {spec.device} ({spec.dtype}), best of {args.repeats} "
              f"timed passes per side, device rounds {'on' if spec.speculation.rounds else 'off'}", flush=True)
        results = [r for b, prompts in workloads.items() for r in _compare(args, plain, spec, prompts, b)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": setup.name, "device": args.device, "gen": args.gen,
                       "results": [asdict(r) for r in results]}, f, indent=1)
            f.write("\n")
    return results


def _check(args) -> None:
    if args.random_weights:
        if args.spec_type is None or args.acceptance is None:
            raise SystemExit("--random-weights needs --spec-type (the drafter preset) and --acceptance")
        if args.prompts or args.draft_model:
            raise SystemExit("--prompts and --draft-model need --model (random weights draft random prompts)")
    elif args.prompt_len is not None:
        raise SystemExit("--prompt-len needs --random-weights (a checkpoint's prompts come from --prompts)")
    if any(not 0.0 <= a <= 1.0 for a in args.acceptance or ()):
        raise SystemExit("--acceptance values must lie in [0, 1]")
    if min(args.batch) < 1 or args.num_requests < 1 or args.gen < 2 or args.repeats < 1:
        raise SystemExit("--batch, --num-requests and --repeats must be >= 1, --gen >= 2")
    if args.gpu_memory_utilization is not None:
        raise SystemExit("--gpu-memory-utilization does not apply to bench spec: each engine's KV pool is sized to "
                         "hold the workload, so that both engines fit on the GPU together")


def _setup(args, root: Path) -> Setup:
    from outrider.models.loader import resolve_dtype

    device = torch.device(args.device)
    if args.random_weights:
        from outrider.bench.drafter_shapes import preset, write_preset
        from outrider.bench.shapes import RANDOM_MODELS, fix_successors, random_model
        from outrider.models import registry

        name = args.random_weights
        dtype = resolve_dtype(args.dtype, registry.model_config(RANDOM_MODELS[name]), device)
        shape = preset(name, args.spec_type)
        paths = write_preset(name, shape, root, dtype, args.seed)
        model, cfg = random_model(name, device, dtype, args.seed)
        fix_successors(model, args.seed)  # plain and speculative runs then commit the same tokens
        if args.weights_format != "bf16":
            from outrider.quant.writers import quantize_projections_randomly

            quantize_projections_randomly(model, RANDOM_MODELS[name], args.weights_format, args.seed)
            name = f"{name} {args.weights_format}"
            torch.cuda.empty_cache()  # the bf16 projections let go
        rng = random.Random(args.seed)
        count = max(_workload_size(b, args.num_requests) for b in args.batch)
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len or 128)] for _ in range(count)]
        drafter = dict(spec_type=shape.kind, draft_model=str(paths.draft) if paths.draft else None)
        return Setup(f"{name} + {shape.kind} (random weights)", str(paths.target), (model, cfg), drafter, prompts)
    from outrider.models import load_model, resolve_model_path
    from outrider.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(text) for text in _prompt_texts(args.prompts)]
    drafter = dict(spec_type=args.spec_type, draft_model=args.draft_model,
                   spec_ngram=NgramConfig(args.spec_ngram_simple_size_n, args.spec_ngram_simple_size_m,
                                          args.spec_ngram_simple_min_hits))
    return Setup(str(args.model), str(path), load_model(path, dtype=args.dtype, device=device), drafter, prompts)


def _prompt_texts(path: str | None) -> list[str]:
    """A JSON list of strings, or of objects with a "prompt" (the demo's eval_prompts.json, the default)."""
    if path is None:
        from outrider.demo import DEMO_DIR

        path = str(DEMO_DIR / "eval_prompts.json")
    items = json.loads(Path(path).read_text())
    texts = [item if isinstance(item, str) else item.get("prompt") for item in items]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise SystemExit(f"{path}: expected a non-empty JSON list of strings or of objects with a \"prompt\"")
    return texts


def _workload_size(batch: int, num_requests: int) -> int:
    return -(-num_requests // batch) * batch


def _workload(prompts: list[list[int]], batch: int, num_requests: int) -> list[list[int]]:
    """--num-requests prompts, rounded up to whole waves of `batch`, cycling through the prompt list."""
    return [prompts[i % len(prompts)] for i in range(_workload_size(batch, num_requests))]


def _compare(args, plain: Engine, spec: Engine, prompts: list[list[int]], batch: int) -> list[SpecResult]:
    """One batch size's results, one per acceptance."""

    def plain_pass(profile: StepProfile | None = None) -> Pass:
        with profile.instrumented() if profile is not None else nullcontext():
            return _decode(plain, prompts, batch, args)

    recorded = plain_pass()  # (the first pass at this batch size: it warms up too)
    real = spec.speculation.drafter
    vocab = spec.model_config.vocab_size
    results = []
    for n, alpha in enumerate(args.acceptance or [None]):
        ctl = None
        if alpha is not None:  # (device rounds substitute on the device, from a RoundScript: rounds of their own)
            script = RoundScript(max(map(len, prompts)) + args.gen + 2 * real.max_draft + 2, args.gen + 1,
                                 spec.device) if spec.speculation.rounds else None
            ctl = ControlledDrafter(real, alpha, vocab, args.seed, script)

        def register(i: int, req: Request) -> None:
            if ctl is not None:
                ctl.expect(req.request_id, prompts[i] + recorded.outputs[i], stream=i)

        passes = {"plain": plain_pass, "spec": lambda: _decode(spec, prompts, batch, args, register)}
        timed: dict[str, list[Pass]] = {"plain": [], "spec": []}
        if ctl is None:
            drafting = nullcontext()
        else:
            rounds = device_rounds_for(spec, ctl) if ctl.rounds is not None else spec.speculation.rounds
            drafting = spec.speculation.drafting_with(ctl, rounds)
        with drafting:
            if n == 0:
                _decode(spec, prompts[:batch], batch, args, register)  # warm-up: one wave at this batch size
            for i in range(args.repeats):  # P S, S P, P S, ...: a drift does not favour one side
                for side in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                    timed[side].append(passes[side]())
            policy_ms = {k: 1e3 * s for k, s in sorted(spec.speculation.policy.costs.at(batch).items())}
            # The two profiled passes back to back: their decode steps are compared
            plain_profile, profile = StepProfile(plain, None), StepProfile(spec, real)
            plain_pass(plain_profile)
            with profile.instrumented():
                passes["spec"]()
        off_script = max(len(ctl.off_script.intersection(p.request_ids)) for p in timed["spec"]) if ctl else 0
        result = _result(real.kind, batch, alpha, spec.config.spec_draft_n_max, timed["plain"], timed["spec"],
                         recorded, profile, plain_profile, off_script, policy_ms)
        results.append(result)
        print(report(result), flush=True)
    return results


def _decode(engine: Engine, prompts: Sequence[list[int]], batch: int, args,
            register: Callable[[int, Request], None] | None = None) -> Pass:
    """Greedy, --gen tokens each (ignore_eos), in waves of `batch` requests; register(i, request) runs before
    request i is added."""
    outputs: list[list[int]] = [[] for _ in prompts]
    ids: list[int] = []
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True, seed=args.seed)
    counters = engine.counters
    step_s: list[float] = []
    prefill: list[bool] = []
    rounds: list[bool] = []
    wave: list[Request] = []
    steps0 = counters["steps"]
    clock0 = _sm_clock(engine.device)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        wave.clear()
        for i in range(start, min(start + batch, len(prompts))):
            req = Request(list(prompts[i]), params)
            wave.append(req)
            ids.append(req.request_id)
            if register is not None:
                register(i, req)
            engine.add_request(req, lambda out, got=outputs[i]: got.extend(out.new_token_ids))
        verified = 0  # (the wave's rounds so far: its requests are new)
        while engine.has_work():
            prompted = counters["prompt_tokens"]
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
            prefill.append(counters["prompt_tokens"] != prompted)
            before, verified = verified, sum(r.timing.draft_rounds for r in wave)
            rounds.append(verified != before)
    seconds = time.perf_counter() - t0
    clock1 = _sm_clock(engine.device)
    short = [i for i, o in enumerate(outputs) if len(o) != args.gen]
    if short:
        raise SystemExit(f"requests {short[:5]} produced fewer than {args.gen} tokens (see the log above)")
    clock = (clock0, clock1) if clock0 is not None and clock1 is not None else None
    return Pass(outputs, ids, seconds, counters["steps"] - steps0, step_s, prefill, rounds, clock)


def _sm_clock(device: torch.device) -> int | None:
    """The GPU's SM clock in MHz (NVML's, through torch.cuda.clock_rate); None off CUDA or where NVML fails."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.clock_rate(device)
    except Exception:  # (no pynvml installed, or NVML refused: the clock is unknown, the measurement stands)
        return None


def _unmeasured(batch: int, k: int, seconds: float) -> None:
    """DraftPolicy.observe_step during a profiled pass."""


class StepProfile:
    """Instruments one pass of an engine with synchronising timers: the time of each pure decode step that carried
    no drafts (no prefill in the plan launched), and with a drafter, the (k, m) of every verified draft, the split
    of each round's time (RoundSplit) and which forwards ran as CUDA graphs. Synchronising timers serialise host
    and GPU, so the profiled pass runs slower than a timed one; what it shows is each part's own cost."""

    def __init__(self, engine: Engine, drafter) -> None:
        self.engine, self.drafter = engine, drafter
        self.timer = PhaseTimer(engine.device)
        self.rounds: list[tuple[int, int]] = []
        self.undrafted = 0
        self.splits: list[tuple[float, float, float]] = []  # seconds of draft, verify, host per round
        self.undrafted_steps: list[float] = []  # seconds of each pure decode step without drafts
        self.verify_eager = 0
        # Each choice between a drafter's CUDA graph and an eager forward (learning, drafting, chaining): replayed
        # (True) or eager; none at all for a drafter without graphs.
        self.draft_paths = {True: 0, False: 0}
        self._plan = None

    def instrumented(self):
        timed = self.timer.timed
        targets = [(self.engine, "step", self._step), (self.engine.runner, "launch", self._launch),
                   (self.engine.runner, "sample", timed("verify")), (self.engine.runner, "collect", timed("verify")),
                   (self.engine, "deliver", self._deliver), (self.engine.runner, "forward_eager", self._eager),
                   (DeviceRound, "replay", timed("verify"))]  # (a device round: verify and drafts, one replay)
        if self.engine.speculation is not None:  # (synchronised steps run slower than served ones: not the costs)
            # The costs stay as the timed passes left them, none going stale: a stale plain step would make the
            # policy take plain steps to re-measure it, which this pass never does.
            targets += [(self.engine.speculation.policy, "observe_step", lambda _: _unmeasured),
                        (self.engine.speculation.policy.costs, "stale_after", lambda _: 1 << 62)]
        if self.drafter is not None:
            # (a drafter that stages its drafts on the device proposes through `stage` too: timed once, there)
            drafts = "stage" if self.drafter.stages_on_device else "propose"
            targets += [(self.drafter, drafts, timed("draft")), (self.drafter, "on_commit", timed("draft"))]
            # (drafting ahead of a verdict counts in the step doing it)
            targets.append((self.engine.speculation.speculator, "draft_ahead", timed("draft")))
            targets.append((CudaGraphRunner, "can_run", self._drafter_graph))
        return patched(*targets)

    def _eager(self, forward_eager):
        def count(*args, **kwargs):
            if self._plan is not None and any(s.draft_tokens for s in self._plan.scheduled):
                self.verify_eager += 1
            return forward_eager(*args, **kwargs)

        return count

    def _drafter_graph(self, can_run):
        target = self.engine.runner.graphs or ()

        def count(runner: CudaGraphRunner, meta) -> bool:
            fits = can_run(runner, meta)
            if not any(runner is g for g in target):
                self.draft_paths[fits] += 1
            return fits

        return count

    def _step(self, step):
        timed = self.timer.timed("step")(step)

        def split_step() -> None:
            before = dict(self.timer.total)
            self._plan = None
            timed()
            plan = self._plan
            if plan is None or plan.has_prefill:
                return
            spent = {k: self.timer.total[k] - before.get(k, 0.0) for k in ("step", "draft", "verify")}
            if any(s.draft_tokens for s in plan.scheduled):
                self.splits.append((spent["draft"], spent["verify"], spent["step"] - spent["draft"] - spent["verify"]))
            else:
                self.undrafted_steps.append(spent["step"])

        return split_step

    def _launch(self, launch):
        timed = self.timer.timed("verify")(launch)

        def keep_plan(plan, *args, **kwargs):
            self._plan = plan
            return timed(plan, *args, **kwargs)

        return keep_plan

    def _deliver(self, deliver):
        def count(plan, out):
            self._plan = self._plan or plan  # (a device round launches nothing through the runner)
            for s, m in zip(plan.scheduled, out.accepted):
                if s.draft_tokens:
                    self.rounds.append((len(s.draft_tokens), m))
                elif s.samples and s.num_new_tokens == 1:
                    self.undrafted += 1
            return deliver(plan, out)

        return count

    def decode_step_cost(self) -> StepCost | None:
        """The pure decode steps without drafts; None: there was none."""
        steps = self.undrafted_steps
        if not steps:
            return None
        return StepCost(1e3 * statistics.fmean(steps), 1e3 * statistics.median(steps), len(steps))

    def split(self) -> RoundSplit:
        n = len(self.splits)
        mean = [1e3 * sum(x[i] for x in self.splits) / n if n else 0.0 for i in range(3)]
        graphs = sum(self.draft_paths.values()) > 0
        return RoundSplit(*mean, steps=n, verify_eager=self.verify_eager,
                          draft_graph=self.draft_paths[True] if graphs else None,
                          draft_eager=self.draft_paths[False] if graphs else None)


def _result(kind: str, batch: int, alpha: float | None, n_max: int, plain: list[Pass], spec: list[Pass],
            recorded: Pass, profile: StepProfile, plain_profile: StepProfile, off_script: int,
            policy_ms: dict[int, float]) -> SpecResult:
    rounds = Rounds(profile.rounds, profile.undrafted)
    best_plain, best_spec = (min(passes, key=lambda p: p.seconds) for passes in (plain, spec))
    plain_rate, spec_rate = best_plain.tokens / best_plain.seconds, best_spec.tokens / best_spec.seconds
    paired = statistics.median((s.tokens / s.seconds) / (p.tokens / p.seconds) for p, s in zip(plain, spec))
    return SpecResult(
        kind=kind, batch=batch, acceptance=alpha, draft_n_max=n_max, requests=len(recorded.outputs),
        tokens=recorded.tokens, plain_tok_s=plain_rate, spec_tok_s=spec_rate, speedup=spec_rate / plain_rate,
        plain_step_ms=1e3 * best_plain.seconds / best_plain.steps,
        spec_step_ms=1e3 * best_spec.seconds / best_spec.steps,
        tau=rounds.tau, tau_theory=rounds.tau_theory(alpha) if alpha is not None else None,
        tau_theory_n_max=expected_tokens(alpha, n_max) if alpha is not None else None, mean_k=rounds.mean_k,
        rounds=len(rounds.rounds), undrafted=rounds.undrafted, accepted_by_position=rounds.accepted_by_position(),
        split=profile.split(), identical=min(sum(a == b for a, b in zip(p.outputs, recorded.outputs)) for p in spec),
        off_script=off_script, repeats=len(spec), plain_pass_s=[p.seconds for p in plain],
        spec_pass_s=[p.seconds for p in spec], paired_speedup=paired, plain_steps=StepTimes.of(plain),
        spec_steps=StepTimes.of(spec), plain_clock_mhz=_clocks(plain), spec_clock_mhz=_clocks(spec),
        plain_decode_step=plain_profile.decode_step_cost(), undrafted_step=profile.decode_step_cost(),
        policy_ms=policy_ms)


def _clocks(passes: Sequence[Pass]) -> list[tuple[int, int]] | None:
    clocks = [p.clock_mhz for p in passes]
    return None if None in clocks else clocks


def report(r: SpecResult) -> str:
    """Four or five printed lines: the speeds; how undisturbed the timed passes were; what a step that drafts
    nothing costs; what the rounds did and cost; what the policy had measured of them (when it measures)."""
    alpha = f" acceptance={r.acceptance:g}" if r.acceptance is not None else ""
    sides = (("plain", r.plain_steps, r.plain_clock_mhz), ("speculative", r.spec_steps, r.spec_clock_mhz))
    slow = ", ".join(f"{name} {sum(t.slow)} (slowest {t.max_ms:.1f} ms)" for name, t, _ in sides)
    clock = "" if r.plain_clock_mhz is None or r.spec_clock_mhz is None else "; SM clock " + ", ".join(
        f"{name} {min(map(min, c))}-{max(map(max, c))} MHz" for name, _, c in sides)
    plain, cost = r.plain_decode_step, r.undrafted_step
    undrafted = (f"{cost.mean_ms:.3f} / {cost.median_ms:.3f} over {cost.steps} steps" if cost is not None
                 else "none (every decode step drafted)")
    theory = ""
    if r.acceptance is not None:
        theory = (f" (theory {r.tau_theory:.2f} at the k each round drafted, {r.tau_theory_n_max:.2f} at "
                  f"k={r.draft_n_max}; {r.off_script} requests left the recording)")
    s = r.split
    by_position = " ".join(f"{a:.2f}" for a in r.accepted_by_position) or "-"
    drafter_graphs = ("without CUDA graphs" if s.draft_graph is None else
                      f"{s.draft_graph} graph replays, {s.draft_eager} eager")
    return (f"spec {r.kind} bs={r.batch}{alpha}: plain {r.plain_tok_s:.1f} tok/s ({r.plain_step_ms:.2f} ms/step), "
            f"speculative {r.spec_tok_s:.1f} tok/s ({r.spec_step_ms:.2f} ms/step), best of {r.repeats}; speedup "
            f"{r.speedup:.2f}x (median of paired passes {r.paired_speedup:.2f}x); {r.requests} requests x "
            f"{r.tokens // r.requests} tokens, output identical {r.identical}/{r.requests}\n"
            f"  timed steps: median plain {r.plain_steps.median_ms:.3f} ms, "
            f"speculative {r.spec_steps.median_ms:.3f} ms (those committing a prompt's first token: plain "
            f"{r.plain_steps.prefill_median_ms:.3f} ms, speculative {r.spec_steps.prefill_median_ms:.3f} ms); "
            f"slow steps (> {SLOW_FACTOR}x their kind's median): {slow}{clock}\n"
            f"  a timed pass by what its steps committed (mean of the passes): "
            + "; ".join(f"{name}: " + ", ".join(f"{kind} {n:.4g} steps {ms:.1f} ms" for kind, (n, ms) in
                                                t.split.items()) for name, t, _ in sides) + "\n"
            f"  decode step without drafts (synchronised, profiled passes; mean / median ms): plain "
            f"{plain.mean_ms:.3f} / {plain.median_ms:.3f} over {plain.steps} steps, speculative {undrafted}\n"
            f"  tau {r.tau:.2f}{theory} over {r.rounds} request rounds of mean k {r.mean_k:.2f}, "
            f"{r.undrafted} undrafted decodes; accepted by draft position {by_position}; "
            f"round ms: draft {s.draft_ms:.3f} + verify {s.verify_ms:.3f} + host {s.host_ms:.3f} = "
            f"{s.total_ms:.3f} (synchronised, mean of {s.steps} verify steps); verify eager in {s.verify_eager}; "
            f"drafter forwards {drafter_graphs}"
            + ("\n  the policy's measured step ms by draft length: " + ", ".join(
                f"k={k} {ms:.3f}" for k, ms in r.policy_ms.items()) if r.policy_ms else ""))
