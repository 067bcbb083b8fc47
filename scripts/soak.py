#!/usr/bin/env python3
"""Soak test: many concurrent clients against a real `outrider serve`, then a leak check (outrider_tools/soak.py
says how; --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # outrider_tools is not installed: run from a checkout
from outrider_tools.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
