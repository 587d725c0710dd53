"""EAGLE-1 / EAGLE-3 drafters: TTT attention, losses, masks, vocab maps, the incremental inference API."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from draftheads.models.eagle import (
    Eagle1Drafter,
    Eagle3Drafter,
    EagleConfig,
    EagleError,
    EagleTrainModule,
    StepCounts,
    build_drafter,
    chunked_draft_targets,
    count_tokens,
    draft_targets,
    draft_to_target,
    eagle1_loss,
    row_draft_targets,
    select_draft_vocab,
    step_counts,
    target_to_draft,
    ttt_attention,
    ttt_attention_mask,
)
from draftheads.models.verifier import Verifier, VerifierError
from tests.utils import FAMILIES, unsettle_norms_and_biases

T = 12


@pytest.fixture(scope="module")
def verifiers(tiny_verifier_dirs):
    return {family: Verifier.from_pretrained(path) for family, path in tiny_verifier_dirs.items()}


def make(verifier, version, seed=0, **overrides):
    """A drafter with random (non-trivial) weights, in eval mode; EAGLE-3 gets a 100-token draft vocabulary."""
    torch.manual_seed(seed)
    cfg = EagleConfig(version=version, ttt_steps=overrides.pop("ttt_steps", 4), **overrides)
    counts = torch.randint(0, 50, (verifier.vocab_size,)) if version == 3 else None
    if version == 3 and cfg.draft_vocab_size is not None:
        cfg.draft_vocab_size = min(cfg.draft_vocab_size, 100)
    drafter = build_drafter(verifier, cfg, token_counts=counts)
    return unsettle_norms_and_biases(drafter).eval()


def batch(verifier, drafter, B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, verifier.vocab_size, (B, T), generator=g)
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    return ids, feats


def step0_hidden(drafter, feats):
    return drafter.project_features(feats.layers if drafter.version == 3 else [feats.final])


def step0_inputs(verifier, version):
    """A `make` drafter, the ids of a `batch` and their step-0 hidden states (no grad)."""
    drafter = make(verifier, version)
    ids, feats = batch(verifier, drafter)
    with torch.no_grad():
        return drafter, ids, step0_hidden(drafter, feats)


# ---- TTT attention -------------------------------------------------------------------------------------------
def test_ttt_mask_matches_its_definition():
    for step in range(4):
        mask = ttt_attention_mask(5, step)
        assert mask.shape == (5, 5 * (step + 1))
        for t in range(5):
            for j in range(step + 1):
                for s in range(5):
                    allowed = s <= t if j == 0 else s == t
                    assert bool(mask[t, j * 5 + s]) == allowed, (step, t, j, s)


@pytest.mark.parametrize("nkv", [4, 2])  # MHA and GQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ttt_attention_equals_sdpa_with_the_ttt_mask(nkv, dtype):
    """Within float32 rounding (float64 inputs: float64's, so a float64 drafter's unroll is exact)."""
    g = torch.Generator().manual_seed(0)
    B, nh, T, d = 2, 4, 7, 8
    for step in (1, 3):
        q = torch.randn(B, nh, T, d, generator=g).to(dtype).requires_grad_()
        keys = [torch.randn(B, nkv, T, d, generator=g).to(dtype).requires_grad_() for _ in range(step + 1)]
        values = [torch.randn(B, nkv, T, d, generator=g).to(dtype).requires_grad_() for _ in range(step + 1)]
        fast = ttt_attention(q, keys, values)
        rep = nh // nkv
        exact = torch.promote_types(dtype, torch.float32)  # the reference's precision
        reference = torch.nn.functional.scaled_dot_product_attention(
            q.to(exact), torch.cat(keys, 2).to(exact).repeat_interleave(rep, 1),
            torch.cat(values, 2).to(exact).repeat_interleave(rep, 1), attn_mask=ttt_attention_mask(T, step))
        tol = {torch.float32: dict(rtol=0, atol=1e-5), torch.bfloat16: dict(rtol=0.02, atol=0.02),
               torch.float64: dict(rtol=0, atol=1e-12)}[dtype]
        torch.testing.assert_close(fast.to(exact), reference, **tol)
        weights = torch.randn(reference.shape, generator=g, dtype=exact)
        grads = torch.autograd.grad((fast.to(exact) * weights).sum(), [q, *keys, *values])
        expected = torch.autograd.grad((reference * weights).sum(), [q, *keys, *values])
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got.to(exact), want.to(exact), **({**tol, "atol": tol["atol"] * 5}))


def slow_ttt(drafter, ids, hidden, steps):
    """Loop over steps k and positions t: query (k, t) attends to step-0 keys s <= t and to (j, t), 1 <= j <= k."""
    B, T_ = ids.shape
    groups = drafter.num_heads // drafter.num_kv_heads
    positions = torch.arange(T_).expand(B, T_)
    keys, values, outs = [], [], []
    for k in range(steps):
        ids_k = torch.zeros_like(ids)
        ids_k[:, :T_ - 1 - k] = ids[:, 1 + k:]
        x, residual = drafter._layer_input(drafter.embed(ids_k), hidden)
        q, kk, vv = drafter._qkv(x, positions + k)
        keys.append(kk.repeat_interleave(groups, 1))
        values.append(vv.repeat_interleave(groups, 1))
        attn = torch.zeros(B, drafter.num_heads, T_, drafter.head_dim)
        for t in range(T_):
            ks = torch.cat([keys[0][:, :, :t + 1]] + [keys[j][:, :, t:t + 1] for j in range(1, k + 1)], dim=2)
            vs = torch.cat([values[0][:, :, :t + 1]] + [values[j][:, :, t:t + 1] for j in range(1, k + 1)], dim=2)
            scores = torch.einsum("bhd,bhsd->bhs", q[:, :, t], ks) / math.sqrt(drafter.head_dim)
            attn[:, :, t] = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), vs)
        hidden = drafter._block(attn.transpose(1, 2).reshape(B, T_, -1), residual)
        outs.append(hidden)
    return outs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("version", [1, 3])
def test_ttt_unroll_matches_slow_reference(verifiers, family, version):
    drafter, ids, hidden = step0_inputs(verifiers[family], version)
    with torch.no_grad():
        fast = drafter.ttt_unroll(ids, hidden, steps=4)
        slow = slow_ttt(drafter, ids, hidden, steps=4)
    for k, (a, b) in enumerate(zip(fast, slow)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"step {k}")


@pytest.mark.parametrize("version", [1, 3])
def test_ttt_unroll_is_what_inference_does(verifiers, version):
    """Each TTT chain equals drafting with the KV cache: the step-0 prefix 0..t, then one token per step."""
    verifier = verifiers["llama"]
    drafter = make(verifier, version)
    ids, feats = batch(verifier, drafter)
    steps = 4
    with torch.no_grad():
        hidden = step0_hidden(drafter, feats)
        ttt = drafter.ttt_unroll(ids, hidden, steps=steps)
        ids_in = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        out0, (k0, v0) = drafter(ids_in, hidden)  # step 0 over the whole prefix, plain causal
        torch.testing.assert_close(out0, ttt[0])
        for t in range(T - steps):
            cache = (k0[:, :, :t + 1], v0[:, :, :t + 1])
            prev = out0[:, t:t + 1]
            for k in range(1, steps):
                pos = torch.full((ids.shape[0], 1), t + k)
                prev, cache = drafter(ids[:, t + 1 + k:t + 2 + k], prev, pos, past_key_value=cache)
                torch.testing.assert_close(prev[:, 0], ttt[k][:, t], atol=1e-5, rtol=1e-5,
                                           msg=f"chain from t={t}, step {k}")


@pytest.mark.parametrize("version", [1, 3])
def test_chain_counts_score_the_drafted_chains(verifiers, version):
    verifier = verifiers["llama"]
    drafter = make(verifier, version)
    ids, feats = batch(verifier, drafter)
    loss_mask = (torch.arange(T) % 4 != 1).long().expand(2, T)
    steps = 4
    with torch.no_grad():
        counts = drafter.chain_counts(ids, feats, loss_mask, steps=steps)
        outs = drafter.ttt_unroll(ids, step0_hidden(drafter, feats), steps=steps)
        trained = drafter.training_loss(ids, feats, loss_mask).counts
    greedy = feats.logits.argmax(-1)
    for k in range(steps):  # by hand: position t's step-k draft against argmax q_{t+1+k}, scored iff x_{t+2+k} is
        draft = drafter.to_target_ids(drafter.logits(outs[k]).argmax(-1))
        right = scored = 0
        for t in range(T - 2 - k):
            if loss_mask[0, t + 2 + k]:
                scored += 2
                right += int((draft[:, t] == greedy[:, t + 1 + k]).sum())
        assert (float(counts.correct[k]), float(counts.valid[k])) == (right, scored)
    # the trainer's counts are the same chains: all K steps for EAGLE-3, step 0 for EAGLE-1
    K = len(trained.correct)
    for name in ("correct", "valid", "chain_correct", "chain_valid"):
        torch.testing.assert_close(getattr(trained, name), getattr(counts, name)[:K])


# ---- incremental inference API -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("version", [1, 3])
def test_incremental_equals_full_forward(verifiers, family, version):
    drafter, ids, hidden = step0_inputs(verifiers[family], version)
    with torch.no_grad():
        full, (k_full, v_full) = drafter(ids, hidden)
        prefix = 5
        out, cache = drafter(ids[:, :prefix], hidden[:, :prefix])
        outs = [out]
        for t in range(prefix, T):
            out, cache = drafter(ids[:, t:t + 1], hidden[:, t:t + 1], past_key_value=cache)
            outs.append(out)
        inc = torch.cat(outs, dim=1)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[0], k_full, atol=1e-5, rtol=1e-5)
    assert cache[0].shape == (2, drafter.num_kv_heads, T, drafter.head_dim)
    torch.testing.assert_close(drafter.logits(inc), drafter.logits(full), atol=1e-4, rtol=1e-4)
    width = verifiers[family].vocab_size if version == 1 else drafter.draft_vocab_size
    assert drafter.logits(full).shape == (2, T, width)


@pytest.mark.parametrize("version", [1, 3])
def test_tree_mask_matches_chains(verifiers, version):
    """A draft tree in one call (ancestor mask, position = prefix + depth) equals running each path alone."""
    verifier = verifiers["llama"]
    drafter = make(verifier, version)
    ids, feats = batch(verifier, drafter, B=1)
    parents = [-1, -1, 0, 0, 1, 2]  # node -> parent (-1: child of the prefix)
    prefix = 6
    with torch.no_grad():
        hidden = step0_hidden(drafter, feats)
        _, cache = drafter(ids[:, :prefix], hidden[:, :prefix])
        N = len(parents)
        node_ids = torch.randint(3, verifier.vocab_size, (1, N))
        node_hidden = torch.randn(1, N, drafter.hidden_size)
        depth, anc = [], torch.zeros(N, N, dtype=torch.bool)
        for n, p in enumerate(parents):
            depth.append(0 if p < 0 else depth[p] + 1)
            anc[n, n] = True
            if p >= 0:
                anc[n] |= anc[p]
        mask = torch.cat([torch.ones(N, prefix, dtype=torch.bool), anc], 1)[None, None]  # (1, 1, N, prefix+N)
        pos = torch.tensor(depth)[None] + prefix
        tree_out, (k, _) = drafter(node_ids, node_hidden, pos, mask, past_key_value=cache)
        assert k.shape[2] == prefix + N
        additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        torch.testing.assert_close(drafter(node_ids, node_hidden, pos, additive, past_key_value=cache)[0], tree_out)
        for n in range(N):
            path = [n]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path = path[::-1]
            chain_out, _ = drafter(node_ids[:, path], node_hidden[:, path], pos[:, path], past_key_value=cache)
            torch.testing.assert_close(chain_out[:, -1], tree_out[:, n], atol=1e-5, rtol=1e-5)


def test_bad_mask_shape_is_a_clear_error(verifiers):
    drafter = make(verifiers["llama"], 1)
    ids = torch.randint(3, 256, (1, 4))
    with pytest.raises(EagleError, match=r"expected \(B, 1, 4, 4\)"):
        drafter(ids, torch.randn(1, 4, 64), attention_mask=torch.ones(1, 1, 4, 5, dtype=torch.bool))


# ---- losses and masks ----------------------------------------------------------------------------------------
def test_eagle1_loss_is_a_masked_mean():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    pl, tl = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 0, 0]]).bool()
    total, feature, token = eagle1_loss(pred, target, pl, tl, mask, 1.0, 0.1)
    sel = mask.flatten()
    p, t_ = pred.reshape(10, 8)[sel], target.reshape(10, 8)[sel]
    ref_feature = torch.nn.functional.smooth_l1_loss(p, t_)
    ref_token = -(tl.reshape(10, 11)[sel].softmax(-1) * pl.reshape(10, 11)[sel].log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(feature, ref_feature)
    torch.testing.assert_close(token, ref_token)
    torch.testing.assert_close(total, ref_feature + 0.1 * ref_token)
    # masked positions contribute nothing
    pred2, pl2 = pred.clone(), pl.clone()
    pred2[~mask], pl2[~mask] = 1e3, -1e3
    torch.testing.assert_close(eagle1_loss(pred2, target, pl2, tl, mask)[0], eagle1_loss(pred, target, pl, tl, mask)[0])


@pytest.mark.parametrize("version", [1, 3])
def test_masked_positions_contribute_nothing(verifiers, version):
    verifier = verifiers["llama"]
    drafter = make(verifier, version)
    ids, feats = batch(verifier, drafter)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 4:7] = 0  # a "prompt" in the middle of row 0
    m = 9
    loss_mask[:, m:] = 0  # and a tail
    base = drafter.training_loss(ids, feats, loss_mask).loss

    # 1. tokens in the masked tail (from m - 1 on) feed only unscored predictions
    ids2 = ids.clone()
    ids2[:, m - 1:] = torch.randint(3, verifier.vocab_size, ids2[:, m - 1:].shape)
    feats2 = verifier.features(ids2, layer_ids=drafter.feature_layers, return_logits=True)
    torch.testing.assert_close(drafter.training_loss(ids2, feats2, loss_mask).loss, base)

    # 2. the verifier's distribution where the predicted token is masked (q_{j-1} predicts x_j)
    logits = feats.logits.clone()
    for j in [4, 5, 6]:
        logits[0, j - 1] = torch.randn(verifier.vocab_size) * 5
    logits[:, m - 1:] = torch.randn_like(logits[:, m - 1:]) * 5
    perturbed = SimpleNamespace(final=feats.final, layers=feats.layers, logits=logits)
    torch.testing.assert_close(drafter.training_loss(ids, perturbed, loss_mask).loss, base)

    # positive control: the same change at a scored position moves the loss (argmax kept draftable)
    logits[1, 5] = torch.randn(verifier.vocab_size) * 5
    logits[1, 5, int(torch.nonzero(drafter.t2d)[0]) if version == 3 else 0] += 50
    assert not torch.allclose(drafter.training_loss(ids, perturbed, loss_mask).loss, base)


def test_eagle3_skips_targets_outside_the_draft_vocab(verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, 3, ttt_steps=1)
    ids, feats = batch(verifier, drafter)
    outside = int(torch.nonzero(~drafter.t2d)[0])
    logits = feats.logits.clone()
    logits[0, 3, outside] = 100.0  # q_3's argmax is not draftable: the prediction of x_4 at t = 2 is not trained
    mask = torch.ones_like(ids)
    f = SimpleNamespace(final=feats.final, layers=feats.layers, logits=logits)
    base = drafter.training_loss(ids, f, mask)
    logits[0, 3, drafter.d2t[:10] + torch.arange(10)] += torch.randn(10) * 5  # change its draft-vocab columns
    again = drafter.training_loss(ids, f, mask)
    torch.testing.assert_close(again.loss, base.loss)
    assert base.counts.valid[0] == 2 * (T - 2)  # still scored (as a miss): the drafter cannot produce that token


def test_noise_only_in_training(verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, 1)
    ids, feats = batch(verifier, drafter)
    mask = torch.ones_like(ids)
    assert drafter.cfg.input_noise == 0.2
    a, b = drafter.training_loss(ids, feats, mask).loss, drafter.training_loss(ids, feats, mask).loss
    assert torch.equal(a, b)
    drafter.train()
    assert not torch.equal(drafter.training_loss(ids, feats, mask).loss, a)


# ---- draft vocabulary ----------------------------------------------------------------------------------------
def test_draft_vocab_selection_and_round_trip():
    ids = torch.tensor([[5, 5, 5, 9, 9, 2, 7, 7, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1, 1, 1, 1]])
    counts = count_tokens(ids, mask, 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 3, 0, 4, 0, 2, 0, 0]  # token 2 sits at a masked position
    d2t, t2d = select_draft_vocab(counts, 4)
    targets = draft_to_target(torch.arange(4), d2t)
    assert targets.tolist() == [0, 5, 7, 9]  # 7, 5, 9 by count, then the tie at 0 broken by lowest id; ascending
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.sum() == 4
    assert target_to_draft(targets, t2d).tolist() == [0, 1, 2, 3]
    assert target_to_draft(torch.tensor([2, 7, 11]), t2d).tolist() == [-1, 2, -1]
    g = torch.Generator().manual_seed(0)
    d2t, t2d = select_draft_vocab(torch.randint(0, 1000, (5000,), generator=g), 700)
    draft = torch.arange(700)
    assert torch.equal(target_to_draft(draft_to_target(draft, d2t), t2d), draft)
    with pytest.raises(EagleError, match="expected 1..12"):
        select_draft_vocab(counts, 13)


def test_draft_targets_renormalise_over_the_draft_vocab():
    logits = torch.randn(2, 3, 12)
    logits[0, 0, [3, 9]] = 5.0  # a tie across the draft boundary: the first maximum (3) is the target, undrafted
    logits[0, 1, [8, 10]] = 5.0  # a tie inside the draft vocabulary: 8
    d2t, t2d = select_draft_vocab(torch.arange(12), 5)  # the five highest ids: 7..11
    logp, target_ids, in_draft = draft_targets(logits, d2t, t2d)
    full = logits.softmax(-1)[..., 7:]
    torch.testing.assert_close(logp.exp(), full / full.sum(-1, keepdim=True))
    assert torch.equal(in_draft, logits.argmax(-1) >= 7)
    assert torch.equal(target_ids, logits.argmax(-1))
    assert target_ids[0, 0] == 3 and not in_draft[0, 0] and target_ids[0, 1] == 8



def test_chunked_draft_targets_equal_the_whole_rows():
    logits = torch.randn(2, 10, 12)
    d2t, t2d = select_draft_vocab(torch.arange(12), 5)
    whole = draft_targets(logits, d2t, t2d)
    asked = []

    def logits_at(s, e):
        asked.append((s, e))
        return logits[:, s:e]

    for chunk, expected in ((3, [(0, 3), (3, 6), (6, 9), (9, 10)]), (None, [(0, 10)])):
        asked.clear()
        parts = chunked_draft_targets(logits_at, 2, 10, 12, d2t, t2d, chunk=chunk)
        assert asked == expected  # never more than `chunk` positions' logits at once
        for got, want in zip(parts, whole):
            assert torch.equal(got, want)

def test_draft_targets_from_the_draft_rows_and_a_stored_argmax_equal_the_whole_heads():
    torch.manual_seed(0)
    final, weight = torch.randn(2, 10, 8), torch.randn(12, 8)
    d2t, t2d = select_draft_vocab(torch.arange(12), 5)
    whole = draft_targets(final @ weight.T, d2t, t2d)
    rows = weight[draft_to_target(torch.arange(5), d2t)]
    for chunk in (3, None):
        logp, ids, in_draft = row_draft_targets(final, rows, whole[1].int(), t2d, chunk=chunk)
        torch.testing.assert_close(logp, whole[0], rtol=1e-6, atol=1e-6)
        assert ids.dtype == torch.long and torch.equal(ids, whole[1]) and torch.equal(in_draft, whole[2])
    stored = torch.randint(0, 12, (2, 10), dtype=torch.int32)  # the stored ids are the targets, drafted or not
    _, ids, in_draft = row_draft_targets(final, rows, stored, t2d)
    assert torch.equal(ids, stored.long()) and torch.equal(in_draft, t2d[stored.long()]) and not in_draft.all()


def test_a_drafter_holding_the_draft_rows_trains_as_with_the_whole_head(tiny_verifier_dirs):
    """hold_draft_rows: the verifier frees lm_head's other rows; with the argmax in the features (as a cache stores
    it) the loss, its gradients and the counts are the whole head's."""
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])  # its own: keep_head_rows frees rows
    drafter = make(verifier, 3)
    ids = torch.randint(0, verifier.vocab_size, (2, T))
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    mask = torch.ones(2, T, dtype=torch.long)
    argmax = verifier.head_argmax(feats.final)
    runs = []
    for hold in (False, True):
        if hold:
            drafter.hold_draft_rows(verifier)
            assert verifier.lm_head.weight.device.type == "meta"
            with pytest.raises(EagleError, match="must carry the verifier's argmax"):
                drafter.training_loss(ids, feats, mask)
            feats = dataclasses.replace(feats, argmax=argmax.long())
        drafter.zero_grad()
        out = drafter.training_loss(ids, feats, mask)
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = runs
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(b.counts.correct, a.counts.correct) and torch.equal(b.counts.valid, a.counts.valid)
    for name, grad in ga.items():
        torch.testing.assert_close(gb[name], grad, rtol=1e-5, atol=1e-7)


