"""The optimizer and the learning-rate schedule of a training run.

`train.optimizer: adamw` (the default) trains every parameter with AdamW. `muon` trains the drafter's hidden
matrices (fc, attention and MLP projections, Medusa's ResBlocks) with Muon, the orthogonalised momentum update
(torch.optim.Muon's, models/muon.py) that speculators uses for its drafters, and the rest (the output heads,
norms, vectors) with AdamW, in one optimizer (`MuonAdamW`: one state dict, one schedule). Muon's update is scaled to
AdamW's size (`match_rms_adamw`), so `train.lr` serves both. `train.optimizer_state: bfloat16` keeps AdamW's two
moments in bf16 (`CompactAdamW`, models/adamw.py): half the state, where it dominates the memory (DFlash's and
Medusa's drafters at 8B shapes).

AdamW runs torch's fused kernel where every parameter is a floating-point tensor on a CPU or CUDA device (the same
update, one pass over each tensor: at Llama-3.1-8B shapes 0.3 against 2.4 CPU-seconds a step for 308M weights on two
cores), else torch's default implementation.
"""

from __future__ import annotations

import torch

from draftheads.models.adamw import CompactAdamW
from draftheads.models.muon import MuonAdamW
from draftheads.models.schedule import warmup_cosine_schedule
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
    param_groups = [{**g, "params": _tensors(g["params"])} if isinstance(g, dict) else g for g in param_groups]
    if cfg.train.optimizer_state == "bfloat16":
        return CompactAdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                            weight_decay=cfg.train.weight_decay, seed=cfg.train.seed)
    return torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                             weight_decay=cfg.train.weight_decay, fused=fusable(param_groups) or None)


def fusable(param_groups: list) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters (tensors or param-group dicts): each a floating-point
    tensor on a CPU or CUDA device."""
    params = [p for g in param_groups for p in (_tensors(g["params"]) if isinstance(g, dict) else [g])]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _tensors(params) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


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
