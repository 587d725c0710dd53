"""scripts/peer_step_check.py's position bookkeeping: the loss mask it hands speculators makes speculators' rule
train exactly the positions our `trained_mask` trains, and its count of what speculators trains beyond ours on
packed documents is that rule's."""

import sys

import pytest
import torch

from draftheads.models.eagle.drafter import EagleDrafter
from tests.utils import script_module


@pytest.fixture(scope="module")
def check():
    # the script imports the bench beside it by name, as `python scripts/peer_step_check.py` finds it
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "bench_peers", script_module("bench_peers"))
        yield script_module("peer_step_check")


def speculators_trained(masks: list[torch.Tensor], step: int) -> torch.Tensor:
    """speculators 0.9's rule, written from its code: `shift_batch` drops each document's first mask entry, its
    `CollateFn` packs the documents into one sequence, and `align_for_step` trains position i at TTT step k iff
    loss_mask[i + k]: (S - k,) bool over the packed, shifted positions."""
    shifted = torch.cat([m[1:] for m in masks]).bool()
    return shifted[step:]


def test_ours_rule_mask_makes_speculators_train_our_positions(check):
    gen = torch.Generator().manual_seed(0)
    for length in (9, 40):
        mask = (torch.rand(length, generator=gen) < 0.7).long()
        for k in range(5):
            ours = EagleDrafter.trained_mask(mask[None], None, k)[0]  # (T-2-k,): stream positions 0..T-3-k
            theirs = speculators_trained([check.ours_rule_mask(mask)], k)  # (T-1-k,)
            assert torch.equal(theirs[:len(ours)], ours)
            assert not theirs[len(ours):].any()  # nothing after the document's last token
        raw = speculators_trained([mask], 0)  # the raw mask: speculators reads mask[j-1] for token j
        assert torch.equal(raw[:length - 2], mask[1:length - 1].bool())


def test_expected_extra_is_speculators_rule_on_packed_documents(check):
    lengths = (12, 9, 15)
    masks = [torch.ones(n, dtype=torch.long) for n in lengths]
    for k in range(6):
        ours = sum(int(EagleDrafter.trained_mask(m[None], None, k).sum()) for m in masks)  # one row per document
        theirs = int(speculators_trained(masks, k).sum())
        assert theirs - ours == check.expected_extra(len(lengths), k)


def test_rel_diff_is_on_the_tensors_scale(check):
    a = torch.tensor([1.0, -4.0, 1e-9])
    assert check.rel_diff(a, a) == 0.0
    assert check.rel_diff(a, a + torch.tensor([0.0, 0.0, 4e-6])) == pytest.approx(1e-6)
