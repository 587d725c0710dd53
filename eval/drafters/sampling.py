"""How a drafter picks a node's children in a draft tree: draws without replacement (lossless at T > 0) or top-k."""

from __future__ import annotations

import torch

from draftheads.eval.engine.acceptance import exponential_noise, probs_from_logits
from draftheads.eval.engine.protocol import Sampling

TREE_SAMPLING = ("sample", "topk")


def pick_children(logits: torch.Tensor, k: int, sampling: Sampling, mode: str = "sample"
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose k children per parent from draft logits (B, n, V) -> tokens (B, n, k), probs (B, n, k, V) or None.

    greedy, or mode "topk": the k most likely tokens, a deterministic pick (probs None: one-hot).
    mode "sample": k draws without replacement from the draft distribution (the exponential race: the top-k of
    p / Exp(1) is such a sample, in draw order); child r's distribution is p with the r earlier picks removed and
    renormalised, or one-hot on the pick when nothing is left (fewer than k tokens with mass under top-p).
    """
    if sampling.greedy or mode == "topk":
        scores = logits if sampling.greedy else probs_from_logits(logits, sampling.temperature, sampling.top_p)
        return scores.topk(k, dim=-1).indices, None
    p = probs_from_logits(logits, sampling.temperature, sampling.top_p)  # (B, n, V)
    noise = exponential_noise(p.shape, sampling.generator, p.device)
    picks = (p / noise).topk(k, dim=-1).indices  # (B, n, k) in draw order
    onehot = torch.zeros(*p.shape[:-1], k, p.shape[-1], device=p.device).scatter_(-1, picks[..., None], 1.0)
    removed = onehot.cumsum(-2) - onehot  # (B, n, k, V): tokens drawn before child r
    rest = p[..., None, :] * (1 - removed)
    mass = rest.sum(-1, keepdim=True)
    probs = torch.where(mass > 0, rest / mass.clamp_min(1e-30), onehot)
    return picks, probs