def test_draft_rows_under_bf16_autocast_give_the_whole_heads_targets(tiny_verifier_dirs):
    """A bf16 verifier under bf16 autocast (the 8B recipes): the rows' log-probs within bf16 rounding of the whole
    head's and the stored argmax (the verifier's, in its own dtype) the whole head's argmax under autocast."""
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"], dtype="bfloat16")
    drafter = make(verifier, 3)
    feats = verifier.features(torch.randint(0, verifier.vocab_size, (2, T)), layer_ids=drafter.feature_layers)
    feats = dataclasses.replace(feats, argmax=verifier.head_argmax(feats.final).long())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = drafter._draft_targets(dataclasses.replace(feats, argmax=None), 2, T)
        drafter.hold_draft_rows(verifier)
        rows = drafter._draft_targets(feats, 2, T)
    torch.testing.assert_close(rows[0], whole[0], rtol=0, atol=1e-2)
    assert torch.equal(rows[1], whole[1]) and torch.equal(rows[2], whole[2])


def test_drafter_maps_and_lm_head_start_from_the_verifier(verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, 3)
    cols = draft_to_target(torch.arange(drafter.draft_vocab_size), drafter.d2t)
    torch.testing.assert_close(drafter.lm_head.weight, verifier.lm_head.weight[cols])
    assert torch.equal(drafter.to_target_ids(torch.arange(drafter.draft_vocab_size)), cols)


