#!/usr/bin/env python3
"""DraftPolicy alone against a simulated device (outrider_tools/policy_sim.py says how; --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # outrider_tools is not installed: run from a checkout
from outrider_tools.policy_sim import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
