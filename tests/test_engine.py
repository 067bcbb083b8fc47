"""Engine invariance: batching, chunked prefill, prefix caching, preemption and overlap scheduling never change
the output. Every test runs twice: synchronous steps, and overlap scheduling (forced on, as on CUDA)."""

import functools
import json
import re

import jsonschema
import pytest

import outrider.llm
from outrider import LLM, SamplingParams
from outrider.config import EngineConfig, NgramConfig
from outrider.engine.builder import warm_up
from outrider.engine.request import FinishReason, Request
from outrider.testing import write_tiny_checkpoint

PROMPTS = [
    list(range(3, 40)),
    [5, 9, 13, 200, 17],
    list(range(100, 171)),
    [42] * 19,
    list(range(7, 10)),
    list(range(300, 333)),
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", hidden_size=64, layers=2, seed=3)


def run(ckpt, prompts, params=GREEDY, **kw):
    llm = LLM(ckpt, **kw)
    outs = llm.generate(prompts, params)
    return llm, [o.token_ids for o in outs]


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    """Engines built by LLM in the test use this scheduling mode (the module-scoped reference is built first,
    synchronously)."""
    monkeypatch.setattr(outrider.llm, "EngineConfig", functools.partial(EngineConfig, overlap_schedule=request.param))
    return request.param


@pytest.fixture(scope="module")
def reference(ckpt):
    """Each prompt alone, whole prompt in one step, no prefix cache."""
    return [run(ckpt, [p], enable_prefix_caching=False)[1][0] for p in PROMPTS]


def test_outputs_are_not_degenerate(reference):
    assert all(len(r) == GREEDY.max_tokens for r in reference)
    assert len({tuple(r) for r in reference}) == len(reference)
    assert any(len(set(r)) > 4 for r in reference)


def test_batched_equals_one_at_a_time(ckpt, reference):
    _, outs = run(ckpt, PROMPTS, max_num_seqs=8, enable_prefix_caching=False)
    assert outs == reference


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_equals_reference(ckpt, reference, chunk):
    _, outs = run(ckpt, PROMPTS, max_num_seqs=8, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    assert outs == reference


def test_warm_prefix_cache_equals_reference(ckpt, reference):
    llm = LLM(ckpt, max_num_seqs=8, block_size=4)
    first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    second = llm.generate(PROMPTS, GREEDY)
    assert first == reference
    assert [o.token_ids for o in second] == reference
    for prompt, out in zip(PROMPTS, second):
        t = out.timing
        assert t.cache_n > 0 or len(prompt) <= 4
        assert t.cache_n + t.prompt_n == len(prompt)
        assert t.predicted_n == len(out.token_ids)
    # Shared prefix: a prompt that extends a cached one computes only the rest.
    longer = PROMPTS[2] + [1, 2, 3]
    out = llm.generate([longer], GREEDY)[0]
    assert out.timing.cache_n >= len(PROMPTS[2]) - 4


def test_preemption_recomputes_and_frees_every_block(ckpt, reference):
    llm = LLM(ckpt, max_num_seqs=6, block_size=4, num_kv_blocks=40, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    engine = llm.engine
    assert engine.pool.num_used == 0
    assert engine.stats()["num_running"] == 0


def test_preemption_happened(ckpt):
    """The small pool above really forces preemption (otherwise the test proves nothing)."""
    llm = LLM(ckpt, max_num_seqs=6, block_size=4, num_kv_blocks=40, enable_prefix_caching=False)
    reqs = [Request(list(p), GREEDY) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert llm.engine.pool.num_used == 0


def test_offline_completions_carry_each_tokens_top_logprobs_when_asked(ckpt, reference):
    outs = LLM(ckpt).generate(PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n_probs=3))
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref
        assert [lp.token_id for lp in out.logprobs] == ref
        for lp in out.logprobs:  # greedy: the token is the first of its three, best first
            assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob)
            assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert LLM(ckpt).generate(PROMPTS[:1], GREEDY)[0].logprobs == []


def test_seeded_sampling_is_batch_invariant(ckpt):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234, ignore_eos=True)
    llm = LLM(ckpt, max_num_seqs=8)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    busy = llm.generate(PROMPTS, [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(len(PROMPTS))])
    mixed = llm.generate(PROMPTS[:1] + [PROMPTS[1]] + PROMPTS[2:],
                         [SamplingParams(max_tokens=30, temperature=1.0, seed=9)] + [params] +
                         [SamplingParams(max_tokens=10, temperature=0.5)] * 4)
    assert mixed[1].token_ids == alone
    assert busy[1].token_ids != alone  # a different seed changes the output
    again = llm.generate([PROMPTS[1]], params)[0].token_ids
    assert again == alone


def test_stop_string_cut_exactly(ckpt):
    llm = LLM(ckpt)
    full = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 12
    stop = text[5:11]  # spans token boundaries in general
    cut = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                               stop=(stop,)))[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == FinishReason.STOP and cut.stop_type == "word"


def test_max_tokens_and_context_limits(ckpt):
    llm = LLM(ckpt, max_model_len=64)
    out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=-1, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == FinishReason.CONTEXT
    assert len(out.prompt_ids) + len(out.token_ids) == 64
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 5
    assert llm.engine.pool.num_used == 0


def test_cache_prompt_false_bypasses_the_prefix_cache(ckpt, reference):
    llm = LLM(ckpt, block_size=4)
    llm.generate([PROMPTS[0]], GREEDY)
    warm = llm.generate([PROMPTS[0]], GREEDY)[0]
    cold = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                     cache_prompt=False))[0]
    assert warm.timing.cache_n > 0 and cold.timing.cache_n == 0
    assert warm.token_ids == cold.token_ids == reference[0]


