"""Engine: the step loop. plan = scheduler.schedule(); launched = runner.launch(plan); runner.sample(launched);
commit(collect(launched)).

Everything here runs on one thread (the engine thread of AsyncEngine, or the caller's thread offline).
Commit is where tokens become visible: stop conditions, incremental detokenization, timing stamps and the
RequestOutput handed to the request's owner all happen in one place, once per committed token batch.

Overlap scheduling (CUDA): each step() schedules and launches step n+1 before it collects and commits step n, so
the host's work for one step runs while the GPU computes the other. Step n+1 feeds each request the token step n
sampled straight from device memory (Request.num_pending). A request that stops on step n's token wasted one token
of compute in step n+1, which is discarded; one whose max_tokens or context is reached by its pending token is
not scheduled again. A step whose sampling reads host state that the step in flight advances (a grammar's
matcher, a penalty's recent tokens) is enqueued in two phases: its forward, fed from the device as any other;
then the step in flight is committed; then its sampling, whose masks and penalty windows are computed on the host
while the device runs the forward. A speculative round is committed before the next step launches (its positions
follow the verdict), but the drafter's next round is enqueued from the verdict on the device before the host reads
it, so the drafter runs while the host commits (Speculator.draft_ahead; docs/speculative.md).
"""

from __future__ import annotations

import logging
import secrets
import traceback
from dataclasses import dataclass, replace
from typing import Callable

import torch

from outrider.attention import KVCache
from outrider.config import EngineConfig, ModelConfig
from outrider.engine.kv_cache import BlockPool
from outrider.engine.memory import (CPU_KV_CACHE_GIB, cuda_budget, graph_reserve, kv_block_bytes, measure_step_reserve,
                                    num_kv_blocks)
from outrider.engine.request import FinishReason, PromptProgress, Request, RequestOutput, Status
from outrider.engine.runner import LaunchedStep, ModelRunner, Prelaunched, StepOutput
from outrider.engine.scheduler import ScheduledRequest, Scheduler, StepPlan
from outrider.models import load_model, resolve_model_path
from outrider.params import SamplingParams
from outrider.quant.checkpoint import summarize as summarize_weights
from outrider.speculative import DraftPolicy, Drafter, detect_kind, load_drafter
from outrider.speculative.device_round import DeviceRound, RoundCopy, committed
from outrider.speculative.drafter import DEFAULT_N_MAX, PENDING
from outrider.speculative.speculator import Drafts, Speculator
from outrider.structured.grammar import GrammarCompiler
from outrider.timing import now
from outrider.tokenizer import Detokenizer, Tokenizer

log = logging.getLogger("outrider.engine")

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class _Live:
    """Engine-side companions of a running request: who to tell, and its detokenizer."""

    request: Request
    on_output: OutputCallback
    detok: Detokenizer
    stop_ids: frozenset[int]  # ids that end the request past min_tokens: stop_token_ids, and EOS unless ignore_eos


@dataclass(frozen=True)
class _Appended:
    """What a step's tokens did to a request: the text each kept token added (tokens are kept up to the first
    stop), and that stop, if one came."""

    pieces: list[str]
    reason: FinishReason | None = None
    stop_type: str = "none"  # llama-server's: none | eos | word | limit
    word: str = ""

    @property
    def kept(self) -> int:
        return len(self.pieces)


@dataclass(frozen=True)
class _RoundFlight:
    """A device round replayed and not yet committed (Engine._device_round)."""

    request: Request
    k: int  # its length (what its time is the cost of)
    drafts: int  # the drafts it verified: k, or fewer in the first round after a switch from a shorter length
    copy: RoundCopy  # its verdict, on its way to the host
    t0: float  # when its time began: its launch, or the landing of the round before it (still running then)


