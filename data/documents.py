"""Documents inside a packed row, read from its `position_ids`: the one place that says what a boundary is.

A packed row (`data.batching.pack` with `data.document_mask`, the default) carries per-token `position_ids` that
restart at 0 at the first token of every document; everything about documents is derived from them:

    position_ids  0 1 2 3 | 0 1 2 | 0 1        three documents in one row of 9 tokens
    document_ids  0 0 0 0 | 1 1 1 | 2 2        a new document wherever position_ids[t] != position_ids[t-1] + 1

- Attention: token t attends to token s iff s <= t and both are in one document (`causal_document_mask`); the
  verifier's feature forward, the drafters' training attention and the training-time-test unroll all use it, so a
  packed document's features and drafts equal those of the document computed alone, as a server computes them.
- Targets: a prediction made at position t of token t+s (s >= 1) is trained only when t+s is in t's document,
  `same_document(position_ids, s)[:, t]`, i.e. position_ids[t+s] == position_ids[t] + s (documents are contiguous
  and their positions count up by one, so the difference equals s exactly when no restart lies between them).
  Medusa head k (target t+k+2) and EAGLE TTT step k (target t+k+2, having read tokens t+1 .. t+k+1) use s = k+2;
  the next-token loss of Medusa-2 uses s = 1. A prediction whose target is another document's token is never
  trained nor scored, whatever the loss mask says there.
- Rows without restarts (`data.pack=false`, or `data.document_mask=false`: position_ids = 0..T-1) are one document
  each: the rule and the mask reduce to the plain causal ones.

A document cut by the end of a row continues in the next row as a document of its own (positions from 0); the
padding after the last document of the last row is a document of its own too (it is never a target); batches
join it to the row's last document (`join_padding`), which changes nothing a trainer reads at a real token.
"""

from __future__ import annotations

import numpy as np
import torch


def packed_positions(starts: np.ndarray, total: int, seq_len: int) -> np.ndarray:
    """Per-token position ids of a token stream of `total` tokens (padded to whole rows of seq_len) whose documents
    start at the sorted offsets `starts` (the first is 0): the distance to the latest document start or row start,
    whichever is later. (R * seq_len,) int32; the padding after `total` counts from 0 as one more document."""
    rows = -(-total // seq_len) if total else 0
    index = np.arange(rows * seq_len, dtype=np.int64)
    bounds = np.append(np.asarray(starts, dtype=np.int64), total)  # the padding starts a document of its own
    doc_start = bounds[np.searchsorted(bounds, index, side="right") - 1]
    row_start = index - index % seq_len
    return (index - np.maximum(doc_start, row_start)).astype(np.int32)


def restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: token t begins a document (t = 0, or its position is not the previous one's plus one)."""
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return start


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: the index of each token's document within its row (0, 0, 0, 1, 1, 2, ...)."""
    return restarts(position_ids).long().cumsum(-1) - 1


def join_padding(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position_ids with each row's right padding (the positions after its last real token) counting on from
    that token, so that the padding joins the row's last document instead of being a document of its own.

    Nothing computed for a real token changes: no real token attends to a later position, and padding is never a
    target (its loss_mask is 0). What changes is that a row holding one document reads as unpacked (`is_packed`),
    so attention over it takes the causal fast path (SDPA's is_causal, the flash kernel without a mask) instead of
    a (B, 1, T, T) document mask, in the verifier's feature forward and in the drafter alike. The batch collators
    apply it; the rows on disk keep the padding as a document of its own. A row whose attention_mask is not ones
    then zeros (not right-padded), or that is all padding, is returned as it is."""
    real = attention_mask.bool()
    B, T = real.shape
    index = torch.arange(T, device=position_ids.device)
    n = real.sum(1)  # (B,) real tokens: a prefix of the row when right-padded
    right_padded = ((index[None, :] < n[:, None]) == real).all(1) & (n > 0)
    last = (n - 1).clamp(min=0)[:, None]
    counted_on = position_ids.gather(1, last) + (index[None, :] - last)  # the last token's position, counting on
    tail = (index[None, :] >= n[:, None]) & right_padded[:, None]
    return torch.where(tail, counted_on.to(position_ids.dtype), position_ids)


def is_packed(position_ids: torch.Tensor | None) -> bool:
    """Whether any row holds more than one document (a host sync: one small reduction)."""
    return position_ids is not None and bool(restarts(position_ids)[:, 1:].any())


def same_document(position_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """(B, T) bool: the token `shift` places ahead of t exists and is in t's document (False past the row's end).
    Multiply a target weight `loss_mask[t + shift]` by it: the target rule of the module docstring."""
    B, T = position_ids.shape
    same = torch.zeros(B, T, dtype=torch.bool, device=position_ids.device)
    if shift < T:
        same[:, :T - shift] = position_ids[:, shift:] == position_ids[:, :T - shift] + shift
    return same


def causal_document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True = attend: key s <= query t, both in one document (SDPA's boolean `attn_mask`)."""
    T = position_ids.shape[1]
    docs = document_ids(position_ids)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]  # (B, 1, T, T)
