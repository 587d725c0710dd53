"""Slow, readable references of the Medusa losses and held-out metrics, on materialised (K, B, T, V) logits.

The product code (models/medusa/) computes the same values through models/linear_loss.py without ever building
these logits; the tests compare the two (values and gradients). Definitions: models/medusa/'s docstring.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn.functional as F


def _shifted_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, shift: int,
                     segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and validity for predicting token t+shift from position t, for t in [0, T-shift).

    The mask is read at the *target* token, so a prompt token (loss_mask 0) is never a target, whatever position
    predicts it. With `segment_ids` (packed documents), a target in another document than its source is excluded.
    """
    T = input_ids.shape[1]
    n = max(T - shift, 0)
    target = input_ids[:, T - n:]  # (B, n)
    valid = loss_mask[:, T - n:].bool()  # (B, n)
    if segment_ids is not None:
        valid = valid & (segment_ids[:, T - n:] == segment_ids[:, :n])
    return target, valid


def medusa_loss(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                mode: Literal["labels", "distill"] = "labels", verifier_logits: torch.Tensor | None = None,
                decay: float = 0.8, segment_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k decay^k · L_k, and the per-head losses L_k (K,) (detached, for logging).

    head_logits (K, B, T, V); input_ids, loss_mask (B, T); verifier_logits (B, T, V), needed for `distill`.
    Head k at position t is scored against token t+k+2:
      labels:  L_k = mean over valid t of CE(head_logits[k, :, t], input_ids[:, t+k+2])
      distill: L_k = mean over valid t of KL(softmax(verifier_logits[:, t+k+1]) || softmax(head_logits[k, :, t])),
               the verifier's own distribution of that same token t+k+2.
    Valid: t+k+2 < T and loss_mask[:, t+k+2] (the mask is read at the target token), and same segment if given.
    A head with no valid position contributes 0. The total is not normalised by Σ decay^k (head 0 has weight 1).
    """
    if mode not in ("labels", "distill"):
        raise ValueError(f"medusa loss mode {mode!r}: expected 'labels' or 'distill'")
    if mode == "distill" and verifier_logits is None:
        raise ValueError("medusa loss mode 'distill' needs verifier_logits (B, T, V)")
    K, T = head_logits.shape[0], head_logits.shape[2]
    per_head = []
    for k in range(K):
        target, valid = _shifted_targets(input_ids, loss_mask, k + 2, segment_ids)  # (B, n)
        n = target.shape[1]
        logits = head_logits[k, :, :n].float()  # (B, n, V)
        if mode == "labels":
            token_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        else:
            log_p = F.log_softmax(verifier_logits[:, k + 1:k + 1 + n].float(), dim=-1)  # (B, n, V)
            log_q = F.log_softmax(logits, dim=-1)
            token_loss = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).flatten()
        valid = valid.flatten()
        per_head.append((token_loss * valid).sum() / valid.sum().clamp(min=1))
    per_head = torch.stack(per_head)  # (K,)
    weights = decay ** torch.arange(K, device=per_head.device, dtype=per_head.dtype)
    return (weights * per_head).sum(), per_head.detach()


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                    segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The verifier's own CE: logits (B, T, V) at t against input_ids[:, t+1], masked at the target token."""
    target, valid = _shifted_targets(input_ids, loss_mask, 1, segment_ids)  # (B, T-1)
    token_loss = F.cross_entropy(logits[:, :target.shape[1]].float().flatten(0, 1), target.flatten(),
                                 reduction="none")
    valid = valid.flatten()
    return (token_loss * valid).sum() / valid.sum().clamp(min=1)


def faithfulness_kl(logits: torch.Tensor, reference_logits: torch.Tensor, input_ids: torch.Tensor,
                    loss_mask: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) per position (B, T, V each), averaged where token t+1 is trained."""
    _, valid = _shifted_targets(input_ids, loss_mask, 1, segment_ids)  # (B, T-1)
    n = valid.shape[1]
    log_p = F.log_softmax(reference_logits[:, :n].float(), dim=-1)
    log_q = F.log_softmax(logits[:, :n].float(), dim=-1)
    token_kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).flatten()
    valid = valid.flatten()
    return (token_kl * valid).sum() / valid.sum().clamp(min=1)


def medusa2_loss(logits: torch.Tensor, reference_logits: torch.Tensor, head_logits: torch.Tensor,
                 input_ids: torch.Tensor, loss_mask: torch.Tensor, mode: Literal["labels", "distill"] = "labels",
                 decay: float = 0.8, lm_weight: float = 1.0, kl_weight: float = 1.0, heads_weight: float = 0.2,
                 segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Medusa-2: lm_weight·CE(verifier) + kl_weight·KL(original || adapted) + heads_weight·Σ_k decay^k L_k.

    logits (B, T, V) from the adapted verifier (with grad); reference_logits (B, T, V) from the same verifier with
    adapters disabled (no grad); head_logits (K, B, T, V). In `distill` mode the heads learn the *adapted*
    verifier's distribution (detached: the head loss must not pull the verifier towards the heads), since that is
    the model that verifies their drafts at inference. Returns (loss, parts) with detached parts for logging:
    `lm`, `kl`, `heads` (the weighted head sum) and `per_head` (K,).
    """
    lm = next_token_loss(logits, input_ids, loss_mask, segment_ids)
    kl = faithfulness_kl(logits, reference_logits, input_ids, loss_mask, segment_ids)
    heads, per_head = medusa_loss(head_logits, input_ids, loss_mask, mode,
                                  logits.detach() if mode == "distill" else None, decay, segment_ids)
    loss = lm_weight * lm + kl_weight * kl + heads_weight * heads
    return loss, {"lm": lm.detach(), "kl": kl.detach(), "heads": heads.detach(), "per_head": per_head}




@torch.no_grad()
def head_rank_hits(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   max_rank: int = 10, segment_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits (K, R), counts (K,)): hits[k, r] = valid positions where token t+k+2 is head k's rank-r prediction.

    Sums, not means, so they add up across batches and processes; hits / counts[:, None] is the per-rank accuracy
    the tree is built from, and hits[:, :k].sum(-1) / counts is top-k accuracy. Validity as in `medusa_loss`.
    """
    K, V = head_logits.shape[0], head_logits.shape[-1]
    R = min(max_rank, V)
    hits, counts = [], []
    for k in range(K):
        target, valid = _shifted_targets(input_ids, loss_mask, k + 2, segment_ids)  # (B, n)
        top = head_logits[k, :, :target.shape[1]].topk(R, dim=-1).indices  # (B, n, R), best first
        match = (top == target[..., None]) & valid[..., None]  # (B, n, R)
        hits.append(match.sum((0, 1)))
        counts.append(valid.sum())
    return torch.stack(hits).float(), torch.stack(counts).float()


@torch.no_grad()
def head_accuracy(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  ks: Sequence[int] = (1, 5), segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(K, len(ks)) top-k accuracy of each head against token t+k+2 (0 where a head has no valid position)."""
    hits, counts = head_rank_hits(head_logits, input_ids, loss_mask, max(ks), segment_ids)
    return topk_from_hits(hits, counts, ks)


def topk_from_hits(hits: torch.Tensor, counts: torch.Tensor, ks: Sequence[int] = (1, 5)) -> torch.Tensor:
    """Top-k accuracies (K, len(ks)) from accumulated `head_rank_hits` sums."""
    cumulative = hits.cumsum(-1)  # (K, R): hits within the top r+1
    columns = [cumulative[:, min(k, hits.shape[1]) - 1] for k in ks]
    return torch.stack(columns, dim=-1) / counts.clamp(min=1)[:, None]
