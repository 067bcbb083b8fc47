"""Hybrid models (Qwen3-Next, Qwen3.5 dense and MoE: Gated DeltaNet + attention) through the real engine on tiny random
fp32 checkpoints: greedy tokens equal transformers' in a batch of mixed prompt lengths, unchanged by chunked
prefill, batch size, preemption and prefix hits (served from state snapshots only); speculation on a hybrid target
is lossless for every drafter kind at batch 1 and 8 with overlap on, host rounds and device rounds, greedy and
(chi-square) sampled with ragged acceptance; and no state slot leaks through random admissions, preemptions and
aborts."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy import stats

from outrider import LLM, SamplingParams
from outrider.engine.request import Request
from outrider.testing import write_tiny_checkpoint
from outrider.tokenizer import Tokenizer
from spec_helpers import write_hybrid_family

transformers = pytest.importorskip("transformers")

N_NEW = 64
PROMPTS = [[1, 17, 99, 200, 7], [1] + list(range(30, 70)), [42], [1, 300, 301, 302, 5, 6, 7, 8, 9, 10, 11],
           list(range(100, 123))]
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    """(checkpoint, transformers' greedy tokens for PROMPTS)."""
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param, layers=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    # ignore_eos bans end-of-generation tokens, as llama-server does: the reference bans them too
    eog = sorted(Tokenizer.from_pretrained(ckpt).eos_token_ids | {hf.generation_config.eos_token_id})
    out = []
    for ids in PROMPTS:
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                          suppress_tokens=eog)
        out.append(ref[0, len(ids):].tolist())
    assert len(set(out[0])) > 4, "random tiny model degenerated into repeating one token"
    return ckpt, out


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Request]:
    reqs = [Request(list(p), params) for p in prompts]
    for r in reqs:
        llm.engine.add_request(r, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    return reqs


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_greedy_tokens_match_transformers_at_any_batch_size(case, max_num_seqs):
    ckpt, hf_tokens = case
    llm = LLM(str(ckpt), max_num_seqs=max_num_seqs, dtype="float32", overlap_schedule=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_tokens
    pool = llm.engine.scheduler.states.pool
    assert pool.num_owned == 0 and len(llm.engine.runner.kv_cache.k) == llm.engine.model.num_kv_layers


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(case):
    ckpt, hf_tokens = case
    llm = LLM(str(ckpt), max_num_seqs=5, dtype="float32", block_size=4, max_num_batched_tokens=8,
              num_kv_blocks=48, overlap_schedule=True)
    reqs = run(llm, PROMPTS)
    assert [r.output_ids for r in reqs] == hf_tokens
    assert sum(r.num_preemptions for r in reqs) > 0, "the small pool should force preemption"


def test_prefix_hits_from_state_snapshots_keep_the_tokens(case):
    ckpt, hf_tokens = case
    llm = LLM(str(ckpt), max_num_seqs=5, dtype="float32", block_size=4, max_num_batched_tokens=8,
              overlap_schedule=True)
    run(llm, PROMPTS)
    again = run(llm, PROMPTS)  # the prompts' prefixes are cached, with the state snapshots at their ends
    assert [r.output_ids for r in again] == hf_tokens
    assert llm.engine.pool.hits > 0
    assert [r.timing.cache_n for r in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]


def test_a_prefix_hit_is_cut_to_the_last_state_snapshot(case):
    """Blocks cached without a snapshot at their end serve no hit: only a snapshot reproduces the state."""
    ckpt, hf_tokens = case
    llm = LLM(str(ckpt), max_num_seqs=2, dtype="float32", block_size=4)
    states = llm.engine.scheduler.states
    run(llm, [PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0.0))
    snapshots = list(states.pool._snapshots)
    assert len(snapshots) == 1  # at the prompt's last full block before its last token
    for key in snapshots:
        states.pool.drop(key)
    (cold,) = run(llm, [PROMPTS[1]])
    assert cold.timing.cache_n == 0 and cold.output_ids == hf_tokens[1]


# --- speculation on a hybrid target ------------------------------------------------------------------------------

SPEC_PROMPTS = [[5, 9, 13, 200, 17], list(range(30, 50)), [100], [7, 8, 9, 10, 11, 12, 300], [1, 2, 3],
                [300, 100, 200, 5], list(range(60, 64)), [9] * 7]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def family(request, tmp_path_factory):
    return write_hybrid_family(tmp_path_factory.mktemp("hybrid_family"), request.param)


KINDS = ("draft", "dflash", "mtp")


def speculating(family, kind: str, **kwargs) -> LLM:
    """The family's target drafting with `kind`: a draft model or DFlash drafter beside it, or its own MTP head."""
    if kind == "mtp":
        return LLM(str(family["mtp"]), **kwargs)
    return LLM(str(family["target"]), draft_model=str(family[kind]), **kwargs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculation_on_a_hybrid_target_is_lossless(family, kind, batch):
    prompts, params = SPEC_PROMPTS[:batch], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(family["target"]), spec_type="none", max_num_seqs=batch).generate(prompts, params)
    spec = speculating(family, kind, max_num_seqs=batch, spec_draft_n_max=3, overlap_schedule=True)
    assert spec.engine.drafter_kind == kind
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafted = sum(o.timing.draft_n for o in outs)
    accepted = sum(o.timing.draft_n_accepted for o in outs)
    assert 0 < accepted < drafted, "the drafter should be accepted part of the time"


@pytest.mark.parametrize("kind", KINDS)
def test_device_rounds_on_a_hybrid_target_are_lossless(family, kind):
    """A lone greedy request runs whole rounds on the device; each commits its accepted state there."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompt = [[5, 9, 13, 200, 17]]
    plain = LLM(str(family["target"]), spec_type="none", max_num_seqs=1).generate(prompt, params)
    spec = speculating(family, kind, max_num_seqs=2, spec_draft_n_max=3, spec_device_round=True,
                       overlap_schedule=True)
    rounds = 0
    for r in spec.engine.speculation.rounds.values():
        replay = r.replay

        def counted(replay=replay):
            nonlocal rounds
            rounds += 1
            replay()
        r.replay = counted
    (out,) = spec.generate(prompt, params)
    assert out.token_ids == plain[0].token_ids
    assert rounds > 3 and 0 < out.timing.draft_n_accepted < out.timing.draft_n


N_SAMPLES = 400
N_SAMPLED = 7  # tokens a request: rounds that follow committed rounds


def sampled(llm: LLM) -> list:
    params = [SamplingParams(max_tokens=N_SAMPLED, temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=s,
                             ignore_eos=True) for s in range(N_SAMPLES)]
    return llm.generate([[5, 9, 13, 200, 17]] * N_SAMPLES, params)


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square p-value, outcomes seen fewer than 10 times pooled."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    common = [k for k in keys if a[k] + b[k] >= 10]
    rest = [k for k in keys if k not in common]
    table = [[c[k] for k in common] + ([sum(c[k] for k in rest)] if rest else []) for c in (a, b)]
    if len(table[0]) < 2:
        return 1.0  # (one outcome only: nothing to compare)
    return stats.chi2_contingency(table)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_speculation_on_a_hybrid_target_keeps_the_distribution(family, kind):
    """Chi-square over each position's token, many requests a step, rows accepting nothing beside rows accepting
    every draft."""
    kw = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=64)  # (verify rows: one per sequence)
    plain = sampled(LLM(str(family["target"]), spec_type="none", **kw))
    llm = speculating(family, kind, spec_draft_n_max=2, overlap_schedule=True, **kw)
    llm.engine.speculation.policy.max_batch = 1 << 20  # (every request of the big batch drafts)
    llm.engine.speculation.policy.max_verify_tokens = 1 << 20
    spec = sampled(llm)
    rounds = [(o.timing.draft_n, o.timing.draft_n_accepted) for o in spec]
    assert any(n > 0 and a == 0 for n, a in rounds) and any(n > 0 and a == n for n, a in rounds)
    positions = [chi_square_p(Counter(tuple(o.token_ids[: i + 1]) for o in plain),
                              Counter(tuple(o.token_ids[: i + 1]) for o in spec)) for i in range(N_SAMPLED)]
    assert min(positions) > 1e-3 / N_SAMPLED, positions


# --- the state pool through random traffic ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def soak_llm(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("soak") / "ckpt", "qwen3_5", layers=4)
    return LLM(str(ckpt), max_num_seqs=4, dtype="float32", block_size=4, max_num_batched_tokens=12,
               num_kv_blocks=24, overlap_schedule=True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.booleans()), min_size=1, max_size=10),
       st.integers(0, 2**16))
def test_no_state_slot_leaks_through_admissions_preemptions_and_aborts(soak_llm, traffic, seed):
    engine, rng = soak_llm.engine, random.Random(seed)
    states = engine.scheduler.states
    reqs = []
    for prompt_len, max_tokens, abort in traffic:
        req = Request([rng.randrange(5, 500) for _ in range(prompt_len)],
                      SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        engine.add_request(req, lambda out: None)
        reqs.append((req, abort))
        engine.step()
        assert states.pool.num_owned == len(engine.scheduler.running)
    for req, abort in reqs:
        if abort:
            engine.abort(req.request_id)
    while engine.has_work():
        engine.step()
        assert states.pool.num_owned == len(engine.scheduler.running)
    pool = states.pool
    assert pool.num_owned == 0 and pool.num_free == pool.num_slots
    assert len(set(pool._free) | set(pool._snapshots.values())) == pool.num_slots


def test_metrics_and_slots_report_the_state_pool(tmp_path):
    import threading
    import time

    import httpx

    from outrider.config import EngineConfig
    from test_spec_http import LoopbackServer, scrape

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5", layers=4)
    server = LoopbackServer(EngineConfig(model=str(ckpt), max_num_seqs=3, max_model_len=256, block_size=4))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while client.get("/health").status_code != 200:
                time.sleep(0.1)
            server.engine.engine.runner.step_hook = lambda plan: time.sleep(0.02)  # (a request stays in flight)
            body = {"prompt": list(range(10, 31)), "n_predict": 60, "temperature": 0, "ignore_eos": True}
            done = threading.Thread(target=lambda: client.post("/completion", json=body))
            done.start()
            busy = []
            while not busy and done.is_alive():
                busy = [s for s in client.get("/slots").json() if s["is_processing"] and "state_slot" in s]
                if busy:
                    metrics = scrape(client)
            done.join()
            assert busy and busy[0]["state_slot"] >= 1 and busy[0]["kv_blocks"] > 0
            assert metrics["outrider_state_slots_owned"] == 1
            after = scrape(client)
            assert after["outrider_state_slots_total"] == 6 and after["outrider_state_slots_owned"] == 0
            assert after["outrider_state_slots_snapshot"] == 1  # the prompt's last full block before its last token
            assert after["outrider_state_slots_free"] == 5
    finally:
        server.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_steps_with_prompt_chunks_verify_no_drafts_and_lose_no_token(family, kind):
    """Requests arrive while others decode, their prompts in chunks: those steps carry no drafts (a verify leaves the
    linear layers' slots alone, a chunk must advance them), the others draft again after, and the tokens stay the
    target's."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = LLM(str(family["target"]), spec_type="none", max_num_seqs=8).generate(SPEC_PROMPTS, params)
    spec = speculating(family, kind, max_num_seqs=8, spec_draft_n_max=3, max_num_batched_tokens=10,
                       block_size=4, overlap_schedule=True)
    engine, launched = spec.engine, []
    real_launch = engine.runner.launch

    def launch(plan, *args, **kwargs):
        launched.append(plan)
        return real_launch(plan, *args, **kwargs)
    engine.runner.launch = launch
    reqs = []
    for prompt in SPEC_PROMPTS:  # one arrival every third step
        reqs.append(Request(list(prompt), params))
        engine.add_request(reqs[-1], lambda out: None)
        for _ in range(3):
            engine.step()
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in reqs] == [o.token_ids for o in plain]
    chunked = [p for p in launched if p.has_prefill]
    drafted = [p for p in launched if any(s.draft_tokens for s in p.scheduled)]
    assert chunked and drafted and not [p for p in chunked if p in drafted]


def test_the_state_pool_and_the_attention_layers_kv_share_one_budget(tmp_path):
    from outrider.engine.memory import kv_block_bytes

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5", layers=4)
    budget = 8 * 2**20
    llm = LLM(str(ckpt), max_num_seqs=4, max_model_len=4096, kv_cache_memory_gib=budget / 2**30, block_size=16)
    engine, model = llm.engine, llm.engine.model
    pool = engine.scheduler.states.pool
    assert pool.num_slots == 8  # a slot per sequence, as many for prefix snapshots
    per_block = kv_block_bytes((model.num_kv_layers, engine.model_config.num_key_value_heads,
                                engine.model_config.head_dim), 16, torch.float32)
    state_bytes = pool.layout.pool_bytes(pool.num_slots, 0, 0)
    assert engine.pool.num_blocks + 1 == (budget - state_bytes) // per_block


def test_a_request_asking_for_more_drafts_than_the_verify_rows_hold_is_capped(family):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, spec_n_max=3)
    plain = LLM(str(family["target"]), spec_type="none", max_num_seqs=4).generate(SPEC_PROMPTS[:4], params)
    spec = speculating(family, "dflash", max_num_seqs=4, spec_draft_n_max=2)  # (DFlash blocks of 4: 3 drafts)
    assert spec.engine.scheduler.states.pool.verify_inputs.shape[2] == 3
    outs = spec.generate(SPEC_PROMPTS[:4], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.timing.draft_n <= 2 * o.timing.draft_rounds for o in outs) and sum(o.timing.draft_n for o in outs)


def test_a_failed_step_recomputes_its_requests_rather_than_reuse_a_half_advanced_state(case):
    """A step of several requests fails after its forward advanced their slots: each recomputes (and runs alone to
    find the fault's owner), so no token comes from a state that absorbed a step twice."""
    ckpt, hf_tokens = case
    llm = LLM(str(ckpt), max_num_seqs=8, dtype="float32")
    runner, faults = llm.engine.runner, []
    real_sample = runner.sample

    def sample(step, *args, **kwargs):
        if len(step.plan.scheduled) > 1 and not faults and any(len(r.output_ids) > 3 for r in reqs):
            faults.append(step.plan)
            raise RuntimeError("injected")
        return real_sample(step, *args, **kwargs)
    runner.sample = sample
    reqs = [Request(list(p), GREEDY) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    assert faults and [r.output_ids for r in reqs] == hf_tokens
