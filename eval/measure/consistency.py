"""Train/serve consistency: the exported drafter, reloaded from disk, must decode like the drafter in memory.

    result = check_export(heads_or_eagle, "runs/x/drafter", verifier, prompts, tree=tree)   # ConsistencyError if not
    accelerator.log(result.metrics())      # {"eval/tau": tau of the export, "eval/tau_in_memory": ...}

Both drafters decode the same held-out prompts greedily through this engine (`SpeculativeDecoder`), with the same
options, and the per-call accepted counts must agree (tau within `tolerance`, 0 by default: in float32 the same
weights accept the same drafts). What a difference catches: weights renamed or transposed on export, a lost
bias, a wrong d2t/t2d map, the wrong feature layers or fc order in the config, an export dtype that changes
predictions, a Medusa tree that is not the one built in training, a Medusa-2 adapter that does not reload.

Medusa: the in-memory side drafts the `tree` the trainer built (`paths`; a chain of every head if None); the export
side drafts the tree stored in the export, so a tree lost on the way fails too. Medusa-2 (the verifier carries LoRA
adapters): the in-memory side runs a merged copy of the adapted verifier; the export side the base verifier with
the export's adapter merged, as the engine loads it.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftheads.eval.engine.generic_runtime import on_generic_path
from draftheads.eval.measure.metrics import per_position_acceptance, tau


class ConsistencyError(RuntimeError):
    """The exported drafter does not decode like the in-memory drafter it was written from."""


@dataclass
class ConsistencyResult:
    method: str
    tau_export: float
    tau_in_memory: float
    num_prompts: int
    new_tokens: int
    accepted_export: list[list[int]] = field(repr=False)
    accepted_in_memory: list[list[int]] = field(repr=False)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """What the trainers log: `eval/tau` (the export's, the one a user gets) and the in-memory one."""
        out = {f"{prefix}tau": self.tau_export, f"{prefix}tau_in_memory": self.tau_in_memory}
        for k, p in enumerate(per_position_acceptance(self.accepted_export), 1):
            out[f"{prefix}accept_pos{k}"] = p
        return out


def drafter_method(drafter) -> str:
    """The engine method for an in-memory drafter module."""
    from draftheads.models.dflash import DFlashDrafter
    from draftheads.models.eagle import EagleDrafter
    from draftheads.models.medusa import MedusaHeads
    from draftheads.models.mtp import MtpDrafter

    if isinstance(drafter, MtpDrafter):
        return "mtp"
    if isinstance(drafter, MedusaHeads):
        return "medusa"
    if isinstance(drafter, EagleDrafter):
        return "eagle"
    if isinstance(drafter, DFlashDrafter):
        return "dflash"
    raise TypeError(f"check_export: expected MedusaHeads, an EagleDrafter, a DFlashDrafter or an MtpDrafter, got "
                    f"{type(drafter).__name__}")


def _medusa_verifiers(verifier):
    """(in-memory side, export side) verifiers for Medusa-2: the adapted one merged, and the bare base."""
    from draftheads.models.medusa import lora_model

    peft_model = lora_model(verifier)
    if peft_model is None:
        return verifier, verifier
    merged = copy.deepcopy(verifier)
    merged.model = merged.model.merge_and_unload().eval()
    base = copy.deepcopy(verifier)
    base.model = base.model.unload().eval()  # the original weights, adapters removed (not merged)
    return merged, base


def prompts_from_rows(input_ids, num_prompts: int = 4, prompt_tokens: int = 64, pad_token_id: int | None = None
                      ) -> list[list[int]]:
    """Held-out prompts from token rows (a trainer's eval batches): the first `prompt_tokens` of up to `num_prompts`
    rows, padding dropped."""
    prompts = []
    for row in input_ids:
        ids = [int(t) for t in (row.tolist() if isinstance(row, torch.Tensor) else row)]
        if pad_token_id is not None:
            ids = [t for t in ids if t != pad_token_id]
        ids = ids[:prompt_tokens]
        if len(ids) >= 2:
            prompts.append(ids)
        if len(prompts) == num_prompts:
            break
    return prompts


GENERIC_EAGLE_CHAIN = 4
"""EAGLE's chain length in the check when the verifier runs on the generic path (which verifies chains only)."""


@torch.inference_mode()
def check_export(drafter, export_dir: str | os.PathLike, verifier, prompts: list[list[int]], method: str | None = None,
                 max_new_tokens: int = 32, tolerance: float = 0.0, tree=None, **options) -> ConsistencyResult:
    """Decode `prompts` greedily with the in-memory `drafter` and with the export reloaded from `export_dir`; raise
    ConsistencyError naming the first prompt and call where they part if their tau differs by more than
    `tolerance` (or, at tolerance 0, if any accepted count differs). `options` go to both (e.g. chain=3)."""
    from draftheads.eval.drafters import make_drafter
    from draftheads.eval.engine.decoder import SpeculativeDecoder

    method = method or drafter_method(drafter)
    export_dir = Path(export_dir)
    if not prompts:
        raise ValueError("check_export: no prompts")
    if not (export_dir / "config.json").is_file():
        raise ConsistencyError(f"{export_dir}: no exported drafter there (config.json missing)")
    memory_verifier = export_verifier = verifier
    if on_generic_path(verifier.config):  # the generic path verifies chains only
        if method == "medusa":
            options.setdefault("chain", True)
            tree = None
        elif method == "eagle":
            options.setdefault("chain", GENERIC_EAGLE_CHAIN)
    memory_options = dict(options)
    if method == "medusa":
        memory_verifier, export_verifier = _medusa_verifiers(verifier)
        if not {"paths", "chain", "tree_budget"} & set(options):
            memory_options["paths"] = [list(p) for p in tree] if tree is not None else None
            memory_options["chain"] = None if tree is not None else True
    was_training = drafter.training
    drafter.eval()
    try:
        memory = SpeculativeDecoder(memory_verifier, make_drafter(method, memory_verifier, drafter, **memory_options),
                                    method)
        exported = SpeculativeDecoder(export_verifier, make_drafter(method, export_verifier, str(export_dir), **options),
                                      method)
        a = [memory.generate([p], max_new_tokens, temperature=0.0) for p in prompts]
        b = [exported.generate([p], max_new_tokens, temperature=0.0) for p in prompts]
    finally:
        drafter.train(was_training)
    acc_memory = [r.stats.accepted[0] for r in a]
    acc_export = [r.stats.accepted[0] for r in b]
    result = ConsistencyResult(method, tau(acc_export), tau(acc_memory), len(prompts),
                               sum(len(r.output_ids[0]) for r in b), acc_export, acc_memory)
    differs = abs(result.tau_export - result.tau_in_memory) > tolerance
    if tolerance == 0 and acc_export != acc_memory:
        differs = True
    if differs:
        where = next(((i, j) for i, (x, y) in enumerate(zip(acc_memory, acc_export)) for j, (u, v) in
                      enumerate(zip(x, y)) if u != v), None)
        detail = (f"; prompt {where[0]} first differs at verifier call {where[1]} (accepted "
                  f"{acc_memory[where[0]][where[1]]} in memory, {acc_export[where[0]][where[1]]} from the export)"
                  if where else "")
        raise ConsistencyError(
            f"{export_dir}: the exported {method} drafter, reloaded, reaches tau {result.tau_export:.4f} on "
            f"{len(prompts)} held-out prompts, the in-memory drafter {result.tau_in_memory:.4f}{detail}. The export "
            "does not serve what was trained: check the weight names/layout, config fields (feature layers, draft "
            "vocabulary, tree) and the export dtype")
    return result
