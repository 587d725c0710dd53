"""DFlash's loss weights (pure): block position k (1..N-1) counts exp(-(k-1)/gamma), so the first drafted token,
the one every accepted chain needs, weighs most (the DFlash paper; SpecForge's and speculators' trainers)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from draftheads.models.linear_loss import linear_loss


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(N-1,) float32: exp(-(k-1)/gamma) for block positions k = 1..N-1."""
    if not gamma > 0 or not math.isfinite(gamma):
        raise ValueError(f"gamma={gamma}: expected a finite number > 0")
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dflash_loss(hidden: torch.Tensor, lm_weight: torch.Tensor, targets: torch.Tensor, trained: torch.Tensor,
                gamma: float, teacher: Callable[[int], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DFlash loss, sum over trained positions of w_k loss_k / the sum of their w_k, and each block position's
    mean loss (detached, for logging). loss_k: CE(lm_head(h), target), or with `teacher` KL(softmax(teacher(k)) ||
    softmax(lm_head(h))), the verifier's whole distribution as a soft target.

    hidden (B, A, N-1, H) the drafter's output at block positions 1..N-1; lm_weight (V, H) the verifier's lm_head;
    targets / trained (B, A, N-1); teacher(k) -> (B, A, V) the verifier's logits for block position k + 1 (called
    one position at a time). The (rows, V) logits of one block position exist only inside `linear_loss` (never all
    of them at once), so a real vocabulary with hundreds of anchors per row fits.
    Returns (loss (), step_losses (N-1,), argmax (B, A, N-1): each position's top prediction, an index into
    lm_weight's rows, from the same logits)."""
    K = hidden.shape[2]
    w = position_weights(K + 1, gamma).to(hidden.device)
    weights = trained.float() * w  # (B, A, K)
    total = weights.sum().clamp(min=1e-6)
    losses, step_losses, argmax = [], [], []
    for k in range(K):
        x = hidden[:, :, k].reshape(-1, hidden.shape[-1]).to(lm_weight.dtype)  # (B*A, H)
        token_weight = (weights[:, :, k] / total).reshape(-1)
        if teacher is None:
            out = linear_loss(x, lm_weight, targets[:, :, k].reshape(-1), token_weight, argmax=True)
            part = out.ce
        else:
            soft = teacher(k).reshape(x.shape[0], -1)  # (B*A, V)
            out = linear_loss(x, lm_weight, targets[:, :, k].reshape(-1), token_weight, teacher_logits=soft,
                              ce_weight=0.0, kl_weight=1.0, argmax=True)
            part = out.kl
        losses.append(out.loss)
        argmax.append(out.argmax.view(hidden.shape[:2]))
        count = trained[:, :, k].sum().clamp(min=1)
        step_losses.append(part.detach() * total / (w[k] * count))
    return torch.stack(losses).sum(), torch.stack(step_losses), torch.stack(argmax, -1)
