"""The EAGLE-3 draft vocabulary (pure): token counts, the most frequent ids, and the d2t / t2d maps."""

from __future__ import annotations

import torch

from draftheads.models.eagle.config import EagleError


# ---- draft vocabulary (pure) -------------------------------------------------------------------------------------
def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) int64 count of each token at loss-masked positions; sum these over the training data."""
    ids = input_ids[loss_mask.bool()]
    return torch.bincount(ids.flatten().long(), minlength=vocab_size)[:vocab_size]


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent tokens (ties: lower id first), in ascending target-id order.

    Returns d2t (int64 [Vd], target_id - draft_id, so `target = draft + d2t[draft]`) and t2d (bool [V]).
    """
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise EagleError(f"draft_vocab_size={draft_vocab_size}: expected 1..{vocab_size} (the verifier's vocab)")
    order = torch.sort(counts.cpu(), descending=True, stable=True).indices  # stable: ties keep id order
    target_ids = order[:draft_vocab_size].sort().values
    d2t = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t.long(), t2d


def maps_problem(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> str | None:
    """Why (d2t, t2d) are not the maps of a draft vocabulary over `vocab_size` tokens (one line), or None: d2t int64
    [Vd], t2d bool [V] with Vd tokens set, and draft id -> target id -> draft id the identity."""
    if t2d is None or d2t.dim() != 1 or t2d.shape != (vocab_size,) or d2t.dtype != torch.long \
            or t2d.dtype != torch.bool:
        return f"draft vocab maps must be d2t int64 [Vd] and t2d bool [{vocab_size}]"
    ids = torch.arange(d2t.numel(), device=d2t.device)
    targets = draft_to_target(ids, d2t)
    if int(t2d.sum()) != d2t.numel() or bool(((targets < 0) | (targets >= vocab_size)).any()) \
            or not torch.equal(target_to_draft(targets, t2d.to(d2t.device)), ids):
        return "d2t and t2d disagree: draft id -> target id -> draft id does not round-trip"
    return None


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Verifier token ids of draft ids (the vLLM/SGLang offset convention)."""
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of verifier token ids, -1 where the token is outside the draft vocabulary."""
    rank = torch.cumsum(t2d.long(), 0) - 1  # (V,) draft id of each kept target id
    return torch.where(t2d[target_ids], rank[target_ids], torch.full_like(target_ids, -1))
