"""The trainers' last step: the exported drafter, reloaded from disk, must decode like the drafter that was trained.

    summary = finish_run(accelerator, loop, summary, cfg, drafter, verifier, heldout_ds, tokenizer, tree=tree)

`finish_run` checks (`check_exported_drafter`), logs eval/tau (the export's), eval/tau_in_memory and
eval/accept_pos{k}, adds the check to the run's summary and closes the run (trackers flushed).

Both drafters decode the same held-out prompts greedily through our engine (`draftheads.eval.measure.consistency.check_export`); a
difference raises `ConsistencyError` on every process, so the run exits non-zero with a message saying where the
two parted. Only the main process decodes (it wrote the export); the others wait for its verdict. Under FSDP with a
sharded verifier every process decodes (its forward is collective); the main process still reports.

Held-out prompts: the first `consistency.num_prompts` rows of the run's held-out data (what `data.eval_rows` holds
out: for `data.source: stdlib` the files of the `eval` split), cut to `consistency.prompt_tokens` real tokens. They
are tokenised exactly as the run's data (chat template included) and never trained on. A run without held-out
rows (`data.eval_rows: 0`) takes the first files of the stdlib `eval` split instead: tau then says little about the
run's own domain, but equality still says the export serves what was trained.
"""

from __future__ import annotations

import torch

from draftheads.eval.measure.consistency import ConsistencyError, ConsistencyResult, check_export
from draftheads.train.config import RunConfig


def heldout_prompts(heldout_ds, tokenizer, num_prompts: int, prompt_tokens: int) -> tuple[list[list[int]], str]:
    """(prompts, where they came from): the first real tokens of held-out rows, else of stdlib `eval` files."""
    prompts: list[list[int]] = []
    for i in range(len(heldout_ds) if heldout_ds is not None else 0):
        row = heldout_ds[i]
        ids = torch.as_tensor(row["input_ids"])[torch.as_tensor(row["attention_mask"]).bool()]  # (T',) no padding
        ids = ids[:prompt_tokens]
        if len(ids) >= 2:
            prompts.append(ids.tolist())
        if len(prompts) == num_prompts:
            break
    if prompts:
        return prompts, f"{len(prompts)} held-out rows"
    from draftheads.data.stdlib import read_source, stdlib_files

    for path in stdlib_files("eval"):
        ids = tokenizer(read_source(path), add_special_tokens=False)["input_ids"][:prompt_tokens]
        if len(ids) >= 2:
            prompts.append(list(ids))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ConsistencyError("export check: no held-out rows and no stdlib `eval` files to take prompts from; "
                               "set data.eval_rows > 0 or consistency.enabled=false")
    return prompts, f"{len(prompts)} stdlib eval-split files (the run has no held-out rows)"


def check_exported_drafter(accelerator, cfg: RunConfig, drafter, verifier, heldout_ds, tokenizer, say=print,
                           **options) -> ConsistencyResult | None:
    """Collective: the main process checks `cfg.drafter_dir` against the in-memory `drafter` (options go to
    `check_export`, e.g. Medusa's `tree`) and every process raises ConsistencyError if they differ. Returns the
    result on the main process, None on the others and when `consistency.enabled` is false."""
    from accelerate.utils import broadcast_object_list

    check = cfg.consistency
    if not check.enabled:
        return None
    from draftheads.train.placement import is_sharded, verifier_sharded_by, whole_verifier

    # A verifier sharded by FSDP (train.placement.shard_verifier) runs only collectively: then every process decodes the
    # same prompts in lockstep (greedy, so identically) with its own whole copy of the drafter. A head-only verifier
    # (features: offline) is loaded whole for the check only (`whole_verifier`), sharded as it would have been.
    everywhere = is_sharded(verifier) or (verifier.head_only and verifier_sharded_by(accelerator))
    if everywhere:
        accelerator.wait_for_everyone()  # the main process has written the export
    result, error = None, None
    if accelerator.is_main_process or everywhere:
        try:
            prompts, origin = heldout_prompts(heldout_ds, tokenizer, check.num_prompts, check.prompt_tokens)
            whole = whole_verifier(cfg, verifier, accelerator)  # dropped when this returns
            result = check_export(drafter, cfg.drafter_dir, whole, prompts, max_new_tokens=check.max_new_tokens,
                                  tolerance=check.tolerance, **options)
        except Exception as err:  # any failure: the other processes must not wait for a verdict forever
            error = err
    verdict = broadcast_object_list([None if error is None else f"{type(error).__name__}: {error}"])[0]
    if error is not None:
        if isinstance(error, ConsistencyError):
            raise ConsistencyError(f"train/serve check failed: {error}") from None
        raise error
    if verdict is not None:
        raise ConsistencyError(f"train/serve check failed on the main process: {verdict}")
    if not accelerator.is_main_process:
        return None
    if result is not None:
        say(f"[consistency] {cfg.drafter_dir} reloaded: tau {result.tau_export:.3f} on {origin} "
            f"({result.new_tokens} tokens) = the in-memory drafter's {result.tau_in_memory:.3f}")
    return result


def consistency_summary(result: ConsistencyResult) -> dict:
    """What a run's summary keeps of the check."""
    return {"tau": result.tau_export, "tau_in_memory": result.tau_in_memory, "prompts": result.num_prompts,
            "new_tokens": result.new_tokens}


def finish_run(accelerator, loop, summary: dict, cfg: RunConfig, drafter, verifier, heldout_ds, tokenizer,
               say=print, **options) -> dict:
    """Both trainers' ending after the export: the train/serve check, its metrics logged and kept in `summary`, then
    the run closed (wandb flushed, also when the check fails). Returns `summary`."""
    try:
        checked = check_exported_drafter(accelerator, cfg, drafter, verifier, heldout_ds, tokenizer, say=say,
                                         **options)
    except ConsistencyError:
        accelerator.end_training()
        raise
    if checked is not None:
        loop.log(checked.metrics())
        summary["consistency"] = consistency_summary(checked)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary
