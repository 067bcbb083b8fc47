"""DRY and XTC against llama.cpp's definitions, on crafted logits.

DRY (llama.cpp's `dry` sampler): a token that would extend a repeat of the window's last L tokens (L >=
allowed_length) loses multiplier * base^(L - allowed_length) from its logit; the most recent sequence breaker caps
L at the tokens after it; a token that alone is a breaker is never penalised; only the last dry_penalty_last_n
tokens count. XTC (`xtc`): with probability xtc_probability, when at least two candidates have probability >=
xtc_threshold, all of them but the least probable are removed; a threshold above 0.5 switches it off. It runs
after top-k/top-p/min-p and before the temperature, so it sees the truncated T=1 distribution.
"""

from __future__ import annotations

import math
import numpy as np
import pytest
import torch

from outrider.dry import Breakers, breaker_sequences, dry_penalties
from outrider.params import SamplingParams
from outrider.request_fields import tokenize
from outrider.sampler import RowSpec, Sampler

V = 16
A, B, C, D, X, Y, H, T, Z = 1, 2, 3, 4, 5, 6, 7, 8, 9


def dry(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, dry_multiplier=0.8, dry_base=1.75,
                dry_allowed_length=2)
    return SamplingParams(**{**base, **kw})


def with_breakers(params: SamplingParams, *sequences: tuple[int, ...]) -> SamplingParams:
    """params with breakers given in token form (head, then its tail)."""
    tails: dict[int, set] = {}
    for head, *tail in sequences:
        tails.setdefault(head, set()).add(tuple(tail))
    form = Breakers(tuple((h, tuple(sorted(t))) for h, t in sorted(tails.items())))
    return SamplingParams(**{**params.__dict__, "tokenized": (("dry_sequence_breakers", form),)})


def penalties(params: SamplingParams, history: list[int]) -> dict[int, float]:
    """What the sampler subtracts from each token's logit for a row after `history` (nonzero entries)."""
    sampler = Sampler(V, "cpu")
    adjusted = sampler.adjusted_logits(torch.zeros(1, V), sampler.prepare([RowSpec(params, 0, 0, history)]))
    return {t: -v for t, v in enumerate(adjusted[0].tolist()) if v != 0.0}


def approx(expected: dict[int, float]) -> dict:
    return {t: pytest.approx(v, rel=1e-5) for t, v in expected.items()}


def test_dry_penalises_the_tokens_that_would_extend_a_repeat_by_its_length():
    """llama.cpp's worked example: in `a b c c b c y a b c` the suffix `a b c` also ends at the first c (then
    followed by c: a repeat of 3), `b c` at the third c (then y: 2), `c` at the second b (then b: 1)."""
    history = [A, B, C, C, B, C, Y, A, B, C]
    assert penalties(dry(), history) == approx({C: 0.8 * 1.75 ** 1, Y: 0.8})
    assert penalties(dry(dry_allowed_length=1), history) == approx({C: 0.8 * 1.75 ** 2, Y: 0.8 * 1.75, B: 0.8})
    assert penalties(dry(dry_multiplier=2.0, dry_base=3.0), history) == approx({C: 2.0 * 3.0, Y: 2.0})


def test_dry_takes_the_longest_repeat_a_token_would_extend():
    history = [A, B, X, B, A, B, X, Y, A, B]  # `a b` ends at 1 and at 5, both then x: repeats of 2
    assert penalties(dry(), history) == approx({X: 0.8})
    longer = [A, B, X, Y, A, B, C, Y, A, B]  # `y a b` also ends at 5 (then c): 3 beats x's 2
    assert penalties(dry(), longer) == approx({X: 0.8, C: 0.8 * 1.75})


def test_dry_repeats_do_not_run_across_the_latest_breaker():
    history = [A, X, B, C, D, A, X, B, C]  # `a x b c` repeats (then d): 4 without breakers
    assert penalties(dry(), history) == approx({D: 0.8 * 1.75 ** 2})
    # x breaks: only `b c` (2 tokens after the latest x) may repeat
    assert penalties(with_breakers(dry(), (X,)), history) == approx({D: 0.8})
    # a breaker after the repeat's start by fewer than allowed_length tokens leaves nothing to penalise
    assert penalties(with_breakers(dry(), (B,)), history) == {}


def test_dry_multi_token_breakers_need_their_tail():
    history = [H, T, B, C, D, H, T, B, C]  # `h t b c` repeats (then d)
    assert penalties(with_breakers(dry(), (H, T)), history) == approx({D: 0.8})  # after `h t`: `b c`
    assert penalties(with_breakers(dry(), (H, Z)), history) == approx({D: 0.8 * 1.75 ** 2})  # no `h z` here


def test_dry_never_penalises_a_single_token_breaker():
    history = [A, B, X, C, A, B]  # `a b` then x
    assert penalties(dry(), history) == approx({X: 0.8})
    assert penalties(with_breakers(dry(), (X,)), history) == {}


