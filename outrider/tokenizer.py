"""Tokenizer over HF `tokenizers`, sandboxed chat templates, and the incremental per-request Detokenizer."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from outrider.structured.template_caps import TemplateCaps, polyfill, tools_system_prompt, with_system

# End-of-generation specials (llama.cpp treats these as EOG too): present in the vocab as special tokens
# means "stop here", whatever the configs say, since chat fine-tunes often leave only the base EOS there.
_EOG_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "<|return|>",
    "<|end_of_text|>", "<EOT>", "<|end▁of▁sentence|>",
)
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# Fill-in-the-middle tokens by role, as checkpoints spell them (Qwen2.5/Qwen3-Coder, StarCoder/SmolLM, CodeLlama,
# Codestral, DeepSeek-Coder).
_FIM_NAMES = {
    "pre": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>", "▁<PRE>", "[PREFIX]", "<｜fim▁begin｜>"),
    "suf": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<SUF>", "▁<SUF>", "[SUFFIX]", "<｜fim▁hole｜>"),
    "mid": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<MID>", "▁<MID>", "[MIDDLE]", "<｜fim▁end｜>"),
    "rep": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "sep": ("<|file_sep|>", "<file_sep>", "<filename>"),
}


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's fill-in-the-middle token ids; `rep`/`sep` (repository name, file separator) may be absent."""

    pre: int
    suf: int
    mid: int
    rep: int | None
    sep: int | None


