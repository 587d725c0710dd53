"""Anchored blocks (pure functions): where a training row's blocks start, what they read, what they predict, and
who sees whom.

A row x_0 .. x_{T-1} with its verifier context (the target layers' outputs at every position) trains A blocks at
once. Block j starts at anchor a = anchors[b, j]: it reads [x_a, MASK x (N-1)] at positions a .. a+N-1, and its
position k (1 <= k < N) predicts x_{a+k}, exactly what an inference step does with the last committed token as the
anchor. Attention (queries: the A*N block tokens; keys: [context 0..T-1 | block 0 | ... | block A-1]):
  - block j sees the context strictly before its anchor (s < a: the verifier has not yet run on x_a at inference);
  - block j sees its own N tokens (bidirectionally; sliding-window layers causally within the window);
  - blocks never see each other. Invalid (padding) blocks see only themselves and train nothing.
Packed rows (position_ids restarting per document, data/documents.py): a block sits at its anchor's position within
its document (position_ids[a] + k), sees only its own document's context, and trains position k only when a+k is in
the anchor's document, so a packed document trains exactly as the document alone would.
"""

from __future__ import annotations

import torch

from draftheads.data.documents import document_ids, restarts, same_document


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct anchors per row among the positions a <= T-2 with loss_mask[a] = 1 (an assistant token,
    with at least one token after it), up to `num_anchors` per row, sorted.

    loss_mask (B, T) -> anchors (B, A) int64, valid (B, A) bool, A = min(num_anchors, the most any row has, >= 1);
    rows with fewer candidates are padded with anchor 0, valid False."""
    B, T = loss_mask.shape
    candidate = loss_mask.bool().clone()
    candidate[:, max(T - 1, 0):] = False  # the last position has nothing to predict
    counts = candidate.sum(1)
    A = max(1, min(num_anchors, int(counts.max()) if B else 0))
    scores = torch.rand(B, T, generator=generator, device="cpu" if generator is not None else loss_mask.device)
    scores = scores.to(loss_mask.device).masked_fill(~candidate, 2.0)  # candidates first, in random order
    picked = scores.topk(A, dim=1, largest=False).indices  # (B, A)
    valid = torch.arange(A, device=loss_mask.device)[None, :] < counts[:, None].clamp(max=A)
    anchors = torch.where(valid, picked, torch.zeros_like(picked))
    # sort the valid anchors, padding last
    key = torch.where(valid, anchors, torch.full_like(anchors, T + 1))
    order = key.argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                 mask_token_id: int, position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' token ids and positions, flattened block after block: (B, A*N) each. Block j is
    [x_a, MASK x (N-1)] at p .. p+N-1, p = position_ids[a] (= a without position_ids; an invalid block: all MASK,
    at 0 .. N-1)."""
    B, A = anchors.shape
    N = block_size
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    ids = torch.full((B, A, N), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    first = input_ids.gather(1, anchors)  # (B, A)
    ids[:, :, 0] = torch.where(valid, first, torch.full_like(first, mask_token_id))
    start = anchors if position_ids is None else position_ids.long().gather(1, anchors)
    start = torch.where(valid, start, torch.zeros_like(start))
    positions = start[:, :, None] + torch.arange(N, device=anchors.device)  # (B, A, N)
    return ids.view(B, A * N), positions.view(B, A * N)


def block_targets(tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                  block_size: int, position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What block positions k = 1..N-1 predict: tokens[a+k] (B, A, N-1), and whether it is trained: the block is
    valid, a+k < T, loss_mask[a+k] = 1 and (with position_ids) a+k is in a's document (B, A, N-1) bool. `tokens`
    (B, T): the data, or the verifier's greedy token at each position."""
    B, T = tokens.shape
    index = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # (B, A, N-1)
    inside = index < T
    index = index.clamp(max=T - 1)
    flat = index.view(B, -1)
    targets = tokens.gather(1, flat).view_as(index)
    trained = loss_mask.bool().gather(1, flat).view_as(index) & inside & valid[:, :, None]
    if position_ids is not None:
        same = torch.stack([same_document(position_ids, k) for k in range(1, block_size)], -1)  # (B, T, N-1)
        trained &= same.gather(1, anchors[:, :, None].expand(-1, -1, block_size - 1))
    return targets, trained


def anchored_context_mask(anchors: torch.Tensor, valid: torch.Tensor, context_length: int, block_size: int,
                          sliding_window: int | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, A*N, T) bool, True = attend: which context keys 0..T-1 each block token sees (the context part of
    `anchored_block_mask`): those strictly before its anchor; with `sliding_window`, also within the window of the
    query's position; with position_ids (packed rows), in the anchor's document only. An invalid block sees none."""
    B, A = anchors.shape
    N, T = block_size, context_length
    dev = anchors.device
    anchor_of_query = torch.where(valid, anchors, torch.zeros_like(anchors)).repeat_interleave(N, dim=1)  # (B, A*N)
    valid_of_query = valid.repeat_interleave(N, dim=1)
    s = torch.arange(T, device=dev)
    context = (s[None, None, :] < anchor_of_query[:, :, None]) & valid_of_query[:, :, None]  # (B, A*N, T)
    if position_ids is not None:
        docs = document_ids(position_ids)  # (B, T)
        context = context & (docs[:, None, :] == docs.gather(1, anchor_of_query)[:, :, None])
    if sliding_window is not None:
        q_pos = anchor_of_query + torch.arange(A * N, device=dev) % N  # (B, A*N)
        context = context & (q_pos[:, :, None] - s[None, None, :] < sliding_window)
    return context


def anchored_context_ranges(anchors: torch.Tensor, valid: torch.Tensor, context_length: int, block_size: int,
                            sliding_window: int | None = None, position_ids: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`anchored_context_mask` as one range of context keys per block token, (lo, hi) (B, A*N) each: the token sees
    keys lo <= s < hi (documents are contiguous, and so is a window), linear in T where the mask is (A*N, T).
    hi is the anchor (0 for an invalid block); lo the anchor's document start (packed rows), raised to the first key
    within the window of the query's position (sliding layers)."""
    B, A = anchors.shape
    N = block_size
    anchor_of_query = torch.where(valid, anchors, torch.zeros_like(anchors)).repeat_interleave(N, dim=1)  # (B, A*N)
    hi = anchor_of_query.clone()
    lo = torch.zeros_like(hi)
    if position_ids is not None:
        index = torch.arange(position_ids.shape[1], device=anchors.device).expand_as(position_ids)
        starts = torch.where(restarts(position_ids), index, 0).cummax(-1).values  # (B, T) each token's document start
        lo = starts.gather(1, anchor_of_query.clamp(max=context_length - 1))
    if sliding_window is not None:
        q_pos = anchor_of_query + torch.arange(A * N, device=anchors.device) % N
        lo = torch.maximum(lo, q_pos - sliding_window + 1)
    return lo.minimum(hi), hi


def own_block_mask(block_size: int, sliding_window: int | None = None, device=None) -> torch.Tensor:
    """(N, N) bool: which tokens of its own block a block token sees: all of them, or with `sliding_window` the
    ones at offsets 0 .. window-1 before it (causal within the window)."""
    i = torch.arange(block_size, device=device)
    own = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if sliding_window is not None:
        delta = i[:, None] - i[None, :]
        own = (delta >= 0) & (delta < sliding_window)
    return own


def anchored_block_mask(anchors: torch.Tensor, valid: torch.Tensor, context_length: int, block_size: int,
                        sliding_window: int | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, A*N, T + A*N) bool, True = attend: queries are the blocks' tokens, keys [context 0..T-1 | blocks]; see
    the module docstring. With `sliding_window` (sliding layers): context keys also within the window of the query's
    position, and the block causal within the window. With position_ids (packed rows): context keys of the anchor's
    document only. The dense form of `anchored_context_mask` beside `own_block_mask` on the block diagonal."""
    B, A = anchors.shape
    N = block_size
    context = anchored_context_mask(anchors, valid, context_length, N, sliding_window, position_ids)
    own = own_block_mask(N, sliding_window, anchors.device)
    diagonal = torch.block_diag(*([own] * A)) if A else own.new_zeros(0, 0)  # (A*N, A*N)
    return torch.cat([context, diagonal.expand(B, A * N, A * N)], dim=-1)
