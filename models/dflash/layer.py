"""The DFlash drafter's decoder layer: Qwen3-shaped (q/k norms, SwiGLU MLP), its attention's queries from the block
only, its keys and values from the fused context followed by the block. Module names are z-lab's `dflash` 0.1.0
`Qwen3DFlashDecoderLayer`'s, so a state dict moves between the two unchanged."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.models.dflash.config import DFlashConfig
from draftheads.models.lean_layer import cast_once, swiglu_mlp
from draftheads.models.range_attention import range_attention


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 (Qwen3's)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (default rope) for positions (B, N): cos, sin (B, N, d), angles computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
                                / head_dim))  # (d/2,)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, N, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, N, d) rotated by cos/sin (B, N, d)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Block queries over [context; block] keys and values. Projections, q_norm / k_norm (per head), then RoPE."""

    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.layer_type = cfg.layer_type(layer_idx)
        self.sliding_window = cfg.sliding_window if self.layer_type == "sliding_attention" else None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, N, _ = x.shape
        return x.view(B, N, n, self.head_dim)  # (B, N, heads, d)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_v: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of inputs x (B, N, H) at the positions of cos/sin: (B, nkv, N, d) each, keys normed and
        rotated. The context (the fused verifier features) and the block both go through this. x_v: the values'
        input when it is another alias of x (`cast_once`)."""
        x_k, x_v = (x, x_v) if x_v is not None else cast_once(x, 2)
        k = self.k_norm(self._heads(self.k_proj(x_k), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x_v), self.num_kv_heads).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries of the block x (B, N, H): (B, nh, N, d), normed and rotated."""
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T * scaling + mask) v with grouped kv heads: q (B, nh, N, d), k/v (B, nkv, S, d), mask
        broadcastable to (B, nh, N, S), bool (True = attend) or additive, None = all visible. -> (B, N, nh*d)."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)  # (B, nh, N, d)
        B, _, N, _ = out.shape
        return out.transpose(1, 2).reshape(B, N, -1)

    def attend_ranges(self, q: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor,
                      v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, own_mask: torch.Tensor,
                      chunk: int | None = None) -> torch.Tensor:
        """Training's attention for A blocks of N tokens side by side, the anchored block mask's without scoring
        the (A-1)*N keys of other blocks that it hides, nor the context keys past a block's anchor: each block token
        attends to its context range lo <= s < hi (`anchored_context_ranges`, (B, A*N) each) and to its own
        block's keys `own_mask` (N, N) allows, in one softmax over both. The context goes through
        `range_attention` (query chunks, scores recomputed in the backward), the own block is scored in full, the
        two merged by their log-sum-exp. q (B, nh, A*N, d); context_kv (B, nkv, T, d) each; k/v (B, nkv, A*N, d)
        the blocks'. Kept for the backward: q, k, v, the context's output and log-sum-exp and the (A, N, N) own
        scores, nothing (A*N, T). -> (B, A*N, nh*d), equal to `attend` with `anchored_block_mask` (to float
        rounding)."""
        groups = self.num_heads // self.num_kv_heads
        kc, vc = context_kv
        B, nh, AN, d = q.shape
        N = own_mask.shape[0]
        A = AN // N
        acc = torch.promote_types(q.dtype, torch.float32)  # the softmax in fp32 (fp64 for an fp64 drafter)
        o_context, lse_context = range_attention(q, kc, vc, lo, hi, self.scaling, chunk)  # (B,nh,AN,d), (B,nh,AN)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        qb, kb, vb = (t.reshape(B, nh, A, N, d) for t in (q, k, v))
        scores_own = torch.matmul(qb * self.scaling, kb.transpose(-1, -2)).to(acc).masked_fill(~own_mask, -torch.inf)
        lse = torch.logaddexp(lse_context.view(B, nh, A, N), torch.logsumexp(scores_own, -1))  # (B, nh, A, N)
        p_own = (scores_own - lse[..., None]).exp()  # (B, nh, A, N, N)
        out = ((lse_context.view(B, nh, A, N) - lse).exp()[..., None] * o_context.view(B, nh, A, N, d).to(acc)
               + torch.matmul(p_own, vb.to(acc))).to(q.dtype)  # (B, nh, A, N, d)
        return out.view(B, nh, AN, d).transpose(1, 2).reshape(B, AN, nh * d)


#: attend(layer_idx, q (B, nh, N, d), k, v (B, nkv, N, d) of the block's own tokens) -> (B, N, nh*d): the caller
#: puts the context's keys/values (however it keeps them) in front of the block's and runs the attention.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    """One drafter layer (pre-norm): h = x + o_proj(attn(input_layernorm(x))); out = h + mlp(post_norm(h))."""

    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        attn = self.self_attn
        x_q, x_k, x_v = cast_once(self.input_layernorm(hidden), 3)  # one cast kept under autocast, not three
        q = attn.queries(x_q, cos, sin)
        k, v = attn.kv(x_k, cos, sin, x_v)
        h = hidden + attn.o_proj(attend(attn.layer_idx, q, k, v))
        return h + swiglu_mlp(self.mlp, self.post_attention_layernorm(h))  # the MLP keeps gate and up only
