"""What a training step reports: per-step accuracy counts and the drafter's output record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class StepCounts:
    """Per-step counts, (K,) float tensors on device; add them over batches, `summary()` at log time."""

    correct: torch.Tensor
    """Positions where step k's greedy draft equals the verifier's argmax (and the position is scored)."""
    valid: torch.Tensor
    """Positions scored at step k (loss_mask of the predicted token)."""
    chain_correct: torch.Tensor
    """Positions where steps 0..k are all right."""
    chain_valid: torch.Tensor
    """Positions where steps 0..k-1 are all right and step k is scored (the denominator of conditional acc)."""

    def __add__(self, other: "StepCounts") -> "StepCounts":
        return StepCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def summary(self) -> dict[str, torch.Tensor]:
        """acc (K,), cond_acc (K,), cum_acc (K,), accept_length (scalar): device tensors, no host sync."""
        acc = self.correct / self.valid.clamp(min=1)
        cond = self.chain_correct / self.chain_valid.clamp(min=1)
        cum = torch.cumprod(cond, 0)
        return {"acc": acc, "cond_acc": cond, "cum_acc": cum, "accept_length": 1 + cum.sum()}


def step_counts(correct: torch.Tensor, valid: torch.Tensor) -> StepCounts:
    """Counts from per-step booleans aligned on the chain's start position: correct, valid (K, B, T)."""
    correct = correct & valid
    chain = torch.cumprod(correct.long(), 0).bool()  # steps 0..k all right
    before = torch.cat([torch.ones_like(chain[:1]), chain[:-1]], 0)  # steps 0..k-1 all right
    dims = tuple(range(1, correct.dim()))
    return StepCounts(correct=correct.sum(dims).float(), valid=valid.sum(dims).float(),
                      chain_correct=chain.sum(dims).float(), chain_valid=(before & valid).sum(dims).float())


@dataclass
class EagleOutput:
    """One training forward: the loss to backpropagate and what to log."""

    loss: torch.Tensor
    """Scalar, differentiable."""
    step_losses: torch.Tensor
    """(K,) detached per-step losses (EAGLE-1: K = 1, the total)."""
    counts: StepCounts
    """Per-step accuracy counts (EAGLE-1: one step)."""
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached loss components (EAGLE-1: feature_loss, token_loss)."""
