"""What a trainer hands to `accelerator.prepare`: the DFlash drafter wrapped so DDP / FSDP sync through `forward`."""

from __future__ import annotations

from torch import nn

from draftheads.models.dflash.drafter import DFlashDrafter


class DFlashTrainModule(nn.Module):
    """forward(input_ids, features, loss_mask, anchors=None, generator=None, position_ids=None) -> EagleOutput (loss, per-position losses, counts);
    the drafter is `.drafter`."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, features, loss_mask, anchors=None, generator=None, position_ids=None):
        return self.drafter.training_loss(input_ids, features, loss_mask, anchors=anchors, generator=generator,
                                          position_ids=position_ids)
