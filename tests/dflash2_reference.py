"""Slow references for DFlash2 (models/dflash2/): the grouped dynamic convolution, the selector's edge scores and
walk, and its teacher-forced loss, each written as loops straight from its definition."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def slow_grouped_conv(x, delta, base, block_len: int) -> torch.Tensor:
    """x (T, H), delta (T, taps, G), base (taps, H): out[t, c] = sum over taps <= t's block position of
    (base[tap, c] + delta[t, tap, c // (H / G)]) * x[t - tap, c]."""
    T, H = x.shape
    taps, G = delta.shape[1], delta.shape[2]
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(T):
        for c in range(H):
            for tap in range(taps):
                if t % block_len >= tap:
                    out[t, c] += (float(base[tap, c]) + float(delta[t, tap, c // (H // G)])) * float(x[t - tap, c])
    return out


def slow_edge_score(selector, unary: float, h, previous: int, candidate: int) -> float:
    """One edge: unary + sum_r P[previous, r] * (W h)[r] * S[candidate, r]."""
    projected = selector.hidden_projection.weight.detach().double() @ h.detach().double()
    return unary + float((selector.predecessor_codebook[previous].detach().double() * projected
                          * selector.successor_codebook[candidate].detach().double()).sum())


def slow_walk(selector, logits, hidden, anchor: int, top_k: int) -> list[int]:
    """Greedy drafting of one block: logits (K, V), hidden (K, H); each position's best candidate after the token
    drafted before it (the anchor first)."""
    tokens, previous = [], anchor
    for j in range(logits.shape[0]):
        values, ids = logits[j].double().topk(top_k)
        scores = [slow_edge_score(selector, float(values[i]), hidden[j], previous, int(ids[i])) for i in range(top_k)]
        previous = int(ids[max(range(top_k), key=lambda i: scores[i])])
        tokens.append(previous)
    return tokens


def slow_selector_loss(selector, hidden, lm_weight, targets, predecessors, trained, weights) -> float:
    """The teacher-forced loss position by position: top-k of the full logits, the target put in the last slot if
    missing, CE over the k scores, weighted w_k, divided by the sum of the trained positions' w_k."""
    B, A, K, _ = hidden.shape
    C = selector.top_k
    num = den = 0.0
    for b in range(B):
        for a in range(A):
            for k in range(K):
                if not trained[b, a, k]:
                    continue
                logits = lm_weight.double() @ hidden[b, a, k].double()
                ids = logits.topk(C).indices.tolist()
                target = int(targets[b, a, k])
                if target not in ids:
                    ids[-1] = target
                scores = torch.tensor([slow_edge_score(selector, float(logits[i]), hidden[b, a, k],
                                                       int(predecessors[b, a, k]), i) for i in ids])
                ce = -float(F.log_softmax(scores, -1)[ids.index(target)])
                num += float(weights[k]) * ce
                den += float(weights[k])
    return num / den if den else math.nan
