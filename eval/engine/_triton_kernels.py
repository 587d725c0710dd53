"""Triton kernels behind `draftheads.eval.engine.kernels`. Import `draftheads.eval.engine.kernels`, not this module: this one needs triton at import time
(compiled kernels, or interpreted ones when TRITON_INTERPRET=1 was set before triton was imported).

Exactness. Every decision here repeats the torch reference's float operations in the same order: products and
comparisons (`u * p(x) < q(x)`), `max(q - p, 0)`, IEEE division (`div_rn`; Triton's plain `/` on fp32 compiles
to the approximate `div.approx.f32` for sm_90), argmax with ties to the lowest index. The one thing that cannot be
repeated is the order of a float32 sum (the residual's normaliser): it may differ from torch's in the last bit,
which can change a discrete outcome only when a uniform or a ratio falls within one rounding step of a boundary.
Greedy acceptance has no sums and is exact. Launch with `enable_fp_fusion=False` so no multiply-add is fused.
"""

import triton
import triton.language as tl


# ---- argmax over the vocabulary ----------------------------------------------------------------------------------
@triton.jit
def _block_argmax_update(best, where, x, idx):
    """Per-lane running max: a lane keeps its earliest index on ties (strict >)."""
    upd = x > best
    return tl.where(upd, x, best), tl.where(upd, idx, where)


@triton.jit
def _finish_argmax(best, where, V):
    """Lowest index among the lanes holding the maximum (torch.argmax's tie rule); 0 when everything is -inf."""
    m = tl.max(best, axis=0)
    return tl.min(tl.where(best == m, where, V), axis=0) % V


@triton.jit
def argmax_rows_kernel(x_ptr, out_ptr, V, stride_row, BLOCK_V: tl.constexpr):
    """out[r] = argmax(x[r, :V]); one program per row r. x may be bf16/fp16/fp32 (compared in fp32, exactly)."""
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_row
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK_V], tl.int32)
    for off in range(0, V, BLOCK_V):
        idx = off + lanes
        x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        best, where = _block_argmax_update(best, where, x, idx)
    tl.store(out_ptr + r, _finish_argmax(best, where, V).to(tl.int64))


# ---- greedy acceptance over a tree -------------------------------------------------------------------------------
@triton.jit
def greedy_walk_kernel(argmax_ptr, tokens_ptr, parents_ptr, depth_ptr, anc_ptr,
                       num_acc_ptr, path_ptr, next_ptr,
                       N, D, s_par_b, s_dep_b, s_anc_b, s_anc_i,
                       NP: tl.constexpr, DP: tl.constexpr):
    """One program per row: the deepest node whose whole path matches the verifier's argmax (ties: lowest index).

    argmax (B, N+1): the verifier's argmax after each node; tokens (B, N): nodes 1..N; parents / depth (B, N+1);
    anc (B, N+1, N+1) uint8 ancestor-or-self matrix. Writes num_accepted (B,), path (B, D+1), next_token (B,).
    """
    b = tl.program_id(0).to(tl.int64)
    N1 = N + 1
    i = tl.arange(0, NP)
    valid = i < N1
    inner = valid & (i > 0)
    par = tl.load(parents_ptr + b * s_par_b + i, mask=inner, other=0)
    tok = tl.load(tokens_ptr + b * N + i - 1, mask=inner, other=-1)
    tgt = tl.load(argmax_ptr + b * N1 + i, mask=valid, other=0)
    tgt_par = tl.load(argmax_ptr + b * N1 + par, mask=inner, other=-2)
    match = (tok == tgt_par) | (i == 0)  # a node's token equals the argmax at its parent; the root always
    anc = tl.load(anc_ptr + b * s_anc_b + i[:, None] * s_anc_i + i[None, :],
                  mask=valid[:, None] & valid[None, :], other=0).to(tl.int32)  # (NP, NP) [node, ancestor]
    bad = tl.where(match, 0, 1)
    ok = (tl.sum(anc * bad[None, :], axis=1) == 0) & valid
    dep = tl.load(depth_ptr + b * s_dep_b + i, mask=valid, other=0)
    score = tl.where(ok, dep * (N + 2) + (N1 - i), -1)  # deepest first, then the lowest index; all distinct
    top = tl.max(score, axis=0)
    best = tl.sum(tl.where(score == top, i, 0), axis=0)
    a = tl.sum(tl.where(i == best, dep, 0), axis=0)
    nxt = tl.sum(tl.where(i == best, tgt, 0), axis=0)
    on_path = tl.sum(tl.where(i[:, None] == best, anc, 0), axis=0)  # (NP,) ancestors-or-self of best
    d = tl.arange(0, DP)
    hit = (on_path[None, :] != 0) & (dep[None, :] == d[:, None])  # (DP, NP): the path's node at depth d
    node_at = tl.sum(tl.where(hit, i[None, :], 0), axis=1)
    path = tl.where(d <= a, node_at, best)
    tl.store(path_ptr + b * (D + 1) + d, path.to(tl.int64), mask=d < D + 1)
    tl.store(num_acc_ptr + b, a.to(tl.int64))
    tl.store(next_ptr + b, nxt.to(tl.int64))


