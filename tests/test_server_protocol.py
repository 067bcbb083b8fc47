"""Unit tests of the server's pure parts: request validation (protocol.py) and the metrics accounting."""

from __future__ import annotations

import math
import re

import pytest

from outrider.params import SamplingParams
from outrider.server import protocol as proto
from outrider.server.errors import ApiError
from outrider.server.metrics import Metrics
from outrider.server.settings import default_params
from outrider.timing import RequestTiming


class CharTokenizer:
    """One token per character (id = code point), BOS = 1: enough to test prompt and bias parsing."""

    vocab_size = 1000
    bos_token_id = 1
    max_token_chars = 1

    def encode(self, text, add_special=True, parse_special=True):
        return ([1] if add_special else []) + [ord(c) for c in text]


TOK = CharTokenizer()
DEFAULTS = default_params()


def params(**body):
    return proto.sampling_params(body, DEFAULTS, TOK)


def test_prompt_forms():
    assert proto.tokenize_prompts("ab", TOK, 64) == [[1, 97, 98]]
    assert proto.tokenize_prompts([5, 6], TOK, 64) == [[5, 6]]
    assert proto.tokenize_prompts([5, "a", 6], TOK, 64) == [[5, 97, 6]]  # mixed: no BOS unless a string leads
    assert proto.tokenize_prompts(["a", 7], TOK, 64) == [[1, 97, 7]]
    assert proto.tokenize_prompts(["a", "b"], TOK, 64) == [[1, 97], [1, 98]]  # only strings: a batch
    assert proto.tokenize_prompts([[5], "b", {"prompt_string": "c"}], TOK, 64) == [[5], [1, 98], [1, 99]]
    for bad in (None, 3.5, [5, 10**6], [[True]]):
        with pytest.raises(ApiError, match="'prompt'"):
            proto.tokenize_prompts(bad, TOK, 64)
    with pytest.raises(ApiError, match="multimodal"):
        proto.tokenize_prompts({"prompt_string": "x", "multimodal_data": ["AAAA"]}, TOK, 64)


def test_a_string_too_long_for_any_tokenization_is_refused_before_tokenizing():
    class Refuses(CharTokenizer):
        max_token_chars = 4

        def encode(self, *args, **kwargs):
            raise AssertionError("tokenized a prompt that cannot fit")

    with pytest.raises(ApiError) as e:
        proto.tokenize_prompts("x" * 10_000_000, Refuses(), 2048)
    assert e.value.type == "exceed_context_size_error" and e.value.extra == {"n_prompt_tokens": 2_500_000,
                                                                             "n_ctx": 2048}
    with pytest.raises(ApiError, match="exceeds the available context"):
        proto.encode_chat("y" * (4 * 2048), Refuses(), 2048)
    assert proto.tokenize_prompts("z" * (4 * 2047), TOK, 10**5)[0][:2] == [1, ord("z")]  # (may fit: tokenized)


def test_sampling_fields_map_onto_sampling_params():
    p = params(n_predict=5, temperature=-1, top_k=0, top_p=0, seed=-1, stop="END", ignore_eos=True, n_probs=3,
               **{"speculative.n_max": 2, "speculative": {"p_min": 0.25}})
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.ignore_eos, p.n_probs) == \
        (5, 0.0, 0, None, ("END",), True, 3)
    assert 0 < p.top_p < 1e-6 and p.spec_n_max == 2 and p.spec_p_min == 0.25 and p.spec_n_min is None
    assert params(max_tokens=7).max_tokens == 7 and params(max_completion_tokens=9).max_tokens == 9
    assert params(n_predict=0).max_tokens == 1  # llama-server always samples the first token
    assert params().cache_prompt is True and params(cache_prompt=False).cache_prompt is False
    assert params(n_probs=10**6).n_probs == TOK.vocab_size


def test_server_n_predict_caps_requests():
    capped = default_params(max_tokens=32)
    assert proto.sampling_params({}, capped, TOK).max_tokens == 32
    assert proto.sampling_params({"n_predict": -1}, capped, TOK).max_tokens == 32
    assert proto.sampling_params({"n_predict": 100}, capped, TOK).max_tokens == 32
    assert proto.sampling_params({"n_predict": 8}, capped, TOK).max_tokens == 8


def test_logit_bias_forms():
    assert params(logit_bias=[[65, 2.5], ["hi", False]]).logit_bias == \
        ((65, 2.5), (104, -math.inf), (105, -math.inf))
    assert params(logit_bias={"65": -1, "A": 3}).logit_bias == ((65, -1.0), (65, 3.0))
    for bad in ([[65]], {"65": "x"}, [[-1, 1]], "65"):
        with pytest.raises(ApiError, match="'logit_bias'"):
            params(logit_bias=bad)
    with pytest.raises(ApiError, match="'speculative.n_max'"):
        params(speculative={"n_max": -2})


