"""Muon (torch.optim.Muon's update) with the Newton-Schulz orthogonalisation in a chosen dtype.

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
    group["nesterov"]), orthogonalised by `newton_schulz` in ns_dtype. Shared by Muon and train/optim.MuonAdamW."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - group["momentum"])
    update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
    return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], eps, ns_dtype)


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, checks, param groups and state), with `ns_dtype` for the orthogonalisation.
    ns_dtype=torch.bfloat16 gives torch's update to the bit (tests/unit/test_muon.py)."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
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
                grad = p.grad
                if grad.ndim != 2:
                    raise ValueError(f"Muon updates 2-D matrices; got a parameter of shape {tuple(p.shape)}")
                update = muon_update(grad, self.state[p], group, group["eps"], self.ns_dtype)
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
