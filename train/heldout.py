"""Held-out evaluation shared by the trainers: the measured batches, the sums reduced over processes, the counts
turned into rates once (one host sync per evaluation).

    sums = heldout_sums(accelerator, model, eval_dl, max_batches, measure)   # measure(batch) -> {name: device tensor}

A chain drafter (EAGLE, DFlash: draft steps scored as `StepCounts`) measures `chain_sums` and reads its rates with
`chain_eval_values`.
"""

from __future__ import annotations

from typing import Callable

import torch

from draftheads.models.eagle import StepCounts
from draftheads.train.tracking import log_table


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


def chain_sums(out, counts: StepCounts) -> dict[str, torch.Tensor]:
    """What a chain drafter's held-out batch adds to the sums: the loss and per-step losses of its forward `out`,
    and the per-step `counts`."""
    return {"loss": out.loss, "step_losses": out.step_losses, "correct": counts.correct, "valid": counts.valid,
            "chain_correct": counts.chain_correct, "chain_valid": counts.chain_valid}


def chain_eval_values(accelerator, sums: dict[str, torch.Tensor], step: int, unit: str,
                      first: int) -> tuple[dict[str, float], list[float]]:
    """The rates of summed `chain_sums`: eval/loss (per batch), eval/accept_length (simulated) and, per draft `unit`
    (`step`, `position`) numbered from `first`, eval/acc_n, eval/cond_acc_n and eval/cum_acc_n, which are also
    logged as the table eval/per_{unit}. Returns the values and the accuracies (one host sync)."""
    summary = StepCounts(sums["correct"], sums["valid"], sums["chain_correct"], sums["chain_valid"]).summary()
    acc, cond, cum = (summary[k].tolist() for k in ("acc", "cond_acc", "cum_acc"))  # the sync point
    values = {"eval/loss": float(sums["loss"] / sums["batches"]),
              "eval/accept_length": float(summary["accept_length"])}
    for k in range(len(acc)):
        n = k + first
        values.update({f"eval/acc_{n}": acc[k], f"eval/cond_acc_{n}": cond[k], f"eval/cum_acc_{n}": cum[k]})
    log_table(accelerator, f"eval/per_{unit}", [unit, "acc", "cond_acc", "cum_acc"],
              [[k + first, acc[k], cond[k], cum[k]] for k in range(len(acc))], step=step)
    return values, acc
