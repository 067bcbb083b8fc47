"""Generated tokens one by one, and their draft provenance. `split_by_token` cuts an engine output into its
tokens, each with the text it added (the engine's per-token texts), its log-prob, and whether it was a draft the
target accepted or the target's own token (a correction or the bonus token). The native stream sends a frame per
token from it; `"return_draft_provenance": true` (an outrider extension, docs/api.md) renders the same steps as
`draft_provenance` entries, which the web page colours replies with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from outrider.engine.request import RequestOutput, TokenLogprob

FIELD = "draft_provenance"  # the response field, in native frames and bodies and in OpenAI choices


@dataclass(frozen=True)
class TokenStep:
    """One generated token of an engine output, as a per-token frame shows it."""

    token_id: int
    text: str  # what it added to the text (held-back text arrives with a later token)
    logprob: TokenLogprob | None
    drafted: bool  # a draft the target accepted (else the target's own token)


def split_by_token(out: RequestOutput) -> list[TokenStep]:
    """An output's tokens one by one, each with its own text and log-prob: their texts concatenate to out.text.
    (A speculative round commits several tokens in one output; llama-server streams a frame per token.)"""
    texts = out.token_texts
    logprobs = out.logprobs or [None] * len(out.new_token_ids)
    return [TokenStep(tok, text, lp, i < out.accepted_drafts)
            for i, (tok, text, lp) in enumerate(zip(out.new_token_ids, texts, logprobs))]


def entry(step: TokenStep) -> dict[str, Any]:
    """A token's `draft_provenance` entry: its text is what it added to the shown text, so the entries' texts join
    to the content (a token inside a multi-byte character or a held-back stop string has "")."""
    return {"id": step.token_id, "text": step.text, "accepted_draft": step.drafted}


def entries(outs: Iterable[RequestOutput]) -> list[dict[str, Any]]:
    """The entries of every token of `outs`, in order."""
    return [entry(step) for out in outs for step in split_by_token(out)]
