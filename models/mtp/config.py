"""The `mtp` section of a run config (train/mtp.py) and `MtpError`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal


class MtpError(ValueError):
    """An MTP drafter that cannot be built, trained or loaded as asked; the message says what to fix."""


@dataclass
class MtpConfig:
    """Fine-tuning the verifier's own MTP layer as its drafter."""

    steps: int = 3
    """Drafts unrolled per training position: the one layer reused, each step reading the previous step's output,
    as vLLM drafts with it (1 trains the first draft only)."""
    step_decay: float = 0.6
    """Step k's loss is weighted step_decay^(k-1), the weights normalised to sum 1 (FastMTP's 0.6)."""
    targets: Literal["verifier", "data"] = "verifier"
    """What each draft learns: the verifier's greedy token after the true prefix (what greedy verification
    accepts), or the data's next token (as the layer was pretrained)."""
    init: Literal["shipped", "random"] = "shipped"
    """Start from the checkpoint's MTP weights, or from a fresh initialisation of the layer (a baseline)."""
    num_draft_tokens: int = 3
    """Drafts per step in the end-of-run check (vLLM's num_speculative_tokens)."""

    def __post_init__(self):
        for key in ("steps", "num_draft_tokens"):
            if getattr(self, key) < 1:
                raise MtpError(f"mtp.{key}={getattr(self, key)}: expected a positive integer")
        if not (math.isfinite(self.step_decay) and 0 < self.step_decay <= 1):
            raise MtpError(f"mtp.step_decay={self.step_decay}: expected a value in (0, 1]")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
