"""A tiny, genuine HF tokenizer directory for tests: byte-level BPE trained on the fly, ChatML template."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # DFlash drafters fill the positions they predict with this token
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, "<|im_start|>", EOS_TOKEN, MASK_TOKEN)

# Multi-byte text in several scripts, so tests can see characters split across tokens: the frequent words
# merge into whole-character tokens, the rare characters stay split into single-byte tokens.
_MULTIBYTE_TEXT = (
    "café naïve résumé façade über straße crème brûlée jalapeño São Paulo Ελληνικά Привет мир\n"
    "中文文本 日本語のテキスト 한국어 텍스트 你好世界 東京 数据 模型 推理 服务器\n"
    "emoji 😀 🎉 👍 🚀 ❤️ 👨‍👩‍👧 🇫🇷 — “quotes” ‘single’ … • € £ ¥ ± × ÷ → ∞\n"
)

# A ChatML template in the Qwen style (optional system turn, tools, tool calls and tool responses).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0, system=none) -%}\n"
    "{%- if messages and messages[0].role == 'system' -%}\n"
    "{%- set ns.start = 1 -%}{%- set ns.system = messages[0].content -%}\n"
    "{%- endif -%}\n"
    "{%- if ns.system is not none or tools -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if ns.system is not none -%}{{- ns.system -}}{%- endif -%}\n"
    "{%- if tools -%}\n"
    "{%- if ns.system is not none -%}{{- '\\n\\n' -}}{%- endif -%}\n"
    "{{- '# Tools\\n\\nTo call a function, answer with <tool_call>{\"name\": ..., \"arguments\": {...}}"
    "</tool_call>.\\n<tools>' -}}\n"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}\n"
    "{{- '\\n</tools>' -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages[ns.start:] -%}\n"
    "{%- if message.role not in ['user', 'assistant', 'tool'] -%}\n"
    "{{- raise_exception('Unexpected message role: ' ~ message.role) -}}\n"
    "{%- elif message.role == 'tool' -%}\n"
    "{{- '<|im_start|>user\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response><|im_end|>\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' -}}\n"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}\n"
    "{%- for call in message.tool_calls or [] -%}\n"
    "{%- set fn = call.function or call -%}\n"
    "{{- '\\n<tool_call>\\n' ~ ({'name': fn.name, 'arguments': fn.arguments} | tojson) ~ '\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n"
)


def _corpus() -> list[str]:
    """Deterministic training text: a few stdlib modules' source (this interpreter's) plus multi-byte text."""
    import argparse
    import json.decoder
    import string
    import textwrap

    sources = [inspect.getsource(m) for m in (textwrap, string, json.decoder, argparse)]
    return sources + [_MULTIBYTE_TEXT * 20]


def python_sources(max_bytes: int = 80 << 20) -> Iterator[str]:
    """This interpreter's Python sources (stdlib, then installed packages), up to max_bytes: a corpus large
    enough for a vocabulary of a real model's size (~150k tokens, for benchmarks whose cost depends on it)."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"])]
    seen = 0
    for root in roots:
        for file in sorted(root.rglob("*.py")):
            if root == roots[0] and "site-packages" in file.parts:
                continue
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield text
            seen += len(text)
            if seen >= max_bytes:
                return


def write_tiny_tokenizer(path: str | Path, vocab_size: int = 512, add_bos_token: bool = True,
                         corpus: Iterable[str] | None = None) -> int:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json into `path`.

    Returns the real vocabulary size (special tokens included), which is `vocab_size` for any size the corpus
    can fill. Special tokens take ids 0..4 in SPECIAL_TOKENS order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2 if corpus is None else 1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable, whatever the corpus
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    if add_bos_token:  # the post-processor is how tokenizer.json alone says "prepend BOS"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(path / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": ["<|im_start|>", MASK_TOKEN],
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return tok.get_vocab_size(with_added_tokens=True)