# ---- stochastic acceptance over a tree ---------------------------------------------------------------------------
@triton.jit
def _load_q(q_row, scratch, in_scratch, idx, n):
    """q at idx < n: the residual in scratch, or the verifier's row q_row; masked loads, so only one is read.
    (The masks come from integer bounds: combining a vector mask with a scalar flag trips the interpreter.)"""
    qs = tl.load(scratch + idx, mask=idx < n * in_scratch, other=0.0)
    qt = tl.load(q_row + idx, mask=idx < n * (1 - in_scratch), other=0.0)
    return tl.where(in_scratch != 0, qs, qt)


@triton.jit
def _load_p(p_row, x, idx, m, P_MODE: tl.constexpr):
    """The draft distribution at idx: a dense row (0), one-hot at x (1), zero (2)."""
    if P_MODE == 0:
        p = tl.load(p_row + idx, mask=m, other=0.0)
    elif P_MODE == 1:
        p = tl.where(idx == x, 1.0, 0.0)
    else:
        p = tl.zeros(idx.shape, tl.float32)
    return p


@triton.jit
def _residual(q_row, scratch, in_scratch, p_row, x, V, P_MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    """scratch <- normalize(max(q - p, 0)), or q itself where nothing is left (draftheads.eval.engine.acceptance._residual).
    Reads q before writing the same element (same lane), so q may be the scratch row itself."""
    lanes = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for off in range(0, V, BLOCK_V):
        idx = off + lanes
        m = idx < V
        q = _load_q(q_row, scratch, in_scratch, idx, V)
        acc += tl.maximum(q - _load_p(p_row, x, idx, m, P_MODE), 0.0)
    s = tl.sum(acc, axis=0)
    denom = tl.maximum(s, 1e-30)
    for off in range(0, V, BLOCK_V):
        idx = off + lanes
        m = idx < V
        q = _load_q(q_row, scratch, in_scratch, idx, V)
        r = tl.maximum(q - _load_p(p_row, x, idx, m, P_MODE), 0.0)
        out = tl.where(s > 0, tl.math.div_rn(r, tl.zeros_like(r) + denom), q)
        tl.store(scratch + idx, out, mask=m)


@triton.jit
def _sample(q_row, scratch, in_scratch, noise_row, V, BLOCK_V: tl.constexpr):
    """argmax(q / noise): a sample from q with Exponential(1) noise (draftheads.eval.engine.acceptance.sample_from)."""
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK_V], tl.int32)
    for off in range(0, V, BLOCK_V):
        idx = off + lanes
        m = idx < V
        q = _load_q(q_row, scratch, in_scratch, idx, V)
        e = tl.load(noise_row + idx, mask=m, other=1.0)
        x = tl.where(m, tl.math.div_rn(q, e), float("-inf"))
        best, where = _block_argmax_update(best, where, x, idx)
    return _finish_argmax(best, where, V)


