"""`Placed`: a model's `device` and `dtype`, read off the one weight its inputs meet first.

    class EagleDrafter(Placed, nn.Module):
        placed_by = "fc"            # self.fc.weight says where inputs go and what they are cast to
"""

from __future__ import annotations

import torch


class Placed:
    """`device` and `dtype` of the weight of the submodule named by `placed_by` (a verifier's or runner's
    `embed_tokens`, a drafter's `fc`)."""

    placed_by: str

    @property
    def device(self) -> torch.device:
        return getattr(self, self.placed_by).weight.device

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self, self.placed_by).weight.dtype
