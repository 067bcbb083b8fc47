"""Model implementations and the checkpoint loader."""

from outrider.models.loader import load_model, read_tensors, resolve_model_path
from outrider.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "load_model", "read_tensors", "resolve_model_path"]
