"""Evaluation in four rooms: the engine (eval/engine/), the drafters and their registry (eval/drafters/),
measurement (eval/measure/) and the engines themselves (eval/interop/). `draftheads eval` is eval/__main__.py.

    from draftheads.eval import build_decoder, FusedDecoder
    dec = build_decoder("tiny-code", method="eagle", draft="runs/eagle3-tiny/drafter")
    out = dec.generate(prompts, max_new_tokens=64)          # or FusedDecoder(dec).generate(...): CUDA graphs + kernels
"""

from draftheads.eval.drafters import METHODS, build_decoder, make_drafter  # noqa: F401
from draftheads.eval.engine.cuda_loop import FusedDecoder  # noqa: F401
from draftheads.eval.engine.decoder import SpeculativeDecoder  # noqa: F401
from draftheads.eval.engine.loop import DecodeStats, GenerationResult  # noqa: F401
from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, NoDrafter, Sampling  # noqa: F401
from draftheads.eval.engine.tree import Tree  # noqa: F401
