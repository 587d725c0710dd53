"""Documents in packed rows (data/documents.py): positions, the attention mask and the target rule of Medusa and
EAGLE against slow references written from the rule's words."""

import numpy as np
import pytest
import torch

from draftheads.data.documents import (
    causal_document_mask,
    document_ids,
    is_packed,
    join_padding,
    packed_positions,
    same_document,
)
from draftheads.models.eagle import EagleDrafter
from draftheads.models.medusa import target_weights

# Two rows of 9: documents of 4, 3, 2 tokens | a document of 5 cut by the row start (a document of its own), then
# one of a single token, then padding (a document of its own).
POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1],
                          [0, 1, 2, 3, 4, 0, 0, 1, 2]])
DOCS = [[0, 0, 0, 0, 1, 1, 1, 2, 2],
        [0, 0, 0, 0, 0, 1, 2, 2, 2]]


def test_packed_positions_restart_at_documents_rows_and_padding():
    # documents of 4, 3, 4 and 3 tokens in a stream of 14, rows of 6: [0 1 2 3 0 1 | 2 0 1 2 3 0 | 1 2 pad pad...]
    got = packed_positions(np.array([0, 4, 7, 11]), 14, 6).reshape(3, 6)
    assert got.tolist() == [[0, 1, 2, 3, 0, 1],
                            [0, 0, 1, 2, 3, 0],  # the cut document continues as a document of its own
                            [0, 1, 0, 1, 2, 3]]  # the padding after the last document is one too
    assert packed_positions(np.array([0]), 12, 6).reshape(2, 6).tolist() == [list(range(6))] * 2


def test_document_ids_and_mask_against_a_loop():
    assert document_ids(POSITIONS).tolist() == DOCS
    mask = causal_document_mask(POSITIONS)
    B, T = POSITIONS.shape
    assert mask.shape == (B, 1, T, T)
    for b in range(B):
        for q in range(T):
            for k in range(T):
                assert bool(mask[b, 0, q, k]) == (k <= q and DOCS[b][k] == DOCS[b][q]), (b, q, k)
    assert is_packed(POSITIONS) and not is_packed(torch.arange(9)[None]) and not is_packed(None)


@pytest.mark.parametrize("shift", [1, 2, 3, 4, 9, 12])
def test_same_document_is_the_rule(shift):
    got = same_document(POSITIONS, shift)
    B, T = POSITIONS.shape
    for b in range(B):
        for t in range(T):
            assert bool(got[b, t]) == (t + shift < T and DOCS[b][t] == DOCS[b][t + shift]), (b, t)


def test_medusa_and_eagle_target_rules_against_a_slow_reference():
    """Medusa head k and EAGLE TTT step k at position t predict token t+k+2: trained iff that token exists, its
    loss_mask is 1 and it is in t's document (every token between is then in that document too)."""
    torch.manual_seed(0)
    loss_mask = (torch.rand(POSITIONS.shape) > 0.2).long()
    B, T = POSITIONS.shape

    def reference(shift):
        out = torch.zeros(B, T)
        for b in range(B):
            for t in range(T):
                j = t + shift
                out[b, t] = float(j < T and bool(loss_mask[b, j]) and all(DOCS[b][i] == DOCS[b][t]
                                                                          for i in range(t, j + 1)))
        return out

    for k in range(4):
        w, count = target_weights(loss_mask, k + 2, POSITIONS)
        assert torch.equal((w > 0).float(), reference(k + 2)) and count == reference(k + 2).sum()
        trained = EagleDrafter.trained_mask(loss_mask, POSITIONS, k)  # (B, T-2-k)
        assert torch.equal(trained.float(), reference(k + 2)[:, :T - 2 - k])
    w, _ = target_weights(loss_mask, 1, POSITIONS)  # Medusa-2's own next-token loss
    assert torch.equal((w > 0).float(), reference(1))
    # without position_ids: the loss mask alone, as before
    w, _ = target_weights(loss_mask, 2)
    assert torch.equal((w[:, :T - 2] > 0).long(), loss_mask[:, 2:])


def test_join_padding_counts_the_padding_on_from_the_last_real_token():
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2],   # one document, then padding (a document of its own)
                              [0, 1, 2, 0, 1, 0, 1, 2],   # two documents, then padding
                              [0, 1, 2, 3, 4, 5, 6, 7],   # full: nothing to join
                              [0, 1, 2, 3, 4, 5, 6, 7],   # all padding: left as it is
                              [0, 1, 2, 0, 1, 2, 0, 1]])  # not right-padded: left as it is
    attention = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0],
                              [1, 1, 1, 1, 1, 0, 0, 0],
                              [1] * 8,
                              [0] * 8,
                              [1, 1, 1, 0, 0, 1, 1, 1]])
    joined = join_padding(positions, attention)
    assert joined.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7],
                               [0, 1, 2, 0, 1, 2, 3, 4],
                               [0, 1, 2, 3, 4, 5, 6, 7],
                               [0, 1, 2, 3, 4, 5, 6, 7],
                               [0, 1, 2, 0, 1, 2, 0, 1]]
    assert joined.dtype == positions.dtype
    # one document and its padding is no longer a packed row; two documents still are
    assert is_packed(positions[:1]) and not is_packed(joined[:1])
    assert is_packed(joined[1:2])
    # the real tokens keep their documents
    real = attention.bool()
    assert (document_ids(joined)[real] == document_ids(positions)[real]).all()
