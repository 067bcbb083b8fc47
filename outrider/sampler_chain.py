"""llama-server's `samplers` (request field and --samplers/--sampling-seq): which samplers run, in which order.

Our sampler runs one fixed chain (sampler.py), in llama-server's default order. A list is honoured when the
samplers it names that we have come in that chain's order: those it leaves out are switched off. Samplers we lack
are accepted in the list only because their own parameters are refused unless off (protocol.py), so listing them
changes nothing.
"""

from __future__ import annotations

import dataclasses

from outrider.params import SamplingParams
from outrider.request_fields import CHAIN, SAMPLER_ORDER

INERT = tuple(name for name in SAMPLER_ORDER if name not in CHAIN)  # llama-server's samplers we lack
ALIASES = {"top-k": "top_k", "typical_p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typical-p": "typ_p",
           "top-p": "top_p", "nucleus": "top_p", "min-p": "min_p", "temp": "temperature",
           "top-n-sigma": "top_n_sigma", "adaptive-p": "adaptive_p"}
LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
           "m": "min_p", "x": "xtc", "t": "temperature"}


class SamplerChainError(ValueError):
    """A sampler list this server cannot run as given."""


def parse_names(names: list) -> tuple[str, ...]:
    """Canonical names of a list of llama-server sampler names (aliases allowed)."""
    out = []
    for name in names:
        canonical = ALIASES.get(name, name) if isinstance(name, str) else name
        if canonical not in CHAIN and canonical not in INERT:
            raise SamplerChainError(f"unknown sampler {name!r}; known: {', '.join([*CHAIN, *INERT])}")
        out.append(canonical)
    return tuple(out)


def parse_chars(letters: str) -> tuple[str, ...]:
    """llama-server's one-letter form (--sampling-seq, or `samplers` as a string), e.g. "ekypmt"."""
    unknown = [c for c in letters if c not in LETTERS]
    if unknown:
        raise SamplerChainError(f"unknown sampler letter(s) {''.join(unknown)!r}; known: {''.join(LETTERS)}")
    return tuple(LETTERS[c] for c in letters)


def restrict(params: SamplingParams, names: tuple[str, ...]) -> SamplingParams:
    """`params` running only the samplers `names` lists (recorded in params.samplers, which /props shows)."""
    ours = [n for n in names if n in CHAIN]
    if ours != sorted(ours, key=list(CHAIN).index) or len(set(ours)) != len(ours):
        raise SamplerChainError(f"order {', '.join(ours)} is not supported: our samplers run once each, in the "
                                f"order {', '.join(CHAIN)} (leave out those you do not want)")
    off = {field: value for name, fields in CHAIN.items() if name not in ours for field, value in fields.items()}
    return dataclasses.replace(params, samplers=names, **off)
