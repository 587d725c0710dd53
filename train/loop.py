"""`TrainLoop`: the optimizer-step bookkeeping both trainers share (numerical guard, clipping, logging, evaluation
cadence, checkpoints and resume), so `train/medusa.py` and `train/eagle.py` only say what is specific to their
method:

    loop = TrainLoop(accelerator, cfg, drafter, optimizer, scheduler, train_dl, evaluate=...)
    loop.resume()
    for batch in loop.batches():
        with accelerator.accumulate(drafter):
            loss, metrics = ...                      # method-specific
            accelerator.backward(loss)
            loop.step(loss, metrics)                 # optimizer step on gradient-sync micro-batches
    loop.finish()
    loop.final_evaluation()                          # unless the last step ran one (EAGLE, DFlash)

Held-out evaluation is the trainer's `evaluate` callback (built on train/heldout.py), and `loop.summary()` is what
a run reports at the end. The other pieces of a run live beside this file, one concern each: tracking.py (the
Accelerator and wandb), placement.py (the verifier, FSDP sharding, gathering for export), loaders.py, optim.py,
checkpoint.py, features.py, heldout.py, finish.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader

from draftheads.data.progress import EtaBar, quiet
from draftheads.train.checkpoint import (
    TrainState,
    run_summary,
    complete_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    step_dir,
)
from draftheads.train.config import RunConfig


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss; the last good checkpoint is intact."""


class NonFiniteWeightsError(NonFiniteLossError):
    """An update left the drafter's weights non-finite (the loss before it was finite); they are never
    checkpointed or exported, and the last good checkpoint is intact."""


