"""DFlash2's grouped dynamic convolution: a short causal convolution along the block, whose per-tap coefficients are
a learned per-channel base plus a token-dependent term shared by each group of channels.

For block position j (0 = the anchor) and channel c in group g = c // group_size:

    out[j, c] = sum_{tap < taps, tap <= j} (base[tap, c] + delta[j, tap, g]) * x[j - tap, c]

so position j mixes positions j - taps + 1 .. j of its own block, never another block's (the anchor mixes nothing).
`GroupedConv` holds two such convolutions around one sublayer (attention or MLP): `prepare` convolves the sublayer's
input and returns the output side's coefficients, computed from that same input; `finish` convolves the sublayer's
output with them. Both deltas come from one linear map of the sublayer's input. Names and shapes are vLLM's
(qwen3_dflash2.py `DFlashGroupedConv`): base_kernel [2, taps, H], kernel_projection.weight [2 * taps * G, H].
At initialisation the base is the identity (tap 0 is 1, the rest 0) and the projection is zero, so a fresh DFlash2
layer computes what a DFlash layer does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_len: int) -> torch.Tensor:
    """x (B, T, H) with T a whole number of blocks of `block_len` laid side by side; delta (B, T, taps, G) the
    token-dependent coefficients at each output position; base (taps, H). -> (B, T, H), see the module docstring."""
    B, T, H = x.shape
    taps, G = delta.shape[-2], delta.shape[-1]
    if T % block_len:
        raise ValueError(f"grouped_conv: {T} positions are not whole blocks of {block_len}")
    xb = x.view(B, T // block_len, block_len, G, H // G)  # (B, nb, Nb, G, gs)
    coef = base.view(taps, G, H // G).to(x.dtype) + delta.view(B, T // block_len, block_len, taps, G, 1).to(x.dtype)
    out = coef[:, :, :, 0] * xb
    for tap in range(1, min(taps, block_len)):
        shifted = F.pad(xb[:, :, :-tap], (0, 0, 0, 0, tap, 0))  # position j reads j - tap; zeros before the block
        out = out + coef[:, :, :, tap] * shifted
    return out.reshape(B, T, H)


class GroupedConv(nn.Module):
    """The pair of grouped dynamic convolutions around one sublayer (module docstring)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} does not divide hidden_size={hidden_size}")
        self.taps, self.num_groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 passes each channel through, every other coefficient is zero."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, H) the sublayer's input -> (its convolution, the output side's delta (B, T, taps, G))."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.num_groups)
        return grouped_conv(x, delta[..., 0, :, :], self.base_kernel[0], block_len), delta[..., 1, :, :]

    def finish(self, x: torch.Tensor, delta: torch.Tensor, block_len: int) -> torch.Tensor:
        """x (B, T, H) the sublayer's output, convolved with the output side's base and `delta`."""
        return grouped_conv(x, delta, self.base_kernel[1], block_len)
