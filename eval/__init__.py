"""Evaluation: the speculative-decoding engine, the `python -m eval` CLI, metrics and reports."""

from eval.decoder import DecodeStats, GenerationResult, SpeculativeDecoder, make_drafter  # noqa: F401
from eval.protocol import Committed, DecodeState, Draft, Drafter, Sampling  # noqa: F401
from eval.tree import Tree  # noqa: F401