def all_finite(params) -> torch.Tensor:
    """A device bool: every value of every tensor in `params` is finite (a shard's local part under FSDP, and under
    DeepSpeed ZeRO-3, whose parameters are empty outside forward, the partition `ds_tensor`). No host sync."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)).all()
             for p in params]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)


class TrainLoop:
    """Optimizer-step bookkeeping shared by the trainers.

    `batches()` yields micro-batches from where the run left off (epochs reshuffled by (seed, epoch), the consumed
    part of the current epoch skipped on resume) until `train.max_steps` optimizer steps are done. `step(loss,
    metrics)` is called once per micro-batch after backward: on the micro-batch that syncs gradients it checks the
    loss is finite (the one host sync per optimizer step), clips, steps optimizer and schedule, logs every
    `log_every` steps, evaluates every `eval_every`, and checkpoints every `save_every`.
    Metrics are summed on the device between log steps.

    The numerical guard: a non-finite loss skips its update (`max_bad_steps` in a row stop the run); and after each
    update the trained parameters are checked (on the device, read at the next sync point, before any checkpoint
    and at the end), so weights an update made non-finite, even from a finite loss (too high a learning rate),
    stop the run at once and are never checkpointed or exported.
    """

    def __init__(self, accelerator, cfg: RunConfig, model, optimizer, scheduler, train_dl: DataLoader,
                 evaluate: Callable[[], dict[str, float]] | None = None, clip_params=None):
        self.accelerator, self.cfg = accelerator, cfg
        self.model, self.optimizer, self.scheduler, self.train_dl = model, optimizer, scheduler, train_dl
        self.evaluate = evaluate
        self.evaluated_at: int | None = None
        self.clip_params = clip_params
        self.state = TrainState()
        self.output_dir = Path(cfg.output_dir)
        self._finite = torch.ones((), dtype=torch.bool, device=accelerator.device)
        self._weights_finite = torch.ones((), dtype=torch.bool, device=accelerator.device)
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._consecutive_bad = 0
        self._last_log = time.perf_counter()
        self._last_cpu = time.process_time()
        self._tokens = torch.zeros((), device=accelerator.device)
        self.history: list[dict] = []
        self._bar = None
        self._started = time.perf_counter()

    # -- resume --
    def resume(self) -> TrainState:
        path = resolve_resume(self.cfg.train.resume, self.output_dir)
        if path is None:
            if self.cfg.train.resume == "none" and complete_checkpoints(self.output_dir):
                self.print(f"[resume] train.resume=none: starting over; existing checkpoints in "
                           f"{self.output_dir} will be replaced as new ones are written")
            return self.state
        self.state = load_checkpoint(self.accelerator, path)
        self.print(f"[resume] continuing from {path} (step {self.state.step}, epoch {self.state.epoch}, "
                   f"{self.state.consumed} batches into it)")
        return self.state

    # -- data --
    def batches(self) -> Iterator[dict]:
        cfg, state = self.cfg, self.state
        if state.step >= cfg.train.max_steps:
            return
        self._bar = None if quiet() or not self.accelerator.is_main_process else _progress(
            cfg.train.max_steps, state.step, Path(sys.argv[0]).stem or "train")
        while state.step < cfg.train.max_steps:
            self.train_dl.set_epoch(state.epoch)
            loader = self.train_dl
            if state.consumed:
                loader = self.accelerator.skip_first_batches(self.train_dl, state.consumed)
            for batch in loader:
                yield batch
                if state.step >= cfg.train.max_steps:
                    return
            state.epoch += 1
            state.consumed = 0

    # -- one micro-batch --
    def step(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor] | None = None,
             tokens: torch.Tensor | None = None) -> None:
        accelerator, cfg, state = self.accelerator, self.cfg, self.state
        state.consumed += 1
        self._finite &= torch.isfinite(loss.detach())
        for key, value in {"loss": loss, **(metrics or {})}.items():
            value = value.detach().float()
            self._sums[key] = self._sums[key] + value if key in self._sums else value
        self._count += 1
        if tokens is not None:
            self._tokens += tokens.detach()
        if not accelerator.sync_gradients:
            return
        # This is the sync point: two booleans per optimizer step (this loss finite, the last update's weights
        # finite), agreed by all processes.
        flags = torch.stack([self._finite, self._weights_finite]).float()
        finite, weights = (v == 1.0 for v in accelerator.reduce(flags, reduction="mean").tolist())
        self._finite.fill_(True)
        if not weights:
            self._stop_non_finite_weights(state.step)
        if finite:
            self._consecutive_bad = 0
            if cfg.train.grad_clip > 0:  # the exact parameter list: accelerate recognises an FSDP model by it
                params = self.clip_params if self.clip_params is not None else self.model.parameters()
                accelerator.clip_grad_norm_(params, cfg.train.grad_clip)
            try:
                self.optimizer.step()
            except RuntimeError as err:  # torch's AdamW: lr / bias correction beyond float32 ("overflow")
                if "overflow" not in str(err):
                    raise
                self._stop_non_finite_weights(state.step + 1, f"the update overflows float32 ({err})")
            self._weights_finite = all_finite(self._trained()).to(self._finite.device)
        else:
            state.bad_steps += 1
            self._consecutive_bad += 1
            self.print(f"[guard] step {state.step + 1}: non-finite loss, update skipped "
                       f"({self._consecutive_bad} in a row, {state.bad_steps} in total)")
            if self._consecutive_bad >= cfg.train.max_bad_steps:
                last = complete_checkpoints(self.output_dir)
                raise NonFiniteLossError(
                    f"{self._consecutive_bad} consecutive steps had a non-finite loss (train.max_bad_steps="
                    f"{cfg.train.max_bad_steps}); stopping. Last good checkpoint: "
                    f"{last[-1] if last else 'none written yet'}. Lower train.lr or check the data.")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        state.step += 1
        if self._bar is not None:
            self._bar.update(1)
        if state.step % cfg.train.log_every == 0 or state.step == cfg.train.max_steps:
            self._log()
        if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and self.evaluate:
            self._run_evaluation()
        if cfg.train.save_every and state.step % cfg.train.save_every == 0 and not self._consecutive_bad:
            self.save()  # never in the middle of a non-finite streak: the newest checkpoint stays a good one

    def _run_evaluation(self) -> None:
        self.evaluated_at = self.state.step
        self.log(self.evaluate())

    def final_evaluation(self) -> None:
        """The end-of-run held-out evaluation (the trainer's `evaluate`, logged), unless the last step ran one."""
        if self.evaluate and self.evaluated_at != self.state.step:
            self._run_evaluation()

    def _log(self) -> None:
        if not self._count:
            return
        names = sorted(self._sums)
        means = torch.stack([self._sums[k] for k in names]) / self._count
        means = self.accelerator.reduce(means, reduction="mean")
        now, cpu = time.perf_counter(), time.process_time()
        local = self._tokens.item()  # sync point, once per log interval
        tokens = self.accelerator.reduce(self._tokens.clone(), reduction="sum")
        values = dict(zip((f"train/{k}" for k in names), means.tolist()))
        values["train/lr"] = self.scheduler.get_last_lr()[0]
        values["train/bad_steps"] = self.state.bad_steps
        if tokens.item() > 0:
            values["train/tokens_per_s"] = tokens.item() / max(now - self._last_log, 1e-9)
            # this process's tokens per second of its CPU time (all its threads): a rate that a loaded machine
            # bends far less than the wall clock, for comparing trainers run one thread each
            values["train/tokens_per_cpu_s"] = local / max(cpu - self._last_cpu, 1e-9)
        self._sums, self._count, self._last_log, self._last_cpu = {}, 0, now, cpu
        self._tokens.zero_()
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{values['train/loss']:.4f}")
        self.log(values)

    def log(self, values: dict[str, float]) -> None:
        """Log to the trackers and append to `{output_dir}/metrics.jsonl` (main process)."""
        if not values:
            return
        values = {**values}
        self.accelerator.log(values, step=self.state.step)
        if self.accelerator.is_main_process:
            record = {"step": self.state.step, **values}
            self.history.append(record)
            with open(self.output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _trained(self) -> list:
        params = self.clip_params if self.clip_params is not None else self.model.parameters()
        return [p for p in params if p.requires_grad]

    def check_weights(self) -> None:
        """Stop (NonFiniteWeightsError) if the last update left a trained weight non-finite. Collective; a sync."""
        weights = self.accelerator.reduce(self._weights_finite.float(), reduction="mean").item() == 1.0
        if not weights:
            self._stop_non_finite_weights(self.state.step)

    def _stop_non_finite_weights(self, step: int, what: str = "the update made the drafter's weights non-finite "
                                 "(NaN or inf) although the loss was finite") -> None:
        last = complete_checkpoints(self.output_dir)
        raise NonFiniteWeightsError(
            f"step {step}: {what}; stopping without checkpointing or exporting them. Last good checkpoint: "
            f"{last[-1] if last else 'none written yet'}. Lower train.lr (now {self.cfg.train.lr:g}) or check the "
            "data")

    # -- checkpoints --
    def save(self) -> Path:
        self.check_weights()  # a checkpoint is never written from non-finite weights
        return save_checkpoint(self.accelerator, self.output_dir, self.state, self.cfg.train.keep_last)

    def finish(self) -> None:
        """Final checkpoint (unless the last step already wrote one) and progress bar close; the weights, which the
        trainer exports next, checked finite either way."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.state.step and self.state.bad_steps >= self.state.step:  # a run that never applied an update
            raise NonFiniteLossError(
                f"all {self.state.step} steps had a non-finite loss, so nothing was trained; stopping without "
                "exporting. Check the verifier (its features may be NaN) and the data, or lower train.lr")
        if self._consecutive_bad:  # the weights the run ends with may be what makes the loss non-finite
            last = complete_checkpoints(self.output_dir)
            raise NonFiniteLossError(
                f"the run's last {self._consecutive_bad} step(s) had a non-finite loss; stopping without "
                f"checkpointing or exporting the weights they ran on. Last good checkpoint: "
                f"{last[-1] if last else 'none written yet'}. Lower train.lr (now {self.cfg.train.lr:g}) or check "
                "the data")
        done = step_dir(self.output_dir, self.state.step)
        if not (done / "COMPLETE").is_file():
            self.save()
        else:
            self.check_weights()

    def print(self, message: str) -> None:
        """A line for people (main process, not when quiet), above the progress bar while one is shown."""
        if quiet():
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            self.accelerator.print(message)

    def summary(self) -> dict:
        """Where the run ended and the last logged value of every metric (main process), for the export metadata."""
        last: dict = {}
        for record in self.history:
            last.update(record)
        last.pop("step", None)
        return {"steps": self.state.step, "epochs": self.state.epoch + self.state.consumed / max(1, len(self.train_dl)),
                "bad_steps": self.state.bad_steps, "wall_time_s": round(time.perf_counter() - self._started, 3),
                **last, **run_summary(self.output_dir)}


def _progress(total: int, initial: int, desc: str):
    return EtaBar(total=total, initial=initial, desc=desc, dynamic_ncols=True, unit="step")
