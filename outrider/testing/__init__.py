"""Test helpers: tiny HF-format checkpoints and tokenizers written on the fly."""

from outrider.testing.checkpoints import write_tiny_checkpoint

__all__ = ["write_tiny_checkpoint", "write_tiny_tokenizer"]


def __getattr__(name):  # lazy: the tokenizer writer imports `tokenizers` only when used
    if name == "write_tiny_tokenizer":
        from outrider.testing.tokenizer import write_tiny_tokenizer

        return write_tiny_tokenizer
    raise AttributeError(name)
