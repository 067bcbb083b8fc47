"""Speculative decoding through the real engine step: lossless greedy output for every drafter kind, alone and
in mixed batches, counters that add up, and timings that put prefill in prompt_ms and rounds in predicted_ms."""

import time

import pytest

from outrider import LLM, SamplingParams
from outrider.testing.checkpoints import write_tiny_checkpoint
from outrider.testing.drafters import write_dflash_checkpoint, write_mtp_checkpoint

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
            assert t["draft_kind"] == spec.engine.drafter_kind and t["draft_rounds"] > 0
            assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
            # Every round commits accepted + 1 tokens; the first token came from the prefill.
            assert t["predicted_n"] <= 1 + t["draft_n_accepted"] + (o.timing.predicted_n - 1)
    assert spec.engine.pool.num_used == 0


def test_oracle_drafter_accepts_everything(ckpts):
    llm = LLM(ckpts["target"], draft_model=str(ckpts["self"]), spec_type="draft", spec_draft_n_max=3)
    out = llm.generate([PROMPTS[0]], greedy(n=25))[0]
    t = out.timing
    assert t.draft_rounds > 0 and t.draft_n_accepted == t.draft_n  # tau = k + 1 on every round
    assert t.predicted_n == 1 + t.draft_rounds * 4 or t.predicted_n == 25


def test_timings_cover_prefill_and_rounds(ckpts):
    """Test hook: prefill steps take P, every later step R; prompt_ms ~ P and predicted_ms ~ rounds * R."""
    P, R = 0.20, 0.03
    llm = LLM(ckpts["target"], draft_model=str(ckpts["draft"]), max_num_seqs=4)

    def hook(plan):
        time.sleep(P if plan.has_prefill else R)

    llm.engine.runner.step_hook = hook
    for batch in (1, 4):
        for _ in range(2):  # the first request after start and a later one alike
            outs = llm.generate(PROMPTS[:batch], greedy(n=12))
            for o in outs:
                t = o.timing.to_timings()
                assert "draft_n" in t
                assert abs(t["prompt_ms"] - P * 1e3) <= 0.05 * P * 1e3 + 25
                rounds = o.timing.draft_rounds + (o.timing.predicted_n - 1 - o.timing.draft_n_accepted
                                                  - o.timing.draft_rounds)
                assert t["predicted_ms"] >= rounds * R * 1e3 * 0.95