# ---- metrics -------------------------------------------------------------------------------------------------
def test_step_counts_and_acceptance_length():
    # one row, 4 chains (positions), 3 steps; valid everywhere except step 2 of chain 3
    correct = torch.tensor([[[1, 1, 1, 0]], [[1, 0, 1, 1]], [[0, 1, 1, 1]]]).bool()
    valid = torch.ones_like(correct)
    valid[2, 0, 3] = False
    c = step_counts(correct, valid)
    assert c.correct.tolist() == [3, 3, 2] and c.valid.tolist() == [4, 4, 3]
    assert c.chain_correct.tolist() == [3, 2, 1]  # chains right through step k: {0,1,2}, {0,2}, {2}
    assert c.chain_valid.tolist() == [4, 3, 2]  # right through k-1 and scored at k
    s = (c + c).summary()  # adding batches keeps the ratios
    torch.testing.assert_close(s["cond_acc"], torch.tensor([3 / 4, 2 / 3, 1 / 2]))
    torch.testing.assert_close(s["cum_acc"], torch.tensor([3 / 4, 1 / 2, 1 / 4]))
    torch.testing.assert_close(s["accept_length"], torch.tensor(1 + 3 / 4 + 1 / 2 + 1 / 4))
    torch.testing.assert_close(s["acc"], torch.tensor([3 / 4, 3 / 4, 2 / 3]))
    assert isinstance(c, StepCounts)


