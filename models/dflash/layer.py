"""The DFlash drafter's decoder layer: Qwen3-shaped (q/k norms, SwiGLU MLP), its attention's queries from the block
only, its keys and values from the fused context followed by the block. Module names are z-lab's `dflash` 0.1.0
`Qwen3DFlashDecoderLayer`'s, so a state dict moves between the two unchanged."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.models.dflash.config import DFlashConfig


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

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of inputs x (B, N, H) at the positions of cos/sin: (B, nkv, N, d) each, keys normed and
        rotated. The context (the fused verifier features) and the block both go through this."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
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


#: the elements of one query chunk's (B, heads, rows, keys) fp32 scores in `range_attention` (64 MiB; about four
#: such tensors live in its backward)
CHUNK_ELEMENTS = 1 << 24


def range_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                    scale: float, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over one contiguous range of keys, and its log-sum-exp, in memory linear in the
    keys: q (B, nh, M, d), k/v (B, nkv, S, d) (nh a multiple of nkv), lo/hi (B, M) int, query i seeing keys
    lo_i <= s < hi_i. -> out (B, nh, M, d) in q's dtype (0 where the range is empty), lse (B, nh, M) fp32 (fp64 for
    fp64 q; -inf where empty), both differentiable. Queries go in chunks of `chunk` rows (None: CHUNK_ELEMENTS
    scores), each over the keys its rows reach; the backward recomputes each chunk's scores from the log-sum-exp."""
    return _RangeAttention.apply(q, k, v, lo, hi, scale, chunk)


class _RangeAttention(torch.autograd.Function):
    """Plain torch on any device; grouped kv heads are read in place (the G query heads of a kv head stacked)."""

    @staticmethod
    def _chunks(lo, hi, B, nh, M, S, chunk):
        """[(a, b, key_lo, key_hi)]: query rows a..b-1 over the keys any of them sees (one host sync)."""
        rows = chunk or max(16, CHUNK_ELEMENTS // max(1, B * nh * S))
        starts = list(range(0, M, rows))
        pad = len(starts) * rows - M
        lows = F.pad(lo, (0, pad), value=S).view(B, -1, rows).amin((0, 2))
        highs = F.pad(hi, (0, pad), value=0).view(B, -1, rows).amax((0, 2))
        return [(a, min(a + rows, M), kl, kh) for a, kl, kh in zip(starts, lows.tolist(), highs.tolist())]

    @staticmethod
    def _scores(q, k, lo, hi, scale, key_lo):
        """The chunk's queries stacked per kv head (B, nkv, G*c, d) and their masked scores (B, nkv, G, c, S')."""
        B, nh, c, d = q.shape
        nkv, S = k.shape[1], k.shape[2]
        exact = torch.promote_types(q.dtype, torch.float32)
        qg = q.to(exact).reshape(B, nkv, -1, d)
        s = torch.matmul(qg, k.to(exact).transpose(-1, -2)).mul_(scale).view(B, nkv, -1, c, S)
        keys = torch.arange(key_lo, key_lo + S, device=q.device)
        hidden = (keys < lo[:, :, None]) | (keys >= hi[:, :, None])  # (B, c, S')
        return qg, s.masked_fill_(hidden[:, None, None], float("-inf"))

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, scale, chunk):
        B, nh, M, d = q.shape
        nkv = k.shape[1]
        exact = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(B, nh, M, d, dtype=q.dtype, device=q.device)
        lse = torch.full((B, nh, M), float("-inf"), dtype=exact, device=q.device)
        plan = _RangeAttention._chunks(lo, hi, B, nh, M, k.shape[2], chunk)
        for a, b, key_lo, key_hi in plan:
            if key_hi <= key_lo:
                continue  # no query of the chunk sees a key
            _, s = _RangeAttention._scores(q[:, :, a:b], k[:, :, key_lo:key_hi], lo[:, a:b], hi[:, a:b], scale,
                                           key_lo)
            chunk_lse = torch.logsumexp(s, -1)  # (B, nkv, G, c); -inf on an empty row
            p = s.sub_(chunk_lse.nan_to_num(neginf=0.0)[..., None]).exp_().view(B, nkv, -1, key_hi - key_lo)
            out[:, :, a:b] = torch.matmul(p, v[:, :, key_lo:key_hi].to(exact)).view(B, nh, b - a, d)
            lse[:, :, a:b] = chunk_lse.view(B, nh, b - a)
        ctx.save_for_backward(q, k, v, lo, hi, out, lse)
        ctx.scale, ctx.plan = scale, plan
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, lo, hi, out, lse = ctx.saved_tensors
        B, nh, M, d = q.shape
        nkv = k.shape[1]
        exact = lse.dtype
        dq = torch.zeros(B, nh, M, d, dtype=exact, device=q.device)
        dk = torch.zeros(B, nkv, k.shape[2], d, dtype=exact, device=q.device)
        dv = torch.zeros_like(dk)
        d_out = torch.zeros_like(out) if d_out is None else d_out
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
        for a, b, key_lo, key_hi in ctx.plan:
            if key_hi <= key_lo:
                continue
            S, c = key_hi - key_lo, b - a
            qg, s = _RangeAttention._scores(q[:, :, a:b], k[:, :, key_lo:key_hi], lo[:, a:b], hi[:, a:b], ctx.scale,
                                            key_lo)
            chunk_lse = lse[:, :, a:b].reshape(B, nkv, -1, c, 1).nan_to_num(neginf=0.0)
            p = s.sub_(chunk_lse).exp_().view(B, nkv, -1, S)  # (B, nkv, G*c, S)
            du = d_out[:, :, a:b].to(exact).reshape(B, nkv, -1, d)
            # dS = P (dP - rowsum(dO * out) + dL): the log-sum-exp's own gradient enters beside the output's
            rows = (du * out[:, :, a:b].to(exact).reshape(B, nkv, -1, d)).sum(-1, keepdim=True)
            rows = rows - d_lse[:, :, a:b].reshape(B, nkv, -1, 1)
            dv[:, :, key_lo:key_hi] += torch.matmul(p.transpose(-1, -2), du)
            ds = torch.matmul(du, v[:, :, key_lo:key_hi].to(exact).transpose(-1, -2)).sub_(rows).mul_(p)
            ds.mul_(ctx.scale)
            dq[:, :, a:b] = torch.matmul(ds, k[:, :, key_lo:key_hi].to(exact)).view(B, nh, c, d)
            dk[:, :, key_lo:key_hi] += torch.matmul(ds.transpose(-1, -2), qg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


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
        x = self.input_layernorm(hidden)
        q = attn.queries(x, cos, sin)
        k, v = attn.kv(x, cos, sin)
        h = hidden + attn.o_proj(attend(attn.layer_idx, q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))