@pytest.mark.parametrize("field, value", [("temperature", math.inf), ("top_k", True), ("min_p", 1.5),
                                          ("repeat_last_n", -2), ("typical_p", "1"), ("stop", "a b".split() + [3])])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ApiError, match=f"'{field}'") as e:
        params(**{field: value})
    assert e.value.status == 400


def test_features_we_lack_are_refused_unless_off():
    params(grammar="", mirostat=0, dry_multiplier=0.0, top_n_sigma=-1.0, samplers=["top_k"])
    for field, value in [("grammar_lazy", True), ("grammar_triggers", [{"type": 0}]), ("mirostat", 2),
                         ("lora", [{"id": 0, "scale": 1}]), ("n_indent", 4)]:
        with pytest.raises(ApiError, match=f"'{field}' is not supported"):
            params(**{field: value})


def test_make_requests_seeds_and_context():
    reqs = proto.make_requests([[1, 2], [3]], SamplingParams(seed=10), n=2, n_ctx=8)
    assert [r.prompt_ids for r in reqs] == [[1, 2], [1, 2], [3], [3]]
    assert [r.params.seed for r in reqs] == [10, 11, 10, 11]
    with pytest.raises(ApiError) as e:
        proto.make_requests([[1] * 8], SamplingParams(), n=1, n_ctx=8)
    assert e.value.type == "exceed_context_size_error" and e.value.extra == {"n_prompt_tokens": 8, "n_ctx": 8}


def _timing(prompt_n=10, cache_n=6, predicted=5, rounds=()):
    t = RequestTiming(t_arrival=0.0)
    t.mark_admitted(0.5, cache_n=cache_n, prompt_n=prompt_n)
    t.mark_tokens(1, 1.0)
    for proposed, accepted in rounds:
        t.mark_draft_round(proposed, accepted)
    t.mark_tokens(predicted - 1, 2.0)
    return t


def _value(text, name):
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_metrics_sum_timings_and_reset_throughput_windows():
    m = Metrics()
    m.on_finished(_timing())
    m.on_finished(_timing(prompt_n=4, cache_n=0, predicted=3))
    text = m.render({"steps": 7, "num_running": 1, "num_waiting": 2, "busy_slots_total": 14})
    assert _value(text, "llamacpp:prompt_tokens_total") == 14
    assert _value(text, "llamacpp:prompt_tokens_cached_total") == 6
    assert _value(text, "llamacpp:tokens_predicted_total") == 8
    assert _value(text, "llamacpp:prompt_seconds_total") == pytest.approx(1.0)
    assert _value(text, "llamacpp:tokens_predicted_seconds_total") == pytest.approx(2.0)
    assert _value(text, "llamacpp:n_tokens_max") == 21
    assert _value(text, "llamacpp:predicted_tokens_seconds") == pytest.approx(6 / 2.0)
    assert _value(text, "llamacpp:n_busy_slots_per_decode") == 2
    assert _value(text, "llamacpp:requests_deferred") == 2
    assert "spec_decode_num_accepted_tokens_per_pos_total" not in text
    assert _value(m.render({}), "llamacpp:predicted_tokens_seconds") == 0  # the window was reset by the read
    assert _value(text, "outrider_time_to_first_token_seconds_sum") == pytest.approx(2.0)
    assert _value(text, "outrider_queue_wait_seconds_sum") == pytest.approx(1.0)


def test_metrics_speculative_counters_and_accepted_lengths():
    m = Metrics()
    # rounds of 3 drafts: accepted 3, 1, 0 -> 4, 2 and 1 tokens committed
    m.on_finished(_timing(predicted=8, rounds=[(3, 3), (3, 1), (3, 0)]))
    text = m.render({})
    assert _value(text, "llamacpp:spec_decode_num_draft_tokens_total") == 9
    assert _value(text, "llamacpp:spec_decode_num_accepted_tokens_total") == 4
    assert _value(text, "llamacpp:spec_decode_num_drafts_total") == 3
    for pos, n in enumerate([2, 1, 1]):
        assert _value(text, f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}') == n
    assert _value(text, "outrider_spec_accepted_length_count") == 3
    assert _value(text, "outrider_spec_accepted_length_sum") == 4 + 2 + 1
    assert _value(text, 'outrider_spec_accepted_length_bucket{le="1.0"}') == 1
    assert _value(text, 'outrider_spec_accepted_length_bucket{le="2.0"}') == 2
