"""Speculative decoding through the real engine step: lossless greedy output for every drafter kind, alone and
in mixed batches, counters that add up, and timings that put prefill in prompt_ms and rounds in predicted_ms."""

import logging
import re
import time

import pytest

import outrider.engine.builder as builder_mod
from outrider import LLM, SamplingParams
from outrider.testing.checkpoints import write_tiny_checkpoint
from outrider.config import NgramConfig
from outrider.testing.drafters import write_dflash_checkpoint, write_eagle3_checkpoint, write_mtp_checkpoint
from spec_helpers import SETUPS as FAMILY
from spec_helpers import StepClock, write_families

PROMPTS = [list(range(3, 30)), [5, 9, 13, 200, 17], list(range(100, 141)), [42] * 11,
           list(range(7, 10)), list(range(300, 333)), [8, 8, 9, 9, 10], list(range(50, 70))]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = write_tiny_checkpoint(root / "target", "qwen3", hidden_size=64, layers=3, seed=5)
    return {
        "target": target,
        "draft": write_tiny_checkpoint(root / "draft", "qwen3", hidden_size=32, layers=1, seed=6),
        "self": target,  # the target as its own draft model: an oracle drafter
        "mtp": write_mtp_checkpoint(root / "mtp", "qwen", hidden_size=64, layers=3, seed=5),
        "mimo": write_mtp_checkpoint(root / "mimo", "mimo", hidden_size=64, layers=3, seed=5),
        "dflash": write_dflash_checkpoint(root / "dflash", target, block_size=4),
    }


SETUPS = {  # name -> (target, engine kwargs)
    "draft": ("target", lambda c: dict(draft_model=str(c["draft"]))),
    "mtp": ("mtp", lambda c: {}),
    "mimo": ("mimo", lambda c: {}),
    "dflash": ("target", lambda c: dict(draft_model=str(c["dflash"]))),
}


def test_each_token_carries_its_own_piece_of_the_text(ckpts):
    """A round's text splits exactly into its tokens' texts, across characters split between tokens and text held
    back while it may start a stop string."""
    from outrider.engine.request import Request

    spec = LLM(ckpts["target"], max_num_seqs=8, spec_draft_n_max=4, spec_type="draft", draft_model=str(ckpts["self"]))
    outputs: dict[int, list] = {}
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=40, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=i,
                                ignore_eos=True, stop=("\n\n\n", "é\u00ff"))
        req = Request(prompt, params)
        outputs[req.request_id] = []
        spec.engine.add_request(req, outputs[req.request_id].append)
    while spec.engine.has_work():
        spec.engine.step()
    rounds = [o for outs in outputs.values() for o in outs if o.new_token_ids]
    assert all(len(o.token_texts) == len(o.new_token_ids) and "".join(o.token_texts) == o.text for o in rounds)
    assert any(len(o.new_token_ids) > 1 for o in rounds)  # the oracle drafter's rounds commit several tokens
    assert any(piece == "" for o in rounds for piece in o.token_texts)  # a token whose text comes later


