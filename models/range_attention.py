"""Attention of each query over one contiguous range of keys, in memory linear in the keys: only a chunk of queries'
scores exists at a time, and the backward recomputes them from the saved log-sum-exp.

    out, lse = range_attention(q, k, v, lo, hi, scale)   # query i sees keys lo_i <= s < hi_i

The drafters' training attentions are ranges: EAGLE's TTT prefix (query t: keys from its document's start to t,
models/eagle/ttt.py) and DFlash's context (a block token: keys from its anchor's document start, or its window, to
its anchor, models/dflash/layer.py). Each merges the range's output with other keys' scores by the log-sum-exp.
`range_forward` / `range_backward` are the same computation without autograd, for a caller's own autograd Function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the elements of one query chunk's (B, heads, rows, keys) fp32 scores (64 MiB; about four such tensors live in the
#: backward): it sets the rows of a chunk
CHUNK_ELEMENTS = 1 << 24


def range_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                    scale: float, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, nh, M, d), k/v (B, nkv, S, d) (nh a multiple of nkv: head h reads kv head h // (nh / nkv)), lo/hi
    (B, M) int. -> out (B, nh, M, d) in q's dtype (0 where the range is empty), lse (B, nh, M) fp32 (fp64 for fp64 q;
    -inf where empty), both differentiable. Queries go in chunks of `chunk` rows (None: CHUNK_ELEMENTS scores), each
    over the keys its rows reach."""
    return _RangeAttention.apply(q, k, v, lo, hi, scale, chunk)


def range_chunks(lo: torch.Tensor, hi: torch.Tensor, heads: int, keys: int, chunk: int | None = None
                 ) -> list[tuple[int, int, int, int]]:
    """[(a, b, key_lo, key_hi)]: query rows a..b-1 over the keys any of them sees (one host sync)."""
    B, M = lo.shape
    rows = chunk or max(16, CHUNK_ELEMENTS // max(1, B * heads * keys))
    starts = list(range(0, M, rows))
    pad = len(starts) * rows - M
    lows = F.pad(lo, (0, pad), value=keys).view(B, -1, rows).amin((0, 2))
    highs = F.pad(hi, (0, pad), value=0).view(B, -1, rows).amax((0, 2))
    return [(a, min(a + rows, M), kl, kh) for a, kl, kh in zip(starts, lows.tolist(), highs.tolist())]


def _scores(q, k, lo, hi, scale, key_lo):
    """A chunk's queries stacked per kv head (B, nkv, G*c, d) and their masked scores (B, nkv, G, c, S), fp32."""
    B, nh, c, d = q.shape
    nkv, S = k.shape[1], k.shape[2]
    exact = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(exact).reshape(B, nkv, -1, d)  # heads h = j * G + g of kv head j, their rows stacked
    s = torch.matmul(qg, k.to(exact).transpose(-1, -2)).mul_(scale).view(B, nkv, -1, c, S)
    keys = torch.arange(key_lo, key_lo + S, device=q.device)
    hidden = (keys < lo[:, :, None]) | (keys >= hi[:, :, None])  # (B, c, S)
    return qg, s.masked_fill_(hidden[:, None, None], float("-inf"))


def range_forward(q, k, v, lo, hi, scale, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """`range_attention`'s values over the chunks of `plan` (`range_chunks`), without autograd."""
    B, nh, M, d = q.shape
    nkv = k.shape[1]
    exact = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(B, nh, M, d, dtype=q.dtype, device=q.device)
    lse = torch.full((B, nh, M), float("-inf"), dtype=exact, device=q.device)
    with torch.autocast(q.device.type, enabled=False):  # scores in fp32 under mixed precision too, as the backward
        for a, b, key_lo, key_hi in plan:  # (outside autocast) recomputes them
            if key_hi <= key_lo:
                continue  # no query of the chunk sees a key
            _, s = _scores(q[:, :, a:b], k[:, :, key_lo:key_hi], lo[:, a:b], hi[:, a:b], scale, key_lo)
            chunk_lse = torch.logsumexp(s, -1)  # (B, nkv, G, c); -inf on an empty row
            p = s.sub_(chunk_lse.nan_to_num(neginf=0.0)[..., None]).exp_().view(B, nkv, -1, key_hi - key_lo)
            out[:, :, a:b] = torch.matmul(p, v[:, :, key_lo:key_hi].to(exact)).view(B, nh, b - a, d)
            lse[:, :, a:b] = chunk_lse.view(B, nh, b - a)
    return out, lse


def range_backward(d_out, q, k, v, out, lse, d_lse, lo, hi, scale, plan):
    """dq (B, nh, M, d), dk, dv (B, nkv, S, d), fp32 (fp64 for fp64 q), of `range_forward`'s outputs given their
    gradients (d_lse None: none). dS = P (dP - rowsum(dO * out) + dL). A caller that merges the range's softmax with
    other keys' may pass instead the merged output as `out` and dO scaled by the range's share of the merged softmax
    as `d_out`: the rows are then the merged softmax's, and the gradients the range's part of the merged ones."""
    B, nh, M, d = q.shape
    nkv = k.shape[1]
    exact = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(B, nh, M, d, dtype=exact, device=q.device)
    dk = torch.zeros(B, nkv, k.shape[2], d, dtype=exact, device=q.device)
    dv = torch.zeros_like(dk)
    for a, b, key_lo, key_hi in plan:
        if key_hi <= key_lo:
            continue
        S, c = key_hi - key_lo, b - a
        qg, s = _scores(q[:, :, a:b], k[:, :, key_lo:key_hi], lo[:, a:b], hi[:, a:b], scale, key_lo)
        p = s.sub_(lse[:, :, a:b].to(exact).reshape(B, nkv, -1, c, 1).nan_to_num(neginf=0.0)).exp_()
        p = p.view(B, nkv, -1, S)  # (B, nkv, G*c, S)
        du = d_out[:, :, a:b].to(exact).reshape(B, nkv, -1, d)
        rows = (du * out[:, :, a:b].to(exact).reshape(B, nkv, -1, d)).sum(-1, keepdim=True)
        if d_lse is not None:
            rows = rows - d_lse[:, :, a:b].to(exact).reshape(B, nkv, -1, 1)
        dv[:, :, key_lo:key_hi] += torch.matmul(p.transpose(-1, -2), du)
        ds = torch.matmul(du, v[:, :, key_lo:key_hi].to(exact).transpose(-1, -2)).sub_(rows).mul_(p).mul_(scale)
        dq[:, :, a:b] = torch.matmul(ds, k[:, :, key_lo:key_hi].to(exact)).view(B, nh, c, d)
        dk[:, :, key_lo:key_hi] += torch.matmul(ds.transpose(-1, -2), qg)
    return dq, dk, dv


class _RangeAttention(torch.autograd.Function):
    """Plain torch on any device; grouped kv heads are read in place (the G query heads of a kv head stacked)."""

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, scale, chunk):
        plan = range_chunks(lo, hi, q.shape[1], k.shape[2], chunk)
        out, lse = range_forward(q, k, v, lo, hi, scale, plan)
        ctx.save_for_backward(q, k, v, lo, hi, out, lse)
        ctx.scale, ctx.plan = scale, plan
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, lo, hi, out, lse = ctx.saved_tensors
        d_out = torch.zeros_like(out) if d_out is None else d_out
        dq, dk, dv = range_backward(d_out, q, k, v, out, lse, d_lse, lo, hi, ctx.scale, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