def test_training_metrics_and_loss_shapes(verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, 3, ttt_steps=3)
    ids, feats = batch(verifier, drafter)
    out = drafter.training_loss(ids, feats, torch.ones_like(ids))
    assert out.step_losses.shape == (3,) and out.counts.valid.tolist() == [2 * (T - 2), 2 * (T - 3), 2 * (T - 4)]
    torch.testing.assert_close(out.loss, sum(0.8 ** k * out.step_losses[k] for k in range(3)))
    summary = out.counts.summary()
    assert summary["accept_length"].shape == () and summary["acc"].shape == (3,)


# ---- training ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [1, 3])
def test_a_few_steps_reduce_the_loss_and_leave_the_verifier_alone(verifiers, version):
    verifier = verifiers["llama"]
    drafter = make(verifier, version, seed=3)
    before = {k: v.clone() for k, v in verifier.state_dict().items()}
    ids, feats = batch(verifier, drafter, B=4)
    # the random verifier's distributions are nearly flat (a soft-CE floor near log V); sharpen the targets
    feats = SimpleNamespace(final=feats.final, layers=feats.layers, logits=feats.logits * 20)
    mask = torch.ones_like(ids)
    module = EagleTrainModule(drafter).train()
    own = {id(p) for p in drafter.parameters()}
    assert id(verifier.embed_tokens.weight) not in own and id(verifier.lm_head.weight) not in own
    assert not any(k.startswith(("embed_tokens", "model.")) for k in drafter.state_dict())
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.cfg.noise = 0.0
    losses = []
    for _ in range(25):
        out = module(ids, feats, mask)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    for k, v in verifier.state_dict().items():
        assert torch.equal(v, before[k]), k
        assert v.grad is None if isinstance(v, torch.nn.Parameter) else True


