"""DFlash's losses (pure functions of the drafter's output, the lm_head, targets and masks).

`dflash_loss` (dflash.loss ce / kl): block position k (1..N-1) counts exp(-(k-1)/gamma), so the first drafted token,
the one every accepted chain needs, weighs most (the DFlash paper; SpecForge's and speculators' trainers).
`dpace_loss` (dflash.loss dpace): D-PACE's weights instead, from the drafter's own confidence in each target: the
derivative of the block's smoothed expected accepted length (Dynamic Position-Aware Cross-Entropy, arXiv
2605.18810; speculators' DFlash default since 0.9).
DSpark (dflash.markov_rank): both take `markov` = (the Markov embeddings (B, A, K, r), markov_w2 (V, r)), whose
product is added to every logit (teacher-forced transition bias); `token_overlap` and `confidence_loss` train the
confidence head."""

from __future__ import annotations

import math
from typing import Callable

import torch

from draftheads.models.linear_loss import default_chunk_rows, linear_loss


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(N-1,) float32: exp(-(k-1)/gamma) for block positions k = 1..N-1."""
    if not gamma > 0 or not math.isfinite(gamma):
        raise ValueError(f"gamma={gamma}: expected a finite number > 0")
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def _markov_at(markov, k: int, rows: int):
    """The k-th position's `extra` for linear_loss: (embeddings (rows, r), markov_w2), or None."""
    if markov is None:
        return None
    embed, w2 = markov
    return embed[:, :, k].reshape(rows, -1), w2


def dflash_loss(hidden: torch.Tensor, lm_weight: torch.Tensor, targets: torch.Tensor, trained: torch.Tensor,
                gamma: float, teacher: Callable[[int], torch.Tensor] | None = None,
                markov: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DFlash loss, sum over trained positions of w_k loss_k / the sum of their w_k, and each block position's
    mean loss (detached, for logging). loss_k: CE(lm_head(h), target), or with `teacher` KL(softmax(teacher(k)) ||
    softmax(lm_head(h))), the verifier's whole distribution as a soft target.

    hidden (B, A, N-1, H) the drafter's output at block positions 1..N-1; lm_weight (V, H) the verifier's lm_head;
    targets / trained (B, A, N-1); teacher(k) -> (B, A, V) the verifier's logits for block position k + 1 (called
    one position at a time); markov (DSpark): (embed (B, A, K, r), w2 (V, r)), logits += embed @ w2^T. The (rows, V)
    logits of one block position exist only inside `linear_loss` (never all of them at once), so a real vocabulary
    with hundreds of anchors per row fits.
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
        extra = _markov_at(markov, k, x.shape[0])
        if teacher is None:
            out = linear_loss(x, lm_weight, targets[:, :, k].reshape(-1), token_weight, argmax=True, extra=extra)
            part = out.ce
        else:
            soft = teacher(k).reshape(x.shape[0], -1)  # (B*A, V)
            out = linear_loss(x, lm_weight, targets[:, :, k].reshape(-1), token_weight, teacher_logits=soft,
                              ce_weight=0.0, kl_weight=1.0, argmax=True, extra=extra)
            part = out.kl
        losses.append(out.loss)
        argmax.append(out.argmax.view(hidden.shape[:2]))
        count = trained[:, :, k].sum().clamp(min=1)
        step_losses.append(part.detach() * total / (w[k] * count))
    return torch.stack(losses).sum(), torch.stack(step_losses), torch.stack(argmax, -1)


