"""The optimizer and the learning-rate schedule of a training run."""

from __future__ import annotations

import torch

from draftheads.models.schedule import warmup_cosine_schedule
from draftheads.train.config import RunConfig


def build_optimizer(param_groups, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (a module, an iterable of tensors, or param-group dicts)."""
    if isinstance(param_groups, torch.nn.Module):
        param_groups = [p for p in param_groups.parameters() if p.requires_grad]
    return torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                             weight_decay=cfg.train.weight_decay)


def cosine_schedule(optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The project's one schedule (models/schedule.py): linear warm-up over train.warmup_steps to each group's lr,
    then cosine decay to lr x min_lr_ratio at the last of train.max_steps. Stepped once per optimizer step."""
    return warmup_cosine_schedule(optimizer, cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.min_lr_ratio)
