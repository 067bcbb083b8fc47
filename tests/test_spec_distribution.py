"""Lossless sampling THROUGH THE ENGINE: for every drafter kind (and n-gram lookup alone and combined), the joint
distribution of the first generated tokens at temperature 0.8 / top-p 0.9 with speculation equals plain sampling
(a two-sample chi-square test over many seeded requests), also with DRY and with XTC on, and the same test
rejects an engine whose verification sees another distribution than the plain path.

A random tiny checkpoint spreads its next-token mass over the whole 512-token vocabulary and random drafters
almost never propose a token the target keeps, so such a test would compare two plain samplers. The checkpoint
family of spec_helpers fixes both: the target's top-p set holds two or three "hub" tokens and every drafter
agrees with it part of the time, so acceptance is well inside (0, 1) and the drafted positions carry real
rejections (checked on every run).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from scipy import stats

import outrider.speculative.verify as verify_mod
from outrider import LLM, SamplingParams
from spec_helpers import LOOKUP_SETUPS, SETUPS, write_families

N = 800  # seeded requests per sample (one generate call each)
PROMPT = [5, 9, 13, 200, 17]
N_MAX = 2  # drafts per round: the 2nd and 3rd tokens can both come out of one verify


@dataclass(frozen=True)
class Case:
    """A drafter setup on one family's target: the kinds its requests may report, on which prompt, and how many
    of the requests must draft (n-gram lookup drafts only where the prompt repeats itself)."""

    arch: str
    served: str
    kwargs: Callable
    kinds: frozenset[str]
    prompt: tuple[int, ...] = tuple(PROMPT)
    min_drafting: float = 1.0  # share of requests with a draft round


CASES = {kind: Case(arch, served, kwargs, frozenset({reported})) for kind, (arch, served, kwargs, reported)
         in SETUPS.items()}
CASES |= {kind: Case(arch, served, kwargs, frozenset(kinds), tuple(prompt), min_drafting=0.9)
          for kind, (arch, served, kwargs, kinds, prompt) in LOOKUP_SETUPS.items()}


# Samplers that read the history (DRY) or draw their own coin (XTC), set to change the distribution visibly.
SAMPLERS = {"dry": (("dry_multiplier", 1.0), ("dry_allowed_length", 0)),
            "xtc": (("xtc_probability", 0.5), ("xtc_threshold", 0.1))}


def params(seed: int, grammar=None, extra: tuple = ()) -> SamplingParams:
    # 4 tokens so the first round (after the prefill's token) drafts k = 2: the policy leaves room for the bonus.
    return SamplingParams(max_tokens=4, temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=seed,
                          ignore_eos=True, grammar=grammar, **dict(extra))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_families(tmp_path_factory.mktemp("spec_dist"))


def engine(path: Path, **kwargs) -> LLM:
    # Many requests per step (up to 256 running at once); no context beyond what they need.
    llm = LLM(path, max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=64, spec_draft_n_max=N_MAX,
              **kwargs)
    if llm.engine.speculation is not None:
        # The batch-size caps switch drafting off for large batches (right for a GPU server, useless here):
        # lift them so every request of the big batch drafts.
        llm.engine.speculation.policy.max_batch = 1 << 20
        llm.engine.speculation.policy.max_verify_tokens = 1 << 20
    return llm


def sample(llm: LLM, seeds: range, prompt: tuple[int, ...], grammar=None, extra: tuple = ()) -> tuple[Counter, list]:
    outs = llm.generate([list(prompt)] * len(seeds), [params(s, grammar, extra) for s in seeds])
    assert all(len(o.token_ids) == 4 for o in outs)
    return Counter(tuple(o.token_ids[:3]) for o in outs), outs


@pytest.fixture(scope="module")
def plain(families):
    """Plain sampling (no drafter) of a family's target on a prompt, with seeds no speculative run uses."""
    cache: dict[tuple, Counter] = {}

    def counts(case: Case, extra: tuple = ()) -> Counter:
        key = (case.arch, case.prompt, extra)
        if key not in cache:
            llm = engine(families[case.arch]["target"], spec_type="none")
            assert llm.engine.speculation is None
            cache[key] = sample(llm, range(N), case.prompt, extra=extra)[0]
        return cache[key]

    return counts


def two_sample_pvalue(a: Counter, b: Counter, min_pooled: int = 10) -> float:
    """Chi-square test of homogeneity on a 2 x bins table; bins with fewer than `min_pooled` pooled counts
    (expected < 5 per sample) are merged into one."""
    keys = set(a) | set(b)
    big = sorted(k for k in keys if a[k] + b[k] >= min_pooled)
    rest = [k for k in keys if a[k] + b[k] < min_pooled]
    table = [[c[k] for k in big] + [sum(c[k] for k in rest)] for c in (a, b)]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 8, f"too few bins to say anything: {table}"
    return stats.chi2_contingency(table, correction=False).pvalue


