"""A seed means the same tokens, with or without a drafter (llama-server's rule): verification samples the target's
token at each verified position with the noise a plain step draws with for that output index and accepts drafts
while they match it. So a seeded request at temperature > 0 returns the tokens the plain path returns, for every
drafter kind, batch size, draft length and sampler setting, with overlap scheduling on.
"""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from spec_helpers import LOOKUP_SETUPS, SETUPS, write_families

MAX_TOKENS = 24
PROMPTS = [[5, 9, 13, 200, 17], [5, 9, 100, 200, 13, 100, 200], [7, 300, 100, 9], [11, 12, 13, 14, 15, 16],
           [5, 300, 100, 9, 300, 100, 13, 17], [100, 200], [42], [8, 100, 200, 300, 100]]
SEEDED = [  # the request first
    dict(temperature=0.2, top_k=5, seed=4242),
    dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=7),
    dict(temperature=1.0, top_k=40, min_p=0.05, seed=11, repeat_penalty=1.3, repeat_last_n=16),
    dict(temperature=0.9, top_k=0, top_p=0.95, seed=12, dry_multiplier=0.8, dry_allowed_length=1),
    dict(temperature=0.9, top_k=0, seed=13, xtc_probability=0.5, xtc_threshold=0.1),
    dict(temperature=0.7, top_k=20, typical_p=0.8, seed=14),
    dict(temperature=1.2, top_k=0, top_p=0.8, seed=15, presence_penalty=0.5),
    dict(temperature=0.5, top_k=3, seed=16, dry_multiplier=1.5, xtc_probability=1.0, xtc_threshold=0.2),
]
# kind -> (family, served checkpoint, engine kwargs)
KINDS = {kind: (arch, served, kwargs) for kind, (arch, served, kwargs, _) in SETUPS.items()}
KINDS |= {kind: (arch, served, kwargs) for kind, (arch, served, kwargs, _, _) in LOOKUP_SETUPS.items()}


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED[i % len(SEEDED)])


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_families(tmp_path_factory.mktemp("spec_seeded"))


def engine(path, **kwargs) -> LLM:
    llm = LLM(path, max_num_seqs=8, max_model_len=64, overlap_schedule=True, **kwargs)
    if llm.engine.speculation is not None:  # (the batch-size caps would switch drafting off at batch 8 on the CPU)
        llm.engine.speculation.policy.max_batch = 1 << 20
        llm.engine.speculation.policy.max_verify_tokens = 1 << 20
    return llm


def run(llm: LLM, batch: int) -> list:
    """Every prompt with its own settings: `batch` requests per generate call."""
    out = []
    for start in range(0, len(PROMPTS), batch):
        idx = range(start, min(start + batch, len(PROMPTS)))
        out += llm.generate([PROMPTS[i] for i in idx], [params(i) for i in idx])
    return out


@pytest.fixture(scope="module")
def plain(families):
    cache: dict[tuple, list[list[int]]] = {}

    def tokens(arch: str, served: str) -> list[list[int]]:
        if (arch, served) not in cache:
            cache[arch, served] = [o.token_ids for o in run(engine(families[arch][served], spec_type="none"), 8)]
        return cache[arch, served]

    return tokens


@pytest.mark.parametrize("n_max", [1, 3])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", list(KINDS))
def test_seeded_output_is_the_same_with_and_without_a_drafter(families, plain, kind, batch, n_max):
    arch, served, kwargs = KINDS[kind]
    llm = engine(families[arch][served], spec_draft_n_max=n_max, **kwargs(families[arch]))
    assert llm.engine.speculation is not None and llm.engine.overlap
    outs = run(llm, batch)
    assert [o.token_ids for o in outs] == plain(arch, served)
    # drafts were proposed, and both accepted and rejected: the verify path decided many of these tokens
    drafted, accepted = sum(o.timing.draft_n for o in outs), sum(o.timing.draft_n_accepted for o in outs)
    assert 0 < accepted < drafted, (accepted, drafted)
