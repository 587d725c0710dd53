"""Pieces of a drafter layer's training forward that keep less for the backward than the plain modules do, with the
same arithmetic: under bf16 autocast a Llama layer keeps three bf16 copies of the attention input (one per q/k/v
projection's cast), two of the MLP input, and four (T, intermediate) tensors of its MLP (gate, SiLU(gate), up and
their product). Here the input is cast once for all its projections (`cast_once`), and the MLP keeps only gate and
up (`swiglu_mlp`: SiLU(gate) and the product are recomputed in the backward, elementwise, where they are read). At
Llama-3.1-8B's shapes that is 94 of the 268 KiB a token that one EAGLE-3 TTT step kept.

Both run autograd's own ops in the same dtypes, the projections as the modules (so autocast's weight cache and
DeepSpeed's and FSDP's module hooks see them as usual); the one difference is where a cast input's gradients are
summed: in fp32 after each is cast (as separate casts give them), not in bf16 before (as one shared cast would).
Results equal the modules' within float rounding (tests/unit/test_lean_layer.py). Under activation checkpointing
(`checkpoint_layers`) the MLP keeps what checkpointing decides.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


_enabled = True


@contextmanager
def plain_modules():
    """Inside: `cast_once` and `swiglu_mlp` run the plain modules (for side-by-side measurements and tests)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast fp32 `x` to for a matmul, or None (autocast off, or x not fp32)."""
    device = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


class _CastOnce(torch.autograd.Function):
    """x (fp32) -> `n` aliases of one copy of x in `dtype`; their gradients are cast to fp32 each, then summed."""

    @staticmethod
    def forward(ctx, x, dtype, n):
        cast = x.to(dtype)
        return tuple(cast.view_as(cast) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                total = g.float() if total is None else total + g.float()
        return total, None, None


def cast_once(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """`n` inputs for `n` projections of x: under autocast, aliases of x cast once (one copy kept for all their
    backwards instead of one each), each projection's gradient reaching x in fp32 as through its own cast; else x
    itself n times."""
    dtype = _autocast_dtype(x)
    if dtype is None or not (_enabled and torch.is_grad_enabled() and x.requires_grad):
        return (x,) * n
    return _CastOnce.apply(x, dtype, n)


class _SiluMul(torch.autograd.Function):
    """SiLU(gate) * up, keeping gate and up (autograd's graph keeps gate, SiLU(gate) and up); the backward is
    autograd's, op for op, with SiLU(gate) recomputed."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


class _Recompute:
    """What `_recomputed`'s pack hook keeps of the product: its view's geometry, nothing of its data."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()


def _recomputed(product: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, outer):
    """saved_tensors_hooks under which what the down projection saves of `product` (the tensor or a view of it) is
    not kept but recomputed from gate and up (which `_SiluMul` keeps anyway) when its backward reads it; every other
    saved tensor goes through `outer`, the hooks active before (a measurement's), if any."""
    storage = product.untyped_storage().data_ptr()

    def pack(t):
        if t.untyped_storage().data_ptr() == storage:
            return _Recompute(t)
        return outer[0](t) if outer else t

    def unpack(packed):
        if isinstance(packed, _Recompute):  # bit for bit the forward's product: the same ops on the same inputs
            return (F.silu(gate) * up).as_strided(packed.shape, packed.stride, packed.offset)
        return outer[1](packed) if outer else packed

    return pack, unpack


def _checkpointing(hooks) -> bool:
    """Whether the active saved-tensor hooks are activation checkpointing's (torch.utils.checkpoint, non-reentrant:
    its forward or its recomputation): it already decides what is kept, and holding gate and up here would undo it."""
    return hooks is not None and any(name in getattr(hooks[0], "__qualname__", "")
                                     for name in ("_checkpoint_hook", "_recomputation_hook"))


def swiglu_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama-style MLP, down(act(gate(x)) * up(x)), keeping gate and up only (`_SiluMul`, and `_recomputed`'s hooks
    on the down projection) when it is SiLU without biases and gradients are needed; as the module otherwise."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    lean = (_enabled and torch.is_grad_enabled() and silu
            and all(isinstance(getattr(mlp, name, None), nn.Linear) and getattr(mlp, name).bias is None
                    for name in ("gate_proj", "up_proj", "down_proj")))
    if not lean:
        return mlp(x)
    to_gate, to_up = cast_once(x, 2)
    gate, up = mlp.gate_proj(to_gate), mlp.up_proj(to_up)
    product = _SiluMul.apply(gate, up)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if _checkpointing(outer):
        return mlp.down_proj(product)
    with torch.autograd.graph.saved_tensors_hooks(*_recomputed(product, gate, up, outer)):
        return mlp.down_proj(product)
