#!/usr/bin/env python3
"""Train outrider's bundled demo model family (outrider_tools/demo/train.py says how; --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # outrider_tools is not installed: run from a checkout
from outrider_tools.demo.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