def test_dry_reads_only_its_window():
    history = [A, B, C, Z, Z, Y, Z, A, B]
    assert penalties(dry(), history) == approx({C: 0.8})
    assert penalties(dry(dry_penalty_last_n=9), history) == approx({C: 0.8})
    assert penalties(dry(dry_penalty_last_n=8), history) == {}  # the first `a b c` is out of the window
    assert penalties(dry(dry_multiplier=0.0), history) == {}
    assert not dry(dry_penalty_last_n=0).penalized


def test_dry_caps_the_exponent_below_float_overflow():
    history = [A] * 300
    (pen,) = penalties(dry(dry_base=10.0, dry_allowed_length=0), history).values()
    assert math.isfinite(pen) and pen == pytest.approx(0.8 * 10.0 ** int(88.7228391 / math.log(10.0)), rel=1e-5)


def windows(rng: np.random.Generator):
    """Random windows over a small alphabet (many short repeats), and periodic ones and runs with a few tokens
    changed (long repeats that end early or run to the window's start)."""
    for _ in range(200):
        yield rng.integers(0, 4, rng.integers(1, 40)).tolist()
    for _ in range(100):
        period = int(rng.integers(1, 12))
        window = np.tile(rng.integers(0, 5, period), 300 // period + 1)[: rng.integers(2, 300)]
        flips = rng.integers(0, len(window), rng.integers(0, 3))
        window[flips] = rng.integers(0, 5, len(flips))
        yield window.tolist()


def test_dry_host_search_matches_a_brute_force_one():
    """Against the definition read literally."""
    rng = np.random.default_rng(0)
    for window in windows(rng):
        allowed = int(rng.integers(0, 4))
        ids, pen = dry_penalties(window, 1.0, 1.1, allowed, None)
        expected: dict[int, int] = {}
        n = len(window)
        for j in range(n - 1):
            length = 0
            while length <= j and window[j - length] == window[n - 1 - length]:
                length += 1
            if length >= allowed:
                expected[window[j + 1]] = max(expected.get(window[j + 1], -1), length)
        if n <= allowed:
            expected = {}
        assert dict(zip(ids.tolist(), pen.tolist())) == approx({t: 1.1 ** (L - allowed) for t, L in expected.items()})


def test_dry_applies_to_greedy_rows_and_penalties_run_first():
    history = [A, B, C, A, B]
    logits = torch.zeros(1, V)
    logits[0, C] = 1.0  # c would win, but it extends the repeat `a b` (c then loses 2.0 * 1.75^0)
    sampler = Sampler(V, "cpu")
    greedy = dry(temperature=0.0, dry_multiplier=2.0)
    assert sampler.sample(logits, sampler.prepare([RowSpec(greedy, 0, 0, history)])).token_ids.item() != C
    both = dry(dry_multiplier=0.5, repeat_penalty=2.0, repeat_last_n=-1)
    adjusted = sampler.adjusted_logits(logits, sampler.prepare([RowSpec(both, 0, 0, history)]))
    assert adjusted[0, C].item() == pytest.approx(1.0 / 2.0 - 0.5)  # llama.cpp: penalties, then DRY


class FakeTokenizer:
    pieces = [b"<s>", b"a", b"b", b"\n", b"x\ny", b"fo", b"o", b"foo", b"bar", b"o:", b":"]
    vocab_size = len(pieces)

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return [self.pieces.index(c.encode()) for c in text]  # (one token a character, enough here)


def test_breakers_in_token_form_follow_llama_cpp():
    """A token whose text holds the breaker is one alone; a token whose text ends with a prefix of it is a head
    whose tail is the rest, tokenized."""
    tok = FakeTokenizer()
    form = breaker_sequences(tok, ("\n", "foo"))
    assert form.tails == {3: ((),), 4: ((),), 7: ((),), 5: ((6,),)}  # `fo`, then `o`
    assert sorted(form.single) == [3, 4, 7]
    params = tokenize(dry(), tok)  # the default breakers, \n : " *; `o:` holds `:`
    assert params.token_form("dry_sequence_breakers").single == [3, 4, 9, 10]
    assert tokenize(dry(dry_multiplier=0.0), tok).tokenized == ()  # DRY off: no vocab scan


def breakers_read_literally(tokenizer, breakers: tuple[str, ...]) -> dict:
    """llama.cpp's breaker processing as it reads: per token, the breaker inside it, or each position from which
    the token's end is a prefix of the breaker."""
    out: dict[int, set] = {}
    for text in breakers:
        raw = text.encode()[:40]
        for tok in range(tokenizer.vocab_size):
            word = tokenizer.token_bytes(tok)
            if raw and raw in word:
                out.setdefault(tok, set()).add(())
                continue
            for pos in range(len(word)):
                if raw and raw.startswith(word[pos:]):
                    rest = raw[len(word) - pos:].decode("utf-8", errors="ignore")
                    out.setdefault(tok, set()).add(tuple(tokenizer.encode(rest, add_special=False,
                                                                          parse_special=False)[:20]))
    return {t: tuple(sorted(v)) for t, v in out.items()}


@pytest.mark.parametrize("breakers", [("\n", ":", '"', "*"), ("foo",), ("o:", "ab", ""), ("é", "\n\n"),
                                      ("the end", "###", "x" * 50)])
def test_breakers_in_token_form_match_a_literal_reading(tmp_path_factory, breakers):
    tok = real_tokenizer(tmp_path_factory)
    assert breaker_sequences(tok, breakers).tails == breakers_read_literally(tok, breakers)
    assert breaker_sequences(FakeTokenizer(), breakers).tails == breakers_read_literally(FakeTokenizer(), breakers)


_REAL: list = []


def real_tokenizer(tmp_path_factory):
    """The tiny checkpoints' byte-level tokenizer (built once)."""
    if not _REAL:
        from outrider.testing import write_tiny_checkpoint
        from outrider.tokenizer import Tokenizer

        _REAL.append(Tokenizer.from_pretrained(write_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "t")))
    return _REAL[0]


