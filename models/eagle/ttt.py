"""Training-time test attention (pure): each unroll step sees the step-0 prefix causally plus its own chain.

`ttt_attention` never holds a (T, T) matrix for backward, on any device: the step-0 prefix goes through a kernel
that returns its output and log-sum-exp (the CPU's flash kernel; on CUDA the flash or memory-efficient SDPA op; else
`models.range_attention`, plain torch over query chunks: query t sees the keys from its document's start to t), the
query's own chain (k scores) is merged with it by the log-sum-exp, and the backward reruns the prefix kernel's
backward. Packed rows pass per-token document ids, from which each chunk's mask is built where it is needed; nothing
(T, T) is kept, not even the mask.

A sliding window W (`eagle.sliding_window`) is counted as vLLM serves it: a query at position p sees the keys at
positions p-W+1 .. p (W keys, itself included; flash-attn's window (W-1, 0)). Step k's query at stream position t
sits at position t+k, so it sees the prefix keys s >= t+k-W+1 and the chain keys of steps j > k-W (key t at
position t+j): the band narrows by one key a step, exactly as the drafter's KV cache looks to it at decode.

A later step need not query every position: `where` names the stream positions whose queries it computes (those
whose targets are still read, at this step or a later one); the prefix stays the whole row. When they are the first
m positions, that is causal attention over the first m keys (the fast path); else the query chunks carry a mask.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from draftheads.models.range_attention import CHUNK_ELEMENTS, range_backward, range_chunks, range_forward


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str | None = None,
                       prefix_mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """(T, (step+1)T) bool, True = attend: step `step`'s queries over keys [step 0 | step 1 | ... | step `step`].

    Query t sees step-0 keys s <= t (causal; `prefix_mask` (..., T, T) instead, e.g. causal inside each packed
    document) and, for each later step j <= step, only key t (its own chain). With a sliding `window` W (module
    docstring), only the keys within W positions of the query's t + step: s > t + step - W, and j > step - W. The
    definition, for tests and references: `ttt_attention` computes the same attention without it.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if prefix_mask is not None:
        causal = prefix_mask
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device).expand(*causal.shape[:-2], -1, -1)
    if window is not None:
        t = torch.arange(seq_len, device=device)
        causal = causal & (t[None, :] > t[:, None] + step - window)
        return torch.cat([causal] + [diagonal & (step - j < window) for j in range(1, step + 1)], dim=-1)
    return torch.cat([causal] + [diagonal] * step, dim=-1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  documents: torch.Tensor | None = None, *, kernel: Literal["fused", "chunked"] = "fused",
                  chunk: int | None = None, window: int | None = None, where: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Step k >= 0 of the TTT attention, (B, nh, T, d): what SDPA over [K_0 | ... | K_k] with `ttt_attention_mask`
    gives, without the (k+1)T-wide score matrix, in memory linear in T (step 0: causal attention over K_0).

    q (B, nh, T, d) (RoPE applied); keys, values: k+1 tensors (B, nkv, T, d), step 0 first (nh a multiple of nkv).
    documents (B, T) int, the document id of each token of packed rows (`data.documents.document_ids`; documents
    are contiguous): the prefix is causal inside each document, and a position's own chain is in its document.
    None: one document per row. window: a sliding window of W positions (module docstring); None: full attention.
    A window that covers the row (W >= T + k) is full attention and takes its path.
    where: (M,) int, sorted distinct stream positions of the M queries (q (B, nh, M, d) and the chain's keys and
    values (B, nkv, M, d) at those positions; keys[0], values[0] the whole row of T); None: every position, M = T.

    kernel "fused": the device's attention kernel over the prefix (CPU: SDPA's flash kernel; CUDA: the flash kernel
    for bf16/fp16 rows of one document, else the memory-efficient one), "chunked" where the device has none or it
    refuses the inputs; "chunked": `range_attention`'s (any device). chunk: query rows per chunk where the prefix is
    chunked (packed rows, or the chunked kernel); None sizes it to range_attention.CHUNK_ELEMENTS elements of a
    chunk's scores (chunked) or bias (fused). All give the same values and gradients within float rounding
    (tests/unit/test_ttt_attention.py).
    """
    if kernel not in ("fused", "chunked"):
        raise ValueError(f"ttt_attention: kernel={kernel!r}; expected 'fused' or 'chunked'")
    if window is not None and window < 1:
        raise ValueError(f"ttt_attention: window={window}; expected at least 1 position or None")
    T, M = keys[0].shape[2], q.shape[2]
    if where is not None:
        if where.dim() != 1 or where.numel() != M or (M and (int(where[0]) < 0 or int(where[-1]) >= T or
                                                              bool((where[1:] <= where[:-1]).any()))):
            raise ValueError(f"ttt_attention: where {tuple(where.shape)} must be {M} sorted distinct positions "
                             f"below {T}, one per query")
        if M and int(where[-1]) == M - 1:  # the first M positions: causal over the first M keys, the fast path
            keys, values = [keys[0][:, :, :M], *keys[1:]], [values[0][:, :, :M], *values[1:]]
            documents = None if documents is None else documents[:, :M]
            T, where = M, None
    elif M != T:
        raise ValueError(f"ttt_attention: {M} queries over a row of {T} keys; pass `where`, their positions")
    if window is not None and window >= T + len(keys) - 1:
        window = None  # every key in reach: full attention, its faster path
    return _TTTAttention.apply(q.contiguous(), documents, kernel, chunk, window, where, keys[0], values[0],
                               *keys[1:], *values[1:])


# ---- the prefix kernels: (output, log-sum-exp) of attention over the step-0 prefix, and its backward ---------------
# Each sees one query chunk q (B, nh, c, d) against the key slice k, v (B, nkv, S, d) it may attend to, with
# `allowed` (B or 1, 1, c, S) bool or None and `causal` (one square call over the whole row). forward -> o (B, nh, c, d)
# in q's dtype or fp32, lse (B, nh, c) and the kernel's own state for backward; backward(du, q, k, v, out, lse, ...)
# -> dq, dk, dv, where `out` is the *merged* output of the whole softmax and du the upstream gradient scaled by the
# prefix's share of it: a flash-style backward reads `out` only for rowsum(du * out), which is then the merged
# softmax's, so the prefix's gradients come out exact.

def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, nkv, S, d) -> (B, nkv * groups, S, d): one kv head per query head (head h = j * groups + g reads j)."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand_heads`: each kv head's copies summed back onto it."""
    if groups == 1:
        return x
    B, nh, S, d = x.shape
    return x.view(B, nh // groups, groups, S, d).sum(2)


def _bias(allowed: torch.Tensor, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
    """SDPA's additive form of a bool mask: 0 where attended, -inf elsewhere; the last dim's storage padded to a
    multiple of `align` (the memory-efficient kernel's alignment), the view unpadded."""
    S = allowed.shape[-1]
    padded = -(-S // align) * align
    bias = torch.zeros(*allowed.shape[:-1], padded, dtype=dtype, device=allowed.device)[..., :S]
    return bias.masked_fill_(~allowed, float("-inf"))


class _CpuFlashPrefix:
    """SDPA's CPU flash kernel (aten `_scaled_dot_product_flash_attention_for_cpu` and its backward): no (c, S)
    matrix beyond its tiles. It takes one kv head per query head (GQA copies of the slice, transient) and a mask only
    as a dense bias of q's dtype, (B, 1, c, S): packed rows are therefore chunked over queries, a bias of
    range_attention.CHUNK_ELEMENTS at most alive at a time and rebuilt in backward."""

    name = "cpu-flash"

    @staticmethod
    def forward(q, k, v, allowed, causal, scale):
        G = q.shape[1] // k.shape[1]
        bias = None if allowed is None else _bias(allowed, q.dtype)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand_heads(k, G), _expand_heads(v, G), 0.0, causal, attn_mask=bias, scale=scale)
        return o, lse, None

    @staticmethod
    def backward(du, q, k, v, out, lse, allowed, causal, scale, state):
        G = q.shape[1] // k.shape[1]
        bias = None if allowed is None else _bias(allowed, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            du.to(q.dtype), q, _expand_heads(k, G), _expand_heads(v, G), out.to(q.dtype), lse.contiguous(), 0.0,
            causal, attn_mask=bias, scale=scale)
        return dq, _sum_heads(dk, G), _sum_heads(dv, G)


class _CudaPrefix:
    """CUDA's fused SDPA ops, which return the log-sum-exp: the flash kernel (`_scaled_dot_product_flash_attention`,
    bf16/fp16, causal rows of one document) or the memory-efficient one (`_scaled_dot_product_efficient_attention`:
    fp32, or packed rows with a per-chunk bias aligned to 16; its log-sum-exp is padded to a multiple of 32 rows).
    GQA through copies of the key slice, as on the CPU. Any error falls back to `range_attention`'s computation
    (`_TTTAttention`)."""

    name = "cuda"

    @staticmethod
    def forward(q, k, v, allowed, causal, scale):
        G = q.shape[1] // k.shape[1]
        k, v = _expand_heads(k, G), _expand_heads(v, G)
        c = q.shape[2]
        if allowed is None and q.dtype in (torch.float16, torch.bfloat16):
            o, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale)
            return o, lse, ("flash", cum_q, cum_k, max_q, max_k, rng, unused)
        bias = None if allowed is None else _bias(allowed, q.dtype, align=16).expand(-1, q.shape[1], -1, -1)
        o, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale)
        return o, lse[..., :c], ("efficient", seed, offset)

    @staticmethod
    def backward(du, q, k, v, out, lse, allowed, causal, scale, state):
        G = q.shape[1] // k.shape[1]
        ke, ve = _expand_heads(k, G), _expand_heads(v, G)
        du, out = du.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        if state[0] == "flash":
            _, cum_q, cum_k, max_q, max_k, rng, unused = state
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                du, q, ke, ve, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, rng, unused,
                scale=scale)
        else:
            _, seed, offset = state
            B, nh, c, _ = q.shape
            padded = torch.zeros(B, nh, -(-c // 32) * 32, dtype=torch.float32, device=q.device)
            padded[..., :c] = lse
            bias = None if allowed is None else _bias(allowed, q.dtype, align=16).expand(-1, nh, -1, -1)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                du, q, ke, ve, bias, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, _sum_heads(dk, G), _sum_heads(dv, G)


def _fused_prefix(device: torch.device):
    return {"cpu": _CpuFlashPrefix, "cuda": _CudaPrefix}.get(device.type)


def _prefix_ranges(documents: torch.Tensor | None, B: int, T: int, device, window: int | None = None, step: int = 0,
                   where: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) (B, T): query t sees the step-0 keys lo_t <= s < t + 1, lo_t the start of its document (documents are
    contiguous; 0 for one document a row), or with a sliding window W at step k, the later of that and t+k-W+1.
    where (M,): the queries at those positions only, (B, M)."""
    index = torch.arange(T, device=device).expand(B, T)
    if documents is None:
        lo = torch.zeros_like(index)
    else:
        start = torch.ones_like(documents, dtype=torch.bool)
        start[:, 1:] = documents[:, 1:] != documents[:, :-1]
        lo = torch.where(start, index, 0).cummax(-1).values
    if window is not None:
        lo = torch.maximum(lo, index + (step - window + 1))
    if where is not None:
        return lo[:, where], index[:, where] + 1
    return lo, index + 1


def _band_rows(window: int | None, B: int) -> int | None:
    """Query rows of a fused chunk under a sliding window: about W, so a chunk's keys span about 2W and the kernel
    (which computes its whole masked chunk) does O(T W) work, not O(T^2); capped so a chunk's bias stays within
    range_attention.CHUNK_ELEMENTS. None (no window): range_chunks' own size."""
    if window is None:
        return None
    return max(64, min(window, CHUNK_ELEMENTS // (B * 2 * window)))


def _fused_forward(prefix, plan, q, k0, v0, lo, hi, scale):
    """o0 (B, nh, T, d), lse0 (B, nh, T) and each chunk's kernel state, over the chunks of `plan` (`range_chunks`;
    None: one causal call over the whole row), each chunk's mask built from the ranges."""
    if plan is None:
        o, lse, state = prefix.forward(q, k0, v0, None, True, scale)
        return o, lse, [state]
    outs, lses, states = [], [], []
    for a, b, key_lo, key_hi in plan:
        allowed = _allowed(lo, hi, a, b, key_lo, key_hi)
        o, lse, state = prefix.forward(q[:, :, a:b], k0[:, :, key_lo:key_hi], v0[:, :, key_lo:key_hi], allowed,
                                       False, scale)
        outs.append(o)
        lses.append(lse)
        states.append(state)
    return torch.cat(outs, 2), torch.cat(lses, 2), states


def _fused_backward(prefix, plan, states, upstream, q, k0, v0, out, lse0, lo, hi, scale):
    """dq (B, nh, T, d), dK_0, dV_0 (B, nkv, T, d) of the prefix block, the chunks' gradients summed."""
    if plan is None:
        return prefix.backward(upstream, q, k0, v0, out, lse0, None, True, scale, states[0])
    B, nh, M, d = q.shape
    exact = torch.promote_types(q.dtype, torch.float32)
    dq = torch.empty(B, nh, M, d, dtype=exact, device=q.device)
    dk0 = torch.zeros(B, k0.shape[1], k0.shape[2], d, dtype=exact, device=q.device)
    dv0 = torch.zeros_like(dk0)
    for (a, b, key_lo, key_hi), state in zip(plan, states):
        keys = slice(key_lo, key_hi)
        dq_c, dk_c, dv_c = prefix.backward(upstream[:, :, a:b], q[:, :, a:b], k0[:, :, keys], v0[:, :, keys],
                                           out[:, :, a:b], lse0[:, :, a:b], _allowed(lo, hi, a, b, key_lo, key_hi),
                                           False, scale, state)
        dq[:, :, a:b] = dq_c
        dk0[:, :, keys] += dk_c
        dv0[:, :, keys] += dv_c
    return dq, dk0, dv0


def _allowed(lo: torch.Tensor, hi: torch.Tensor, a: int, b: int, key_lo: int, key_hi: int) -> torch.Tensor:
    """(B, 1, b-a, key_hi-key_lo) bool: query t in a..b-1 sees key s in key_lo..key_hi-1 iff lo_t <= s < hi_t."""
    s = torch.arange(key_lo, key_hi, device=lo.device)
    return ((s >= lo[:, a:b, None]) & (s < hi[:, a:b, None]))[:, None]


def _fallback(prefix, error: Exception) -> None:
    warnings.warn(f"ttt_attention: the {prefix.name} attention kernel failed ({error}); using the chunked prefix "
                  f"(the same values, slower)", stacklevel=3)


class _TTTAttention(torch.autograd.Function):
    """The TTT attention as two blocks merged by their log-sum-exp: the step-0 prefix through a prefix kernel (above),
    which returns its output o_0 and logsumexp L_0 without a (T, T) probability matrix in memory, and the query's
    own chain, k scores s_j = q_t . k_jt. With L = logaddexp(L_0, logsumexp_j s_j):
        out = exp(L_0 - L) o_0 + sum_j exp(s_j - L) v_jt.
    Backward: the kernel's backward of the prefix block, given the upstream gradient scaled by exp(L_0 - L) and the
    merged output (it reads `out` only for rowsum(dO * out), which the merged softmax needs), gives the prefix's dq,
    dK_0, dV_0 exactly; the chain's terms are written out
    (dS = P * (dP - rowsum(dO * out))). Saved: q, K_0, V_0, the chain, out, L_0 and the chain's probabilities, all
    linear in T. The chain (k small) is a loop of elementwise products, in float32 (float64 for float64 inputs, so
    that a float64 unroll is exact). A fused kernel that fails (forward or backward) hands over to `range_attention`'s
    computation, which needs only L_0 and out.
    """

    @staticmethod
    def forward(ctx, q, documents, kernel, chunk, window, where, k0, v0, *chain):
        B, nh, T, d = q.shape  # T: the queries (where's M, else the row)
        nkv, S = k0.shape[1], k0.shape[2]
        G, n, scale = nh // nkv, len(chain) // 2, d ** -0.5
        exact = torch.promote_types(q.dtype, torch.float32)
        # a window of W <= k positions leaves step k no prefix key at all (t+k-W+1 > t), else every query some
        empty = window is not None and window <= n
        prefix = _fused_prefix(q.device) if kernel == "fused" and not empty else None
        lo, hi = _prefix_ranges(documents, B, S, q.device, window, n, where)
        o0 = None
        if empty:
            plan = states = None
            o0 = torch.zeros_like(q, dtype=exact)
            lse0 = torch.full((B, nh, T), float("-inf"), dtype=exact, device=q.device)
        elif prefix is not None:
            # one causal call over the row; packed rows and windows in chunks, the transient a (B, 1, c, S) bias
            plan = None if documents is None and window is None and where is None else range_chunks(
                lo, hi, 1, S, chunk or _band_rows(window, B))
            try:
                o0, lse0, states = _fused_forward(prefix, plan, q, k0, v0, lo, hi, scale)
            except RuntimeError as error:  # a kernel that refuses these inputs: chunked, never a (T, T) matrix
                _fallback(prefix, error)
        if o0 is None:
            prefix, plan, states = None, range_chunks(lo, hi, nh, S, chunk), None
            o0, lse0 = range_forward(q, k0, v0, lo, hi, scale, plan)
        lse0 = lse0.to(exact).view(B, nkv, G, T)  # heads h = j * G + g share kv head j
        if n:
            q5 = q.to(exact).view(B, nkv, G, T, d)
            own = torch.stack([(q5 * k.to(exact)[:, :, None]).sum(-1) for k in chain[:n]], -1).mul_(scale)
            if window is not None and window < n:  # chain key j (step j+1) is n-1-j positions back
                own[..., :n - window] = float("-inf")
            lse = torch.logaddexp(lse0, torch.logsumexp(own, -1))  # (B, nkv, G, T)
            weight0 = (lse0 - lse).exp_()  # the prefix block's share of the softmax
            p_own = own.sub_(lse[..., None]).exp_()  # (B, nkv, G, T, k)
            out = o0.to(exact).view(B, nkv, G, T, d) * weight0[..., None]
            for j, v in enumerate(chain[n:]):
                out += p_own[..., j, None] * v.to(exact)[:, :, None]
            out = out.view(B, nh, T, d).to(q.dtype)
        else:  # step 0: the prefix alone
            weight0 = p_own = None
            out = o0.to(q.dtype)
        ctx.save_for_backward(q, documents, where, k0, v0, lse0, weight0, p_own, out, *chain)
        ctx.prefix, ctx.plan, ctx.states, ctx.chunk = prefix, plan, states, chunk  # prefix None: range_attention's
        ctx.window, ctx.empty = window, empty
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, documents, where, k0, v0, lse0, weight0, p_own, out, *chain = ctx.saved_tensors
        B, nh, T, d = q.shape
        nkv, S = k0.shape[1], k0.shape[2]
        G, n, scale = nh // nkv, len(chain) // 2, d ** -0.5
        exact = torch.promote_types(q.dtype, torch.float32)
        d5 = d_out.to(exact).reshape(B, nkv, G, T, d)
        upstream = d5 if weight0 is None else d5 * weight0[..., None]
        upstream, lse0 = upstream.view(B, nh, T, d), lse0.view(B, nh, T)
        lo, hi = _prefix_ranges(documents, B, S, q.device, ctx.window, n, where)
        dq = None
        if ctx.empty:  # no prefix key: the chain's terms alone
            dq, dk0, dv0 = torch.zeros_like(q, dtype=exact), torch.zeros_like(k0), torch.zeros_like(v0)
        elif ctx.prefix is not None:
            try:
                dq, dk0, dv0 = _fused_backward(ctx.prefix, ctx.plan, ctx.states, upstream, q, k0, v0, out, lse0, lo,
                                               hi, scale)
            except RuntimeError as error:  # range_attention's backward needs only L_0 and the merged output
                _fallback(ctx.prefix, error)
        if dq is None:
            plan = ctx.plan if ctx.prefix is None else range_chunks(lo, hi, nh, S, ctx.chunk)
            dq, dk0, dv0 = range_backward(upstream, q, k0, v0, out, lse0, None, lo, hi, scale, plan)
        dq = dq.to(exact)
        d_keys, d_values = [], []
        if n:
            rows = (d5 * out.to(exact).view(B, nkv, G, T, d)).sum(-1)  # rowsum(dO * out), (B, nkv, G, T)
            q5, dq5 = q.to(exact).view(B, nkv, G, T, d), dq.view(B, nkv, G, T, d)
            for j in range(n):
                k, v, p = chain[j].to(exact)[:, :, None], chain[n + j].to(exact)[:, :, None], p_own[..., j]
                d_values.append((p[..., None] * d5).sum(2).to(chain[n + j].dtype))
                ds = ((d5 * v).sum(-1) - rows) * p * scale  # (B, nkv, G, T)
                dq5 += ds[..., None] * k
                d_keys.append((ds[..., None] * q5).sum(2).to(chain[j].dtype))
        return (dq.to(q.dtype), None, None, None, None, None, dk0.to(k0.dtype), dv0.to(v0.dtype), *d_keys,
                *d_values)
