"""`ttt_attention`'s prefix kernels (the CPU flash kernel, the chunked one, CUDA's fused ops) against plain autograd
over the (T, T) scores: values and gradients of q, every key and every value, with GQA, with and without packed
documents; and what they keep for backward, which grows linearly in T."""

import warnings

import pytest
import torch

from draftheads.data.documents import causal_document_mask, document_ids
from draftheads.models.eagle import ttt_attention


def positions(T):
    """(2, T): row 0 packs documents of 10, 1, 19 and T-30 tokens, row 1 is one document; chunks of the prefix start
    inside, at and across document boundaries."""
    packed = list(range(10)) + [0] + list(range(19)) + list(range(T - 30))
    return torch.tensor([packed, list(range(T))])


def autograd_ttt(q, keys, values, prefix_mask=None):
    """The reference: softmax over [causal (or `prefix_mask`) scores against K_0 | the chain's own scores], autograd
    through the (B, nh, T, T) matrices."""
    B, nh, T, d = q.shape
    groups = nh // keys[0].shape[1]

    def per_head(x):
        return x.repeat_interleave(groups, dim=1)

    scale = d ** -0.5
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if prefix_mask is None else prefix_mask
    prefix = (q @ per_head(keys[0]).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))  # (B, nh, T, T)
    own = [(q * per_head(k)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # (B, nh, T, 1) each
    exact = torch.promote_types(q.dtype, torch.float32)
    p = torch.softmax(torch.cat([prefix, *own], dim=-1).to(exact), dim=-1)
    out = p[..., :T] @ per_head(values[0]).to(exact)
    for j, v in enumerate(values[1:]):
        out = out + p[..., T + j, None] * per_head(v).to(exact)
    return out


def inputs(dtype, nkv, step, device="cpu", T=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, nh, d = 2, 4, 8

    def make(heads):
        return torch.randn(B, heads, T, d, generator=g).to(device=device, dtype=dtype).requires_grad_()

    return make(nh), [make(nkv) for _ in range(step + 1)], [make(nkv) for _ in range(step + 1)]


def assert_matches_reference(q, keys, values, packed, rtol, **options):
    rows = positions(q.shape[2]).to(q.device)
    documents = document_ids(rows) if packed else None
    out = ttt_attention(q, keys, values, documents, **options)
    reference = autograd_ttt(q, keys, values, causal_document_mask(rows) if packed else None)
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1), dtype=reference.dtype)
    weights = weights.to(q.device)
    got = [out.to(reference.dtype)] + list(torch.autograd.grad((out * weights).sum(), [q, *keys, *values]))
    want = [reference] + list(torch.autograd.grad((reference * weights).sum(), [q, *keys, *values]))
    names = ["out", "dq"] + [f"dk{j}" for j in range(len(keys))] + [f"dv{j}" for j in range(len(values))]
    for name, a, b in zip(names, got, want):
        error = ((a.to(b.dtype) - b).abs().max() / b.abs().max()).item()  # relative to the tensor's scale
        assert error <= rtol, f"{name}: {error:.2e} relative ({options}, packed={packed})"


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("nkv", [4, 2])  # MHA and GQA
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("options", [dict(kernel="fused"), dict(kernel="fused", chunk=8), dict(kernel="chunked"),
                                     dict(kernel="chunked", chunk=5)], ids=["fused", "fused-8", "chunked", "chunked-5"])
def test_every_kernel_equals_autograd_over_the_full_scores(dtype, rtol, nkv, packed, options):
    for step in (0, 1, 3):  # step 0: the prefix alone
        q, keys, values = inputs(dtype, nkv, step, seed=step)
        assert_matches_reference(q, keys, values, packed, rtol, **options)


def test_bf16_within_bf16_rounding():
    for options in (dict(kernel="fused"), dict(kernel="chunked", chunk=8)):
        q, keys, values = inputs(torch.bfloat16, 2, 3)
        assert_matches_reference(q, keys, values, True, 0.03, **options)


def saved_bytes(T, packed, **options):
    """Bytes the attention keeps for backward (saved_tensors_hooks), GQA, step 3."""
    q, keys, values = inputs(torch.float32, 2, 3, T=T)
    rows = torch.arange(T).remainder(T // 3).expand(2, T)  # three documents a row
    total = 0

    def pack(x):
        nonlocal total
        total += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ttt_attention(q, keys, values, document_ids(rows) if packed else None, **options)
    return total


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("options", [dict(kernel="fused"), dict(kernel="chunked", chunk=32)], ids=["fused", "chunked"])
def test_what_is_kept_for_backward_grows_linearly_in_T(packed, options):
    small, large = saved_bytes(96, packed, **options), saved_bytes(384, packed, **options)
    assert large <= 4.05 * small, f"{small} bytes at T=96, {large} at T=384: not linear in T"
    q, keys, values = inputs(torch.float32, 2, 3, T=384)  # the reference keeps (T, T) matrices: the check can fail
    total = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: total.append(x.numel() * x.element_size()) or x,
                                                  lambda x: x):
        autograd_ttt(q, keys, values)
    assert sum(total) > 8 * large


def test_a_bad_kernel_name_is_refused():
    q, keys, values = inputs(torch.float32, 2, 1)
    with pytest.raises(ValueError, match="kernel='flash'; expected 'fused' or 'chunked'"):
        ttt_attention(q, keys, values, kernel="flash")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 0.03)])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_fused_kernels_equal_autograd_without_falling_back(dtype, rtol, packed):
    """The flash op (bf16, one document a row) and the memory-efficient op (fp32, packed rows) on the GPU; a
    fallback to the chunked prefix would warn, which fails here."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (0, 3):
            q, keys, values = inputs(dtype, 2, step, device="cuda", T=37, seed=step)
            q64, k64, v64 = inputs(dtype, 2, step, device="cuda", T=64, seed=step)  # aligned lengths too
            assert_matches_reference(q, keys, values, packed, rtol, kernel="fused")
            assert_matches_reference(q64, k64, v64, packed, rtol, kernel="fused", chunk=16)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_a_failing_fused_kernel_hands_over_to_the_chunked_one(monkeypatch, stage):
    """What guards CUDA's fused ops, run on the CPU's: the kernel raises, a warning says so, the results stay exact."""
    from draftheads.models.eagle import ttt

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for these inputs")

    monkeypatch.setattr(ttt._CpuFlashPrefix, stage, staticmethod(refuse))
    q, keys, values = inputs(torch.float32, 2, 3)
    with pytest.warns(UserWarning, match="cpu-flash attention kernel failed .*no kernel for these inputs.*chunked"):
        assert_matches_reference(q, keys, values, True, 1e-5, kernel="fused", chunk=8)


# ---- sliding window -----------------------------------------------------------------------------------------------
def windowed_reference(q, keys, values, rows, window):
    """The slow dense reference of the windowed TTT attention, from positions alone: step k's query at stream t sits
    at position t+k; a prefix key s at position s, a chain key of step j at position t+j. A key is seen iff it is in
    the query's document, at or before the query, and fewer than `window` positions back (vLLM's count: W keys, the
    query's own included). Autograd through (B, nh, T, (k+1)T) scores."""
    B, nh, T, d = q.shape
    k = len(keys) - 1
    doc = document_ids(rows)  # (B, T)
    t = torch.arange(T)
    qpos = t + k  # (T,)
    seen = []
    for j in range(k + 1):
        if j == 0:
            kpos = t[None, :].expand(T, T)
            same = (doc[:, :, None] == doc[:, None, :]) & (t[None, :] <= t[:, None])  # (B, T, T)
        else:
            kpos = (t + j)[:, None].expand(T, T)
            same = torch.eye(T, dtype=torch.bool).expand(B, T, T)
        near = qpos[:, None] - kpos < window
        seen.append(same & near & (kpos <= qpos[:, None]))
    allowed = torch.cat(seen, -1)[:, None]  # (B, 1, T, (k+1)T)
    groups = nh // keys[0].shape[1]
    K = torch.cat([x.repeat_interleave(groups, 1) for x in keys], 2)
    V = torch.cat([x.repeat_interleave(groups, 1) for x in values], 2)
    exact = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(exact) @ K.to(exact).transpose(-1, -2) * d ** -0.5).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ V.to(exact)


