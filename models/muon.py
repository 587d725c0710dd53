"""Muon (torch.optim.Muon's update) with the Newton-Schulz orthogonalisation in a chosen dtype: `Muon` for the
embedded verifier's pretraining (models/tiny/pretrain.py), `MuonAdamW` for a drafter's training (train/optim.py).

torch.optim.Muon always orthogonalises in bf16. A CPU that multiplies bf16 in hardware (AVX512-BF16, AMX) does
that fast; every other x86-64 CPU emulates it, and there one Newton-Schulz pass over a 768 x 256 matrix took
248 ms in bf16 against 22 ms in fp32 (measured on a 2-core AMD EPYC without AVX-512, one thread): the embedded
verifier's build spent most of its time there. So the build picks the dtype per machine
(`draftheads.models.tiny.pretrain.compute_dtype`): bf16 where it is native, which is torch's update exactly, and
fp32 elsewhere, the same iteration with less rounding.
"""

from __future__ import annotations

import math

import torch


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of a 2-D `update`, run in `dtype`
    (the same steps as torch.optim.Muon's, which runs them in bf16). Returns a tensor of `dtype`."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:  # iterate on the wide side: X X^T is the smaller Gram matrix
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate scaling by the matrix's shape (A, B)."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    return lr


def muon_update(grad: torch.Tensor, state: dict, group: dict, eps: float, ns_dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's update direction for one matrix: the momentum buffer in `state` (Nesterov when
    group["nesterov"]), orthogonalised by `newton_schulz` in ns_dtype."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - group["momentum"])
    update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
    return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], eps, ns_dtype)


def muon_step_(p: torch.Tensor, state: dict, group: dict, eps: float, ns_dtype: torch.dtype) -> None:
    """One Muon step for the matrix `p` (its .grad set), in place: weight decay by lr x weight_decay, then the
    orthogonalised momentum update scaled by the matrix's shape (`adjusted_lr`)."""
    lr = float(group["lr"])
    update = muon_update(p.grad, state, group, eps, ns_dtype)
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


def adamw_step_(p: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.AdamW's step for `p` (its .grad set), in place: decoupled decay by lr x weight_decay, then the
    bias-corrected Adam update."""
    lr, grad = float(group["lr"]), p.grad
    p.mul_(1 - lr * group["weight_decay"])
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


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(param_groups):
    """(group, parameter) for every parameter that has a gradient, group by group."""
    return ((group, p) for group in param_groups for p in group["params"] if p.grad is not None)


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, checks, param groups and state), with `ns_dtype` for the orthogonalisation.
    ns_dtype=torch.bfloat16 gives torch's update to the bit (tests/unit/test_muon.py)."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group, p in _with_grads(self.param_groups):
            if p.grad.ndim != 2:
                raise ValueError(f"Muon updates 2-D matrices; got a parameter of shape {tuple(p.shape)}")
            muon_step_(p, self.state[p], group, group["eps"], self.ns_dtype)
        return loss


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
        loss = _closure_loss(closure)
        for group, p in _with_grads(self.param_groups):
            if group["use_muon"]:
                muon_step_(p, self.state[p], group, group["ns_eps"], self.ns_dtype)
            else:
                adamw_step_(p, self.state[p], group)
        return loss
