"""Per-step time and memory of a training loop, measured the same way for every trainer: the scale bench's meter.

    meter = StepMeter(warmup=1, steps=2).install()    # before the trainer builds its optimizer
    ... the trainer's own loop runs ...                # each optimizer step marks the end of a training step
    meter.write("report.json", {"tokens_per_step": 2048})

The step boundary is the optimizer's step, seen through torch's global optimizer hook
(`torch.optim.optimizer.register_optimizer_step_post_hook`), so the loop measured is the trainer's own, whoever
wrote it (ours in scripts/bench_scale.py, speculators' and SpecForge's in scripts/bench_scale_peer.py): step k is
the time from the end of optimizer step k-1 to the end of optimizer step k (data loading, features, forward,
backward, clipping, the update, and whatever the loop does around them). The first `warmup` steps are not
measured; after `warmup + steps` steps the hook raises `Enough`, which ends the trainer's loop (the runner
catches it), so a peer's epoch need not be run to its end.

Per measured step: wall seconds, CPU seconds of this process (every thread: `time.process_time`), and the RSS at
its end; for the process: the peak RSS (`ru_maxrss`, what the kernel counted, the set-up included), the RSS when
the meter was installed (the process with torch imported, nothing built), and on CUDA
`torch.cuda.max_memory_allocated`. At the end of the first step (the optimizer state exists then) the memory that
does not grow with the tokens is counted from the tensors (`memory_split`): the parameters and buffers of the
modules the runner handed to `watch` (the drafter, the verifier or the parts of it the trainer holds), the
gradients of the optimizers' parameters and the optimizers' state. This file runs in the peers' environments too,
so it imports only the standard library and torch.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time


class Enough(Exception):
    """Raised from the optimizer hook once the measured steps are done: the trainer's loop stops there."""


def rss_mib() -> float:
    """This process's resident set now, MiB (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """The peak resident set of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each storage once (tied and shared weights are one)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def memory_split(modules, optimizers, device_type: str | None = None) -> dict:
    """Bytes of what does not grow with the tokens: every parameter and buffer of `modules` and every parameter of
    `optimizers` (shared storages once), the gradients of the parameters that have one (called after the optimizer
    step, before zero_grad frees them) and the optimizers' state; with `device_type` ("cuda") only the tensors
    there, as the peak it is taken from counts only them (a verifier's embedding may stay in host memory)."""
    grouped = list({id(p): p for opt in optimizers for g in opt.param_groups for p in g["params"]}.values())
    # what trains: a peer may hand its optimizer frozen parameters too (speculators: the embedding), which get
    # neither gradients nor state
    trainable = [p for p in grouped if p.grad is not None] or [p for p in grouped if p.requires_grad]
    def there(tensors):
        return [t for t in tensors if device_type is None or t.device.type == device_type]

    held = there([t for m in modules for t in (*m.parameters(), *m.buffers())] + grouped)
    state = there([v for opt in optimizers for s in opt.state.values() for v in s.values()
                   if hasattr(v, "untyped_storage")])
    weights, grads, optimizer = tensor_bytes(held), sum(p.numel() * p.element_size() for p in there(trainable)), \
        tensor_bytes(state)
    return {"weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": optimizer,
            "static_bytes": weights + grads + optimizer, "trainable_params": sum(p.numel() for p in trainable)}


class StepMeter:
    """Marks the end of each training step at the optimizer's step; see the module doc."""

    def __init__(self, warmup: int = 1, steps: int = 2, optimizer_steps_per_step: int = 1, stop: bool = True):
        if warmup < 0 or steps < 1 or optimizer_steps_per_step < 1:
            raise ValueError(f"StepMeter(warmup={warmup}, steps={steps}, optimizer_steps_per_step="
                             f"{optimizer_steps_per_step}): expected warmup >= 0, steps >= 1, optimizer steps >= 1")
        self.warmup, self.steps, self.per_step, self.stop = warmup, steps, optimizer_steps_per_step, stop
        self.calls = 0
        self.marks: list[tuple[float, float, float]] = []  # (wall, cpu, rss MiB) at the end of each step
        self.started = (time.perf_counter(), time.process_time())
        self.handle = None
        self.cuda = False
        self.baseline_rss = rss_mib()
        self.modules: list = []
        self.optimizers: dict[int, object] = {}
        self.split: dict | None = None

    def watch(self, *modules) -> None:
        """Count these modules' parameters and buffers in the static memory (see `memory_split`)."""
        self.modules.extend(m for m in modules if m is not None)

    def install(self) -> "StepMeter":
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.handle = register_optimizer_step_post_hook(self._hook)
        return self

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    @property
    def done(self) -> bool:
        return len(self.marks) >= self.warmup + self.steps

    def _hook(self, optimizer, args, kwargs) -> None:
        self.calls += 1
        self.optimizers.setdefault(id(optimizer), optimizer)
        if self.calls % self.per_step:
            return  # another optimizer of the same training step
        if self.split is None:
            import torch

            on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self.split = memory_split(self.modules, list(self.optimizers.values()), "cuda" if on_cuda else None)
        self.mark()

    def mark(self) -> None:
        """The end of one training step (called by the hook; a loop without an optimizer may call it itself)."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the step's kernels are done, not merely queued
            self.cuda = True
        self.marks.append((time.perf_counter(), time.process_time(), rss_mib()))
        if self.stop and self.done:
            raise Enough(f"{len(self.marks)} steps measured")

    def report(self) -> dict:
        """The measured steps (after the warm-up) and the process's memory, as a JSON-able dict."""
        import torch

        walls, cpus, rss = [], [], []
        for k in range(self.warmup, min(len(self.marks), self.warmup + self.steps)):
            before = self.marks[k - 1] if k > 0 else (*self.started, 0.0)
            walls.append(self.marks[k][0] - before[0])
            cpus.append(self.marks[k][1] - before[1])
            rss.append(self.marks[k][2])
        out = {"steps_done": len(self.marks), "warmup": self.warmup, "steps_measured": len(walls),
               "step_seconds": walls, "step_cpu_seconds": cpus, "step_end_rss_mib": rss,
               "seconds_per_step": statistics.median(walls) if walls else None,
               "cpu_seconds_per_step": statistics.median(cpus) if cpus else None,
               "peak_rss_mib": peak_rss_mib(), "baseline_rss_mib": self.baseline_rss,
               "threads": torch.get_num_threads(), **(self.split or {})}
        if self.cuda:
            out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            out["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
            out["cuda_device"] = torch.cuda.get_device_name()
        return out

    def write(self, path: str | os.PathLike, extra: dict | None = None) -> dict:
        report = {**self.report(), **(extra or {})}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, path)
        return report


def write_failure(path: str | os.PathLike, reason: str, extra: dict | None = None) -> None:
    """A child that could not measure: one line saying why (the table shows it), and what it knew."""
    report = {"error": reason.strip().splitlines()[0][:300] if reason.strip() else "failed",
              "peak_rss_mib": peak_rss_mib(), **(extra or {})}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
