"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from outrider.config import SUPPORTED_ARCHITECTURES, ModelConfig
from outrider.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}") from None
