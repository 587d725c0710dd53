"""Training-time test attention (pure): each unroll step sees the step-0 prefix causally plus its own chain."""

from __future__ import annotations

import torch


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str | None = None,
                       prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(T, (step+1)T) bool, True = attend: step `step`'s queries over keys [step 0 | step 1 | ... | step `step`].

    Query t sees step-0 keys s <= t (causal; `prefix_mask` (..., T, T) instead, e.g. causal inside each packed
    document) and, for each later step j <= step, only key t (its own chain).
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if prefix_mask is not None:
        causal = prefix_mask
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device).expand(*causal.shape[:-2], -1, -1)
    return torch.cat([causal] + [diagonal] * step, dim=-1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Step k >= 1 of the TTT attention, (B, nh, T, d): what SDPA over [K_0 | ... | K_k] with `ttt_attention_mask`
    gives, without the (k+1)T-wide score matrix.

    q (B, nh, T, d) (RoPE applied); keys, values: k+1 tensors (B, nkv, T, d), step 0 first (nh a multiple of nkv).
    prefix_mask (B, 1, T, T) bool replaces the causal mask over the step-0 keys: packed rows pass the causal mask
    inside each document (`data.documents.causal_document_mask`); a position's own chain is in its document.
    """
    B, nh, T, d = q.shape
    groups = nh // keys[0].shape[1]

    def per_head(x):  # GQA: each kv head serves `groups` query heads
        return x.repeat_interleave(groups, dim=1) if groups > 1 else x

    scale = d ** -0.5
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if prefix_mask is None else prefix_mask
    prefix = (q @ per_head(keys[0]).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))  # (B, nh, T, T)
    chain_k = torch.stack([per_head(k) for k in keys[1:]], dim=3)  # (B, nh, T, k, d)
    chain_v = torch.stack([per_head(v) for v in values[1:]], dim=3)
    own = torch.einsum("bhtd,bhtkd->bhtk", q, chain_k) * scale  # (B, nh, T, k): q_t . k_{j,t}
    p = torch.softmax(torch.cat([prefix, own], dim=-1).float(), dim=-1).to(q.dtype)  # (B, nh, T, T + k)
    return p[..., :T] @ per_head(values[0]) + torch.einsum("bhtk,bhtkd->bhtd", p[..., T:], chain_v)