# ---- config and families ---------------------------------------------------------------------------------------
def test_config_defaults_and_errors():
    assert EagleConfig(version=1).use_fc_bias is False and EagleConfig(version=1).input_noise == 0.2  # vLLM's fc
    assert EagleConfig(version=3).use_fc_bias is False and EagleConfig(version=3).input_noise == 0.0
    assert EagleConfig(version=1, fc_bias=False, noise=0.0).use_fc_bias is False
    with pytest.raises(EagleError, match="fc_bias"):
        EagleConfig(version=3, fc_bias=True)
    with pytest.raises(EagleError, match="exactly three"):
        EagleConfig(layer_ids=[1, 2])
    with pytest.raises(EagleError, match="version"):
        EagleConfig(version=2)


def test_layer_ids_are_validated_against_the_verifier(verifiers):
    with pytest.raises(VerifierError, match=r"eagle.layer_ids=\[0, 1, 4\].*\[4\] out of range"):
        build_drafter(verifiers["llama"], EagleConfig(layer_ids=[0, 1, 4]))
    drafter = build_drafter(verifiers["llama"], EagleConfig(layer_ids=[0, 1, 3]))
    assert drafter.feature_layers == [0, 1, 3]
    assert build_drafter(verifiers["llama"], EagleConfig()).feature_layers == [1, 2, 3]  # 4 layers: not 2, 2, 1


