"""Slow references for DSpark (models/dflash/dspark.py, the DSpark terms of models/dflash/losses.py): the
left-to-right Markov chain through the full V x Vd transition table, and the training loss written as loops over
blocks and positions from its definition (speculators' / SpecForge's DSpark trainers: teacher-forced previous token,
the confidence head's BCE against the drafter/verifier overlap)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def slow_markov_chain(base: torch.Tensor, root: int, w1: torch.Tensor, w2: torch.Tensor) -> list[int]:
    """Greedy drafts of one block: base (K, V) the backbone's logits, w1 (V, r), w2 (V, r). The transition table
    M = w1 @ w2^T (V, V) is formed whole; draft k = argmax(base[k] + M[draft k-1]), draft 0's predecessor the root."""
    table = w1.double() @ w2.double().T  # (V, V): row = previous token
    prev, out = root, []
    for k in range(base.shape[0]):
        prev = int((base[k].double() + table[prev]).argmax())
        out.append(prev)
    return out


def slow_dspark_loss(hidden, lm_weight, w1, w2, proj_w, proj_b, input_ids, loss_mask, anchors, valid, gamma,
                     teacher, with_markov=True, kl=False, confidence_weight=1.0):
    """The DSpark loss by loops (data targets, the verifier's lm_head): hidden (B, A, N-1, H) of block positions
    1..N-1; teacher (B, T, V) the verifier's logits. Block position k of anchor a, trained where a + k < T and
    loss_mask[a + k]: prev = x_{a+k-1}, e = w1[prev], logits = hidden @ lm_weight^T + w2 @ e; token loss CE(logits,
    x_{a+k}) (kl: KL(softmax(teacher[a+k-1]) || softmax(logits))) weighted exp(-(k-1)/gamma), a weighted mean; the
    confidence term BCE(proj([h; e]), sum_v min(softmax(logits), softmax(teacher[a+k-1]))) with the same weights,
    the overlap held constant. Returns token mean + confidence_weight * confidence mean (differentiable)."""
    B, A, K, _ = hidden.shape
    T = input_ids.shape[1]
    token, conf, den = 0.0, 0.0, 0.0
    for b in range(B):
        for j in range(A):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            for k in range(1, K + 1):
                if a + k >= T or not loss_mask[b, a + k]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                h = hidden[b, j, k - 1]
                e = w1[input_ids[b, a + k - 1]]
                logits = h @ lm_weight.T + w2 @ e
                log_q = F.log_softmax(logits.double(), -1)
                log_p = F.log_softmax(teacher[b, a + k - 1].double(), -1)
                if kl:
                    term = (log_p.exp() * (log_p - log_q)).sum()
                else:
                    term = -log_q[input_ids[b, a + k]]
                overlap = torch.minimum(log_q.exp(), log_p.exp()).sum().detach()
                x = torch.cat([h, e]) if with_markov else h
                c = x.double() @ proj_w[0].double() + proj_b[0].double()
                bce = F.binary_cross_entropy_with_logits(c, overlap)
                token = token + w * term
                conf = conf + w * bce
                den += w
    return (token + confidence_weight * conf) / den
