"""EAGLE's training losses (pure): EAGLE-1's feature + token loss, EAGLE-3's draft-vocabulary targets and its
per-step token loss, chunked over positions (`step_token_loss`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftheads.models.draft_losses import masked_mean, soft_cross_entropy, token_loss


# ---- losses and metrics (pure) -----------------------------------------------------------------------------------
def add_uniform_noise(x: torch.Tensor, width: float) -> torch.Tensor:
    """x + U(-width/2, width/2), elementwise."""
    return x + (torch.rand_like(x) - 0.5) * width


def eagle1_loss(pred: torch.Tensor, target: torch.Tensor, pred_logits: torch.Tensor, target_logits: torch.Tensor,
                mask: torch.Tensor, feature_weight: float = 1.0, token_weight: float = 0.1,
                token_kind: str = "forward_kl", lk_eta: float = 3.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1 loss: (total, feature SmoothL1, token loss), each a mean over masked positions; the token loss is
    `token_kind` (models/draft_losses.py; forward_kl: the soft cross-entropy of the EAGLE repo).

    pred, target (B, T, H); pred_logits, target_logits (B, T, V); mask (B, T).
    """
    feature = masked_mean(F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1), mask)
    per_position, _ = token_loss(token_kind, pred_logits, torch.log_softmax(target_logits.float(), dim=-1),
                                 lk_eta)
    token = masked_mean(per_position, mask)
    return feature_weight * feature + token_weight * token, feature, token


def draft_targets(target_logits: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's distribution renormalised over the draft vocabulary, its argmax and whether that is drafted.

    target_logits (B, T, V) -> log-probs (B, T, Vd) (log-softmax over the draft columns), target_ids (B, T) (argmax
    over the whole vocabulary), in_draft (B, T) bool.
    """
    target_ids = target_logits.max(-1).indices  # argmax (the first maximum), about 2x faster on a CPU
    columns = torch.arange(d2t.numel(), device=d2t.device) + d2t  # (Vd,) target id of each draft id
    # gather, not index_select: on a CPU index_select along the last dim is ~8x slower (a strided copy per column)
    drafted = torch.gather(target_logits, -1, columns.expand(*target_logits.shape[:-1], -1))  # (B, T, Vd)
    logp = torch.log_softmax(drafted.float(), dim=-1)
    return logp, target_ids, t2d[target_ids]


#: Bytes of one (B, C, Vd) fp32 buffer of `step_token_loss`: a chunk of C positions at a time (a few such buffers
#: are alive while a chunk runs). 128 MiB: 1,024 positions of a 32k draft vocabulary, 261 of a 128k one; small
#: vocabularies take every position in one chunk.
CHUNK_BYTES = 1 << 27


@dataclass
class StepLoss:
    """What `step_token_loss` returns for one TTT step, each over the step's n stream positions."""

    per_position: torch.Tensor
    """(B, n) the token loss at each position (differentiable)."""
    alpha: torch.Tensor | None
    """(B, n) acceptance alpha, detached; None on the fused forward_kl path, which does not compute it."""
    argmax: torch.Tensor
    """(B, n) the drafter's top draft id."""
    top: torch.Tensor | None
    """(B, n, topk) its top `topk` draft ids (topk > 1), else None."""


def step_token_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, target: torch.Tensor,
                    kind: str = "forward_kl", lk_eta: float = 3.0, target_mass: torch.Tensor | None = None,
                    topk: int = 1, chunk_rows: int | None = None) -> StepLoss:
    """One TTT step's token loss from the drafter's hidden states, `chunk_rows` positions at a time, so that no
    (B, n, Vd) tensor of the step is kept for backward: each chunk's logits (`logits_of(hidden chunk)`, the final
    norm and lm_head) and its softmaxes exist only while the chunk runs, and are recomputed from the chunk's hidden
    states in backward (activation checkpointing of the head and the loss, one matmul more). Over a 32k draft
    vocabulary at 2,048 positions that is 262 MB of fp32 softmax per step not kept (1.8 GB for 7 steps).

    hidden (B, n, H); target (B, n, Vd): the verifier's probabilities p when `target_mass` ((B, n), sum of p) is given
    (forward_kl's fused soft cross-entropy), else its log-probabilities (`token_loss(kind, ...)`). Results equal the
    unchunked computation's (one chunk is the same arithmetic)."""
    B, n = hidden.shape[:2]
    chunk_rows = chunk_rows or max(1, CHUNK_BYTES // (4 * target.shape[-1] * max(B, 1)))
    fused = target_mass is not None

    def piece(h, tgt, mass):
        logits = logits_of(h)  # (B, C, Vd)
        if fused:
            loss, alpha = soft_cross_entropy(logits, tgt, mass), None
        else:
            loss, alpha = token_loss(kind, logits, tgt, lk_eta)
        with torch.no_grad():
            argmax = logits.max(-1).indices  # the first maximum, about 2x faster than argmax on a CPU
            top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices if topk > 1 else None
        return loss, alpha, argmax, top

    keep = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, n, chunk_rows):
        args = (hidden[:, start:start + chunk_rows], target[:, start:start + chunk_rows],
                target_mass[:, start:start + chunk_rows] if fused else None)
        parts.append(checkpoint(piece, *args, use_reentrant=False) if keep else piece(*args))
    if len(parts) == 1:
        loss, alpha, argmax, top = parts[0]
        return StepLoss(loss, alpha, argmax, top)
    loss, alpha, argmax, top = zip(*parts)
    return StepLoss(torch.cat(loss, 1), None if fused else torch.cat(alpha, 1), torch.cat(argmax, 1),
                    torch.cat(top, 1) if topk > 1 else None)
