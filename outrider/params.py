"""SamplingParams: everything a request says about how to pick and stop tokens.

Its sampling fields (temperature, top_k, ..., DRY, XTC) come from request_fields.SUPPORTED, with their defaults and
range checks; the fields below are the ones whose parsing is their own (aliases with a cap, a token-level bias,
stop strings, per-request speculative settings, the sampler list, a grammar).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from outrider.request_fields import SUPPORTED, WINDOWED, history_window, sampler_on

if TYPE_CHECKING:
    from outrider.structured.grammar import Grammar

_OWN_FIELDS: list[tuple[str, Any, Any]] = [
    ("max_tokens", int, 16),  # -1 = until a stop or the context is full
    ("logit_bias", tuple, ()),  # ((token id, bias), ...); -inf bans the token
    ("seed", "int | None", None),  # None = engine picks one; the same seed gives the same tokens
    ("n_probs", int, 0),  # top-n log-probabilities per generated token
    ("prompt_logprobs", "int | None", None),  # top-n log-probabilities per prompt token (None: not computed)
    ("pooling", "str | None", None),
    # --context-shift (server/context_shift.py): prompt tokens kept after the BOS (-1: the whole prompt), and tokens
    # discarded per shift (0: half of what follows the kept ones), as llama-server's fields
    ("n_keep", int, 0),
    ("n_discard", int, 0),  # mean | cls | last | none: pool the prompt's hidden states (engine/pooling.py)
    ("stop", tuple, ()),
    ("stop_token_ids", tuple, ()),
    # Speculative decoding, per request (None = server default)
    ("spec_n_max", "int | None", None),
    ("spec_n_min", "int | None", None),
    ("spec_p_min", "float | None", None),
    # llama-server's `samplers` as given (sampler_chain.py; the ones left out are switched off); () = all
    ("samplers", tuple, ()),
    ("grammar", "Grammar | None", None),  # constrains the output (each Request matches it with its own Constraint)
    # (field name, its token form) for the fields whose meaning depends on the vocab (request_fields.tokenize)
    ("tokenized", tuple, ()),
]


class _SamplingParamsBase:
    def __post_init__(self) -> None:
        for field in SUPPORTED:
            object.__setattr__(self, field.name, field.check(getattr(self, field.name)))
        for ok, name in [(self.max_tokens >= -1, "max_tokens"), (self.n_probs >= 0, "n_probs")]:
            if not ok:
                raise ValueError(f"invalid value for '{name}'")

    def sampler_on(self, sampler: str) -> bool:
        """Does this llama-server sampler (request_fields.SAMPLER_ORDER) change anything here?"""
        return sampler_on(self, sampler)

    @property
    def reads_every_prompt_row(self) -> bool:
        """Pooling needs every prompt row computed: no cached prefix is reused (prompt log-probs recompute the
        cached rows' hidden states instead: engine/prompt_logprobs.py)."""
        return self.pooling is not None

    @property
    def penalized(self) -> bool:
        """True when a penalty (repeat/presence/frequency, DRY) reads the recent tokens, on the host."""
        return any(sampler_on(self, s) for s in WINDOWED)

    @property
    def penalty_window(self) -> int:
        """How many recent tokens the penalties read (-1: all of them, 0: none)."""
        return history_window(self)

    def token_form(self, name: str) -> Any:
        """The token form of a vocab-dependent field (None when not computed: request_fields.tokenize)."""
        return next((form for n, form in self.tokenized if n == name), None)


SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(f.name, f.type, dataclasses.field(default=f.default)) for f in SUPPORTED]
    + [(name, kind, dataclasses.field(default=default)) for name, kind, default in _OWN_FIELDS],
    bases=(_SamplingParamsBase,),
    frozen=True,
)
SamplingParams.__module__ = __name__
SamplingParams.__doc__ = __doc__
