"""Run speculators 0.9's EAGLE-3 trainer on this CPU, from offline features, and report its loop's time and memory.

    .venv-speculators/bin/python eval/interop/speculators_runner.py REPORT.json -- [speculators train flags ...]

This file runs in the speculators environment (scripts/setup_peers.sh), so it imports nothing of draftheads. It
changes nothing in speculators' code; it patches four names at run time, each because the trainer assumes an
accelerator on a path a CPU run takes:
  - `speculators.train.trainer.get_local_rank`: the trainer moves the model and every batch to
    `self.local_rank` (an int, i.e. cuda:0); here it returns "cpu".
  - `torch.accelerator.current_accelerator`: with none the trainer picks autocast device "cuda"; here it
    answers the CPU device, so autocast is the CPU's (at float32 features it is a no-op); asked with
    check_available=True (the end-of-run cache release) it still answers none.
  - `torch.accelerator.synchronize`: the step timer calls it unconditionally; a no-op without an accelerator.
  - `speculators.train.checkpointer.get_current_device`: "cuda:0" without an accelerator; here "cpu".
Then it times `Trainer.run_training` (the loop, not the imports and set-up) and counts the tokens the loader
hands it (the rows' lengths), and writes {seconds (wall), cpu_seconds (process time), tokens, peak_rss_mib, steps}
to REPORT.json.
Flags the bench passes (scripts/bench_peers.py): `--draft-attn-impl sdpa --loss-implementation eager
--num-workers 0 --hidden-states-dtype float32`, single process.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def patch_for_cpu() -> None:
    import torch

    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    if not torch.cuda.is_available():
        # asked whether one is *available* (the end-of-run cache release), still none
        torch.accelerator.current_accelerator = lambda check_available=False: (
            None if check_available else torch.device("cpu"))
        torch.accelerator.synchronize = lambda device=None: None
        torch.accelerator.is_available = lambda: False


def timed_training(report: dict) -> None:
    """Wrap Trainer.run_training: wall seconds of the loop, and the tokens of every batch it draws."""
    import speculators.train.trainer as trainer

    original = trainer.Trainer.run_training

    def run_training(self, *args, **kwargs):
        loader = self.train_loader
        draws = loader.__iter__

        class Counting:  # the loader, counting tokens as batches come out
            def __init__(self, inner):
                self.inner = inner

            def __iter__(self):
                for batch in draws():
                    report["tokens"] += int((batch["document_ids"] >= 0).sum())  # -1: padding
                    report["batches"] += 1
                    yield batch

            def __len__(self):
                return len(loader)

            def __getattr__(self, name):
                return getattr(loader, name)

        self.train_loader = Counting(loader)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            report["seconds"] = time.perf_counter() - t0
            report["cpu_seconds"] = time.process_time() - c0  # every thread of this process

    trainer.Trainer.run_training = run_training


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: speculators_runner.py REPORT.json -- [speculators train flags ...]", file=sys.stderr)
        return 2
    out, flags = argv[0], argv[2:]
    patch_for_cpu()
    report = {"tokens": 0, "batches": 0, "seconds": None}
    timed_training(report)
    from speculators.train.config import TrainConfig
    from speculators.train.cli import main as train_main

    train_main(TrainConfig.resolve(flags))  # what `speculators train FLAGS` runs
    report["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
