"""Evaluation: the speculative-decoding engine, the `python -m eval` CLI, metrics and reports."""
