"""Request fields, declared once: each sampling field's name, HTTP spellings, command-line flag and environment
variable, default, bounds and the sampler it configures.

Everything else is derived from FIELDS: SamplingParams' attributes, defaults and checks (params.py), request
parsing (server/protocol.py), the server-wide default flags (server/flags.py, cli.py), `generation_settings`
(server/render.py), the `samplers` list's switches (sampler_chain.py) and the sampler's per-row columns
(sampler.py ParamTable). Adding a field is one entry here and its maths in sampler.py (docs/contributing.md);
implementing one of llama-server's samplers we lack (declared below as not `supported`) is the same.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

from outrider.dry import breaker_sequences

# llama-server's samplers by name, in its default order; sampler.py runs those a field below configures in this
# order (the others are accepted in a `samplers` list, where they change nothing: sampler_chain.py).
SAMPLER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
                 "adaptive_p")

Column = Literal["float", "int"]


@dataclass(frozen=True)
class Field:
    """One request field: `name` is its SamplingParams attribute and the spelling `generation_settings` shows."""

    name: str
    type: type  # bool, int, float, or tuple (a list of strings)
    default: Any
    help: str
    aliases: tuple[str, ...] = ()  # other HTTP spellings (OpenAI's); the first one present in a request wins
    flag: str | None = None  # server-wide default on the command line (llama-server's spelling)
    env: str | None = None  # its LLAMA_ARG_* variable
    lo: float = -math.inf  # accepted range, inclusive
    hi: float = math.inf
    floor: float | None = None  # a value below is raised to this (llama.cpp's meaning for it)
    sampler: str | None = None  # the SAMPLER_ORDER name it configures
    off: Any = None  # the value that switches `sampler` off (a `samplers` list leaving the sampler out sets it)
    column: Column | None = None  # the sampler reads it per row: a ParamTable column of this kind
    window: bool = False  # how many recent tokens `sampler` reads (-1: all of them, 0: the sampler is off)
    tokenized: Callable[[Any, Any], Any] | None = None  # (tokenizer, value) -> its form in token ids
    shown: bool = True  # in `generation_settings`
    # False: a llama-server field we do not implement. A request may send it at a value in [lo, hi], where it
    # changes nothing (any other is a 400 "not supported"); generation_settings shows the default.
    supported: bool = True

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def check(self, value: Any) -> Any:
        """The value as SamplingParams holds it (floored); ValueError when out of range."""
        if self.type is tuple:
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"invalid value for '{self.name}': expected strings")
            return value
        if self.type in (int, float) and not (self.lo <= value <= self.hi):  # (NaN fails too)
            raise ValueError(f"invalid value for '{self.name}'")
        return value if self.floor is None or value >= self.floor else self.type(self.floor)


FIELDS: tuple[Field, ...] = (
    # llama.cpp treats any temperature <= 0 as greedy; without its sampler it draws from the distribution as it
    # is: temperature 1
    Field("temperature", float, 0.8, "temperature (<= 0: greedy)", flag="--temp", floor=0.0,
          sampler="temperature", off=1.0, column="float"),
    Field("top_k", int, 40, "top-k (<= 0: off)", flag="--top-k", env="LLAMA_ARG_TOP_K", sampler="top_k", off=0,
          column="int"),
    # top_p = 0 keeps only the most probable token, which a tiny positive nucleus also does
    Field("top_p", float, 0.95, "top-p (1: off)", flag="--top-p", lo=0.0, hi=1.0, floor=1e-9, sampler="top_p",
          off=1.0, column="float"),
    Field("min_p", float, 0.05, "min-p (0: off)", flag="--min-p", lo=0.0, hi=1.0, sampler="min_p", off=0.0,
          column="float"),
    Field("typical_p", float, 1.0, "locally typical sampling p (1: off)", flag="--typical", lo=0.0, hi=1.0,
          floor=1e-9, sampler="typ_p", off=1.0, column="float"),
    Field("repeat_last_n", int, 64, "penalty window (-1: the whole context, 0: off)", flag="--repeat-last-n",
          lo=-1, sampler="penalties", column="int", window=True),
    # llama.cpp: divides positive logits of seen tokens, multiplies negative ones
    Field("repeat_penalty", float, 1.0, "repeat penalty (1: off)", flag="--repeat-penalty", lo=1e-9,
          sampler="penalties", off=1.0, column="float"),
    Field("presence_penalty", float, 0.0, "presence penalty (0: off)", flag="--presence-penalty",
          sampler="penalties", off=0.0, column="float"),
    Field("frequency_penalty", float, 0.0, "frequency penalty (0: off)", flag="--frequency-penalty",
          sampler="penalties", off=0.0, column="float"),
    Field("dry_multiplier", float, 0.0, "DRY penalty multiplier (0: off)", flag="--dry-multiplier", lo=0.0,
          sampler="dry", off=0.0, column="float"),
    Field("dry_base", float, 1.75, "DRY penalty base", flag="--dry-base", lo=1.0, sampler="dry", column="float"),
    Field("dry_allowed_length", int, 2, "DRY: repeats up to this long go unpenalised",
          flag="--dry-allowed-length", lo=0, sampler="dry", column="int"),
    Field("dry_penalty_last_n", int, -1, "DRY window (-1: the whole context, 0: off)",
          flag="--dry-penalty-last-n", lo=-1, sampler="dry", column="int", window=True),
    Field("dry_sequence_breakers", tuple, ("\n", ":", '"', "*"), "DRY: strings a repeat does not run across",
          flag="--dry-sequence-breaker", sampler="dry", tokenized=breaker_sequences),
    Field("xtc_probability", float, 0.0, "XTC: chance to exclude the top choices (0: off)",
          flag="--xtc-probability", lo=0.0, hi=1.0, sampler="xtc", off=0.0, column="float"),
    Field("xtc_threshold", float, 0.1, "XTC: probability a top choice needs (> 0.5: off)", flag="--xtc-threshold",
          lo=0.0, hi=1.0, sampler="xtc", column="float"),
    Field("ignore_eos", bool, False, "keep generating after end-of-generation tokens", flag="--ignore-eos"),
    Field("min_tokens", int, 0, "tokens generated before end-of-generation is allowed", lo=0, shown=False),
    Field("cache_prompt", bool, True, "reuse cached prompt prefixes", shown=False),
    # llama-server's samplers we lack, accepted where they are off
    Field("dynatemp_range", float, 0.0, "dynamic temperature range", lo=0.0, hi=0.0, supported=False),
    Field("dynatemp_exponent", float, 1.0, "dynamic temperature exponent", supported=False),
    Field("top_n_sigma", float, -1.0, "top-n-sigma (<= 0: off)", hi=0.0, supported=False),
    Field("mirostat", int, 0, "Mirostat version (0: off)", lo=0, hi=0, supported=False),
    Field("mirostat_tau", float, 5.0, "Mirostat target entropy", supported=False),
    Field("mirostat_eta", float, 0.1, "Mirostat learning rate", supported=False),
    Field("min_keep", int, 0, "candidates every filter keeps", lo=0, hi=0, supported=False),
    Field("adaptive_target", float, -1.0, "adaptive-p target (< 0: off)", hi=-math.ulp(0.0), shown=False,
          supported=False),
    Field("adaptive_decay", float, 0.9, "adaptive-p decay", shown=False, supported=False),
)
SUPPORTED = tuple(f for f in FIELDS if f.supported)  # SamplingParams' fields
COLUMNS: dict[Column, tuple[str, ...]] = {kind: tuple(f.name for f in SUPPORTED if f.column == kind)
                                          for kind in ("float", "int")}
# Our chain, in llama-server's order: each sampler a field configures, with the values that switch it off.
CHAIN: dict[str, dict[str, Any]] = {
    s: {f.name: f.off for f in SUPPORTED if f.sampler == s and f.off is not None}
    for s in SAMPLER_ORDER if any(f.sampler == s for f in SUPPORTED)
}
WINDOWED = tuple(s for s in CHAIN if any(f.window for f in SUPPORTED if f.sampler == s))  # samplers reading history


_WINDOWS = {s: tuple(f.name for f in SUPPORTED if f.sampler == s and f.window) for s in CHAIN}  # per sampler


def sampler_on(params: Any, sampler: str) -> bool:
    """Does `sampler` change anything for these params: some field of it away from its "off" value, and its
    window (if it reads one) not empty. (Read per row and step: the tables are built once.)"""
    return (any(getattr(params, name) != off for name, off in CHAIN.get(sampler, {}).items())
            and all(getattr(params, name) != 0 for name in _WINDOWS.get(sampler, ())))


def history_window(params: Any) -> int:
    """How many recent tokens the samplers that are on read (-1: all of them, 0: none)."""
    windows = [getattr(params, f.name) for f in SUPPORTED if f.window and sampler_on(params, f.sampler)]
    return -1 if -1 in windows else max(windows, default=0)


def tokenize(params: Any, tokenizer: Any) -> Any:
    """`params` with each vocab-dependent field's token form (SamplingParams.tokenized), for this tokenizer."""
    forms = tuple((f.name, f.tokenized(tokenizer, getattr(params, f.name)))
                  for f in SUPPORTED if f.tokenized is not None and sampler_on(params, f.sampler))
    return dataclasses.replace(params, tokenized=forms) if forms else params