def assert_window_matches(q, keys, values, rows, packed, window, want, rtol, **options):
    out = ttt_attention(q, keys, values, document_ids(rows) if packed else None, window=window, **options)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=want.dtype)
    got = [out.to(want.dtype)] + list(torch.autograd.grad((out * weights).sum(), [q, *keys, *values]))
    ref = [want] + list(torch.autograd.grad((want * weights).sum(), [q, *keys, *values], retain_graph=True))
    names = ["out", "dq"] + [f"dk{j}" for j in range(len(keys))] + [f"dv{j}" for j in range(len(values))]
    for name, a, b in zip(names, got, ref):
        # relative to the tensor's scale, or the output's where the tensor is zero (W = 1 at step 0: dq is 0)
        error = ((a.to(b.dtype) - b).abs().max() / torch.maximum(b.abs().max(), want.abs().max())).item()
        assert error <= rtol, f"{name}: {error:.2e} relative (window {window}, {options}, packed={packed})"


WINDOW_KERNELS = [dict(kernel="fused"), dict(kernel="fused", chunk=8), dict(kernel="chunked", chunk=5)]


@pytest.mark.parametrize("options", WINDOW_KERNELS, ids=["fused", "fused-8", "chunked-5"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_window_that_covers_the_row_is_full_attention(options, packed):
    """W >= T + k: every key of the row in reach, so the windowed attention is the full one (fp32, 1e-5 relative)."""
    for step in (0, 3):
        q, keys, values = inputs(torch.float32, 2, step, seed=step)
        T = q.shape[2]
        rows = positions(T)
        full = autograd_ttt(q, keys, values, causal_document_mask(rows) if packed else None)
        assert_window_matches(q, keys, values, rows, packed, T + step, full, 1e-5, **options)
        # and the same window through the dense windowed reference, which does not know the shortcut
        assert_window_matches(q, keys, values, rows, packed, T + step,
                              windowed_reference(q, keys, values, rows if packed else positions(T)[1:].expand(2, T),
                                                 T + step), 1e-5, **options)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("options", WINDOW_KERNELS, ids=["fused", "fused-8", "chunked-5"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_window_shorter_than_the_row_equals_the_dense_masked_reference(dtype, rtol, options, packed):
    """Windows inside the row, one that leaves the later steps only part of their chain (2 < k = 3), and one that
    leaves a step no prefix key (W <= k): values and gradients of q, every key and every value, GQA."""
    for step, window in ((0, 1), (0, 6), (1, 6), (3, 11), (3, 2), (3, 3), (2, 36)):
        q, keys, values = inputs(dtype, 2, step, seed=step + window)
        rows = positions(q.shape[2]) if packed else positions(q.shape[2])[1:].expand(2, -1)
        want = windowed_reference(q, keys, values, rows, window)
        assert_window_matches(q, keys, values, rows, packed, window, want, rtol, **options)


def test_the_window_reference_can_fail():
    """The same inputs against a window one position longer or shorter (an off-by-one in counting) differ."""
    q, keys, values = inputs(torch.float32, 2, 2)
    rows = positions(q.shape[2])[1:].expand(2, -1)
    out = ttt_attention(q, keys, values, window=6)
    for other in (5, 7):
        assert (out - windowed_reference(q, keys, values, rows, other)).abs().max() > 1e-3


def test_a_window_below_one_is_refused():
    q, keys, values = inputs(torch.float32, 2, 1)
    with pytest.raises(ValueError, match="window=0; expected at least 1"):
        ttt_attention(q, keys, values, window=0)


def test_the_window_mask_definition_is_the_reference():
    """`ttt_attention_mask(window=W)` (the documented definition) is the dense reference's mask."""
    from draftheads.models.eagle.ttt import ttt_attention_mask

    T = 9
    for step, window in ((0, 3), (2, 4), (3, 2), (3, 20)):
        mask = ttt_attention_mask(T, step, window=window)
        for t in range(T):
            for col in range(mask.shape[1]):
                j, s = divmod(col, T)
                kpos = s if j == 0 else t + j
                expect = (s <= t if j == 0 else s == t) and t + step - kpos < window
                assert bool(mask[t, col]) == expect, (step, window, t, col)


def test_what_a_window_keeps_for_backward_grows_linearly_in_T():
    def kept(T):
        q, keys, values = inputs(torch.float32, 2, 3, T=T)
        total = 0

        def pack(x):
            nonlocal total
            total += x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            ttt_attention(q, keys, values, window=16)
        return total

    assert kept(384) <= 4.05 * kept(96)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 0.03)])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_windowed_kernel_equals_the_dense_reference_without_falling_back(dtype, rtol, packed):
    """The band goes through CUDA's memory-efficient op with a per-chunk bias: values and gradients against the
    dense reference (float64 on the CPU); a fallback to the chunked prefix would warn, which fails here."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, window in ((0, 6), (3, 11), (3, 2)):
            q, keys, values = inputs(dtype, 2, step, device="cuda", T=64, seed=step)
            rows = positions(64) if packed else positions(64)[1:].expand(2, -1)
            cpu = [x.detach().double().cpu().requires_grad_() for x in (q, *keys, *values)]
            n = len(keys)
            want = windowed_reference(cpu[0], cpu[1:1 + n], cpu[1 + n:], rows, window)
            out = ttt_attention(q, keys, values, document_ids(rows.cuda()) if packed else None, window=window,
                                chunk=16)
            weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            got = [out.double().cpu()] + [g.double().cpu() for g in torch.autograd.grad(
                (out.double() * weights.cuda()).sum(), [q, *keys, *values])]
            ref = [want] + list(torch.autograd.grad((want * weights).sum(), cpu))
            for name, a, b in zip(["out", "dq", *(f"dk{j}" for j in range(n)), *(f"dv{j}" for j in range(n))],
                                  got, ref):
                error = ((a - b).abs().max() / torch.maximum(b.abs().max(), want.abs().max())).item()
                assert error <= rtol, f"{name}: {error:.2e} relative (step {step}, window {window})"


def test_a_window_bounds_the_fused_kernels_work_by_T_times_W():
    """Under a window the fused prefix is chunked so each chunk's keys span about 2W: the scores the kernel computes
    (chunk rows x key span, summed) are O(T W), a fraction of the causal T^2 / 2 at T >> W."""
    from draftheads.models.eagle.ttt import _band_rows, _prefix_ranges
    from draftheads.models.range_attention import range_chunks

    T, W = 8192, 256  # range_chunks' own size would be 2048 rows here: 4.4x the work
    lo, hi = _prefix_ranges(None, 1, T, "cpu", W, 3)
    plan = range_chunks(lo, hi, 1, T, _band_rows(W, 1))
    work = sum((b - a) * (key_hi - key_lo) for a, b, key_lo, key_hi in plan)
    assert work <= 2 * T * W < T * T / 8


def where_cases(T):
    """Query positions a later TTT step computes: a prefix (the causal fast path), a tail after a prompt, gaps."""
    return {"prefix": torch.arange(T - 5), "tail": torch.arange(9, T - 3), "gaps": torch.tensor([0, 3, 4, 11, 12, 20,
                                                                                                  T - 1])}


@pytest.mark.parametrize("case", ["prefix", "tail", "gaps"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("options", [dict(kernel="fused"), dict(kernel="chunked", chunk=5), dict(window=6)])
def test_where_equals_the_full_computation_at_those_positions(case, packed, options):
    """Queries at `where` only (the chain's keys there too) give the full step's rows at those positions, and the
    same gradients for q, the chain and the whole prefix of a loss that reads those rows."""
    q, keys, values = inputs(torch.float64, 2, 3)
    T = q.shape[2]
    where = where_cases(T)[case]
    documents = document_ids(positions(T)) if packed else None
    weights = torch.randn(2, 4, len(where), 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    full = ttt_attention(q, keys, values, documents, **options)[:, :, where]
    want = torch.autograd.grad((full * weights).sum(), [q, *keys, *values])

    sub = [x.detach()[:, :, where].requires_grad_() for x in (q, *keys[1:], *values[1:])]
    q_w, chain = sub[0], sub[1:]
    out = ttt_attention(q_w, [keys[0], *chain[:3]], [values[0], *chain[3:]], documents, where=where, **options)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out * weights).sum(), [q_w, keys[0], values[0], *chain])
    torch.testing.assert_close(got[0], want[0][:, :, where])
    torch.testing.assert_close(got[1], want[1])  # dK_0 over the whole row
    torch.testing.assert_close(got[2], want[1 + len(keys)])  # dV_0
    for j in range(3):
        torch.testing.assert_close(got[3 + j], want[2 + j][:, :, where], msg=f"dk{j + 1}")
        torch.testing.assert_close(got[6 + j], want[2 + len(keys) + j][:, :, where], msg=f"dv{j + 1}")


def test_bad_where_is_refused():
    q, keys, values = inputs(torch.float32, 2, 1)
    with pytest.raises(ValueError, match="sorted distinct positions"):
        ttt_attention(q[:, :, :3], [keys[0], keys[1][:, :, :3]], [values[0], values[1][:, :, :3]],
                      where=torch.tensor([4, 2, 9]))
    with pytest.raises(ValueError, match="pass `where`"):
        ttt_attention(q[:, :, :3], [keys[0], keys[1][:, :, :3]], [values[0], values[1][:, :, :3]])
