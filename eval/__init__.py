"""Evaluation: the speculative-decoding engine, the `python -m eval` CLI, metrics and reports.

    from eval import SpeculativeDecoder, FusedDecoder
    dec = SpeculativeDecoder.from_pretrained("tiny-code", draft="runs/eagle3-tiny/drafter", method="eagle")
    out = dec.generate(prompts, max_new_tokens=64)          # or FusedDecoder(dec).generate(...): CUDA graphs + kernels
"""

from eval.cuda_loop import FusedDecoder  # noqa: F401
from eval.decoder import SpeculativeDecoder, make_drafter  # noqa: F401
from eval.generation import DecodeStats, GenerationResult  # noqa: F401
from eval.protocol import Committed, DecodeState, Draft, Drafter, Sampling  # noqa: F401
from eval.tree import Tree  # noqa: F401