class ChatTemplateError(ValueError):
    """The chat template is missing, failed to render, or the messages cannot be rendered."""


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _byte_decoder()


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or a serialised AddedToken dict."""
    return value.get("content") if isinstance(value, Mapping) else value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_ids(value: Any) -> list[int]:
    """eos_token_id in generation_config/config.json: an int, a list of ints, or absent."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode with llama-server semantics, EOS ids, chat template."""

    def __init__(self, tok: tokenizers.Tokenizer, config: Mapping, gen_config: Mapping, model_config: Mapping,
                 chat_template: str | None):
        self._tok = tok
        self._added = dict(tok.get_added_tokens_decoder())
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._template_tokens = {  # as HF: only the special tokens the checkpoint defines
            k: v for k in ("bos_token", "eos_token", "pad_token", "unk_token") if (v := _token_text(config.get(k)))
        }
        self.bos_token_id = self._id(self.bos_token)
        if self.bos_token_id is None:
            ids = _as_ids(gen_config.get("bos_token_id")) or _as_ids(model_config.get("bos_token_id"))
            self.bos_token_id = ids[0] if ids else None

        eos = {self._id(self.eos_token)}
        text_config = model_config.get("text_config") or {}  # multimodal checkpoints nest the LM's config
        for cfg in (gen_config, model_config, text_config):
            eos.update(_as_ids(cfg.get("eos_token_id")))
        eos.update(i for i, t in self._added.items() if t.special and t.content in _EOG_TOKENS)
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if i is not None)

        self._prefix, self._suffix = self._special_affixes(config)
        decoder = tok.decoder.__getstate__() if tok.decoder is not None else b""
        self._byte_level = b'"type":"ByteLevel"' in decoder
        self._byte_fallback = b'"type":"ByteFallback"' in decoder
        # A plain byte-level decoder maps each token to bytes on its own and decodes their concatenation.
        self._concatenates = bool(decoder) and json.loads(decoder).get("type") == "ByteLevel"
        # Cached per instance: the Detokenizer asks for nearly every token it pushes, and a hit is far cheaper than
        # a decode.
        self.whole_text = functools.cache(self.whole_text)
        self._alone: tuple[dict[int, str], dict[int, str]] = ({}, {})  # decode_one's, by skip_special_tokens

    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ generation_config/config.json) from a directory or hub id,
        or the tokenizer a GGUF file describes (gguf_tokenizer.py).

        `chat_template` overrides the checkpoint's (chat_template.jinja, else tokenizer_config.json).
        """
        path = Path(path)
        if path.suffix.lower() == ".gguf":
            from outrider.gguf_tokenizer import read_gguf_tokenizer

            g = read_gguf_tokenizer(path)
            return cls(g.tokenizer, g.config, {"eos_token_id": g.eos_token_ids}, {}, chat_template or g.chat_template)
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(path), allow_patterns=["*.json", "chat_template.jinja"]))
        config = _read_json(path / "tokenizer_config.json")
        if chat_template is None:
            jinja_file = path / "chat_template.jinja"
            chat_template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
        if chat_template is None:
            chat_template = config.get("chat_template")
            if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t["name"]: t["template"] for t in chat_template}
                chat_template = named.get("default", next(iter(named.values()), None))
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        return cls(tok, config, _read_json(path / "generation_config.json"), _read_json(path / "config.json"),
                   chat_template)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _special_affixes(self, config: Mapping) -> tuple[list[int], list[int]]:
        """Ids that add_special puts around the text: the post-processor's, unless add_bos/eos_token say otherwise."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full)) if full[i:i + len(plain)] == plain), len(full))
        prefix, suffix = full[:start], full[start + len(plain):]
        eos_id = self._id(self.eos_token)
        if config.get("add_bos_token") is not None:
            prefix = [self.bos_token_id] if config["add_bos_token"] and self.bos_token_id is not None else []
        if config.get("add_eos_token") is not None:
            suffix = [eos_id] if config["add_eos_token"] and eos_id is not None else []
        return prefix, suffix

    @functools.cached_property
    def _literal_tok(self):
        """A copy that encodes special-token text as plain text (a copy: the flag is shared mutable state)."""
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    @functools.cached_property
    def fim_tokens(self) -> FimTokens | None:
        """The fill-in-the-middle tokens the vocabulary declares, None without a prefix, suffix and middle one."""
        vocab = self.vocab()
        found = {role: next((vocab[n] for n in names if n in vocab), None) for role, names in _FIM_NAMES.items()}
        if None in (found["pre"], found["suf"], found["mid"]):
            return None
        return FimTokens(**found)

    def vocab(self) -> dict[str, int]:
        """Every token's vocabulary string (added tokens included) -> its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's vocabulary string holds (a byte-level vocabulary spells each byte as
        one character): a text of n characters has at least n / max_token_chars tokens."""
        return max(map(len, self.vocab()), default=1)

    @property
    def add_bos(self) -> bool:
        """Whether encode(add_special=True) prepends BOS."""
        return self.bos_token_id is not None and self.bos_token_id in self._prefix

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; add_special adds BOS/EOS as the checkpoint says, parse_special=False reads
        special-token text (e.g. "<|im_end|>") as ordinary characters."""
        tok = self._tok if parse_special else self._literal_tok
        ids = tok.encode(text, add_special_tokens=False).ids
        return [*self._prefix, *ids, *self._suffix] if add_special else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD; ids outside the vocabulary are ignored)."""
        return self._tok.decode(ids if isinstance(ids, list) else list(ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """decode([token_id]), cached."""
        cache = self._alone[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.decode([token_id], skip_special_tokens)
        return text

    def to_json(self) -> str:
        """The `tokenizers` serialisation (tokenizer.json): grammar engines build their token tries from it."""
        return self._tok.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a piece of a multi-byte character for byte tokens)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        byte = _SPM_BYTE.fullmatch(piece) if self._byte_fallback else None
        if byte:
            return bytes([int(byte.group(1), 16)])
        if token_id in self._added:  # added tokens hold their text as is, in any tokenizer
            return piece.encode()
        if self._byte_level:
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:  # a vocab entry outside the byte alphabet: take it literally
                return piece.encode()
        return piece.replace("▁", " ").encode()  # SentencePiece marks spaces with U+2581

    def whole_text(self, token_id: int) -> str:
        """The text `token_id` adds after any text that ends on a whole character, when it does not depend on the
        tokens around it: under a plain byte-level decoder, an ordinary token whose bytes are whole UTF-8
        characters. "" otherwise (decode with the neighbours)."""
        if not self._concatenates or token_id in self._added:
            return ""
        text = self.decode_one(token_id)
        return "" if "\ufffd" in text else text

    def token_piece(self, token_id: int) -> str:
        """The token's text (U+FFFD where it holds only part of a multi-byte character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @property
    def template_caps(self) -> TemplateCaps:
        """What the chat template shows (probed once per template)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass one (e.g. --chat-template-file)")
        return _template_caps(self.chat_template, tuple(sorted(self._template_tokens.items())))

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            tools: list | None = None, **extra: Any) -> str:
        """Render `messages` with the chat template in a jinja2 sandbox, ready for encode(add_special=True);
        `extra` are template variables (chat_template_kwargs, e.g. enable_thinking). Messages are normalised
        first (null or missing content is "", text parts are joined, tool-call arguments are objects) and rewritten
        to what the template can show (structured/template_caps.py); `tools` a template cannot show are offered in
        the system message (structured/generic_tools.py). Raises ChatTemplateError, naming the first message
        whose conversation prefix fails to render when the template fails on one."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass one (e.g. --chat-template-file)")
        variables = {**self._template_tokens, **extra}

        def render(msgs: list[dict], tools: list | None, generation_prompt: bool) -> str:
            return _compile(self.chat_template).render(**variables, messages=msgs, tools=tools or None,
                                                       add_generation_prompt=generation_prompt)

        caps = self.template_caps

        def prepared(msgs: Sequence[Mapping]) -> list[dict]:
            normalized = []
            for i, m in enumerate(msgs):
                try:
                    normalized.append(_normalize_message(m))
                except ChatTemplateError as e:
                    raise ChatTemplateError(f"messages[{i}]: {e}") from e
            if tools and not caps.tools:
                normalized = with_system(normalized, tools_system_prompt(tools))
            return polyfill(normalized, caps)

        shown_tools = tools if caps.tools else None
        try:
            prompt = render(prepared(messages), shown_tools, add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - whatever a template raises is the request's fault
            raise ChatTemplateError(f"chat template error{_failing_message(render, prepared, messages, shown_tools)}"
                                    f": {_describe(e)}") from e
        # As llama-server: encode(prompt, add_special=True) adds BOS itself, so a template's own is dropped.
        if self.add_bos and self.bos_token and prompt.startswith(self.bos_token):
            prompt = prompt[len(self.bos_token):]
        return prompt


@functools.lru_cache(maxsize=16)
def _template_caps(source: str, tokens: tuple[tuple[str, str], ...]) -> TemplateCaps:
    return TemplateCaps.probe(lambda msgs, tools, gen: _compile(source).render(
        **dict(tokens), messages=msgs, tools=tools, add_generation_prompt=gen))


def _failing_message(render, prepared, messages: Sequence[Mapping], tools: list | None) -> str:
    """" at messages[i]" for the first message whose conversation prefix fails to render ("" when every prefix
    renders: the failure needs the whole conversation or the generation prompt)."""
    for i in range(len(messages)):
        try:
            render(prepared(messages[: i + 1]), tools, False)
        except Exception:  # noqa: BLE001
            return f" at messages[{i}]"
    return ""


def _describe(e: Exception) -> str:
    if isinstance(e, jinja2.TemplateError):
        return str(e.message or e)
    return f"{type(e).__name__}: {e}"


def content_text(content: Any) -> Any:
    """A message's content as templates take it: a list of text parts joined with a blank line (as llama-server
    does); a string or None as is."""
    return "\n\n".join(_part_text(p) for p in content) if isinstance(content, list) else content


def _normalize_message(message: Mapping) -> dict:
    """An OpenAI message as HF templates expect: text parts joined, tool-call arguments as objects."""
    msg = dict(message)
    msg["content"] = content_text(msg.get("content")) or ""
    if msg.get("tool_calls"):
        msg["tool_calls"] = [_parse_arguments(c) for c in msg["tool_calls"]]
    return msg


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type") == "text":
        return part.get("text") or ""
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ChatTemplateError(f"unsupported content part type: {kind!r} (only text is supported)")


def _parse_arguments(call: Mapping) -> dict:
    """OpenAI sends arguments as a JSON string; templates (`arguments | tojson`) expect the object."""
    fn = call.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return dict(call)
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return dict(call)
    return {**call, "function": {**fn, "arguments": args}}


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Unlike jinja2's own tojson, no HTML escaping: prompts are not HTML.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """The environment HF templates are written for: trimmed blocks, loop controls, HF's helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


