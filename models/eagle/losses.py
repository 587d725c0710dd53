"""EAGLE's training losses (pure): EAGLE-1's feature + token loss, EAGLE-3's draft-vocabulary targets."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftheads.models.draft_losses import masked_mean, token_loss


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
