"""Grammar-constrained decoding over llguidance (docs/architecture.md says why this engine).

A request's grammar (GBNF, Lark, JSON Schema, or the tool-call syntax) is compiled once, when the HTTP layer
validates the request: one that fails to compile is a 400 before anything is allocated. Each Request then holds
a Constraint, its own matcher over that grammar:
- the engine advances it over committed tokens only, so it never has to roll back with the KV (a rejected
  draft never reaches it), and ends the request once the grammar is complete;
- the runner asks it, after the step's forward is launched, for the allowed tokens of each of the request's
  sampling rows: the committed state for a plain row and, for verify rows, the states after each draft
  prefix, reached by advancing tentatively and rolling back.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from outrider.sampler import TokenMasks

if TYPE_CHECKING:
    from outrider.steps import ScheduledRequest

log = logging.getLogger("outrider.structured")

# Compact JSON with Python's separators: no free whitespace, which a small model could emit until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ALL_ALLOWED = -1  # a bitmask word with every bit set


class GrammarError(ValueError):
    """A grammar that does not compile; the message says why."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: immutable, so one SamplingParams carries it for every request it serves."""

    kind: str  # gbnf | lark | json_schema | tool_calls
    source: str  # as the request gave it (generation_settings shows it)
    compiled: str = field(repr=False, compare=False)  # llguidance's grammar text
    tokenizer: llguidance.LLTokenizer = field(repr=False, compare=False)


class GrammarCompiler:
    """Compiles grammars against one vocabulary: the logits' width, with the engine's end-of-generation ids as
    the tokens that may follow a complete match. Building the token trie takes about a second for a 150k
    vocabulary, so the engine builds its compiler once, at start-up."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.vocab_size = vocab_size

    def gbnf(self, text: str) -> Grammar:
        """llama.cpp's GBNF (a grammar starting with `%llguidance` is read as llguidance's Lark, as llama-server
        does)."""
        try:
            compiled = llguidance.grammar_from("gbnf", text)
        except ValueError as e:
            raise GrammarError(str(e)) from e
        return self._checked("gbnf", text, compiled)

    def lark(self, text: str, kind: str = "lark") -> Grammar:
        return self._checked(kind, text, llguidance.LLMatcher.grammar_from_lark(text))

    def json_schema(self, schema: dict[str, Any]) -> Grammar:
        """A JSON Schema; as in llama-server, an object's `additionalProperties` defaults to false."""
        source = json.dumps(schema)
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from e
        return self._checked("json_schema", source, compiled)

    def _checked(self, kind: str, source: str, compiled: str) -> Grammar:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, self.tokenizer)
        if is_error:
            raise GrammarError(messages[0].strip())
        return Grammar(kind, source, compiled, self.tokenizer)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_VALUES = ("const", "enum", "default", "examples")  # JSON values, not subschemas


def closed_objects(schema: Any) -> Any:
    """`schema` with additionalProperties: false on every object schema that lists properties and says nothing
    about others (a copy; the request's schema is left alone)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _VALUES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = closed_objects(value)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


class Constraint:
    """One request's matcher over its grammar."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.compiled, log_level=0)  # (not thread-safe)

    def accept(self, token: int) -> bool:
        """Advance over a committed token. True when the request must end here: the grammar is complete (only
        end-of-generation could follow), or the matcher failed (logged; the masks make that a bug)."""
        m = self.matcher
        if not m.consume_token(token):
            log.error("grammar matcher rejected committed token %d: %s", token, m.get_error())
            return True
        return m.is_stopped()

    def fill(self, out: np.ndarray, drafts: Sequence[int] = ()) -> None:
        """Write the allowed tokens as bitmask rows, out: int32 [len(drafts) + 1, W]: the committed state, then
        the state after each draft prefix (reached tentatively, rolled back before returning). A row past a
        draft the grammar forbids, or past the grammar's end, allows everything: the target never commits a
        token there (the forbidden draft has probability 0, so verification rejects it first)."""
        m = self.matcher
        self._fill_row(out[0])
        valid = m.validate_tokens(list(drafts)) if drafts else 0
        consumed = 0
        for j in range(1, len(drafts) + 1):
            if j > valid or (consumed and m.is_stopped()) or not m.consume_token(drafts[j - 1]):
                out[j:] = ALL_ALLOWED
                break
            consumed += 1
            if m.is_stopped():
                out[j] = ALL_ALLOWED
            else:
                self._fill_row(out[j])
        if consumed:
            m.rollback(consumed)

    def _fill_row(self, row: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.matcher.is_error():  # (a grammar past its limits) unconstrained here; accept() reports it
            row[:] = ALL_ALLOWED


def token_masks(sampled: Sequence[ScheduledRequest], vocab_size: int) -> TokenMasks | None:
    """The allowed tokens of a step's constrained sampling rows, or None when no request is constrained. Each
    sampling request owns 1 + len(draft_tokens) consecutive rows (its last known token's, then one per draft).
    Rows without drafts (every row of a decode step) are computed in parallel, on llguidance's threads."""
    if all(s.request.constraint is None for s in sampled):
        return None
    constraints = [s.request.constraint for s in sampled]
    drafts = [s.draft_tokens for s in sampled]
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
    rows = [r for i, c in enumerate(constraints) if c is not None for r in range(starts[i], starts[i + 1])]
    bits = np.empty((len(rows), (vocab_size + 31) // 32), dtype=np.int32)
    plain: list[tuple[Constraint, int]] = []
    at = 0
    for c, d in zip(constraints, drafts):
        if c is None:
            continue
        if d:
            c.fill(bits[at : at + len(d) + 1], d)
        else:
            plain.append((c, at))
        at += len(d) + 1
    if len(plain) == 1:
        plain[0][0].fill(bits[plain[0][1] : plain[0][1] + 1])
    elif plain:
        _executor().unsafe_compute_mask_ptr([(c.matcher, i) for c, i in plain], bits.ctypes.data,
                                            bits.shape[1] * 4, len(bits))
        for c, i in plain:
            if c.matcher.is_error():
                bits[i] = ALL_ALLOWED
    return TokenMasks(np.asarray(rows, dtype=np.int64), bits)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()