class Detokenizer:
    """Incremental detokenizer for one request: emits complete UTF-8 only and cuts stop strings exactly.

    Stop semantics: the first stop string to *end* in the text wins (ties: the one starting earlier), as if text
    were checked one character at a time, so the result does not depend on how tokens are batched into pushes.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 context: Sequence[int] = ()):
        """`context`: the last few prompt ids, so the first output token decodes as it would mid-text
        (SentencePiece decoders drop the leading space of whatever token starts a decode)."""
        self._skip = skip_special_tokens
        self._decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self._decode_one = tokenizer.decode_one
        self._stop = tuple(s for s in stop if s)
        # Decode window: ids from the last emitted boundary; the first _read of them are decoded already.
        self._window: list[int] = list(context)
        self._read = len(self._window)
        self._held = ""  # decoded text that could still be the start of a stop string
        self._chunks: list[str] = []
        self.stop_word: str | None = None
        self._whole = tokenizer.whole_text

    @property
    def text(self) -> str:
        """All text emitted so far (after a stop or flush(): the final output)."""
        return "".join(self._chunks)

    def push(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Add tokens; return (text now safe to emit, stop word if one matched). Input after a stop is ignored."""
        if self.stop_word is not None:
            return "", None
        window = self._window
        window.extend(token_ids)
        if self._read == 1 and len(window) == 2 and self._whole(window[0]) and (new := self._whole(window[1])):
            # The usual case once decoding runs: one new id after the previous one, both of whole characters, so
            # the new text is known without a decode (Tokenizer.whole_text).
            self._window = window[1:]
        else:
            new = self._decode_new(final=False)
        return self._emit(new, final=False)

    def flush(self) -> str:
        """At finish: return what was held back (a stop string found here still cuts it, see stop_word)."""
        if self.stop_word is not None:
            return ""
        return self._emit(self._decode_new(final=True), final=True)[0]

    def _decode_new(self, final: bool) -> str:
        """Text added by the unread ids; "" while it ends in U+FFFD (a character still split across tokens)."""
        window = self._window
        if self._read == 1:  # the decoded part is the previous token
            before = self._decode_one(window[0], self._skip)
        else:
            before = self._decode(window[:self._read])
        after = self._decode(window)
        if after == before:
            # The new ids add nothing (skipped specials, ids the vocabulary lacks): drop them, or a long run of
            # them would make every later decode longer.
            self._window = window[:self._read]
            return ""
        if after.endswith("\ufffd") and not final:
            return ""
        new = after[len(before):]
        # Keep only the ids since the last boundary, so the window is a token or two, never the whole output
        # (unless the new ids only rewrote earlier text, leaving nothing new: then they stay for the next decode).
        if new:
            self._window = window[self._read:]
        self._read = len(self._window)
        return new

    def _emit(self, new: str, final: bool) -> tuple[str, str | None]:
        if not self._stop:  # nothing to hold back or cut
            if new:
                self._chunks.append(new)
            return new, None
        text = self._held + new
        match = self._find_stop(text)
        if match is not None:
            out, self.stop_word, self._held = text[:match[0]], match[1], ""
        else:
            keep = 0 if final else self._holdback(text)
            out, self._held = text[:len(text) - keep], text[len(text) - keep:]
        if out:
            self._chunks.append(out)
        return out, self.stop_word

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, word) of the stop string that ends first in `text`. Earlier text was held back whenever it
        could begin a stop string, so any match starts inside `text`."""
        best = None
        for word in self._stop:
            start = text.find(word)
            if start >= 0 and (best is None or (start + len(word), start) < (best[0] + len(best[1]), best[0])):
                best = (start, word)
        return best

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string. (Checked suffix by
        suffix: `text` is a few characters unless it already begins a stop string, and a long stop string costs
        nothing up front; one pattern of every prefix would take memory quadratic in its length.)"""
        best = 0
        for word in self._stop:
            for k in range(min(len(word) - 1, len(text)), best, -1):
                if word.startswith(text[len(text) - k:]):
                    best = k
                    break
        return best
