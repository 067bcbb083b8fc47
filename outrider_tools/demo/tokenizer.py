"""The demo family's byte-level BPE tokenizer: its special tokens and chat template, training, saving, and
encoding documents into one token stream."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EOT_ID, IM_START_ID, IM_END_ID, MASK_ID = 0, 1, 2, 3
EOS_IDS = [EOT_ID, IM_END_ID]
MAX_POSITIONS = 2048

CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- set content = message['content'] if message['content'] is string else '' -%}\n"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ content ~ '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n"
)


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    # Encoding with special tokens prepends <|endoftext|>, the document separator seen before every training file.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[0]} $A", pair=f"{SPECIAL_TOKENS[0]} $A {SPECIAL_TOKENS[0]} $B",
        special_tokens=[(SPECIAL_TOKENS[0], EOT_ID)])
    return tok


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def write_tokenizer(tok, path: Path, pretty: bool = True) -> None:
    tok.save(str(path / "tokenizer.json"), pretty=pretty)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_stream(tok, docs: list[str], chunk: int = 1024) -> torch.Tensor:
    """Documents joined into one token stream, each preceded by <|endoftext|>. Encoded in chunks of documents,
    without offsets where the tokenizers version can: tens of MB of text at once would hold gigabytes of them."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts = []
    for i in range(0, len(docs), chunk):
        for enc in encode(docs[i:i + chunk], add_special_tokens=False):
            parts.append(torch.tensor([EOT_ID, *enc.ids], dtype=torch.int32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)

