"""AdamW whose two moments are kept in bf16: half of AdamW's state, for drafters where the state dominates the memory
(`train.optimizer_state: bfloat16`, train/optim.py).

    optimizer = CompactAdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0, seed=0)

The update is torch.optim.AdamW's (decoupled decay, bias-corrected moments, eps outside the square root), computed in
fp32 from the stored moments; only the stored moments are bf16 (2 bytes each instead of 4: 4 bytes of state per
trained weight instead of 8). Writing a moment back to bf16 rounds stochastically (up or down with the probabilities
that make the rounding unbiased), because rounding to nearest would lose every change smaller than half a bf16 step
(2^-9 of the value): with beta2 = 0.999 the second moment moves by 0.1% a step, so it would never move at all.

The rounding noise is a function of (seed, the parameter's place in the optimizer, its step count, the chunk), not of
a random generator's state: every data-parallel process draws the same noise for the same update (its replicas stay
equal), and a run resumed from a checkpoint (whose state holds the step counts) continues exactly as the run that was
not stopped. Each tensor is updated in chunks of `chunk` elements, so the fp32 temporaries are a few chunks, never a
copy of the whole state (Medusa's 4 x 525M-weight heads at Llama-3 shapes).
"""

from __future__ import annotations

import math

import torch

CHUNK = 1 << 22
"""Elements updated at a time (16 MiB of each fp32 temporary)."""
_LOW_MASK = (1 << 16) - 1
_HIGH_MASK = -(1 << 16)  # 0xFFFF0000 as an int32: the bits a bf16 keeps of an fp32


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 up or down at random, with the probability of rounding up equal to the distance
    from the lower neighbour over the step, so the rounded value equals `x` in expectation. Returns a bf16 tensor."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_MASK + 1, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    # fp32 is sign-magnitude: adding to the low bits moves the magnitude, whatever the sign; then truncate them
    return ((bits + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)


class CompactAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with bf16 moments written back by stochastic rounding; see the module doc."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, seed: int = 0, state_dtype: torch.dtype = torch.bfloat16,
                 chunk: int = CHUNK):
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"CompactAdamW(state_dtype={state_dtype}): expected torch.bfloat16 or torch.float32")
        if chunk < 1:
            raise ValueError(f"CompactAdamW(chunk={chunk}): expected a positive number of elements")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.seed, self.state_dtype, self.chunk = int(seed), state_dtype, int(chunk)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state tensor to its parameter's dtype (fp32) when loading: store them as ours
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], group["eps"]
            for p in group["params"]:
                index += 1  # the parameter's place in the optimizer: part of its rounding noise's seed
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CompactAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.contiguous_format)
                state["step"] += 1
                step = int(state["step"].item())
                p.mul_(1 - lr * group["weight_decay"])
                noise = _noise(self.seed, index, step, p.device) if self.state_dtype == torch.bfloat16 else None
                _update_(*map(_local, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])), lr=lr, beta1=beta1,
                         beta2=beta2, eps=eps, step=step, chunk=self.chunk, generator=noise)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this process (FSDP2 shards a parameter, its gradient and the state made like it alike),
    else the tensor: the update is elementwise, so each process updates its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def _noise(seed: int, index: int, step: int, device: torch.device) -> torch.Generator:
    """The generator of one parameter's rounding noise at one step (one stream over its chunks)."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + index) * 2_147_483_659 + step & (2**63 - 1))
    return gen


def _update_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
             beta1: float, beta2: float, eps: float, step: int, chunk: int,
             generator: torch.Generator | None) -> None:
    """One AdamW moment-and-weight update of `p` (after its decay), chunk by chunk over the flattened tensors; with a
    `generator`, the moments are written back stochastically rounded to their (bf16) dtype."""
    bias1, bias2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
    flat_p = p.view(-1) if p.is_contiguous() else None
    target = flat_p if flat_p is not None else p.detach().clone().view(-1)
    g_all, m_all, v_all = grad.reshape(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    for start in range(0, target.numel(), chunk):
        end = min(start + chunk, target.numel())
        g = g_all[start:end].float()
        m = m_all[start:end].float().lerp_(g, 1 - beta1)
        v = v_all[start:end].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if generator is None:
            m_all[start:end].copy_(m)
            v_all[start:end].copy_(v)
        else:
            m_all[start:end].copy_(stochastic_round_bf16(m, generator))
            v_all[start:end].copy_(stochastic_round_bf16(v, generator))
        denom = v.sqrt().div_(bias2_sqrt).add_(eps)  # v may be the stored fp32 moment itself
        target[start:end].addcdiv_(m, denom, value=-lr / bias1)
    if flat_p is None:
        p.copy_(target.view_as(p))
