#!/usr/bin/env python3
"""Train a DFlash drafter for SmolLM2-135M-Instruct and measure it through the engine
(outrider_tools/smollm2_drafter.py says how; --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # outrider_tools is not installed: run from a checkout
from outrider_tools.smollm2_drafter import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