def test_small_draft_vocab_needs_token_counts(verifiers):
    with pytest.raises(EagleError, match="token counts"):
        build_drafter(verifiers["llama"], EagleConfig(draft_vocab_size=10))
    assert build_drafter(verifiers["llama"], EagleConfig()).draft_vocab_size == 256  # min(32000, V)


def test_other_families_get_a_llama_layer_and_gpt2_is_refused_by_name():
    """Any family with decoder layers gets a Llama drafter layer with its dims (what the engines build); GPT-2 has
    none (`transformer.h`), so the verifier itself is refused, naming what is missing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.utils import tiny_model

    qwen3 = Verifier(tiny_model("qwen3"))
    drafter = Eagle1Drafter(qwen3, EagleConfig(version=1))
    assert type(drafter.layer).__name__ == "LlamaDecoderLayer" and drafter.head_dim == qwen3.config.head_dim
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(VerifierError, match=r"GPT2LMHeadModel.*no `layers`/`norm`"):
        Verifier(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_follows_the_family(verifiers, family):
    drafter = make(verifiers[family], 3)
    attn = drafter.layer.self_attn
    assert (attn.q_proj.bias is not None) == (family == "qwen2")
    assert attn.o_proj.bias is None
    assert attn.q_proj.in_features == 2 * verifiers[family].hidden_size
    assert type(drafter.layer).__name__.lower().startswith(family)
    assert isinstance(make(verifiers[family], 3, qkv_bias=False).layer.self_attn.q_proj.bias, type(None))
    e1 = make(verifiers[family], 1)
    assert not hasattr(e1.layer, "input_layernorm") and isinstance(e1, Eagle1Drafter)
    assert isinstance(drafter, Eagle3Drafter)


def test_bf16_drafter_keeps_fp32_rope(verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, 3)
    half = make(verifier, 3).to(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half._held.rotary_emb.inv_freq.dtype == torch.float32
    ids, feats = batch(verifier, drafter)
    pos = torch.arange(400, 400 + T).expand(2, T)  # large positions: bf16 angles would be visibly off
    with torch.no_grad():
        a = drafter.logits(drafter(ids, step0_hidden(drafter, feats), pos)[0])
        b = half.logits(half(ids, step0_hidden(half, feats), pos)[0]).float()
    assert (a.softmax(-1) - b.softmax(-1)).abs().max() < 0.05


def test_version_override_from_the_command_line_resolves_its_own_defaults():
    """The parser builds the default (EAGLE-3) section first; --eagle.version=1 must still get EAGLE-1 defaults."""
    from dataclasses import dataclass, field

    from draftheads.train.config import RunConfig, parse_config

    @dataclass
    class EagleRun(RunConfig):
        eagle: EagleConfig = field(default_factory=EagleConfig)

    cfg = parse_config(EagleRun, ["--eagle.version=1"]).eagle
    assert cfg.version == 1 and not cfg.use_fc_bias and cfg.input_noise == 0.2  # no fc bias for either version
    cfg = parse_config(EagleRun, ["--eagle.layer_ids=[1,2,3]", "--eagle.ttt_steps=3"]).eagle
    assert cfg.layer_ids == [1, 2, 3] and not cfg.use_fc_bias and cfg.input_noise == 0.0
