"""The optimizer and the learning-rate schedule of a training run.

`train.optimizer: adamw` (the default) trains every parameter with AdamW. `muon` trains the drafter's hidden
matrices (fc, attention and MLP projections, Medusa's ResBlocks) with Muon, the orthogonalised momentum update
(torch.optim.Muon's, models/tiny/muon.py) that speculators uses for its drafters, and the rest (the output heads,
norms, vectors) with AdamW, in one optimizer (`MuonAdamW`: one state dict, one schedule). Muon's update is scaled to
AdamW's size (`match_rms_adamw`), so `train.lr` serves both.
"""

from __future__ import annotations

import math

import torch

from draftheads.models.schedule import warmup_cosine_schedule
from draftheads.models.tiny.muon import adjusted_lr, muon_update
from draftheads.train.config import ConfigError, RunConfig

#: Parameters kept on AdamW under `train.optimizer: muon` although they are matrices: vocabulary-sized heads and
#: embeddings (Muon is for hidden-to-hidden maps, as in its paper and in speculators).
ADAMW_MATRICES = ("lm_head", "embed")


def build_optimizer(param_groups, cfg: RunConfig) -> torch.optim.Optimizer:
    """The run's optimizer over the trainable parameters (a module, an iterable of tensors, or param-group dicts;
    `train.optimizer: muon` needs a module, whose parameter names say which matrices Muon takes)."""
    if cfg.train.optimizer == "muon":
        if not isinstance(param_groups, torch.nn.Module):
            raise ConfigError("train.optimizer=muon: this trainer's optimizer takes parameter groups (Medusa-2's "
                              "adapters and heads at two learning rates); use train.optimizer=adamw")
        muon, adamw = muon_split(param_groups)
        device = (muon or adamw)[0].device
        native = device.type == "cuda" or _native_bf16()
        return MuonAdamW(muon, adamw, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                         weight_decay=cfg.train.weight_decay, ns_dtype=torch.bfloat16 if native else torch.float32)
    if isinstance(param_groups, torch.nn.Module):
        param_groups = [p for p in param_groups.parameters() if p.requires_grad]
    return torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                             weight_decay=cfg.train.weight_decay)


def _native_bf16() -> bool:
    from draftheads.models.tiny.pretrain import native_bf16

    return native_bf16()


def muon_split(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Muon's parameters: trainable 2-D matrices other than heads and embeddings; AdamW's: every other trainable
    parameter), in the module's order."""
    muon, adamw = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and not any(part in name for part in ADAMW_MATRICES)
        (muon if hidden_matrix else adamw).append(p)
    return muon, adamw


def cosine_schedule(optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The project's one schedule (models/schedule.py): linear warm-up over train.warmup_steps to each group's lr,
    then cosine decay to lr x min_lr_ratio at the last of train.max_steps. Stepped once per optimizer step."""
    return warmup_cosine_schedule(optimizer, cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.min_lr_ratio)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for `muon_params` (torch.optim.Muon's update: Nesterov momentum 0.95, five Newton-Schulz steps in
    `ns_dtype`, scaled by `match_rms_adamw`) and AdamW for `adamw_params` (torch.optim.AdamW's update), one
    optimizer: group 0 is Muon's (`use_muon`), group 1 AdamW's; both decay weights by lr x weight_decay."""

    def __init__(self, muon_params, adamw_params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.0, eps: float = 1e-8, momentum: float = 0.95,
                 ns_dtype: torch.dtype = torch.float32):
        groups = [{"params": list(muon_params), "use_muon": True}, {"params": list(adamw_params), "use_muon": False}]
        groups = [g for g in groups if g["params"]]
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": True, "ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "ns_eps": 1e-7,
                    "adjust_lr_fn": "match_rms_adamw"}
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = float(group["lr"]), group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                p.mul_(1 - lr * decay)
                if group["use_muon"]:
                    update = muon_update(grad, state, group, group["ns_eps"], self.ns_dtype)
                    p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
                    continue
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                beta1, beta2 = group["betas"]
                step = float(state["step"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))
        return loss