def greedy(n=20, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("kind", list(SETUPS))
def test_greedy_output_is_identical_with_and_without_drafter(ckpts, kind):
    target, kwargs = SETUPS[kind]
    plain = LLM(ckpts[target], spec_type="none", max_num_seqs=8)
    spec = LLM(ckpts[target], max_num_seqs=8, spec_draft_n_max=4, **kwargs(ckpts))
    assert spec.engine.drafter_kind == ("mtp" if kind == "mimo" else kind)
    # Alone.
    ref = [o.token_ids for o in plain.generate(PROMPTS, greedy())]
    assert [spec.generate([p], greedy())[0].token_ids for p in PROMPTS[:3]] == ref[:3]
    # A batch of 8 mixed requests: some draft (different k), some do not.
    params = [greedy(spec_n_max=k) for k in (0, 1, 2, 3, 4, 0, 2, 4)]
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ref
    for p, o in zip(params, outs):
        t = o.timing.to_timings()
        if p.spec_n_max == 0:
            assert "draft_n" not in t
        else:
            assert o.timing.draft_kind == spec.engine.drafter_kind and t["draft_rounds"] > 0
            assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
            # Every round commits its accepted drafts and one target token (a stop may cut the last round short);
            # the first token came from the prefill.
            assert t["draft_n_accepted"] + t["draft_rounds"] <= t["predicted_n"] == len(o.token_ids)
    assert spec.engine.pool.num_used == 0


def test_oracle_drafter_accepts_everything(ckpts):
    llm = LLM(ckpts["target"], draft_model=str(ckpts["self"]), spec_type="draft", spec_draft_n_max=3)
    out = llm.generate([PROMPTS[0]], greedy(n=25))[0]
    t = out.timing
    assert t.draft_rounds > 0 and t.draft_n_accepted == t.draft_n  # tau = k + 1 on every round
    assert t.predicted_n == 25 == 1 + t.draft_rounds * 4  # the prefill's token, then six full rounds


# --- timings: prefill in prompt_ms, every round in predicted_ms (criterion 4, offline; tests/test_spec_http.py
# does the same over HTTP, streamed and not) ---------------------------------------------------------------------

P_S, R_S = 0.30, 0.06  # the step clock: a step that prefills lasts P, any other R
JITTER_MS = 10.0  # what the clock cannot place: the token stamp after the hook, the prompt start in the step


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_families(tmp_path_factory.mktemp("spec_family"))


def family_llm(families, kind: str) -> LLM:
    arch, served, kwargs, _ = FAMILY[kind]
    return LLM(families[arch][served], max_num_seqs=4, spec_draft_n_max=3, **kwargs(families[arch]))


def timed_batches(llm: LLM, clock: StepClock) -> list:
    """The first request after start alone, then batches of 4 and 1 (later requests), checked against the clock.
    Batches mix a greedy request, a plain one (n_max = 0), a sampled one and one with k <= 1; lengths vary so
    that some requests end on a drafted multi-token round."""
    outs = []
    for batch in (1, 4, 1, 4):
        params = [greedy(8 + (len(outs) + j) % 4) for j in range(batch)]
        if batch == 4:
            params[1] = greedy(9, spec_n_max=0)
            params[2] = SamplingParams(max_tokens=10, temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=7,
                                       ignore_eos=True)
            params[3] = greedy(11, spec_n_max=1)
        got = llm.generate([[7 + len(outs) + j, 11, 13, 17, 19] for j in range(batch)], params)
        for p, o in zip(params, got):
            assert len(o.token_ids) == p.max_tokens
            assert (o.timing.draft_rounds > 0) == (p.spec_n_max != 0)
            clock.check(o.timing.to_timings(), o.timing, JITTER_MS)
        outs += got
    # Some rounds committed several tokens (predicted_ms still counts rounds, not tokens).
    assert any(len(clock.steps_of(o.timing)) < o.timing.predicted_n for o in outs)
    return outs


@pytest.mark.parametrize("kind", ["dflash", "mtp", "eagle3"])
def test_model_drafts_stay_on_the_device_until_the_verdict_reads_them(families, kind):
    """A model drafter's argmax drafts feed the verify forward from the device and reach the host with the verdict
    (one sync): the drafter is staged, never asked to propose, and every plan ends up holding the real drafts
    (no placeholder left), which the target accepted where they were right. A request with a confidence stop (p_min > 0) needs the values
    before scheduling, so its drafts are proposed to the host."""
    llm = family_llm(families, kind)
    engine, drafter = llm.engine, llm.engine.speculation.drafter
    calls, plans = {"stage": 0, "propose": 0}, []

    def counted(name, method):
        def call(*args, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)
        return call

    drafter.stage, drafter.propose = counted("stage", drafter.stage), counted("propose", drafter.propose)
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *a, **kw: plans.append(schedule(*a, **kw)) or plans[-1]
    outs = llm.generate(PROMPTS[:4], [greedy(16)] * 4)
    assert calls["stage"] > 0 and calls["propose"] == 0
    drafted = [s.draft_tokens for p in plans for s in p.scheduled if s.draft_tokens]
    assert drafted and all(0 <= t < engine.model_config.vocab_size for d in drafted for t in d)  # (PENDING < 0)
    assert sum(o.timing.draft_n_accepted for o in outs) > 0
    calls.update(stage=0, propose=0)
    llm.generate([PROMPTS[0]], [greedy(16, spec_p_min=1e-9)])
    assert calls["propose"] > 0


@pytest.mark.parametrize("kind", list(FAMILY))
def test_timings_cover_prefill_and_rounds(families, kind):
    """Test hook: prefill steps last P, every later step R; prompt_ms ~ P and predicted_ms ~ the rounds' total,
    for the first request and later ones, alone and four at once, for every drafter kind."""
    llm = family_llm(families, kind)
    timed_batches(llm, StepClock(P_S, R_S).install(llm.engine))


def test_slow_drafter_load_shows_in_no_timings(families, monkeypatch, caplog):
    load_s = 1.0
    real_loader = builder_mod.load_drafter

    def slow_loader(*args, **kwargs):
        time.sleep(load_s)
        return real_loader(*args, **kwargs)

    monkeypatch.setattr(builder_mod, "load_drafter", slow_loader)
    with caplog.at_level(logging.INFO, logger="outrider.engine"):
        llm = family_llm(families, "draft")
    loaded = re.search(r"Drafter loaded \(kind=draft, (\d+) ms\)", caplog.text)
    assert loaded and int(loaded.group(1)) >= load_s * 1e3  # it loaded beside the target, slowly
    timed_batches(llm, StepClock(P_S, R_S).install(llm.engine))


@pytest.mark.parametrize("kind", list(FAMILY))
def test_default_draft_length_is_the_drafters(families, kind):
    """Without --spec-draft-n-max, DFlash drafts its whole block (block_size - 1) and the other kinds 4; the
    resolved value is what the engine config (and so /props) reports. An explicit value always wins."""
    arch, served, kwargs, _ = FAMILY[kind]
    llm = LLM(families[arch][served], max_num_seqs=2, **kwargs(families[arch]))
    drafter = llm.engine.speculation.drafter
    want = drafter.block - 1 if kind == "dflash" else 4
    assert drafter.max_draft == llm.engine.speculation.policy.n_max == llm.engine.config.spec_draft_n_max == want
    assert family_llm(families, kind).engine.speculation.policy.n_max == 3


def test_ngram_lookup_drafts_up_to_sixteen_by_default_and_each_combined_kind_keeps_its_own(families):
    """Without --spec-draft-n-max, n-gram lookup drafts up to 16 (its drafts cost nothing to make); beside a draft
    model, the lookup keeps 16 and the draft model its 4, and the policy's length is the longer."""
    target = families["qwen3"]["target"]
    lookup = LLM(target, max_num_seqs=2, spec_type="ngram").engine
    assert lookup.speculation.drafter.max_draft == lookup.speculation.policy.n_max == lookup.config.spec_draft_n_max == 16
    both = LLM(target, max_num_seqs=2, spec_type="ngram,draft", draft_model=str(families["qwen3"]["draft"])).engine
    assert [m.max_draft for m in both.speculation.drafter.members] == [16, 4] and both.speculation.policy.n_max == 16
    assert LLM(target, max_num_seqs=2, spec_type="ngram", spec_draft_n_max=5).engine.speculation.policy.n_max == 5


@pytest.mark.parametrize("kind", list(SETUPS))
def test_one_memory_budget_sizes_the_target_and_drafter_pools(ckpts, kind):
    """The drafter's KV pool has as many blocks as the target's, so the budget is split over both: together
    they fit it (sized before either loads), and neither pool alone is sized for the whole budget."""
    target, kwargs = SETUPS[kind]
    budget_gib = 1 / 256
    llm = LLM(ckpts[target], max_num_seqs=64, max_model_len=2048, kv_cache_memory_gib=budget_gib, **kwargs(ckpts))
    engine = llm.engine

    def pool_bytes(kv):
        return sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))

    target_bytes, draft_bytes = pool_bytes(engine.kv_cache), pool_bytes(engine.speculation.drafter.kv)
    blocks = engine.kv_cache.num_blocks
    per_block = (target_bytes + draft_bytes) // blocks
    assert engine.speculation.drafter.kv.num_blocks == blocks
    assert blocks == int(budget_gib * 2**30 // per_block)  # the budget binds, not the limits
    assert target_bytes + draft_bytes <= budget_gib * 2**30 < target_bytes + draft_bytes + per_block


# --- EAGLE-3 and n-gram lookup, alone and combined, on random checkpoints -------------------------------------

@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 4-layer target (EAGLE-3 taps the inputs of layers 1-3), a draft model and an EAGLE-3 head for it."""
    root = tmp_path_factory.mktemp("spec_deep")
    target = write_tiny_checkpoint(root / "target", "qwen3", hidden_size=64, layers=4, seed=7)
    return {"target": target,
            "draft": write_tiny_checkpoint(root / "draft", "qwen3", hidden_size=32, layers=1, seed=6),
            "eagle3": write_eagle3_checkpoint(root / "eagle3", target, aux_layer_ids=[1, 2, 3], seed=8)}


NGRAM = NgramConfig(size_n=2, size_m=8)
MORE_SETUPS = {  # kind -> engine kwargs
    "eagle3": lambda c: dict(draft_model=str(c["eagle3"])),
    "ngram": lambda c: dict(spec_type="ngram", spec_ngram=NGRAM),
    "ngram,draft": lambda c: dict(spec_type="ngram,draft", spec_ngram=NGRAM, draft_model=str(c["draft"])),
    "ngram,eagle3": lambda c: dict(spec_type="ngram,eagle3", spec_ngram=NGRAM, draft_model=str(c["eagle3"])),
}
# Prompts that repeat themselves (lookup drafts from their start) and ones that do not.
REPEATING = [list(range(3, 20)) * 2, [5, 9, 13, 200, 17] * 3, list(range(100, 141)), [42, 43] * 6,
             list(range(7, 12)), list(range(300, 320)) + list(range(300, 310)), [8, 8, 9, 9, 10], list(range(50, 70))]


@pytest.mark.parametrize("kind", list(MORE_SETUPS))
def test_greedy_output_is_identical_with_eagle3_and_lookup(deep, kind):
    """Alone and in a mixed batch of 8 (several draft lengths, some requests not drafting), greedy output equals
    plain output; every kind of a combination drafts for some request, and each request reports the kind that
    drafted its latest round."""
    plain = LLM(deep["target"], spec_type="none", max_num_seqs=8)
    spec = LLM(deep["target"], max_num_seqs=8, spec_draft_n_max=4, **MORE_SETUPS[kind](deep))
    assert spec.engine.drafter_kind == kind
    ref = [o.token_ids for o in plain.generate(REPEATING, greedy(24))]
    assert [spec.generate([p], greedy(24))[0].token_ids for p in REPEATING[:2]] == ref[:2]
    # (a fresh engine: the random drafters' misses alone would have taught the policy to start new requests low)
    spec = LLM(deep["target"], max_num_seqs=8, spec_draft_n_max=4, **MORE_SETUPS[kind](deep))
    params = [greedy(24, spec_n_max=k) for k in (4, 1, 2, 3, 4, 0, 2, 4)]
    outs = spec.generate(REPEATING, params)
    assert [o.token_ids for o in outs] == ref
    assert {o.timing.draft_kind for o in outs if o.timing.draft_rounds} == set(kind.split(","))
    assert not outs[5].timing.draft_rounds
    assert spec.engine.pool.num_used == 0
