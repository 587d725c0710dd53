"""The run's Accelerator and its experiment tracking: one `Accelerator` per run (mixed precision, gradient
accumulation, the launch's processes), which claims the run folder (train/run_folder.py: lock, record, config.yaml)
before anything is loaded; wandb through Accelerate's tracker (offline unless an API key is configured), its mode
and folders settled before anything is loaded too (eval/measure/wandb_check.py: no API key, no network or a
read-only HOME end in one line or a fallback within seconds, never after training), started by `start_tracking`
only once the verifier and the data passed their checks, so a failed attempt leaves no wandb run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from draftheads.eval.measure.wandb_check import TrackingError, prepare_wandb
from draftheads.train.config import ConfigError, RunConfig, config_dict
from draftheads.train.run_folder import claim_run_folder, on_main_process
from draftheads.train.zero import before_accelerator, settle_deepspeed


def build_accelerator(cfg: RunConfig):
    """One Accelerator per run (mixed precision, gradient accumulation), its launch checked and its run folder
    claimed; trackers are configured but start with `start_tracking`."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if cfg.train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.mixed_precision=fp16 needs a CUDA GPU; use `bf16` or `no` on the CPU")
    log_with = "wandb" if cfg.wandb.enabled else None
    accelerator = Accelerator(
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_steps=cfg.train.grad_accum,
        log_with=log_with,
        project_dir=cfg.output_dir,
        step_scheduler_with_optimizer=False,  # we step the schedule once per optimizer step, whatever the world size
        kwargs_handlers=before_accelerator(),  # DeepSpeed without GPUs: the gloo group (train/zero.py)
    )
    settle_deepspeed(accelerator, cfg)  # a DeepSpeed launch trains what the run config says, or stops here
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        # `accelerate launch --multi_gpu` on a machine without GPUs starts N independent single-process runs that
        # would all write output_dir; refuse instead of training N unsynchronised copies.
        raise ConfigError(
            f"launched as {launched} processes (WORLD_SIZE={launched}) but Accelerate set up "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); without GPUs set ACCELERATE_USE_CPU=true "
            "(or `accelerate launch --cpu --num_processes N`) so the processes train together over gloo")
    if accelerator.gradient_accumulation_steps != cfg.train.grad_accum:
        # A launch config (DeepSpeed's gradient_accumulation_steps, ACCELERATE_GRADIENT_ACCUMULATION_STEPS) overrides
        # the argument; the global batch would silently differ from the run config's.
        raise ConfigError(
            f"the accelerate launch config sets gradient_accumulation_steps={accelerator.gradient_accumulation_steps} "
            f"but train.grad_accum={cfg.train.grad_accum}; make them equal")
    set_seed(cfg.train.seed)
    claim_run_folder(accelerator, cfg)  # one run per folder: lock, record, config.yaml; before anything is loaded
    if cfg.wandb.enabled:
        cfg.wandb.mode = on_main_process(accelerator, lambda: _settle_wandb(accelerator, cfg))
    return accelerator


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide singletons, so the next Accelerator built in this process starts fresh (one
    process that trains several runs one after another: tests, benchmark scripts)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # True: the PartialState too
    GradientState._reset_state()


def _settle_wandb(accelerator, cfg: RunConfig) -> str:
    """The wandb mode this run logs in (main process), after `prepare_wandb`'s checks; its notes printed."""
    try:
        mode, notes = prepare_wandb(cfg.wandb.mode, cfg.output_dir, "wandb.mode")
    except TrackingError as err:
        raise ConfigError(str(err)) from None
    for note in notes:
        accelerator.print(note)
    return mode


def start_tracking(accelerator, cfg: RunConfig) -> None:
    """wandb (when enabled), once everything before training was checked."""
    if accelerator.log_with:
        init_wandb(accelerator, cfg)


def init_wandb(accelerator, cfg: RunConfig) -> None:
    project = cfg.wandb.project or os.environ.get("WANDB_PROJECT") or "draftheads"
    init_kwargs = {"name": cfg.wandb.run_name or Path(cfg.output_dir).name, "dir": cfg.output_dir,
                   "mode": cfg.wandb.mode}  # as `build_accelerator` settled it
    if cfg.wandb.entity:
        init_kwargs["entity"] = cfg.wandb.entity
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    accelerator.init_trackers(project, config=config_dict(cfg), init_kwargs={"wandb": init_kwargs})


def log_table(accelerator, key: str, columns: list[str], rows: list[list], step: int | None = None) -> None:
    """A wandb table (e.g. per-head accuracy) at `step` (the training step; None: wandb's own counter); no-op
    without wandb. Main process only."""
    if not accelerator.is_main_process or not accelerator.log_with:
        return
    import wandb

    tracker = accelerator.get_tracker("wandb", unwrap=True)
    tracker.log({key: wandb.Table(columns=columns, data=rows)}, step=step)
