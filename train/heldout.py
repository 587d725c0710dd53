"""Held-out evaluation shared by the trainers: the measured batches, the sums reduced over processes, the counts
turned into rates once (one host sync per evaluation).

    sums = heldout_sums(accelerator, model, eval_dl, max_batches, measure)   # measure(batch) -> {name: device tensor}
"""

from __future__ import annotations

from typing import Callable

import torch


@torch.no_grad()
def heldout_sums(accelerator, model, eval_dl, max_batches: int,
                 measure: Callable[[dict], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sum `measure(batch)` over the first `max_batches` held-out micro-batches of each process (0: all of them).

    The model runs in eval mode (no dropout, no feature noise) and is put back in its previous mode after. The
    sums (plus `batches`, how many were measured) are reduced over processes, so the caller divides counts by
    counts; nothing syncs to the host here. Collective: every process calls it. Empty held-out data gives {}.
    """
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(eval_dl):
        if max_batches and i >= max_batches:
            break
        values = {**measure(batch), "batches": torch.ones((), device=accelerator.device)}
        for key, value in values.items():
            value = value.detach().float()
            sums[key] = sums[key] + value if key in sums else value
    model.train(was_training)
    if not sums:
        return {}
    return accelerator.reduce(sums, reduction="sum")
