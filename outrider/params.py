"""SamplingParams: everything a request says about how to pick and stop tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outrider.structured.grammar import Grammar


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # -1 = until a stop or the context is full
    temperature: float = 0.8  # <= 0 means greedy
    top_k: int = 40  # <= 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    typical_p: float = 1.0  # 1.0 disables
    repeat_penalty: float = 1.0  # llama.cpp-style: divides positive logits of seen tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64  # window of recent tokens for penalties (-1 = whole context, 0 = off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token
    seed: int | None = None  # None = engine picks one; the same seed gives the same tokens
    n_probs: int = 0  # top-n log-probabilities per generated token
    prompt_logprobs: int | None = None  # top-n log-probabilities per prompt token (None: not computed)
    pooling: str | None = None  # mean | cls | last | none: pool the prompt's hidden states (engine/pooling.py)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Speculative decoding, per request (None = server default)
    spec_n_max: int | None = None
    spec_n_min: int | None = None
    spec_p_min: float | None = None
    cache_prompt: bool = True  # reuse cached prompt prefixes (llama-server `cache_prompt`)
    # llama-server's `samplers` as given (sampler_chain.py; the ones left out are switched off above); () = all
    samplers: tuple[str, ...] = ()
    grammar: Grammar | None = None  # constrains the output (each Request matches it with its own Constraint)

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= -1, "max_tokens"),
            (self.temperature >= 0 or self.temperature != self.temperature, "temperature"),
            (0.0 < self.top_p <= 1.0, "top_p"),
            (0.0 <= self.min_p <= 1.0, "min_p"),
            (0.0 < self.typical_p <= 1.0, "typical_p"),
            (self.repeat_penalty > 0, "repeat_penalty"),
            (self.repeat_last_n >= -1, "repeat_last_n"),
            (self.n_probs >= 0, "n_probs"),
            (self.min_tokens >= 0, "min_tokens"),
        ]
        for ok, name in checks:
            if not ok:
                raise ValueError(f"invalid value for '{name}'")

    @property
    def reads_every_prompt_row(self) -> bool:
        """Prompt log-probs and pooling need every prompt row computed: no cached prefix is reused."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def penalized(self) -> bool:
        """True when repeat/presence/frequency penalties apply (they read the recent tokens on the host)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)
