"""`Placed`: a model's `device` and `dtype`, read off the one weight its inputs meet first; `embedding_rows`: a
table's rows brought to where the ids are (a verifier's embedding may stay in host memory beside a GPU).

    class EagleDrafter(Placed, nn.Module):
        placed_by = "fc"            # self.fc.weight says where inputs go and what they are cast to
    embeds = embedding_rows(verifier.embed_tokens.weight, input_ids)   # (B, T, H) on input_ids' device
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(..., H) the rows `ids` (...) of an embedding `table` (V, H), gathered where the table is and returned on
    `ids`' device: a verifier's table may be kept in host memory while training runs on a GPU (`Verifier.load_head`
    with `embedding_device`), and then only the rows a step reads cross to the GPU."""
    if table.device == ids.device:
        return F.embedding(ids, table)
    return F.embedding(ids.to(table.device), table).to(ids.device, non_blocking=True)
