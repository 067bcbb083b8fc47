"""Speculative decoding: the drafters (draft model, MTP, DFlash, EAGLE-3, n-gram lookup, and combinations of them),
the draft-length policy, the acceptance math, and Speculation, the one object the engine calls
(speculation.py). kinds.py declares each drafter kind, detects the kind a checkpoint holds and loads it; see
docs/speculative.md for the step that uses them.
"""