def test_overlap_keeps_a_step_in_flight(ckpt, reference, overlap):
    """With overlap on, a decode step is launched while the previous one is still to be committed, and requests
    that finish on a token already in flight (max_tokens) or mid-flight (aborts) leave nothing behind."""
    llm = LLM(ckpt, max_num_seqs=8, block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    outs: dict[int, list] = {}
    reqs = [Request(list(p), GREEDY) for p in PROMPTS]
    for r in reqs:
        outs[r.request_id] = []
        engine.add_request(r, outs[r.request_id].append)
    in_flight = 0
    aborted = reqs[3]
    while engine.has_work():
        engine.step()
        in_flight += engine.inflight is not None
        if len(aborted.output_ids) == 5 and aborted.status.value != "finished":
            engine.abort(aborted.request_id)
    assert (in_flight > 0) == overlap
    for r, ref in zip(reqs, reference):
        got = [t for o in outs[r.request_id] for t in o.new_token_ids]
        assert got == (ref[:5] if r is aborted else ref)
        assert outs[r.request_id][-1].finished and r.num_pending == 0 or r is aborted
    assert engine.pool.num_used == 0 and engine.inflight is None


SCHEMA = {"type": "object", "properties": {"k": {"enum": ["ab", "cd"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["k", "n"]}
GBNF = 'root ::= ("yes" | "no") ", " [a-z]{2,6} "."'


def history_requests(engine) -> list[Request]:
    """A batch whose sampling reads host history: JSON-schema and GBNF requests (greedy and seeded, one also
    penalised; their grammars complete within max_tokens), a penalised one and a free one."""
    schema, gbnf = engine.grammars.json_schema(SCHEMA), engine.grammars.gbnf(GBNF)
    params = [SamplingParams(max_tokens=40, temperature=0.0, grammar=schema),
              SamplingParams(max_tokens=40, temperature=0.9, seed=1, grammar=gbnf),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repeat_penalty=1.3),
              GREEDY,
              SamplingParams(max_tokens=40, temperature=0.9, seed=2, grammar=schema, presence_penalty=0.5),
              SamplingParams(max_tokens=40, temperature=0.0, grammar=gbnf)]
    return [Request(list(p), q) for p, q in zip(PROMPTS, params)]


def reads_history(req: Request) -> bool:
    return req.constraint is not None or req.params.penalized


def test_constrained_and_penalised_requests_give_the_synchronous_output(ckpt, overlap):
    """Grammars and penalties read host state that the step in flight advances; mixed with free requests, the
    output is the synchronous one token for token, and each grammar's output is complete and valid. A constrained
    request aborted with its next step in flight delivers what it had."""
    outputs = []
    for mode in (overlap, False):
        engine = LLM(ckpt, max_num_seqs=8, overlap_schedule=mode).engine
        reqs = history_requests(engine)
        aborted = reqs[4]
        outs: dict[int, list] = {r.request_id: [] for r in reqs}
        for r in reqs:
            engine.add_request(r, outs[r.request_id].append)
        while engine.has_work():
            engine.step()
            if len(aborted.output_ids) == 3 and aborted.request_id in engine.live:
                assert aborted.num_pending == mode  # (with overlap, its next token is in flight)
                engine.abort(aborted.request_id)
        assert engine.pool.num_used == 0 and engine.inflight is None
        outputs.append([[t for o in outs[r.request_id] for t in o.new_token_ids] for r in reqs])
        assert len(outputs[-1][4]) == 3 and outs[aborted.request_id][-1].finish_reason == FinishReason.ABORT
        for r in reqs:
            text = "".join(o.text for o in outs[r.request_id])
            if r is aborted:
                continue
            if r.constraint is not None:
                assert outs[r.request_id][-1].stop_type == "eos" and r.num_pending in (0, 1)
            if r.params.grammar is not None and r.params.grammar.kind == "json_schema":
                jsonschema.validate(json.loads(text), SCHEMA)
            elif r.params.grammar is not None:
                assert re.fullmatch(r"(yes|no), [a-z]{2,6}\.", text), text
    assert outputs[0] == outputs[1]


def test_a_step_reading_history_launches_its_forward_before_the_step_in_flight_is_committed(ckpt, overlap):
    """With overlap, a step that samples a constrained or penalised request is launched (its forward) while the
    step before is still in flight; that step is committed, and only then is the new one sampled (its masks and
    penalty windows read the committed tokens); it then stays in flight itself. Without overlap, each step is
    sampled and collected before the next launches."""
    engine = LLM(ckpt, max_num_seqs=8).engine
    runner = engine.runner
    events: list[tuple[str, object]] = []

    def traced(kind, fn, plan_of):
        def wrapper(arg, *args, **kwargs):
            out = fn(arg, *args, **kwargs)
            events.append((kind, plan_of(arg)))
            return out
        return wrapper

    runner.launch = traced("launch", runner.launch, lambda plan: plan)
    runner.sample = traced("sample", runner.sample, lambda step: step.plan)
    runner.collect = traced("collect", runner.collect, lambda step: step.plan)
    reqs = history_requests(engine)
    for r in reqs:
        engine.add_request(r, lambda out: None)
    left_in_flight = set()
    while engine.has_work():
        engine.step()
        if engine.inflight is not None:
            left_in_flight.update(s.request.request_id for s in engine.inflight.plan.scheduled
                                  if s.samples and reads_history(s.request))
    plans = [plan for kind, plan in events if kind == "launch"]
    at = {(kind, id(plan)): i for i, (kind, plan) in enumerate(events)}
    deferred = set()
    for before, plan in zip(plans, plans[1:]):
        launched, sampled, committed = at["launch", id(plan)], at["sample", id(plan)], at["collect", id(before)]
        history = [s.request.request_id for s in plan.scheduled if s.samples and reads_history(s.request)]
        if history:  # sampled only once every earlier step is committed
            assert committed < sampled
        if overlap and launched < committed:
            deferred.update(history)
        if not overlap:
            assert committed < launched
    expected = {r.request_id for r in reqs if reads_history(r)} if overlap else set()
    assert deferred == expected and left_in_flight == expected


def test_constrained_requests_verify_drafts_synchronously_and_overlap_plain_steps(ckpt, overlap):
    """With lookup drafting, a constrained request's speculative rounds are synchronous (no verify step is ever
    left in flight) and its plain steps, where the lookup misses, overlap; the output is the synchronous one."""
    outputs = []
    for mode in (overlap, False):
        engine = LLM(ckpt, max_num_seqs=8, overlap_schedule=mode, spec_type="ngram",
                     spec_ngram=NgramConfig(size_n=1, size_m=4)).engine
        schema = engine.grammars.json_schema(SCHEMA)
        prompt = engine.tokenizer.encode('{"k": "ab", "n": 7} {"k": "cd", "n": 12} {"k": ')
        reqs = [Request(list(prompt), SamplingParams(max_tokens=40, temperature=0.0, grammar=schema)),
                Request(list(PROMPTS[0]), GREEDY),
                Request(prompt[2:], SamplingParams(max_tokens=40, temperature=0.9, seed=3, grammar=schema))]
        outs: dict[int, list] = {r.request_id: [] for r in reqs}
        for r in reqs:
            engine.add_request(r, outs[r.request_id].append)
        constrained_in_flight = 0
        while engine.has_work():
            engine.step()
            if engine.inflight is not None:
                assert engine.inflight.overlappable and not any(s.draft_tokens for s in engine.inflight.plan.scheduled)
                constrained_in_flight += any(s.samples and s.request.constraint is not None
                                             for s in engine.inflight.plan.scheduled)
        assert (constrained_in_flight > 0) == mode
        assert all(r.timing.draft_rounds > 0 for r in reqs if r.constraint is not None)
        for r in (reqs[0], reqs[2]):
            jsonschema.validate(json.loads("".join(o.text for o in outs[r.request_id])), SCHEMA)
        outputs.append([[t for o in outs[r.request_id] for t in o.new_token_ids] for r in reqs])
    assert outputs[0] == outputs[1]


def test_seeded_sampling_and_min_tokens_are_the_same_with_overlap(ckpt, overlap):
    """The RNG counter and the min_tokens ban count a token still in flight: seeded draws (and where EOS may
    first appear) do not depend on the scheduling mode."""
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s, min_tokens=6)
              for s in range(len(PROMPTS))]
    got = [o.token_ids for o in LLM(ckpt, max_num_seqs=8).generate(PROMPTS, params)]
    sync = [o.token_ids for o in LLM(ckpt, max_num_seqs=8, overlap_schedule=False).generate(PROMPTS, params)]
    assert got == sync
    assert len({tuple(t) for t in got}) == len(got)


def test_warm_up_runs_each_attention_tile_height_alone_and_leaves_the_engine_clean(ckpt, overlap):
    """The CUDA warm-up (run here on the CPU) feeds every query length whose rows (tokens x GQA group) pick
    another attention tile height, alone in its step, fresh and as an extend of a cached prefix; afterwards
    nothing is cached, used or counted."""
    engine = LLM(ckpt, max_model_len=512).engine
    launch, steps = engine.runner.launch, []

    def record(plan, *args):
        s = plan.scheduled
        steps.append((len(s), s[0].num_new_tokens, s[0].request.num_computed > 0))
        return launch(plan, *args)

    engine.runner.launch = record
    warm_up(engine)
    mc = engine.model_config
    group = mc.num_attention_heads // mc.num_key_value_heads
    for q_len in (q for q in (1, 2, 4, 8, 16, 32, 64) if q * group <= 64):
        assert (1, q_len, False) in steps and (1, q_len, True) in steps, (q_len, steps)
    assert engine.pool.num_used == 0 and engine.pool.hits == 0 and not any(engine.counters.values())


def test_a_failed_step_measurement_falls_back_to_the_old_reserve(caplog):
    """measure_step_reserve runs on CUDA; when it cannot measure (here it cannot even start), the server still starts
    with the reserve it assumed before measuring, and says so."""
    import logging

    import torch

    from outrider.engine import memory

    with caplog.at_level(logging.WARNING, logger="outrider.engine"):
        got = memory.measure_step_reserve(torch.nn.Identity(), None, tokens=4, rows=1, block_size=16,
                                          dtype=torch.float32, device=torch.device("cpu"))
    assert got == memory.FALLBACK_RESERVE and "could not measure" in caplog.text


class _EagerPrefillGraph:
    """A captured prefill graph's stand-in on the CPU: it takes what CudaGraphRunner(q, buckets [1]) takes, and runs
    it eagerly over a block table as wide as a captured one's, whose entries past the step's own name other blocks
    (a real graph's buffer keeps earlier steps' entries there)."""

    causal, buckets = True, [1]

    def __init__(self, runner, q: int, max_seq_len: int, num_blocks: int):
        self.runner, self.q, self.max_seq_len, self.num_blocks = runner, q, max_seq_len, num_blocks
        self.replays = 0

    def bucket_for(self, num_seqs: int) -> int | None:
        return 1 if num_seqs == 1 else None

    def can_run(self, meta) -> bool:
        return meta.causal and meta.max_query_len == self.q and meta.slot_mapping.shape[0] == meta.num_seqs * self.q \
            and meta.num_seqs == 1

    def run(self, input_ids, positions, meta):
        import dataclasses

        import torch

        self.replays += 1
        block = self.runner.block_size
        table = torch.randint(1, self.num_blocks, (1, -(-self.max_seq_len // block)), dtype=torch.int32)
        table[:, : meta.block_tables.shape[1]] = meta.block_tables
        return self.runner.forward_eager(input_ids, positions, dataclasses.replace(meta, block_tables=table))


@pytest.mark.parametrize("chunk", [16, 2048])
def test_lone_prefill_chunks_padded_to_a_graphs_length_give_the_reference_output(ckpt, reference, chunk):
    """A prefill chunk that runs alone is padded up to the shortest prefill graph that takes it (the pad rows store
    no K/V and no real row sees them): outputs are the reference's, whole prompts and chunks alike, with the prefix
    cache on; chunks longer than every graph run eager."""
    from outrider.engine.cuda_graphs import prefill_graph_lens

    llm = LLM(ckpt, max_num_batched_tokens=chunk, block_size=4)
    engine = llm.engine
    graphs = [_EagerPrefillGraph(engine.runner, q, engine.max_model_len, engine.pool.num_blocks)
              for q in prefill_graph_lens(40, engine.max_model_len)]
    engine.runner.graphs = graphs
    fed = []
    launch = engine.runner.launch

    def launch_logged(plan, *args):
        fed.append([s.num_new_tokens for s in plan.scheduled])
        return launch(plan, *args)

    engine.runner.launch = launch_logged
    for _ in range(2):  # (the second time, prompts extend their cached prefix)
        outs = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
        assert outs == reference
    assert [g.q for g in graphs] == [8, 16, 32, 64]
    padded = [n[0] for n in fed if len(n) == 1 and 1 < n[0] and n[0] not in (8, 16, 32, 64) and n[0] <= 64]
    assert padded and sum(g.replays for g in graphs) >= len(padded)  # (some chunks were padded, and replayed)
    eager = [n[0] for n in fed if len(n) == 1 and n[0] > 64]
    assert bool(eager) == (chunk > 64)  # (the 71-token prompt, whole)


def test_prefill_graph_lengths_are_powers_of_two_that_cover_the_setting_within_the_context():
    from outrider.engine.cuda_graphs import prefill_graph_lens

    assert prefill_graph_lens(0, 4096) == [] and prefill_graph_lens(5, 4096) == [8]
    assert prefill_graph_lens(8, 4096) == [8] and prefill_graph_lens(9, 4096) == [8, 16]
    assert prefill_graph_lens(256, 4096) == [8, 16, 32, 64, 128, 256]
    assert prefill_graph_lens(256, 100) == [8, 16, 32, 64]