def _round_plan(req: Request, k: int) -> StepPlan:
    """A device round as the step it stands for: the request feeds its last token and verifies k drafts."""
    return StepPlan([ScheduledRequest(req, req.num_computed, 1, True, [PENDING] * k)], [])


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Engine:
    def __init__(self, config: EngineConfig, preloaded: tuple[torch.nn.Module, ModelConfig] | None = None,
                 clock: Callable[[], float] = now):
        """`preloaded`: a (model, config) already on the device (benchmarks with random weights). `clock`: what
        every timing stamp reads (tests inject one that advances by chosen phase times)."""
        self.config = config
        self.clock = clock
        self.device = pick_device(config.device)
        if self.device.type == "cpu" and config.cpu_threads > 0:
            torch.set_num_threads(config.cpu_threads)
        dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
        t0 = now()
        self.model_path = resolve_model_path(config.model)
        self.model, self.model_config = preloaded or load_model(
            self.model_path, dtype=dtype, device=self.device, rope=config.rope, quantization=config.quantization)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_path)
        if config.chat_template:
            self.tokenizer.chat_template = config.chat_template
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        mc = self.model_config
        self.weights = summarize_weights(self.model)  # formats and bytes, for the log and /props
        log.info("weights: %s, %.2f GiB on %s", self.weights.describe(), self.weights.nbytes / 2**30, self.device)
        # The drafter loads now, beside the target, never lazily inside a request (no request pays for it), and
        # before the KV pools are sized: its weights and the target rows it reads then count in the budget.
        spec_kind = self._spec_kind()
        self.drafter_error: str | None = None  # why the configured drafter was refused (serving without it)
        self.drafter, self.policy = self._load_drafter(spec_kind) if spec_kind else (None, None)
        # Its KV pool has as many blocks as the target's (they share block ids): one budget sizes both.
        shapes = [(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)]
        shapes += [self.drafter.kv_shape] if self.drafter is not None else []
        num_blocks = self._num_kv_blocks(sum(kv_block_bytes(p, config.block_size, self.dtype) for p in shapes))
        self.kv_cache, *drafter_kv = [KVCache.allocate(layers, num_blocks, config.block_size, kv_heads, head_dim,
                                                       self.dtype, self.device) for layers, kv_heads, head_dim in shapes]
        if self.drafter is not None:
            self.drafter.kv = drafter_kv[0]
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_cache, mc.vocab_size, self.device, self._taps())
        self.speculator = Speculator(self.drafter, self.policy, self.pool, self.runner.hidden_rows,
                                     config.max_num_batched_tokens, clock, self._synchronize) \
            if self.drafter is not None else None
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_id)
        self.runner.sampler.set_eog_ids(self.eos_ids)
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), mc.vocab_size, self.eos_ids)  # (the routes')
        log.info("model loaded (%s, %s, %d KV blocks of %d tokens, %.0f ms)", mc.architecture, self.dtype,
                 num_blocks, config.block_size, (now() - t0) * 1e3)
        if config.spec_draft_n_max is None:  # resolve the default draft length (/props and /slots show it)
            self.config = config = replace(config, spec_draft_n_max=self.policy.n_max if self.policy else DEFAULT_N_MAX)
        if self.device.type == "cuda" and not config.enforce_eager:
            from outrider.engine.cuda_graphs import capture_step_graphs, prefill_graph_lens

            # A verify step feeds k + 1 tokens per sequence, k up to the server's draft length (requests asking
            # for more verify eager).
            verify = range(2, self.policy.n_max + 2) if self.policy is not None else ()
            prefill = [q for q in prefill_graph_lens(config.prefill_graph_tokens, self.max_model_len)
                       if q not in verify]
            self.runner.graphs = capture_step_graphs(self.runner, config.max_num_seqs, self.max_model_len, verify,
                                                     prefill)
            if self.drafter is not None:  # (the policy drafts for at most policy.max_batch sequences)
                try:
                    self.drafter.capture_graphs(min(config.max_num_seqs, self.policy.max_batch), self.max_model_len,
                                                self.runner.graphs[0].pool)
                except Exception as exc:  # the drafter's graphs only save launches: without them it drafts eager
                    log.error("drafter graphs failed to capture, drafting eager: %s\n%s", exc, traceback.format_exc())
        # spec_device_round: a round object per draft length, captured on CUDA; the (request id, k) whose state the
        # device holds now (any other step moves that request on without it).
        on = config.spec_device_round if config.spec_device_round is not None else bool(self.runner.graphs)
        self.device_rounds = self._device_rounds(warn=config.spec_device_round is True) if on else {}
        self.round_owner: tuple[int, int] | None = None
        self.round_flight: _RoundFlight | None = None  # replayed, its verdict not yet read
        self.live: dict[int, _Live] = {}
        # Requests of a step that failed with several in it: each runs alone until it passes or fails alone.
        self.suspects: set[int] = set()
        # Requests admitted in a step they did not run in (it failed, or was cut down to one suspect): their
        # prompt starts when they next run, so their admission is stamped again then.
        self.restamp: set[int] = set()
        # With a drafter, plain steps overlap; a round is committed before the next step (drafted ahead meanwhile).
        self.overlap = config.overlap_schedule if config.overlap_schedule is not None else self.device.type == "cuda"
        self.inflight: LaunchedStep | None = None  # launched, not yet collected (overlap scheduling)
        self.prelaunched: Prelaunched | None = None  # the next step's verify forward, enqueued ahead (_draft_ahead)
        self.counters = dict.fromkeys(("prompt_tokens", "predicted_tokens", "requests_finished", "steps",
                                       "busy_slots_total"), 0)
        if self.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Run every step shape once (prefill, decode, verify; greedy and sampled) before serving, so Triton's
        JIT and torch.compile happen now and no request's timings include a compilation."""
        mc = self.model_config
        ids = [3 + i % (mc.vocab_size - 3) for i in range(min(512, self.max_model_len // 2))]
        for n in (2 * self.config.block_size + 3, len(ids)):
            for params in (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True, n_probs=1)):
                self.add_request(Request(ids[:n], params), lambda out: None)
        self._run_until_idle()
        # Attention compiles a kernel variant per tile height, which follows the step's longest query in rows
        # (tokens x GQA group), and per split plan: short prompts, and short extends of a cached prefix (a chat's
        # next turn), each run alone at every height class.
        group = mc.num_attention_heads // mc.num_key_value_heads
        cached = ids[: len(ids) // 2 // self.config.block_size * self.config.block_size]  # a prefix hit, if caching
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        q_len = 1
        while q_len * group <= 64:
            fresh = [4 + (q_len + i) % (mc.vocab_size - 4) for i in range(q_len)]
            for prompt in (fresh, cached + fresh):
                self.add_request(Request(prompt, one), lambda out: None)
                self._run_until_idle()
            q_len *= 2
        # (and each variant an eager step over a longer context than these meets: the split ones)
        self.runner.backend.compile_eager_variants(self.kv_cache, mc.num_attention_heads, self.max_model_len)
        if self.policy is not None:
            if self.policy.measured:
                self.policy.forget_costs()  # (the steps above compiled kernels: their times are not the device's)
                self._calibrate_speculation()
            self.policy.forget_acceptance()
        self.pool.reset_prefix_cache()
        self.pool.hits = 0
        self.counters = dict.fromkeys(self.counters, 0)

    def _calibrate_speculation(self) -> None:
        """Serve a little traffic at every batch bucket and draft length the policy may choose, so its first
        decisions already rest on this device's measured step costs (every step feeds them, here as later)."""
        vocab = self.model_config.vocab_size
        batch = 1
        while batch <= min(self.config.max_num_seqs, self.policy.max_batch):
            for k in range(self.policy.n_max + 1):
                self.policy.forget_acceptance()  # (the drafts of synthetic prompts miss: each k starts from the prior)
                params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, spec_n_max=k)
                for i in range(batch):
                    self.add_request(Request([5 + (7 * i + j) % (vocab - 5) for j in range(8)], params),
                                     lambda out: None)
                self._run_until_idle()
            batch *= 2

    def _device_rounds(self, warn: bool) -> dict[int, DeviceRound]:
        """Device rounds for every draft length the policy may choose (EngineConfig.spec_device_round); `warn`: the
        user asked for them."""
        if self.speculator is None or not self.speculator.rounds_on_device:
            if warn:
                log.warning("spec_device_round: the %s drafter does not draft on the device; its rounds run as "
                            "usual", self.drafter_kind or "(no)")
            return {}
        return self.device_rounds_for(self.drafter)

    def device_rounds_for(self, drafter) -> dict[int, DeviceRound]:
        """A device round of this RoundDrafter per draft length the policy may choose, captured on CUDA (bench spec
        builds them for its controlled drafter)."""
        width = -(-self.max_model_len // self.config.block_size)
        rounds = {}
        for k in range(1, self.policy.n_max + 1):
            rounds[k] = DeviceRound(self.runner, drafter, k, width)
            if self.runner.graphs:
                rounds[k].capture(self.runner.graphs[0].pool)
        return rounds

    def _run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    def _spec_kind(self) -> str | None:
        """The configured (or detected) drafter kind; None: no speculation."""
        cfg = self.config
        if cfg.spec_type is not None:
            return None if cfg.spec_type == "none" else cfg.spec_type
        if cfg.draft_model:
            return detect_kind(cfg.draft_model, str(self.model_path))
        return "mtp" if self.model_config.mtp_num_hidden_layers > 0 else None

    def _load_drafter(self, kind: str) -> tuple[Drafter | None, DraftPolicy | None]:
        """The drafter of this kind, weights loaded (the engine allocates its KV pool); on failure, log why and
        serve without speculation."""
        cfg = self.config
        t0 = now()
        asked = cfg.spec_draft_n_max  # None: the drafter's own default (an explicit 0 stays 0)
        try:
            drafter = load_drafter(kind, target=self.model, target_cfg=self.model_config,
                                   target_path=str(self.model_path), draft_path=cfg.draft_model,
                                   block_size=cfg.block_size, dtype=self.dtype, ngram=cfg.spec_ngram,
                                   device=self.device, max_draft=max(asked, 1) if asked is not None else None)
        except Exception as exc:
            if cfg.spec_required:  # asked for on the command line: refusing to start says so plainly
                raise
            self.drafter_error = f"{type(exc).__name__}: {exc}"
            log.error("drafter (kind=%s) failed to load, serving without speculative decoding: %s", kind, exc)
            return None, None
        measured = cfg.spec_measured_costs if cfg.spec_measured_costs is not None else self.device.type == "cuda"
        policy = DraftPolicy(n_max=drafter.max_draft if asked is None else asked, n_min=cfg.spec_draft_n_min,
                             p_min=cfg.draft_p_min, measured=measured)
        log.info("Drafter loaded (kind=%s, %.0f ms)", kind, (now() - t0) * 1e3)
        return drafter, policy

    def _taps(self) -> tuple[int, ...]:
        """The target layers whose outputs the drafter reads (every target forward returns them)."""
        return tuple(self.drafter.aux_layer_ids) if self.drafter is not None else ()

    @property
    def drafter_kind(self) -> str | None:
        return self.drafter.kind if self.drafter is not None else None

    def _num_kv_blocks(self, per_block: int) -> int:
        """Blocks for the KV pools (`per_block` bytes a block across them): what the limits can use, within the
        memory budget (engine/memory.py)."""
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        wanted = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size) + 1
        if cfg.kv_cache_memory_gib or self.device.type != "cuda":
            return num_kv_blocks(per_block, wanted, (cfg.kv_cache_memory_gib or CPU_KV_CACHE_GIB) * 2**30)
        # The largest step: a full token budget of prompt, and as many sampled rows as sequences (or verify rows).
        tokens = max(1, min(cfg.max_num_batched_tokens, self.max_model_len))
        rows = min(tokens, max(cfg.max_num_seqs, self.policy.max_verify_tokens if self.policy is not None else 0))
        reserve = measure_step_reserve(self.model, self.model_config, tokens=tokens, rows=rows,
                                       block_size=cfg.block_size, dtype=self.dtype, device=self.device,
                                       aux_layer_ids=self._taps())
        log.info("a step takes up to %.2f GiB beside the weights (measured)", reserve / 2**30)
        graphs = graph_reserve(cfg.max_num_seqs, self.model_config.vocab_size, drafted=self.drafter is not None,
                               eager=cfg.enforce_eager)
        return num_kv_blocks(per_block, wanted, cuda_budget(self.device, cfg.gpu_memory_utilization, reserve + graphs))

    # --- requests ---
    def add_request(self, req: Request, on_output: OutputCallback) -> None:
        if req.params.seed is not None and req.params.seed >= 0:
            req.seed = req.params.seed
        elif self.config.seed >= 0:
            req.seed = self.config.seed
        else:
            req.seed = secrets.randbits(32)  # llama-server's seeds are uint32
        detok = Detokenizer(self.tokenizer, req.params.stop, context=req.prompt_ids[-4:])
        stop_ids = frozenset(req.params.stop_token_ids) | (frozenset() if req.params.ignore_eos else self.eos_ids)
        live = _Live(req, on_output, detok, stop_ids)
        if not req.prompt_ids or req.num_prompt >= self.max_model_len:
            self._finish(live, FinishReason.ERROR, error="prompt is empty or exceeds the context size")
            return
        req.limit_outputs(self.max_model_len)
        self.live[req.request_id] = live
        self.scheduler.add(req)

    def abort(self, request_id: int, error: str | None = None) -> None:
        """End a request now; `error` tells its owner why (e.g. the server is shutting down)."""
        live = self.live.get(request_id)
        if live is not None:
            self._finish(live, FinishReason.ABORT, error=error)

    def has_work(self) -> bool:
        return self.inflight is not None or self.round_flight is not None or self.scheduler.has_work()

    # --- the step ---
    def step(self) -> None:
        """One step: launch the next batch, and commit the previous one (overlap) or this one (otherwise); or, for a
        request that decodes alone, one device round (spec_device_round)."""
        t0 = self.clock()
        lengths = self.speculator.draft_lengths(self.scheduler.running) if self.speculator is not None else {}
        if self.device_rounds and self._device_round(lengths):
            return
        self._land_round()
        self.round_owner = None
        prev, self.inflight = self.inflight, None
        if prev is not None and (lengths or self.suspects):
            # Drafts follow the committed tokens, and a step cut down to one suspect must not leave the others'
            # tokens pending in a step it does not feed from: finish the step in flight first.
            self._complete(prev)
            prev, t0 = None, self.clock()
        launched = self._launch(prev, lengths)
        if prev is not None:
            self._complete(prev)
        if launched is not None and launched.awaits_sampling:  # its sampling reads what prev's commit advanced
            launched = self._sample(launched)
        if launched is None:
            return
        if self.overlap and launched.overlappable:
            if self.speculator is not None:  # the drafter learns this step after the next one has replayed
                self.speculator.keep(launched.plan, launched.out)
            self.inflight = launched
            done = prev
        else:
            if launched.verdict is not None and self._drafts_ahead(launched.plan):
                self._draft_ahead(launched)  # (the next round runs on the device while the host commits this one)
            self._complete(launched)
            done = None if prev is not None else launched  # (two steps completed: no one step's time)
        if done is not None and self.speculator is not None:
            self.speculator.observe_step(done.plan, self.clock() - t0)

    def _device_round(self, lengths: dict[int, int]) -> bool:
        """A whole speculative round on the device for a request that decodes alone, greedy and unconstrained, of
        the length this step decided (`lengths`): one replay, its verdict copied to the host, and the round before
        it (in flight since the last step) committed meanwhile, as a verify step is. The device's state already
        follows that round, so the host reads and commits it while the device runs the next. False: no request
        qualifies now, or it drafts nothing (a round in flight is committed, and the step runs as usual)."""
        req = self._lone_greedy_decoder()
        k = lengths.get(req.request_id, 0) if req is not None else 0
        left = req.max_output_tokens - len(req.output_ids) - req.num_pending if req is not None else 0
        rounds = self.device_rounds.get(k) if k else None
        flight = self.round_flight
        # The round in flight commits 1 .. drafts + 1 tokens: where they may reach the limit, the next round waits
        # for its verdict rather than run after the request ends (at 8B it cost a DFlash request a 5.8 ms round).
        if flight is not None and (rounds is None or flight.request is not req or flight.drafts + 1 >= left):
            self._land_round()  # (its request's state must be on the host before anything else uses it)
            flight, req = None, self._lone_greedy_decoder()
        if req is None or rounds is None:
            return False
        if self.inflight is not None:  # (its token is the round's first input: committed first)
            prev, self.inflight = self.inflight, None
            self._complete(prev)
            if req.status is not Status.RUNNING or req.num_computed != req.num_tokens - 1:
                return False
        # The round launched now starts where the one in flight ends, which the host has not read: room for the
        # worst case, every draft of that one kept.
        start = req.num_tokens - 1 + (flight.drafts + 1 if flight is not None else 0)
        if not self.pool.ensure(req, start + rounds.reach()):
            self._land_round()
            return False
        owner, verified = self.round_owner, k
        if owner is None or owner[0] != req.request_id:  # (then nothing is in flight: a flight's owner is this one)
            drafts = self.speculator.device_round_drafts(req, k)  # (one-off work: done before the round's clock)
            if drafts is None:
                return False
            rounds.load(req.all_ids[-1], drafts, start, req.block_ids)
        elif owner[1] != k:  # (the device's state follows the owner's rounds: the new length takes over from them)
            rounds.continue_from(self.device_rounds[owner[1]])
            verified = min(k, owner[1])
        rounds.set_blocks(req.block_ids)
        self.round_owner = (req.request_id, k)
        t0 = self.clock()
        self.counters["steps"] += 1
        self.counters["busy_slots_total"] += 1
        try:
            rounds.replay()
            copy = rounds.verdict_to_host()
        except Exception as exc:
            self.round_owner = self.round_flight = None
            self._fail(_round_plan(req, k), exc)
            return True
        self.round_flight = _RoundFlight(req, k, verified, copy, t0)
        if flight is not None:
            self._land(flight)
            if req.status is not Status.RUNNING:  # (that round ended the request: the one just launched is moot)
                self.round_owner = self.round_flight = None
            else:  # (the device runs this round once that one is done: from its launch on, it would count both)
                self.round_flight = replace(self.round_flight, t0=self.clock())
        return True

    def _land_round(self) -> None:
        """Commit the device round in flight, if any."""
        flight, self.round_flight = self.round_flight, None
        if flight is not None:
            self._land(flight)

    def _land(self, flight: _RoundFlight) -> None:
        """Read a device round's verdict (waiting for its copy alone) and commit it as a verify step's: the request
        had fed its last token and verified its drafts, and its rows are learned already. Its time is the cost of a
        round of its length, whatever it was given to verify."""
        req = flight.request
        tokens = committed(flight.copy)
        if req.request_id not in self.live:  # (ended meanwhile: nothing to commit)
            return
        req.num_computed += 1  # (the fed token, and the sampled one pending, as a launched verify step counts them)
        req.num_pending += 1
        self._deliver(_round_plan(req, flight.drafts), StepOutput([tokens], [[]], [len(tokens) - 1], torch.empty(0),
                                                                  None), learned=True)
        self.speculator.observe_step(_round_plan(req, flight.k), self.clock() - flight.t0)

    def _synchronize(self) -> None:
        """Wait for the device (the Speculator times one-off work to its end)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _lone_greedy_decoder(self) -> Request | None:
        """The one running request when it decodes alone with nothing waiting (its last token sampled, maybe still
        in flight), its next token the plain argmax: no temperature, bias, penalty, grammar, log-probs, or
        min_tokens left to hold end-of-generation back; and its drafts untrimmed (no p_min or n_min: a device
        round verifies all k)."""
        running = self.scheduler.running
        if len(running) != 1 or self.scheduler.waiting or self.suspects or self.prelaunched is not None:
            return None
        req = running[0]
        p = req.params
        if (not p.temperature <= 0 or p.penalized or p.logit_bias or p.n_probs or req.constraint is not None
                or len(req.output_ids) + req.num_pending <= p.min_tokens or self.policy.trims(req)):
            return None
        return req if req.num_computed == req.num_tokens - 1 else None  # (min_tokens >= 0: one token is out)

    def _launch(self, feed: LaunchedStep | None, lengths: dict[int, int]) -> LaunchedStep | None:
        """Schedule and launch a step (feeding pending tokens from `feed`, the step in flight, and drafts of the
        decided `lengths`), and sample it unless its sampling must wait for feed's commit (reads_history)."""
        prelaunched, self.prelaunched = self.prelaunched, None  # (this step's, or no one's: its rows go stale)
        drafts = self.speculator.propose(self.scheduler.running, lengths) if lengths else Drafts()
        plan = self.scheduler.schedule(drafts.tokens)
        t = self.clock()  # the step is launched now: its prompts' processing starts (docs/architecture.md)
        for req in plan.preempted:
            req.timing.mark_preempted(t)
            self._release_drafter_state(req.request_id)
        if self.suspects:
            plan = self._isolate(plan)
        if not plan.scheduled:
            return None
        admitted = plan.admitted
        if self.restamp:
            admitted = admitted + [s.request for s in plan.scheduled
                                   if s.request.request_id in self.restamp and s.request not in admitted]
            self.restamp.difference_update(req.request_id for req in admitted)
        for req in admitted:
            req.timing.mark_admitted(t, cache_n=req.num_computed, prompt_n=req.num_prompt - req.num_computed)
            if req.return_progress and req.timing.t_first_token is None:
                # llama-server's first progress report: before any prompt work, the cache only
                self.live[req.request_id].on_output(RequestOutput(
                    req.request_id, [], progress=self._progress(req, req.num_computed), timing=req.timing))
        self.counters["steps"] += 1
        self.counters["busy_slots_total"] += len(plan.scheduled)
        try:
            launched = self.runner.launch(plan, feed, drafts.pending, prelaunched)
        except Exception as exc:  # a fault fails the request that caused it, never the server
            self._fail(plan, exc, isolate=True)
            return None
        if feed is not None and launched.reads_history:
            return launched
        return self._sample(launched, drafts.probs)

    def _sample(self, launched: LaunchedStep,
                draft_probs: dict[int, torch.Tensor] | None = None) -> LaunchedStep | None:
        """Enqueue a launched step's sampling; then advance each scheduled request past the tokens it feeds, with
        one pending token per sampled request."""
        plan = launched.plan
        try:
            self.runner.sample(launched, draft_probs, accepted_on_device=self._drafts_ahead(plan))
        except Exception as exc:  # (nothing was advanced yet: each request can run again alone)
            self._fail(plan, exc, isolate=True)
            return None
        for s in plan.scheduled:
            req = s.request
            req.num_computed += s.num_new_tokens
            req.num_pending += s.samples
        return launched

    def _drafts_ahead(self, plan: StepPlan) -> bool:
        return self.config.spec_draft_ahead and self.speculator is not None and self.speculator.drafts_ahead(plan)

    def _draft_ahead(self, launched: LaunchedStep) -> None:
        """Enqueue the next round's drafts from this verify step's verdict, still on the device, and with
        spec_verify_ahead the next verify forward too where the next step is sure to be that round: no request waits
        for admission and none may reach its token limit in this round (a stop token can still end one: the others
        take the forward, or it is dropped)."""
        nxt = self.speculator.draft_ahead(launched)
        if nxt is None or not self.config.spec_verify_ahead or self.scheduler.waiting or self.suspects:
            return
        if any(len(s.request.output_ids) + len(s.draft_tokens) + 1 >= s.request.max_output_tokens
               for s in launched.plan.scheduled):
            return
        try:
            self.prelaunched = self.runner.prelaunch(nxt)
        except Exception as exc:  # (the next step launches its own forward)
            if isinstance(exc, torch.AcceleratorError):
                raise
            log.error("launching the next verify forward ahead failed: %s\n%s", exc, traceback.format_exc())

    def _isolate(self, plan: StepPlan) -> StepPlan:
        """The plan cut down to one suspect (the others wait a step: nothing of theirs was advanced)."""
        self.suspects.intersection_update(self.live)
        suspect = next((s for s in plan.scheduled if s.request.request_id in self.suspects), None)
        if suspect is None:
            return plan
        self.suspects.discard(suspect.request.request_id)
        self.restamp.update(req.request_id for req in plan.admitted if req is not suspect.request)
        return StepPlan([suspect], plan.preempted, [req for req in plan.admitted if req is suspect.request])

    def _fail(self, plan: StepPlan, exc: Exception, isolate: bool = False) -> None:
        """A step failed: fail its requests, or with `isolate` and several of them, suspect them all (the fault's
        owner is unknown; the launch advanced none of them, so each can run again alone). A device error is not a
        request's fault: the device context is lost for every request, so it ends the engine."""
        if isinstance(exc, torch.AcceleratorError):
            raise exc
        if isolate and len(plan.scheduled) > 1:
            log.error("a step of %d requests failed, running each alone to find the one at fault: %s",
                      len(plan.scheduled), exc)
            self.suspects.update(s.request.request_id for s in plan.scheduled)
            self.restamp.update(req.request_id for req in plan.admitted)
            return
        log.error("step failed: %s\n%s", exc, traceback.format_exc())
        for s in plan.scheduled:
            live = self.live.get(s.request.request_id)
            if live is not None:
                self._finish(live, FinishReason.ERROR, error=f"internal error: {exc}")

    def _complete(self, launched: LaunchedStep) -> None:
        """Collect a launched step's tokens, commit and deliver them, then let the drafter learn the step (the
        tokens never wait for it), then release what finished."""
        plan = launched.plan
        try:
            out = self.runner.collect(launched)
        except Exception as exc:
            self._fail(plan, exc)
            return
        self._deliver(plan, out)

    def _deliver(self, plan: StepPlan, out: StepOutput, learned: bool = False) -> None:
        """Commit a step's tokens and deliver them, then let the drafter learn the step unless it `learned` it
        already (a device round), then release what finished."""
        t = self.clock()
        emits = self._commit(plan, out, t)
        for live, output in emits:
            if output.finished:
                self._mark_finished(live, output.finish_reason, t)
            live.on_output(output)
        if self.speculator is not None and not learned:
            # (before finished requests release their blocks: they may serve prefix hits)
            self.speculator.learn(plan, out, self.live)
        for live, output in emits:
            if output.finished:
                self._release(live)

    def _release_drafter_state(self, request_id: int) -> None:
        if self.speculator is not None:
            self.speculator.release(request_id)

    def _commit(self, plan: StepPlan, out: StepOutput, t: float) -> list[tuple[_Live, RequestOutput]]:
        """Apply a step's results to its requests; returns their outputs, delivered (and finished requests
        retired) after drafters learn the step."""
        emits = []
        predicted = 0
        for i, s in enumerate(plan.scheduled):
            live = self.live.get(s.request.request_id)
            if live is None:  # aborted, or finished by the step before, meanwhile
                continue
            req = live.request
            accepted = out.accepted[i]
            req.num_computed += accepted  # (the fed tokens were counted at launch)
            tokens = out.tokens[i]
            # Prefill reports: each chunk, and the first token's step (the whole prompt processed).
            progress = self._progress(req) if req.return_progress and not req.output_ids else None
            if not tokens:  # a prefill chunk that does not reach the end of the prompt yet
                if progress is not None:
                    emits.append((live, RequestOutput(req.request_id, [], progress=progress, timing=req.timing)))
                continue
            req.num_pending -= 1  # (the launch of the next step may have added another)
            appended = self._append(live, tokens)
            n = appended.kept
            if s.draft_tokens:  # count only accepted drafts that were committed (a stop can cut a round short)
                self.speculator.record(req.request_id, len(s.draft_tokens), accepted)
                req.timing.draft_kind = self.speculator.round_kind(req.request_id)
                req.timing.mark_draft_round(len(s.draft_tokens), min(accepted, n))
            req.timing.mark_tokens(n, t)
            predicted += n
            if req.timing.predicted_n == n:
                self.counters["prompt_tokens"] += req.timing.prompt_n
            self.pool.commit_full_blocks(req, req.num_computed)
            kept = tokens if n == len(tokens) else tokens[:n]  # (the step's lists are not reused: no copy needed)
            logprobs = out.logprobs[i][:n] or None
            emits.append((live, RequestOutput(req.request_id, kept, finished=appended.reason is not None,
                                              finish_reason=appended.reason, stop_type=appended.stop_type,
                                              stopping_word=appended.word, logprobs=logprobs,
                                              accepted_drafts=min(accepted, n), timing=req.timing,
                                              token_texts=appended.pieces, progress=progress)))
        self.counters["predicted_tokens"] += predicted
        return emits

    def _progress(self, req: Request, processed: int | None = None) -> PromptProgress:
        """The request's prefill progress now: `processed` prompt tokens (default: those scheduled so far)."""
        done = min(req.num_computed, req.num_prompt) if processed is None else processed
        return PromptProgress(total=req.num_prompt, cache=req.timing.cache_n, processed=done, t=self.clock())

    @staticmethod
    def _append(live: _Live, tokens: list[int]) -> _Appended:
        """Append a step's tokens to the request's outputs, up to the first stop."""
        req, detok = live.request, live.detok
        output_ids, min_tokens = req.output_ids, req.params.min_tokens
        pieces: list[str] = []
        for tok in tokens:
            output_ids.append(tok)
            num_outputs = len(output_ids)
            if tok in live.stop_ids and num_outputs > min_tokens:
                pieces.append(detok.flush())
                return _Appended(pieces, FinishReason.STOP, "eos")
            piece, word = detok.push((tok,))
            pieces.append(piece)
            if word is not None:
                return _Appended(pieces, FinishReason.STOP, "word", word)
            if req.constraint is not None and req.constraint.accept(tok):  # the grammar is complete
                pieces[-1] += detok.flush()
                return _Appended(pieces, FinishReason.STOP, "eos")
            if num_outputs >= req.max_output_tokens:
                pieces[-1] += detok.flush()
                return _Appended(pieces, req.limit_reason(num_outputs), "limit")
        return _Appended(pieces)

    def _finish(self, live: _Live, reason: FinishReason, error: str | None = None) -> None:
        """End a request outside a step's commit (refused, aborted, failed): no tokens, and `error` says why."""
        self._retire(live, reason)
        req = live.request
        live.on_output(RequestOutput(req.request_id, [], finished=True, finish_reason=reason, timing=req.timing,
                                     error=error))

    def _retire(self, live: _Live, reason: FinishReason) -> None:
        self._mark_finished(live, reason, self.clock())
        self._release(live)

    @staticmethod
    def _mark_finished(live: _Live, reason: FinishReason, t: float) -> None:
        req = live.request
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.timing.mark_finished(t)

    def _release(self, live: _Live) -> None:
        """Take a finished request out: scheduler (blocks and slot), drafter state."""
        req = live.request
        self.scheduler.remove(req)
        self._release_drafter_state(req.request_id)
        self.restamp.discard(req.request_id)
        self.live.pop(req.request_id, None)
        self.counters["requests_finished"] += 1

    # --- introspection ---
    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used,
            "kv_block_size": self.pool.block_size,
            "prefix_cache_hit_tokens": self.pool.hits,
            **self.counters,
        }
