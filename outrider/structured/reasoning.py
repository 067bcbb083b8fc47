"""The reasoning split: a reply's `<think>…</think>` text goes to `reasoning_content`, the rest to `content`.

`--reasoning-format` (and a request's `reasoning_format`) as llama-server reads it:
- none: no split, the thoughts stay in `content`;
- deepseek, auto: thoughts in `reasoning_content`, tags removed;
- deepseek-legacy: thoughts in `reasoning_content`, and `content` keeps the whole reply, tags included.
A reply starts inside the thoughts when the prompt ends with the opening tag (templates that open them for the
model, e.g. DeepSeek-R1's or Qwen3's with thinking forced); a reply whose thoughts never close is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


def opens_in_reasoning(prompt: str) -> bool:
    """Whether a reply to this rendered prompt starts inside the thoughts."""
    return prompt.rstrip().endswith(OPEN)


class ReasoningStream:
    """Splits a reply, pushed piece by piece, into reasoning and content deltas (whole: push it, then finish)."""

    def __init__(self, fmt: str, in_reasoning: bool) -> None:
        self.legacy = fmt == "deepseek-legacy"
        # start: an opening tag may still come; think: inside the thoughts; closed: just after them; content
        self._state = "think" if in_reasoning else "start"
        self._held = ""

    def push(self, text: str) -> Split:
        """The deltas safe to send now (a possible tag's first characters are held back)."""
        return self._step(text, final=False)

    def finish(self) -> Split:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> Split:
        held = self._held + text
        reasoning, content = [], [text] if self.legacy else []
        while True:
            if self._state == "start":
                body = held.lstrip()
                if body.startswith(OPEN):
                    held, self._state = body[len(OPEN) :], "think"
                    continue
                if not final and OPEN.startswith(body):  # (empty, or a tag's first characters)
                    break
                self._state = "content"
            if self._state == "think":
                end = held.find(CLOSE)
                if end >= 0:
                    reasoning.append(held[:end])
                    held, self._state = held[end + len(CLOSE) :], "closed"
                    continue
                keep = 0 if final else partial_suffix(held, CLOSE)
                reasoning.append(held[: len(held) - keep])
                held = held[len(held) - keep :]
                break
            if self._state == "closed":  # the whitespace after the thoughts is no content
                held = held.lstrip()
                if not held and not final:
                    break
                self._state = "content"
            if not self.legacy:
                content.append(held)
            held = ""
            break
        self._held = held
        return Split("".join(reasoning), "".join(content))


def split_reasoning(text: str, fmt: str, in_reasoning: bool) -> Split:
    """The whole reply's split."""
    stream = ReasoningStream(fmt, in_reasoning)
    first, last = stream.push(text), stream.finish()
    return Split(first.reasoning + last.reasoning, first.content + last.content)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
