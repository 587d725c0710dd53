"""Training-time test attention (pure): each unroll step sees the step-0 prefix causally plus its own chain."""

from __future__ import annotations

import torch


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str | None = None,
                       prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(T, (step+1)T) bool, True = attend: step `step`'s queries over keys [step 0 | step 1 | ... | step `step`].

    Query t sees step-0 keys s <= t (causal; `prefix_mask` (..., T, T) instead, e.g. causal inside each packed
    document) and, for each later step j <= step, only key t (its own chain).
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if prefix_mask is not None:
        causal = prefix_mask
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device).expand(*causal.shape[:-2], -1, -1)
    return torch.cat([causal] + [diagonal] * step, dim=-1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Step k >= 1 of the TTT attention, (B, nh, T, d): what SDPA over [K_0 | ... | K_k] with `ttt_attention_mask`
    gives, without the (k+1)T-wide score matrix.

    q (B, nh, T, d) (RoPE applied); keys, values: k+1 tensors (B, nkv, T, d), step 0 first (nh a multiple of nkv).
    prefix_mask (B, 1, T, T) bool replaces the causal mask over the step-0 keys: packed rows pass the causal mask
    inside each document (`data.documents.causal_document_mask`); a position's own chain is in its document.

    On the CPU the prefix goes through SDPA's flash kernel (`_PrefixFlashTTT`); elsewhere autograd runs the lines
    below. Both give the same values and gradients within float rounding (tests/unit/test_eagle.py).
    """
    if q.device.type == "cpu":
        bias = None
        if prefix_mask is not None:  # SDPA's additive form: 0 where attended, -inf elsewhere
            bias = torch.zeros(prefix_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~prefix_mask,
                                                                                              float("-inf"))
        return _PrefixFlashTTT.apply(q.contiguous(), bias, keys[0], values[0], *keys[1:], *values[1:])
    B, nh, T, d = q.shape
    groups = nh // keys[0].shape[1]

    def per_head(x):  # GQA: each kv head serves `groups` query heads
        return x.repeat_interleave(groups, dim=1) if groups > 1 else x

    scale = d ** -0.5
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if prefix_mask is None else prefix_mask
    prefix = (q @ per_head(keys[0]).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))  # (B, nh, T, T)
    chain_k = torch.stack([per_head(k) for k in keys[1:]], dim=3)  # (B, nh, T, k, d)
    chain_v = torch.stack([per_head(v) for v in values[1:]], dim=3)
    own = torch.einsum("bhtd,bhtkd->bhtk", q, chain_k) * scale  # (B, nh, T, k): q_t . k_{j,t}
    exact = torch.promote_types(q.dtype, torch.float32)  # softmax in float32 (float64 inputs: float64)
    p = torch.softmax(torch.cat([prefix, own], dim=-1).to(exact), dim=-1).to(q.dtype)  # (B, nh, T, T + k)
    return p[..., :T] @ per_head(values[0]) + torch.einsum("bhtk,bhtkd->bhtd", p[..., T:], chain_v)


class _PrefixFlashTTT(torch.autograd.Function):
    """The TTT attention as two blocks merged by their log-sum-exp: the step-0 prefix through SDPA's CPU flash
    kernel, which returns its output o_0 and logsumexp L_0 without a (T, T) probability matrix in memory, and the
    query's own chain, k scores q_t . k_jt. With L = logaddexp(L_0, logsumexp_j s_j):
        out = exp(L_0 - L) o_0 + sum_j exp(s_j - L) v_jt.
    Backward: the flash kernel's backward of the prefix block, given the upstream gradient scaled by exp(L_0 - L)
    and the *merged* output (it reads `out` only for rowsum(dO * out), which the merged softmax needs), gives the
    prefix's dq, dK_0, dV_0 exactly; the chain's terms are written out (dS = P * (dP - rowsum(dO * out))).
    Against autograd over `ttt_attention`'s lines this skips, per step, the (T, T) score and probability matrices
    (scaled, masked, concatenated with the chain's scores, and sliced again in the gradient) and the chain's GQA
    copies: about 2.5x less time on a CPU. The chain (k small) is a loop of elementwise products, in float32
    (float64 for float64 inputs, so that a float64 unroll is exact).
    """

    @staticmethod
    def forward(ctx, q, bias, k0, v0, *chain):
        B, nh, T, d = q.shape
        nkv = k0.shape[1]
        G, n, scale = nh // nkv, len(chain) // 2, d ** -0.5
        k0e = k0.repeat_interleave(G, dim=1) if G > 1 else k0  # the kernel wants one kv head per query head
        v0e = v0.repeat_interleave(G, dim=1) if G > 1 else v0
        o0, lse0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k0e, v0e, 0.0, bias is None, attn_mask=bias, scale=scale)  # (B, nh, T, d), (B, nh, T) float32
        exact = torch.promote_types(q.dtype, torch.float32)
        q5 = q.to(exact).view(B, nkv, G, T, d)  # heads h = j * G + g share kv head j
        own = torch.stack([(q5 * k.to(exact)[:, :, None]).sum(-1) for k in chain[:n]], -1).mul_(scale)  # (B,nkv,G,T,k)
        lse0 = lse0.view(B, nkv, G, T)
        lse = torch.logaddexp(lse0, torch.logsumexp(own, -1))
        weight0 = (lse0 - lse).exp_()  # the prefix block's share of the softmax
        p_own = own.sub_(lse[..., None]).exp_()
        out = o0.to(exact).view(B, nkv, G, T, d) * weight0[..., None]
        for j, v in enumerate(chain[n:]):
            out += p_own[..., j, None] * v.to(exact)[:, :, None]
        out = out.view(B, nh, T, d).to(q.dtype)
        ctx.save_for_backward(q, bias, k0e, v0e, lse0, weight0, p_own, out, *chain)
        ctx.kv_dtypes = k0.dtype, v0.dtype
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, bias, k0e, v0e, lse0, weight0, p_own, out, *chain = ctx.saved_tensors
        B, nh, T, d = q.shape
        n, scale = len(chain) // 2, d ** -0.5
        nkv = chain[0].shape[1]
        G = nh // nkv
        exact = torch.promote_types(q.dtype, torch.float32)
        d5 = d_out.to(exact).reshape(B, nkv, G, T, d)
        upstream = (d5 * weight0[..., None]).view(B, nh, T, d).to(q.dtype)
        dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            upstream, q, k0e, v0e, out, lse0.view(B, nh, T), 0.0, bias is None, attn_mask=bias, scale=scale)
        if G > 1:  # the GQA copies' gradients, summed back onto their kv head
            dk0, dv0 = dk0.view(B, nkv, G, T, d).sum(2), dv0.view(B, nkv, G, T, d).sum(2)
        rows = (d5 * out.to(exact).view(B, nkv, G, T, d)).sum(-1)  # rowsum(dO * out), (B, nkv, G, T)
        q5, dq5 = q.to(exact).view(B, nkv, G, T, d), dq.to(exact).view(B, nkv, G, T, d)
        d_keys, d_values = [], []
        for j in range(n):
            k, v, p = chain[j].to(exact)[:, :, None], chain[n + j].to(exact)[:, :, None], p_own[..., j]
            d_values.append((p[..., None] * d5).sum(2).to(chain[n + j].dtype))
            ds = ((d5 * v).sum(-1) - rows) * p * scale  # (B, nkv, G, T)
            dq5 += ds[..., None] * k
            d_keys.append((ds[..., None] * q5).sum(2).to(chain[j].dtype))
        return (dq5.view(B, nh, T, d).to(q.dtype), None, dk0.to(ctx.kv_dtypes[0]), dv0.to(ctx.kv_dtypes[1]),
                *d_keys, *d_values)
