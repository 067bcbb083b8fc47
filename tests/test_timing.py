"""The timings contract (llama-server b10406+ formulas) as properties of RequestTiming."""

import math

from hypothesis import given
from hypothesis import strategies as st

from outrider.timing import RequestTiming


@given(
    prompt_s=st.floats(0, 5), gaps=st.lists(st.floats(0, 1), max_size=40), per=st.integers(1, 5),
    prompt_n=st.integers(0, 4000), cache_n=st.integers(0, 4000),
)
def test_formulas(prompt_s, gaps, per, prompt_n, cache_n):
    t = RequestTiming(t_arrival=0.0)
    t.mark_admitted(0.5, cache_n=cache_n, prompt_n=prompt_n)
    clock = 0.5 + prompt_s
    t.mark_tokens(1, clock)
    for g in gaps:
        clock += g
        t.mark_tokens(per, clock)
    out = t.to_timings()
    assert list(out)[:9] == ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                             "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]
    assert all(math.isfinite(v) and v >= 0 for v in out.values())
    assert math.isclose(out["prompt_ms"], prompt_s * 1e3, abs_tol=1e-6)
    n = 1 + per * len(gaps)
    assert out["predicted_n"] == n
    assert math.isclose(out["predicted_ms"], max(1e-3, (clock - 0.5 - prompt_s) * 1e3), rel_tol=1e-9, abs_tol=1e-9)
    if n <= 1:
        assert out["predicted_per_second"] == 0 and out["predicted_per_token_ms"] == 0
    else:
        assert math.isclose(out["predicted_per_second"], 1e3 * (n - 1) / out["predicted_ms"])
        assert math.isclose(out["predicted_per_token_ms"], out["predicted_ms"] / (n - 1))
    assert "draft_n" not in out


def test_no_tokens_yet_is_all_zero():
    out = RequestTiming().to_timings()
    assert out["prompt_ms"] == 0 and out["predicted_ms"] == 0 and out["predicted_per_second"] == 0


def test_draft_keys_only_when_drafted():
    t = RequestTiming(t_arrival=0.0)
    t.mark_admitted(0.0, cache_n=0, prompt_n=1)
    t.mark_tokens(1, 0.1)
    t.mark_draft_round(0, 0)
    assert "draft_n" not in t.to_timings()
    t.draft_kind = "mtp"
    t.mark_draft_round(3, 2)
    t.mark_tokens(3, 0.2)
    t.mark_draft_round(3, 0)
    t.mark_tokens(1, 0.3)
    out = t.to_timings()
    assert (out["draft_n"], out["draft_n_accepted"], out["draft_rounds"]) == (6, 2, 2)
    assert all(isinstance(v, (int, float)) for v in out.values())  # numbers only: the kind is rendered beside it
    assert t.accepted_per_position == [1, 1, 0]
    assert out["predicted_n"] == 5


def test_an_admission_before_the_first_token_restarts_the_prompt():
    t = RequestTiming(t_arrival=0.0)
    t.mark_admitted(1.0, cache_n=0, prompt_n=40)
    t.mark_preempted(1.5)  # before any token: the prefill is discarded
    t.mark_admitted(2.0, cache_n=16, prompt_n=24)
    t.mark_tokens(1, 3.0)
    t.mark_tokens(0, 9.0)  # a step that commits nothing stamps nothing
    assert (t.prompt_ms, t.prompt_n, t.cache_n) == (1000.0, 24, 16)
    assert t.t_last_token == 3.0
    assert t.queue_ms == 2000.0  # the wait and the discarded work


def test_a_preemption_after_the_first_token_keeps_the_prompt_and_adds_its_wait_to_the_queue():
    t = RequestTiming(t_arrival=0.0)
    t.mark_admitted(1.0, cache_n=0, prompt_n=40)
    t.mark_tokens(1, 2.0)
    t.mark_preempted(2.5)
    t.mark_admitted(4.0, cache_n=0, prompt_n=99)  # a resume: recomputes, but the prompt figures stay
    t.mark_tokens(1, 4.5)
    assert (t.prompt_ms, t.prompt_n, t.cache_n) == (1000.0, 40, 0)
    assert t.predicted_ms == 2500.0  # the stall is in the stream
    assert t.queue_ms == 1000.0 + 1500.0


def test_snapshot_keeps_the_figures_of_its_moment():
    """A streamed frame renders a snapshot: later stamps on the live record never reach it."""
    t = RequestTiming(t_arrival=0.0)
    t.mark_admitted(1.0, cache_n=0, prompt_n=1)
    t.mark_tokens(1, 2.0)
    snap = t.snapshot()
    before = snap.to_timings()
    t.mark_draft_round(3, 2)
    t.mark_tokens(3, 2.5)
    t.mark_finished(3.0)
    assert snap.to_timings() == before and "draft_n" not in before
    assert snap.accepted_per_position == [] and t.accepted_per_position == [1, 1, 0]
    assert t.to_timings()["predicted_n"] == 4
