"""outrider: a llama-server compatible LLM inference server with honest speculative decoding."""

from outrider.params import SamplingParams

__all__ = ["SamplingParams", "LLM"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from outrider.llm import LLM

        return LLM
    raise AttributeError(name)