@triton.jit
def sample_walk_kernel(tokens_ptr, children_ptr, dprobs_ptr, tprobs_ptr, uniform_ptr, noise_ptr, scratch_ptr,
                       num_acc_ptr, path_ptr, next_ptr,
                       N, D, K, V, s_ch_b, s_ch_i, s_ch_k,
                       HAS_PROBS: tl.constexpr, IS_CHAIN: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row: multi-candidate recursive rejection sampling (draftheads.eval.engine.acceptance.sample_tree; for a
    chain, sample_chain, whose bonus token is drawn from the renormalised verifier row).

    tokens (B, N); children (B, N+1, K) -1 padded; dprobs (B, N, V) fp32 (unused without HAS_PROBS: one-hot);
    tprobs (B, N+1, V) fp32; uniform (B, N); noise (B, V); scratch (B, V) fp32 workspace.
    """
    b = tl.program_id(0).to(tl.int64)
    N1 = N + 1
    zero = b * 0  # int64 scalars for every loop-carried value
    cur = zero  # current node
    alive = zero + 1  # still descending
    a = zero  # accepted draft tokens
    q_node = zero  # q is the verifier's row at q_node ...
    in_scratch = zero  # ... or, after a rejection, the residual in scratch
    scratch = scratch_ptr + b * V
    noise_row = noise_ptr + b * V
    tl.store(path_ptr + b * (D + 1), zero)
    for d in range(1, D + 1):
        moved = zero
        for c in range(K):
            child = tl.load(children_ptr + b * s_ch_b + cur * s_ch_i + c * s_ch_k)
            if (alive != 0) & (moved == 0) & (child >= 0):
                node = child
                x = tl.load(tokens_ptr + b * N + node - 1)
                u = tl.load(uniform_ptr + b * N + node - 1)
                q_row = tprobs_ptr + (b * N1 + q_node) * V
                qx = _load_q(q_row, scratch, in_scratch, x, V)
                p_row = dprobs_ptr + (b * N + node - 1) * V
                if HAS_PROBS:
                    px = tl.load(p_row + x)
                else:
                    px = 1.0
                if u * px < qx:  # accept with probability min(1, q(x) / p(x))
                    cur = node
                    moved = zero + 1
                    q_node = node
                    in_scratch = zero
                else:  # q <- normalize((q - p)+), and the next sibling is tried against it
                    if HAS_PROBS:
                        _residual(q_row, scratch, in_scratch, p_row, x, V, 0, BLOCK_V)
                    else:
                        _residual(q_row, scratch, in_scratch, p_row, x, V, 1, BLOCK_V)
                    in_scratch = zero + 1
        a += moved * alive
        alive = alive * moved
        tl.store(path_ptr + b * (D + 1) + d, cur)
    q_row = tprobs_ptr + (b * N1 + q_node) * V
    if IS_CHAIN:
        if in_scratch == 0:  # every draft accepted: sample_chain draws the bonus from normalize(q)
            _residual(q_row, scratch, in_scratch, q_row, zero, V, 2, BLOCK_V)
            in_scratch = zero + 1
    nxt = _sample(q_row, scratch, in_scratch, noise_row, V, BLOCK_V)
    tl.store(num_acc_ptr + b, a)
    tl.store(next_ptr + b, nxt.to(tl.int64))


# ---- KV-cache compaction -----------------------------------------------------------------------------------------
@triton.jit
def compact_kernel(table_ptr, positions_ptr, base_ptr, path_ptr, P, s_b, s_h, s_slot, s_pos_b, HD,
                   ELEM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (buffer, row, kv head): slot base+path[j] -> slot base+j for j = 0..P-1, in increasing j.

    table (n_buffers,) int64: the data pointers of every layer's key and value buffer (B, H_kv, C, hd), all of one
    dtype; elements are moved as ELEM-byte integers (bit-exact for any float type). Increasing j needs no
    gather-first copy: path[j] >= j, so no slot is read after it was written (and padding entries, which repeat
    the last accepted node, re-read a slot that only a no-op move ever wrote). Program (0, row, 0) also sets
    positions[row, base+j] = base+j, like StaticKVCache.compact.
    """
    buf = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    addr = tl.load(table_ptr + buf)
    if ELEM == 1:
        ptr = addr.to(tl.pointer_type(tl.int8), bitcast=True)
    elif ELEM == 2:
        ptr = addr.to(tl.pointer_type(tl.int16), bitcast=True)
    elif ELEM == 4:
        ptr = addr.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        ptr = addr.to(tl.pointer_type(tl.int64), bitcast=True)
    row = ptr + b * s_b + h * s_h
    base = tl.load(base_ptr + b)
    lanes = tl.arange(0, BLOCK_D)
    m = lanes < HD
    for j in range(P):
        src = base + tl.load(path_ptr + b * P + j)
        dst = base + j
        if src != dst:
            v = tl.load(row + src * s_slot + lanes, mask=m)
            tl.store(row + dst * s_slot + lanes, v, mask=m)
    if (buf == 0) & (h == 0):
        for j in range(P):
            tl.store(positions_ptr + b * s_pos_b + base + j, base + j)
