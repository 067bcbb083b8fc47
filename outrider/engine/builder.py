"""Building an engine, in one place: the target's weights and tokenizer, the drafter (loaded beside the target, never
lazily inside a request), the KV pools sized from the memory left, the runner with its CUDA graphs, speculation
with its device rounds, and on CUDA a warm-up that compiles every step shape and calibrates the policy before any
request is timed. Each object gets its collaborators in its constructor.

    engine = build_engine(EngineConfig(model=...))
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch

from outrider.attention import KVCache
from outrider.config import EngineConfig, ModelConfig, default_prefill_graph_tokens
from outrider.engine.cuda_graphs import StepGraphs, prefill_graph_lens
from outrider.engine.engine import Engine, EngineParts
from outrider.engine.kv_cache import BlockPool
from outrider.engine.linear_state import LinearStateSlots
from outrider.engine.memory import (CPU_KV_CACHE_GIB, cuda_budget, graph_reserve, kv_block_bytes, measure_step_reserve,
                                    num_kv_blocks)
from outrider.engine.request import Request
from outrider.engine.runner import ModelRunner
from outrider.engine.scheduler import Scheduler
from outrider.engine.state_pool import StateLayout, StatePool
from outrider.models import load_model, resolve_model_path
from outrider.params import SamplingParams
from outrider.quant.checkpoint import summarize as summarize_weights
from outrider.speculative.device_round import device_rounds
from outrider.speculative.drafter import DEFAULT_N_MAX, MAX_VERIFY_TOKENS, DraftPolicy, Drafter
from outrider.speculative.kinds import detect_kind, load_drafter, target_kind
from outrider.speculative.speculation import Speculation
from outrider.speculative.speculator import SpeculationLimits, Speculator
from outrider.structured.grammar import GrammarCompiler
from outrider.timing import now
from outrider.tokenizer import Tokenizer

log = logging.getLogger("outrider.engine")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(frozen=True)
class _Target:
    model: torch.nn.Module
    config: ModelConfig
    path: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


@dataclass(frozen=True)
class Seams:
    """What build_engine makes the block pool, the draft policy and the Speculator with, called with the arguments
    each class takes, and the Speculator's limits: the server's by default; a test passes a subclass that records
    or scripts what it observes, or a partial with other settings."""

    block_pool: Callable[..., BlockPool] = BlockPool
    policy: Callable[..., DraftPolicy] = DraftPolicy
    speculator: Callable[..., Speculator] = Speculator
    limits: SpeculationLimits = SpeculationLimits()


def build_engine(config: EngineConfig, preloaded: tuple[torch.nn.Module, ModelConfig] | None = None,
                 clock: Callable[[], float] = now, seams: Seams = Seams()) -> Engine:
    """An engine for `config`, ready to serve. `preloaded`: a (model, config) already on the device (benchmarks with
    random weights). `clock`: what every timing stamp reads. `seams`: what its parts are made with (tests)."""
    device = pick_device(config.device)
    if device.type == "cpu" and config.cpu_threads > 0:
        torch.set_num_threads(config.cpu_threads)
    t0 = now()
    path = resolve_model_path(config.model)
    dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
    model, mc = preloaded or load_model(path, dtype=dtype, device=device, rope=config.rope,
                                        quantization=config.quantization)
    weights = summarize_weights(model)  # formats and bytes, for the log and /props
    log.info("weights: %s, %.2f GiB on %s", weights.describe(), weights.nbytes / 2**30, device)
    if config.prefill_graph_tokens is None:
        config = replace(config, prefill_graph_tokens=default_prefill_graph_tokens(weights.quantized))
    target = _Target(model, mc, str(path), next(model.parameters()).dtype, device,
                     config.max_model_len or mc.max_position_embeddings)
    tokenizer = Tokenizer.from_pretrained(config.tokenizer or path)
    if config.chat_template:
        tokenizer.chat_template = config.chat_template
    # The drafter loads before the KV pools are sized: its weights and the target rows it reads count in the budget.
    pools = _KVPools(config, target)
    kind = _spec_kind(config, target)
    drafter, policy, drafter_error = (_load_drafter(config, target, kind, pools, seams.policy) if kind
                                      else (None, None, None))
    if config.spec_draft_n_max is None:  # the default draft length, resolved (/props and /slots show it)
        config = replace(config, spec_draft_n_max=policy.n_max if policy is not None else DEFAULT_N_MAX)
    taps = tuple(drafter.aux_layer_ids) if drafter is not None else ()
    kv_cache, num_blocks = pools.target(drafted=drafter is not None), pools.num_blocks
    states = None
    if pools.states is not None:
        states = LinearStateSlots(pools.states, config.block_size, config.max_num_seqs, config.enable_prefix_caching)
    pool = seams.block_pool(num_blocks, config.block_size, config.enable_prefix_caching,
                            snapshots=pools.states if states is not None and config.enable_prefix_caching else None)
    scheduler = Scheduler(pool, config.max_num_seqs, config.max_num_batched_tokens, target.max_model_len, states)
    graphs = _step_graphs(config, target, policy) if device.type == "cuda" and not config.enforce_eager else None
    runner = ModelRunner(model, kv_cache, mc.vocab_size, device, taps, graphs, states)
    eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(mc.eos_token_id)
    runner.sampler.set_eog_ids(eos_ids)
    speculation = None
    if drafter is not None:
        if runner.graphs:  # (the policy drafts for at most policy.max_batch sequences)
            try:
                drafter.capture_graphs(min(config.max_num_seqs, policy.max_batch), target.max_model_len,
                                       runner.graphs[0].pool)
            except Exception as exc:  # the drafter's graphs only save launches: without them it drafts eager
                log.error("drafter graphs failed to capture, drafting eager: %s\n%s", exc, traceback.format_exc())
        catch_up = None if states else partial(runner.hidden_rows, replay=True)  # (before a step's launch)
        speculator = seams.speculator(drafter, policy, pool, catch_up, config.max_num_batched_tokens, clock,
                                      lambda: _synchronize(device), seams.limits)
        speculation = Speculation(speculator, _device_rounds(config, runner, drafter, policy, target), clock)
    log.info("model loaded (%s, %s, %d KV blocks of %d tokens, %.0f ms)", mc.architecture, target.dtype,
             num_blocks, config.block_size, (now() - t0) * 1e3)
    engine = Engine(config, EngineParts(
        device, model, mc, target.path, tokenizer, target.max_model_len, kv_cache, pool, scheduler, runner, eos_ids,
        GrammarCompiler(tokenizer.to_json(), mc.vocab_size, eos_ids), weights, speculation, drafter_error), clock)
    if device.type == "cuda":
        warm_up(engine)
    return engine


def _spec_kind(config: EngineConfig, target: _Target) -> str | None:
    """The configured (or detected) drafter kind; None: no speculation."""
    if config.spec_type is not None:
        return None if config.spec_type == "none" else config.spec_type
    if config.draft_model:
        return detect_kind(config.draft_model, target.path)
    return target_kind(target.config)


def _load_drafter(config: EngineConfig, target: _Target, kind: str, pools: _KVPools,
                  make_policy: Callable[..., DraftPolicy]) -> tuple[Drafter | None, DraftPolicy | None, str | None]:
    """The drafter of this kind, weights loaded, and its policy (made by `make_policy`); on failure, log why and serve
    without speculation (the third part says why)."""
    t0 = now()
    asked = config.spec_draft_n_max  # None: the drafter's own default (an explicit 0 stays 0)
    try:
        drafter = load_drafter(kind, target=target.model, target_cfg=target.config, target_path=target.path,
                               draft_path=config.draft_model, block_size=config.block_size, dtype=target.dtype,
                               ngram=config.spec_ngram, device=target.device, kv_pool=pools.drafter,
                               token_map=config.spec_token_map,
                               max_draft=max(asked, 1) if asked is not None else None)
    except Exception as exc:
        if config.spec_required or config.spec_token_map:  # asked for: refusing to start says so plainly
            raise
        log.error("drafter (kind=%s) failed to load, serving without speculative decoding: %s", kind, exc)
        return None, None, f"{type(exc).__name__}: {exc}"
    measured = config.spec_measured_costs if config.spec_measured_costs is not None else target.device.type == "cuda"
    verified = _verified_drafts(config, target)
    policy = make_policy(n_max=min(drafter.max_draft if asked is None else asked, verified),
                         n_min=config.spec_draft_n_min, p_min=config.draft_p_min, measured=measured,
                         max_draft=verified if _is_hybrid(target) else None)
    log.info("Drafter loaded (kind=%s, %.0f ms)", kind, (now() - t0) * 1e3)
    return drafter, policy, None


HYBRID_MAX_DRAFT = 16  # drafts a hybrid target's verify rows hold without --draft-max (each costs a state per row)


def _is_hybrid(target: _Target) -> bool:
    return bool(getattr(target.model, "num_linear_layers", 0))


def _verified_drafts(config: EngineConfig, target: _Target) -> int:
    """The most drafts one round verifies on a hybrid target: --draft-max, else HYBRID_MAX_DRAFT (its verify rows
    keep the state after each); unbounded (a large number) for other targets."""
    if not _is_hybrid(target):
        return 1 << 30
    asked = config.spec_draft_n_max
    return HYBRID_MAX_DRAFT if asked is None else max(asked, 1)


class _KVPools:
    """The target's KV pool and the drafter's, with as many blocks each (they share block ids), sized in one budget
    and allocated once: when the drafter asks for its pool (its weights loaded: they count), else for the target
    alone. A hybrid target's KV pool holds its attention layers only; its state pool (engine/state_pool.py) is paid
    from the same budget first."""

    def __init__(self, config: EngineConfig, target: _Target) -> None:
        self.config, self.model = config, target
        self.num_blocks = 0
        self._target: KVCache | None = None
        self.states: StatePool | None = None

    def drafter(self, shape: tuple[int, int, int], taps: tuple[int, ...]) -> KVCache:
        """drafter.KVPool: the drafter's pool (the target's is allocated beside it)."""
        if self._target is not None:
            raise ValueError("only one drafter with weights has a KV pool")
        return self._allocate([shape], taps, drafted=True)[1]

    def target(self, drafted: bool) -> KVCache:
        """The target's pool (`drafted`: a drafter without a pool of its own is loaded)."""
        if self._target is None:
            self._allocate([], (), drafted)
        return self._target

    def _allocate(self, drafter_shapes: list, taps: tuple[int, ...], drafted: bool) -> list[KVCache]:
        config, target, mc = self.config, self.model, self.model.config
        self.states = _state_pool(config, target, drafted)
        layers = getattr(target.model, "num_kv_layers", mc.num_hidden_layers)
        shapes = [(layers, mc.num_key_value_heads, mc.head_dim), *drafter_shapes]
        self.num_blocks = _num_kv_blocks(config, target, drafted, taps,
                                         sum(kv_block_bytes(p, config.block_size, target.dtype) for p in shapes),
                                         self.states)
        pools = [KVCache.allocate(layers, self.num_blocks, config.block_size, kv_heads, head_dim, target.dtype,
                                  target.device) for layers, kv_heads, head_dim in shapes]
        self._target = pools[0]
        return pools


