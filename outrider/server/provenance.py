"""Per-token draft provenance, an outrider extension (`"return_draft_provenance": true`): for every generated
token, its id, its text, and whether it was a draft the target accepted or the target's own token (a correction
or the bonus token). The web page colours replies with it; docs/api.md documents the field."""

from __future__ import annotations

import codecs
from typing import Any, Iterable

from outrider.engine.request import RequestOutput
from outrider.tokenizer import Tokenizer

FIELD = "draft_provenance"  # the response field, in native frames and in OpenAI choices


class DraftProvenance:
    """One request's entries, output by output. Each token's `text` is what it completes of the UTF-8 text: a
    token that ends inside a multi-byte character has "" and the token that finishes it carries the character,
    so the texts of all entries join to the generated text (special tokens and stop words included)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def entries(self, out: RequestOutput) -> list[dict[str, Any]]:
        """One entry per token of `out`, in order; the engine puts the accepted drafts first."""
        return [{"id": t, "text": self._utf8.decode(self._tokenizer.token_bytes(t)),
                 "accepted_draft": i < out.accepted_drafts} for i, t in enumerate(out.new_token_ids)]

    def all_entries(self, outs: Iterable[RequestOutput]) -> list[dict[str, Any]]:
        """Every output's entries, joined (a non-streamed response)."""
        return [e for out in outs for e in self.entries(out)]
