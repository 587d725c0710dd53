"""What a trainer hands to `accelerator.prepare`: the drafter wrapped so DDP / FSDP sync through `forward`."""

from __future__ import annotations

from torch import nn

from draftheads.models.eagle.drafter import EagleDrafter


class EagleTrainModule(nn.Module):
    """What a trainer hands to `accelerator.prepare`: DDP/FSDP sync gradients only through `forward`.

    forward(input_ids, features, loss_mask, position_ids=None) -> EagleOutput; the drafter is `.drafter`.
    forward(..., chain_steps=N) -> StepCounts of `drafter.chain_counts` (EAGLE-1's held-out scoring), also through
    `forward`, so it runs when FSDP has sharded the drafter (its weights are gathered only inside `forward`).
    """

    def __init__(self, drafter: EagleDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, features, loss_mask, position_ids=None, chain_steps: int | None = None):
        if chain_steps is not None:
            return self.drafter.chain_counts(input_ids, features, loss_mask, chain_steps, position_ids)
        return self.drafter.training_loss(input_ids, features, loss_mask, position_ids)