def _state_pool(config: EngineConfig, target: _Target, drafted: bool) -> StatePool | None:
    """A hybrid target's state pool: a slot per sequence and as many for prefix snapshots (with prefix caching),
    and verify rows for every sequence a verify step may hold (DraftPolicy.max_batch) when speculating, of as many
    positions as a round verifies (_verified_drafts + 1: the draft policy caps rounds to it)."""
    model = target.model
    if not _is_hybrid(target):
        return None
    layout = StateLayout.of(model.linear_config, model.num_linear_layers)
    slots = config.max_num_seqs * (2 if config.enable_prefix_caching else 1)
    rows = min(config.max_num_seqs, DraftPolicy.max_batch) if drafted else 0
    positions = _verified_drafts(config, target) + 1 if drafted else 0
    log.info("linear-attention state: %d slots, %d verify rows of %d positions, %.2f GiB", slots, rows, positions,
             layout.pool_bytes(slots, rows, positions) / 2**30)
    return StatePool(layout, slots, rows, positions, target.device)


def _num_kv_blocks(config: EngineConfig, target: _Target, drafted: bool, taps: tuple[int, ...],
                   per_block: int, states: StatePool | None) -> int:
    """Blocks for the KV pools (`per_block` bytes a block across them): what the limits can use, within the memory
    budget (engine/memory.py) less a hybrid model's state pool (allocated already)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    wanted = config.max_num_seqs * -(-target.max_model_len // config.block_size) + 1
    if config.kv_cache_memory_gib or target.device.type != "cuda":
        reserved = 0 if states is None else states.layout.pool_bytes(states.num_slots, *states.verify_inputs.shape[1:3])
        return num_kv_blocks(per_block, wanted, (config.kv_cache_memory_gib or CPU_KV_CACHE_GIB) * 2**30 - reserved)
    # The largest step: a full token budget of prompt, and as many sampled rows as sequences (or verify rows).
    tokens = max(1, min(config.max_num_batched_tokens, target.max_model_len))
    rows = min(tokens, max(config.max_num_seqs, MAX_VERIFY_TOKENS if drafted else 0))
    reserve = measure_step_reserve(target.model, target.config, tokens=tokens, rows=rows,
                                   block_size=config.block_size, dtype=target.dtype, device=target.device,
                                   aux_layer_ids=taps,
                                   states=None if states is None else partial(LinearStateSlots.scratch, states))
    log.info("a step takes up to %.2f GiB beside the weights (measured)", reserve / 2**30)
    prefill = max(prefill_graph_lens(config.prefill_graph_tokens, target.max_model_len), default=0)
    graphs = graph_reserve(config.max_num_seqs, target.config.vocab_size, drafted=drafted,
                           eager=config.enforce_eager, prefill_share=prefill / tokens, step_reserve=reserve)
    # (the free memory cuda_budget reads is what the state pool, allocated already, left)
    return num_kv_blocks(per_block, wanted, cuda_budget(target.device, config.gpu_memory_utilization,
                                                        reserve + graphs))


def _step_graphs(config: EngineConfig, target: _Target, policy: DraftPolicy | None) -> StepGraphs:
    """The target's step graphs to capture: decode; verify steps of k + 1 tokens a sequence, k up to the server's
    draft length (requests asking for more verify eager); lone prefill chunks."""
    verify = range(2, policy.n_max + 2) if policy is not None else ()
    prefill = [q for q in prefill_graph_lens(config.prefill_graph_tokens, target.max_model_len) if q not in verify]
    return StepGraphs(config.max_num_seqs, target.max_model_len, tuple(verify), tuple(prefill))


def _device_rounds(config: EngineConfig, runner: ModelRunner, drafter: Drafter, policy: DraftPolicy,
                   target: _Target) -> dict:
    """Device rounds for every draft length the policy may choose (EngineConfig.spec_device_round: by default where
    CUDA graphs are captured, for drafters that draft on the device)."""
    if not (config.spec_device_round if config.spec_device_round is not None else bool(runner.graphs)):
        return {}
    if not hasattr(drafter, "round_drafts"):
        if config.spec_device_round:
            log.warning("spec_device_round: the %s drafter does not draft on the device; its rounds run as usual",
                        drafter.kind)
        return {}
    return device_rounds(runner, drafter, policy.n_max, -(-target.max_model_len // config.block_size),
                         runner.graphs[0].pool if runner.graphs else None)


def device_rounds_for(engine: Engine, drafter) -> dict:
    """Device rounds like the engine's, for another RoundDrafter (a benchmark's controlled one:
    Speculation.drafting_with)."""
    runner = engine.runner
    return device_rounds(runner, drafter, engine.speculation.policy.n_max,
                         -(-engine.max_model_len // engine.config.block_size),
                         runner.graphs[0].pool if runner.graphs else None)


def _synchronize(device: torch.device) -> None:
    """Wait for the device (the Speculator times one-off work to its end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_until_idle(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def warm_up(engine: Engine) -> None:
    """Run every step shape once (prefill, decode, verify; greedy and sampled) before serving, so Triton's JIT and
    torch.compile happen now and no request's timings include a compilation; then calibrate the draft policy."""
    mc, config = engine.model_config, engine.config
    ids = [3 + i % (mc.vocab_size - 3) for i in range(min(512, engine.max_model_len // 2))]
    for n in (2 * config.block_size + 3, len(ids)):
        for params in (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True, n_probs=1)):
            engine.add_request(Request(ids[:n], params), lambda out: None)
    run_until_idle(engine)
    # Attention compiles a kernel variant per tile height, which follows the step's longest query in rows
    # (tokens x GQA group), and per split plan: short prompts, and short extends of a cached prefix (a chat's
    # next turn), each run alone at every height class.
    group = mc.num_attention_heads // mc.num_key_value_heads
    cached = ids[: len(ids) // 2 // config.block_size * config.block_size]  # a prefix hit, if caching
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    q_len = 1
    while q_len * group <= 64:
        fresh = [4 + (q_len + i) % (mc.vocab_size - 4) for i in range(q_len)]
        for prompt in (fresh, cached + fresh):
            engine.add_request(Request(prompt, one), lambda out: None)
            run_until_idle(engine)
        q_len *= 2
    # (and each variant an eager step over a longer context than these meets: the split ones)
    engine.runner.backend.compile_eager_variants(engine.kv_cache, mc.num_attention_heads, engine.max_model_len)
    engine.runner.compile_eager_forwards(min(engine.max_model_len, config.max_num_batched_tokens))
    if engine.speculation is not None:
        policy = engine.speculation.policy
        if policy.measured:
            policy.forget_costs()  # (the steps above compiled kernels: their times are not the device's)
            calibrate_speculation(engine)
        policy.forget_acceptance()
    engine.pool.reset_prefix_cache()
    engine.pool.hits = 0
    engine.counters.update(dict.fromkeys(engine.counters, 0))


def calibrate_speculation(engine: Engine) -> None:
    """Serve a little traffic at every batch bucket and draft length the policy may choose, so its first decisions
    already rest on this device's measured step costs (every step feeds them, here as later)."""
    policy, vocab = engine.speculation.policy, engine.model_config.vocab_size
    batch = 1
    while batch <= min(engine.config.max_num_seqs, policy.max_batch):
        for k in range(policy.n_max + 1):
            policy.forget_acceptance()  # (the drafts of synthetic prompts miss: each k starts from the prior)
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, spec_n_max=k)
            for i in range(batch):
                engine.add_request(Request([5 + (7 * i + j) % (vocab - 5) for j in range(8)], params),
                                   lambda out: None)
            run_until_idle(engine)
        batch *= 2
