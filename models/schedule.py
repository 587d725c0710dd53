"""The one learning-rate schedule: linear warm-up, then cosine decay to a floor.

Used by the trainers (through train/optim.py), the embedded verifier's build (models/tiny/) and the draft-model
script. The formula (the trainers' since their first version, kept so that runs reproduce): step s (0-based, one
per optimizer step) of `warmup` warm-up steps runs at (s + 1) / (warmup + 1) of the peak, so the first step already
learns and the ramp ends one below the peak; from step `warmup` the cosine runs from the peak down to `floor` x
peak at step `total`, the step after the last one (the last of `total` steps runs just above the floor).
"""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """The factor of the peak learning rate at 0-based `step` of `total` steps (see the module docstring)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, warmup: int, total: int, floor: float = 0.1
                           ) -> torch.optim.lr_scheduler.LambdaLR:
    """`warmup_cosine` as a scheduler over every param group of `optimizer` (each scaled from its own lr);
    step it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup, total, floor))
