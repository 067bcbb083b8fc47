"""What grammar-constrained decoding hands the sampler: the allowed tokens of some logits rows, as bitmasks. Below
both (structured/grammar.py makes them, sampler.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenMasks:
    """Allowed tokens of some rows (grammar-constrained ones; the others are free): bit j % 32 of bits[i, j // 32]
    allows token j in row rows[i]."""

    rows: np.ndarray  # [C] int64, ascending
    bits: np.ndarray  # [C, ceil(V / 32)] int32