def speculative_sample(families, case: Case, grammar_text: str | None = None, extra: tuple = (),
                       broken: bool = False) -> tuple[Counter, list]:
    """`extra` sampling fields (SAMPLERS) lower the acceptance (DRY penalises the repeats n-gram lookup drafts
    from) and a `broken` verifier drifts from the prompt's repeats: the checks that the test can see something
    are looser there (a broken verifier is only checked to have drafted)."""
    ckpts = families[case.arch]
    llm = engine(ckpts[case.served], **case.kwargs(ckpts))
    assert set(llm.engine.drafter_kind.split(",")) == case.kinds
    grammar = llm.engine.grammars.lark(grammar_text) if grammar_text else None
    counts, outs = sample(llm, range(10**6, 10**6 + N), case.prompt, grammar, extra)  # seeds disjoint from the plain's
    # The test says something only if the drafter drafted (in every request, for lookup in most) and its drafts
    # were neither always accepted nor always rejected; combined kinds must each have drafted.
    drafted = sum(o.timing.draft_n for o in outs)
    accepted = sum(o.timing.draft_n_accepted for o in outs)
    assert sum(o.timing.draft_rounds > 0 for o in outs) >= case.min_drafting * N * (0.25 if extra or broken else 1)
    assert {o.timing.draft_kind for o in outs if o.timing.draft_rounds} == case.kinds
    if broken:
        return counts, outs
    assert (0.05 if extra else 0.2) < accepted / drafted < 0.8, (accepted, drafted)
    # Some rounds reach the bonus slot (unless a grammar bans what the drafter keeps proposing second).
    assert grammar is not None or extra or any(o.timing.draft_n_accepted == 2 for o in outs[:50])
    return counts, outs


@pytest.mark.parametrize("kind", list(CASES))
def test_speculative_distribution_equals_plain(families, plain, kind):
    counts, _ = speculative_sample(families, CASES[kind])
    assert two_sample_pvalue(counts, plain(CASES[kind])) > 1e-3


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_speculative_distribution_equals_plain_with_dry_and_xtc(families, plain, kind, sampler):
    """Verified positions get the same DRY penalties (over the drafts before them) and the same XTC coin (per
    output index) as plain steps, so speculation keeps the distribution; and the sampler changed it."""
    extra = SAMPLERS[sampler]
    counts, _ = speculative_sample(families, CASES[kind], extra=extra)
    assert two_sample_pvalue(counts, plain(CASES[kind], extra)) > 1e-3
    assert two_sample_pvalue(plain(CASES[kind], extra), plain(CASES[kind])) < 1e-6


@pytest.mark.parametrize("kind", list(CASES))
def test_chi_square_rejects_a_verifier_that_sees_another_distribution(families, plain, kind, monkeypatch):
    """Verify draws the target's token from logits at temperature 1.6 instead of 0.8 (as if it processed the
    verified rows differently from plain steps): the same test must see it (otherwise it could not see a real
    bug either)."""
    original = verify_mod._verify_sampled
    monkeypatch.setattr(verify_mod, "_verify_sampled",
                        lambda sampler, logits, *rest: original(sampler, logits / 2, *rest))
    counts, _ = speculative_sample(families, CASES[kind], broken=True)
    assert two_sample_pvalue(counts, plain(CASES[kind])) < 1e-6


def without_token(banned: int, vocab: int) -> str:
    """Lark (llguidance) admitting any token sequence but `banned`."""
    return f"start: (<[0-{banned - 1}]> | <[{banned + 1}-{vocab - 1}]>)*"


def test_constrained_speculative_distribution_equals_constrained_plain(families, plain):
    """A grammar that forbids the target's favourite first token (so drafters, which agree with the target part
    of the time, propose forbidden tokens): speculation keeps exactly the constrained distribution."""
    case = CASES["draft"]
    free = plain(case)
    banned = Counter(first for first, *_ in free.elements()).most_common(1)[0][0]
    reference = engine(families[case.arch]["target"], spec_type="none")
    text = without_token(banned, reference.engine.model_config.vocab_size)
    constrained, _ = sample(reference, range(N), case.prompt, reference.engine.grammars.lark(text))
    counts, outs = speculative_sample(families, case, text)
    assert all(banned not in key for key in counts) and all(banned not in key for key in constrained)
    assert two_sample_pvalue(counts, constrained) > 1e-3
    assert two_sample_pvalue(constrained, free) < 1e-6  # the grammar changed the distribution
