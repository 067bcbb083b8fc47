"""Structured output: grammar-constrained decoding (grammar.py), tool calls (tool_calls.py) and the reasoning
split (reasoning.py)."""
