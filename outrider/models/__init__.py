"""Model implementations and the checkpoint loader."""

from outrider.models.decoder import CausalLM
from outrider.models.loader import load_model, read_tensors, resolve_model_path

__all__ = ["CausalLM", "load_model", "read_tensors", "resolve_model_path"]