def dpace_weights(confidence: torch.Tensor, trained: torch.Tensor, alpha: float,
                  chained: torch.Tensor | None = None) -> torch.Tensor:
    """D-PACE's weight of each block position (pure, no gradient), over the last dimension K (block positions
    1..K of one block; any leading dimensions).

    confidence (..., K): q_k, the drafter's probability of position k's target (exp(-CE)); trained (..., K) bool:
    the positions with a loss term; chained (..., K) bool, default trained: the positions on the block's acceptance
    chain (a superset of trained: a target the drafter cannot produce, outside its own draft vocabulary, is on the
    chain with q = 0 but has no loss term). Off the chain (a loss-masked or missing position) a position passes the
    chain through.

    With q~_k = (1 - alpha) q_k + alpha on the chain (1 off it) and P_m = prod_{j<=m} q~_j, the smoothed
    probability that a draft is accepted up to position m: w_k = trained_k * sum_{m>=k, trained_m} P_m, the
    derivative of the block's expected accepted length sum_m P_m with respect to log q~_k. Returns (..., K) float32."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha={alpha}: expected a number in (0, 1]")
    chained = trained if chained is None else chained
    with torch.no_grad():
        q = confidence.detach().float()
        smooth = torch.where(chained.bool(), (1 - alpha) * q + alpha, torch.ones_like(q))  # (..., K)
        reach = torch.cumprod(smooth, dim=-1) * trained.float()  # (..., K): P_m where trained
        tail = reach.flip(-1).cumsum(-1).flip(-1)  # (..., K): sum over m >= k
        return tail * trained.float()


def _chunk_logits(x: torch.Tensor, lm_weight: torch.Tensor, extra, start: int, stop: int) -> torch.Tensor:
    """(C, V) float32 logits of rows start:stop, with the `extra` term (x2, w2) when given."""
    logits = (x[start:stop] @ lm_weight.T).float()
    if extra is not None:
        logits += (extra[0][start:stop].to(extra[1].dtype) @ extra[1].T).float()
    return logits


@torch.no_grad()
def _target_nll(x: torch.Tensor, lm_weight: torch.Tensor, targets: torch.Tensor, extra=None) -> torch.Tensor:
    """(M,) float32: -log softmax(x @ lm_weight^T (+ extra))[target] for x (M, H), targets (M,), a chunk of rows at a
    time (as `linear_loss` holds its logits)."""
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    step = default_chunk_rows(lm_weight.shape[0])
    for start in range(0, x.shape[0], step):
        logits = _chunk_logits(x, lm_weight, extra, start, start + step)  # (C, V)
        picked = logits.gather(-1, targets[start:start + step, None]).squeeze(-1)
        out[start:start + step] = torch.logsumexp(logits, -1) - picked
    return out


def dpace_loss(hidden: torch.Tensor, lm_weight: torch.Tensor, targets: torch.Tensor, trained: torch.Tensor,
               alpha: float, chained: torch.Tensor | None = None,
               markov: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The D-PACE loss (Dynamic Position-Aware Cross-Entropy): sum over blocks and trained positions of
    w_k * CE_k, divided by the number of blocks with a trained position; w_k = `dpace_weights` of the drafter's
    own confidence exp(-CE_k) in each target, held constant in the backward. Early positions weigh most while the
    drafter is unsure of them; as they become sure, the later positions' weights grow.

    hidden (B, A, K, H) the drafter's output at block positions 1..K; lm_weight (V, H); targets / trained (B, A, K)
    (targets: token ids, rows of lm_weight); chained (B, A, K), default trained: positions on the acceptance chain,
    where a chained position that is not trained counts confidence 0 (`dpace_weights`); markov as `dflash_loss`'s.
    Two passes over the
    lm_head: one without gradients for the confidences (all K positions are needed before any weight is known),
    then `linear_loss` with those weights. Returns (loss (), step_losses (K,): each position's mean CE, detached,
    argmax (B, A, K))."""
    B, A, K, H = hidden.shape
    chained = trained if chained is None else chained
    x = [hidden[:, :, k].reshape(-1, H).to(lm_weight.dtype) for k in range(K)]  # K x (B*A, H)
    flat_targets = [targets[:, :, k].reshape(-1) for k in range(K)]
    extras = [_markov_at(markov, k, B * A) for k in range(K)]
    nll = torch.stack([_target_nll(x[k].detach(), lm_weight.detach(), flat_targets[k],
                                   None if extras[k] is None else (extras[k][0].detach(), extras[k][1].detach()))
                       for k in range(K)], -1)
    nll = nll.view(B, A, K)
    confidence = torch.where(trained.bool(), torch.exp(-nll), torch.zeros_like(nll))
    weights = dpace_weights(confidence, trained, alpha, chained)  # (B, A, K)
    blocks = trained.bool().any(-1).sum().clamp(min=1)
    losses, argmax = [], []
    for k in range(K):
        out = linear_loss(x[k], lm_weight, flat_targets[k], (weights[:, :, k] / blocks).reshape(-1), argmax=True,
                          extra=extras[k])
        losses.append(out.loss)
        argmax.append(out.argmax.view(B, A))
    mask = trained.float()
    step_losses = (nll * mask).sum((0, 1)) / mask.sum((0, 1)).clamp(min=1)
    return torch.stack(losses).sum(), step_losses, torch.stack(argmax, -1)


@torch.no_grad()
def token_overlap(x: torch.Tensor, lm_weight: torch.Tensor, teacher_logits: torch.Tensor,
                  extra: tuple[torch.Tensor, torch.Tensor] | None = None,
                  columns: torch.Tensor | None = None) -> torch.Tensor:
    """(M,) float32: sum_v min(q_v, p_v), the probability that a token drawn from the drafter's q is accepted by
    speculative sampling against the verifier's p (1 - total variation; the confidence head's target, as in
    speculators' and SpecForge's DSpark trainers). q = softmax(x @ lm_weight^T (+ extra)) (M, Vd); p =
    softmax(teacher_logits) (M, V) over the verifier's whole vocabulary, read at `columns` (Vd,) when the drafter
    has its own vocabulary (q is 0 elsewhere). A chunk of rows at a time."""
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    step = default_chunk_rows(lm_weight.shape[0])
    for start in range(0, x.shape[0], step):
        q = torch.softmax(_chunk_logits(x, lm_weight, extra, start, start + step), -1)  # (C, Vd)
        p = torch.softmax(teacher_logits[start:start + step].float(), -1)  # (C, V)
        if columns is not None:
            p = p[:, columns]
        out[start:start + step] = torch.minimum(q, p).sum(-1)
    return out


def confidence_loss(logits: torch.Tensor, target: torch.Tensor, trained: torch.Tensor, gamma: float) -> torch.Tensor:
    """The confidence head's loss: binary cross-entropy of logits (B, A, K) against target (B, A, K) in [0, 1] (the
    overlap, no gradient), block position k weighted exp(-(k-1)/gamma) where trained, a weighted mean."""
    w = position_weights(logits.shape[-1] + 1, gamma).to(logits.device) * trained.float()  # (B, A, K)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), target.detach().float(),
                                                               reduction="none")
    return (bce * w).sum() / w.sum().clamp(min=1e-6)