# --- XTC ---

def xtc(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.15)
    return SamplingParams(**{**base, **kw})


PROBS = [0.4, 0.3, 0.2, 0.1]


def xtc_probs(params: SamplingParams, step: int = 0, seed: int = 0) -> list[float]:
    logits = torch.full((1, V), -math.inf)
    logits[0, : len(PROBS)] = torch.tensor(PROBS).log()
    sampler = Sampler(V, "cpu")
    return sampler.process(logits, sampler.prepare([RowSpec(params, seed, step)])).exp()[0, : len(PROBS)].tolist()


def test_xtc_removes_the_top_choices_but_the_least_probable_of_them():
    assert xtc_probs(xtc()) == pytest.approx([0, 0, 2 / 3, 1 / 3])  # 0.4, 0.3 out; 0.2 is the last above
    assert xtc_probs(xtc(xtc_threshold=0.3)) == pytest.approx([0, 0.5, 1 / 3, 1 / 6])


def test_xtc_needs_two_choices_above_the_threshold_and_a_threshold_up_to_one_half():
    assert xtc_probs(xtc(xtc_threshold=0.35)) == pytest.approx(PROBS)  # only one above
    assert xtc_probs(xtc(xtc_threshold=0.05)) == pytest.approx([0, 0, 0, 1])
    high = [0.55, 0.45]
    logits = torch.full((1, V), -math.inf)
    logits[0, :2] = torch.tensor(high).log()
    sampler = Sampler(V, "cpu")
    for threshold in (0.4, 0.6):  # 0.6 > 0.5: off, llama.cpp's rule (0.45 would not be above it anyway)
        out = sampler.process(logits, sampler.prepare([RowSpec(xtc(xtc_threshold=threshold), 0, 0)])).exp()[0, :2]
        assert out.tolist() == pytest.approx([0, 1] if threshold == 0.4 else high)


def test_xtc_at_threshold_zero_keeps_the_least_probable_token_still_in():
    assert xtc_probs(xtc(xtc_threshold=0.0)) == pytest.approx([0, 0, 0, 1])  # (the rest of the vocab is -inf)
    assert xtc_probs(xtc(xtc_threshold=0.0, top_k=3)) == pytest.approx([0, 0, 1, 0])


def test_xtc_sees_the_truncated_distribution_at_temperature_one():
    # top-k 2 keeps 0.4 and 0.3, renormalised to 0.57 and 0.43: both above 0.35
    assert xtc_probs(xtc(top_k=2, xtc_threshold=0.35)) == pytest.approx([0, 1, 0, 0])
    # the temperature comes after: the same tokens survive, reweighted
    hot = xtc_probs(xtc(temperature=2.0))
    assert hot[:2] == [0, 0] and hot[2] / hot[3] == pytest.approx(math.sqrt(2))


def test_xtc_fires_with_its_probability_per_output_index_and_never_for_greedy_rows():
    fired = [xtc_probs(xtc(xtc_probability=0.3), step=s)[0] == 0 for s in range(2000)]
    assert 0.27 < np.mean(fired) < 0.33
    assert fired == [xtc_probs(xtc(xtc_probability=0.3), step=s)[0] == 0 for s in range(2000)]  # seeded
    logits = torch.tensor([PROBS + [0.0] * (V - 4)]).log()
    sampler = Sampler(V, "cpu")
    assert sampler.sample(logits, sampler.prepare([RowSpec(xtc(temperature=0.0), 0, 0)])).token_ids.item() == 0
