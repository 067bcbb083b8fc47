"""The tokenizer a GGUF file describes (llama.cpp's `tokenizer.ggml.*` metadata), built as a `tokenizers` tokenizer
with the settings Tokenizer otherwise reads from tokenizer_config.json.

Byte-level BPE (`tokenizer.ggml.model` gpt2: Llama 3, Qwen, SmolLM...) is built from the tokens and merges, and
splits text before merging as llama.cpp does for the file's `tokenizer.ggml.pre`. Other models and
pre-tokenizers are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre`: each splits the pieces the previous one left.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # one digit at a time
    "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,), "llama-v3": (_LLAMA3,), "falcon3": (_LLAMA3,),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,),
}
# Llama 3's vocabulary: a piece that is a whole token is kept whole, whatever the merges say; BOS by default.
_LLAMA3_FAMILY = frozenset(p for p, regexes in PRE_TOKENIZERS.items() if regexes == (_LLAMA3,))
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


@dataclass(frozen=True)
class GGUFTokenizer:
    """What Tokenizer needs: the tokenizer, tokenizer_config.json's settings and the end-of-generation ids."""

    tokenizer: tokenizers.Tokenizer
    config: dict[str, Any]  # bos/eos/unk/pad token texts, add_bos_token, add_eos_token
    eos_token_ids: list[int]  # EOT and EOM, besides the EOS that config names
    chat_template: str | None


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    from outrider.models.gguf import open_gguf

    ck = open_gguf(path)
    kind, pre = ck.value("tokenizer.ggml.model"), ck.value("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} ({ck.name}) is not supported; supported: gpt2 (byte-level "
                         "BPE)")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} ({ck.name}) is not supported; supported: "
                         f"{', '.join(PRE_TOKENIZERS)}")
    tokens: list[str] = ck.value("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in ck.value("tokenizer.ggml.merges", [])]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre in _LLAMA3_FAMILY)
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) are special; user-defined ones (<think>) are plain text matched whole.
    types = ck.value("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = ck.value(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
        "add_bos_token": ck.value("tokenizer.ggml.add_bos_token", pre in _LLAMA3_FAMILY),
        "add_eos_token": ck.value("tokenizer.ggml.add_eos_token", False),
    }
    eog = [i for key in ("eot_token_id", "eom_token_id") if (i := ck.value(f"tokenizer.ggml.{key}")) is not None]
    return GGUFTokenizer(tok, config, eog, ck.value("tokenizer.chat_template"))
