"""DFlash (models/dflash/): config rules, anchors, the anchored block mask and the loss against slow references,
and the property that makes training mean inference: a block trained among many equals that block drafted alone."""

import pytest
import torch

from draftheads.models.dflash import (
    DFlashCache,
    DFlashConfig,
    DFlashError,
    anchored_block_mask,
    anchored_context_mask,
    anchored_context_ranges,
    block_inputs,
    block_targets,
    build_drafter,
    default_gamma,
    default_target_layers,
    own_block_mask,
    position_weights,
    sample_anchors,
)
from draftheads.models.range_attention import range_attention
from draftheads.models.verifier import Verifier
from tests.dflash_reference import slow_block_mask, slow_loss
from tests.utils import tiny_model

N = 4  # block size of the small drafters here


@pytest.fixture(scope="module")
def verifier():
    return Verifier(tiny_model("qwen3", num_layers=6, vocab_size=64))


def make(verifier, seed=0, **overrides):
    torch.manual_seed(seed)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=N, **overrides)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    return drafter


# ---- config ------------------------------------------------------------------------------------------------------
def test_defaults_follow_the_reference():
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, 5 layers: spread over 1..L-3
    assert default_target_layers(6, 1) == [3]
    assert default_target_layers(4, 2) == [0, 2] and default_target_layers(4, 3) == [0, 1, 2]  # shallow
    with pytest.raises(DFlashError, match="set dflash.target_layer_ids"):
        default_target_layers(3, 3)
    assert (default_gamma(16), default_gamma(8)) == (7.0, 4.0)
    assert DFlashConfig(block_size=8).loss_gamma == 4.0 and DFlashConfig(gamma=2.5).loss_gamma == 2.5


@pytest.mark.parametrize("values, key", [
    ({"block_size": 1}, "dflash.block_size=1"),
    ({"target_layer_ids": [3, 3]}, "dflash.target_layer_ids=[3, 3]"),
    ({"target_layer_ids": [1, 5], "num_target_layers": 6}, "expected ids in 0..4"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "not a multiple"),
    ({"layer_types": ["sliding_attention"]}, "dflash.sliding_window"),
    ({"gamma": 0.0}, "dflash.gamma=0.0"),
    ({"loss": "mse"}, "dflash.loss='mse': expected one of ce, kl"),
])
def test_bad_config_one_line(values, key):
    with pytest.raises(DFlashError, match=key.replace("[", r"\[").replace("]", r"\]")) as err:
        DFlashConfig(**values)
    assert "\n" not in str(err.value)


def test_resolve_from_verifier(verifier):
    cfg = DFlashConfig(num_hidden_layers=2).resolve(verifier.config)
    vc = verifier.config
    assert cfg.resolved and cfg.target_layer_ids == [1, 3] and cfg.mask_token_id == vc.pad_token_id
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_target_layers) == (vc.hidden_size, vc.head_dim, 6)
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(DFlashError, match="hidden_size"):
        DFlashConfig(hidden_size=32).resolve(vc)
    with pytest.raises(DFlashError, match="unknown DFlash config keys"):
        DFlashConfig.from_dict({"blocksize": 4})


# ---- anchors, mask, loss -----------------------------------------------------------------------------------------
def test_anchors_are_distinct_loss_masked_and_sorted():
    loss_mask = torch.zeros(3, 20, dtype=torch.long)
    loss_mask[0, 5:] = 1
    loss_mask[1, 2:6] = 1
    anchors, valid = sample_anchors(loss_mask, 8, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 8) and valid.sum(1).tolist() == [8, 4, 0]
    for b in range(3):
        row = anchors[b][valid[b]].tolist()
        assert row == sorted(set(row)) and all(loss_mask[b, a] and a <= 18 for a in row)
    assert set(anchors[1][valid[1]].tolist()) == {2, 3, 4, 5}


@pytest.mark.parametrize("window", [None, 3])
def test_block_mask_matches_slow_reference(window):
    g = torch.Generator().manual_seed(1)
    loss_mask = (torch.rand(2, 11, generator=g) < 0.7).long()
    anchors, valid = sample_anchors(loss_mask, 3, generator=g)
    valid[1, -1] = False  # a padding block
    mask = anchored_block_mask(anchors, valid, 11, N, window)
    assert torch.equal(mask, slow_block_mask(anchors, valid, 11, N, window))


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_loss_matches_slow_reference(verifier, loss):
    drafter = make(verifier, loss=loss)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    loss_mask = torch.ones(2, 12, dtype=torch.long)
    loss_mask[0, :4] = 0
    loss_mask[1, 9] = 0
    anchors = sample_anchors(loss_mask, 5, generator=g)
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    out = drafter.training_loss(ids, feats, loss_mask, anchors=anchors)
    with torch.no_grad():
        hidden = drafter.anchored_hidden(ids, torch.cat(feats.layers, -1), *anchors)
        logits = drafter.logits(hidden[:, :, 1:])
        teacher = verifier.lm_head(feats.final) if loss == "kl" else None
    expected = slow_loss(logits, ids, loss_mask, *anchors, drafter.cfg.loss_gamma, teacher)
    assert torch.allclose(out.loss.double(), expected, atol=1e-5)
    out.loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0 and verifier.lm_head.weight.grad is None


def test_a_stored_argmax_scores_the_blocks_as_lm_head_does(verifier):
    """A cache's argmax (the verifier's greedy tokens) gives the counts lm_head(final) gives, and is what is read."""
    from dataclasses import replace

    drafter = make(verifier)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    loss_mask = torch.ones(2, 12, dtype=torch.long)
    anchors = sample_anchors(loss_mask, 5, generator=g)
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    stored = replace(feats, argmax=verifier.lm_head(feats.final).argmax(-1))
    with torch.no_grad():
        plain, cached = (drafter.training_loss(ids, f, loss_mask, anchors=anchors) for f in (feats, stored))
        # a stored argmax that says the drafter's own tokens: its blocks now count as right
        drafted = drafter.logits(drafter.anchored_hidden(ids, torch.cat(feats.layers, -1), *anchors)[:, :, 1:])
        own = stored.argmax.clone()
        index = (anchors[0][:, :, None] + torch.arange(N - 1)).clamp(max=11)  # (B, A, N-1): anchor + k
        own.scatter_(1, index.flatten(1), drafted.argmax(-1).flatten(1))
        other = drafter.training_loss(ids, replace(feats, argmax=own), loss_mask, anchors=anchors)
    assert torch.equal(plain.loss, cached.loss)
    fields = vars(plain.counts)
    assert all(torch.equal(fields[k], vars(cached.counts)[k]) for k in fields)
    assert torch.equal(plain.loss, other.loss)  # the data targets train; the argmax only scores
    assert other.counts.correct.sum() > plain.counts.correct.sum()


def test_block_targets_and_inputs():
    ids = torch.arange(10)[None] + 100
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    loss_mask[0, 7] = 0
    anchors, valid = torch.tensor([[2, 6, 0]]), torch.tensor([[True, True, False]])
    targets, trained = block_targets(ids, loss_mask, anchors, valid, N)
    assert targets[0, 0].tolist() == [103, 104, 105]
    assert trained[0].tolist() == [[True, True, True], [False, True, True], [False, False, False]]
    tokens, positions = block_inputs(ids, anchors, valid, N, mask_token_id=7)
    assert tokens[0, :N].tolist() == [102, 7, 7, 7] and positions[0, N:2 * N].tolist() == [6, 7, 8, 9]
    assert tokens[0, 2 * N:].tolist() == [7] * N
    assert torch.allclose(position_weights(16, 7.0)[:2], torch.tensor([1.0, torch.exp(torch.tensor(-1 / 7))]))


# ---- training = inference ----------------------------------------------------------------------------------------
def test_anchored_blocks_equal_blocks_drafted_alone(verifier):
    """Block j trained among others (one forward, the anchored mask) = the same block drafted at inference from
    the context before its anchor, through the cache the engine keeps (context appended in two pieces)."""
    drafter = make(verifier)
    ids = torch.randint(0, 64, (1, 14), generator=torch.Generator().manual_seed(3))
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    ctx = torch.cat(feats.layers, -1)  # (1, T, L*H)
    anchors, valid = torch.tensor([[0, 5, 9]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        trained = drafter.anchored_hidden(ids, ctx, anchors, valid)  # (1, 3, N, H)
        for j, a in enumerate(anchors[0].tolist()):
            block = torch.full((1, N), drafter.mask_token_id)
            block[0, 0] = ids[0, a]
            positions = torch.arange(a, a + N)[None]
            if a == 0:
                alone = drafter(positions, noise_embedding=drafter.embed(block), target_hidden=None)
            else:
                cache = DFlashCache(len(drafter.layers))
                half = a // 2
                for lo, hi in ((0, half), (half, a)):
                    for i, (k, v) in enumerate(drafter.context_kv(ctx[:, lo:hi], torch.arange(lo, hi)[None])):
                        cache.update(k, v, i)
                full = drafter(torch.cat([torch.arange(a)[None], positions], 1), noise_embedding=drafter.embed(block),
                               target_hidden=ctx[:, :a])

                def attend(i, q, k, v):
                    keys = torch.cat([cache.keys[i], k], 2)
                    return drafter.layers[i].self_attn.attend(q, keys, torch.cat([cache.values[i], v], 2), None)

                alone = drafter.block(drafter.embed(block), positions, attend)
                assert torch.allclose(alone, full, atol=1e-5)
            assert torch.allclose(trained[0, j], alone[0], atol=1e-5), f"block at anchor {a}"


@pytest.mark.filterwarnings("ignore::draftheads.models.dflash.DFlashWarning")  # window 3 < block 4: on purpose
@pytest.mark.parametrize("window", [None, 3])
def test_block_attention_equals_the_dense_mask(verifier, window):
    """Training scores each block token against its context range and its own block only
    (`Attention.attend_ranges`); SDPA over the dense anchored mask gives the same hidden states and gradients:
    packed rows (two documents), a padding block, a sliding layer beside a full one."""
    layers = ({} if window is None
              else {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": window})
    drafter = make(verifier, **layers)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (2, 14), generator=g)
    position_ids = torch.cat([torch.arange(8), torch.arange(6)]).expand(2, 14)  # two documents per row
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    ctx = torch.cat(feats.layers, -1)
    anchors, valid = sample_anchors(torch.ones(2, 14, dtype=torch.long), 5, generator=g)
    valid[1, -1] = False
    results = {}
    for attention in ("dense", "ranges"):
        drafter.zero_grad()
        hidden = drafter.anchored_hidden(ids, ctx, anchors, valid, position_ids, attention=attention)
        (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
        results[attention] = (hidden.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()})
    dense, dense_grads = results.pop("dense")
    for attention, (fast, fast_grads) in results.items():
        torch.testing.assert_close(fast, dense, atol=1e-5, rtol=1e-5, msg=attention)
        for name, grad in dense_grads.items():
            torch.testing.assert_close(fast_grads[name], grad, atol=1e-4, rtol=1e-4, msg=f"{attention}: {name}")


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore::draftheads.models.dflash.DFlashWarning")
def test_block_attention_equals_the_dense_mask_on_cuda(verifier):
    drafter = make(verifier, layer_types=["sliding_attention", "full_attention"], sliding_window=3).cuda()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (2, 40), generator=g)
    position_ids = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, 40)
    ctx = torch.cat(verifier.features(ids, layer_ids=drafter.feature_layers).layers, -1)
    anchors, valid = sample_anchors(torch.ones(2, 40, dtype=torch.long), 9, generator=g)
    ids, ctx, anchors, valid, position_ids = (t.cuda() for t in (ids, ctx, anchors, valid, position_ids))
    results = {}
    for attention in ("dense", "ranges"):
        drafter.zero_grad()
        hidden = drafter.anchored_hidden(ids, ctx, anchors, valid, position_ids, attention=attention)
        (hidden * torch.linspace(-1, 1, hidden.shape[-1], device="cuda")).sum().backward()
        results[attention] = (hidden.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()})
    (dense, dense_grads), (ranges, range_grads) = results["dense"], results["ranges"]
    torch.testing.assert_close(ranges, dense, atol=1e-5, rtol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(range_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("window", [None, 3])
def test_context_ranges_are_the_context_mask(window):
    g = torch.Generator().manual_seed(5)
    position_ids = torch.cat([torch.arange(8), torch.arange(6)]).expand(2, 14)
    anchors, valid = sample_anchors(torch.ones(2, 14, dtype=torch.long), 5, generator=g)
    valid[1, -1] = False
    for positions in (None, position_ids):
        mask = anchored_context_mask(anchors, valid, 14, N, window, positions)  # (B, A*N, T)
        lo, hi = anchored_context_ranges(anchors, valid, 14, N, window, positions)
        keys = torch.arange(14)
        assert torch.equal((keys >= lo[:, :, None]) & (keys < hi[:, :, None]), mask)


def range_reference(q, k, v, lo, hi, scale):
    """Autograd over the dense (M, S) scores; an empty range gives output 0 and log-sum-exp -inf."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    keys = torch.arange(k.shape[2])
    seen = ((keys >= lo[:, :, None]) & (keys < hi[:, :, None]))[:, None]  # (B, 1, M, S)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = (scores - lse.nan_to_num(neginf=0.0)[..., None]).exp()
    return p @ v, lse


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunk", [None, 3])
def test_range_attention_equals_autograd_over_the_full_scores(dtype, rtol, chunk):
    """Values and gradients of q, k, v through both outputs (the merged softmax reads the log-sum-exp), with GQA,
    empty ranges (a block at anchor 0, an invalid block) and chunks whose rows reach different keys."""
    g = torch.Generator().manual_seed(6)
    B, nh, nkv, M, S, d = 2, 4, 2, 13, 11, 8
    q = torch.randn(B, nh, M, d, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(B, nkv, S, d, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    hi = torch.randint(0, S + 1, (B, M), generator=g)
    lo = (hi - torch.randint(0, 6, (B, M), generator=g)).clamp(min=0)
    hi[0, :3] = 0  # empty ranges
    lo[0, :3] = 0
    out, lse = range_attention(q, k, v, lo, hi, 0.3, chunk)
    want_out, want_lse = range_reference(q, k, v, lo, hi, 0.3)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen) and not out[~seen[..., None].expand_as(out)].any()
    w_out = torch.randn(out.shape, generator=g, dtype=dtype)
    w_lse = torch.randn(lse.shape, generator=g, dtype=dtype)

    def objective(o, l):
        return (o * w_out).sum() + (l.masked_fill(~seen, 0) * w_lse).sum()

    got = [out, lse.masked_fill(~seen, 0)] + list(torch.autograd.grad(objective(out, lse), [q, k, v]))
    want = [want_out, want_lse.masked_fill(~seen, 0)] + list(torch.autograd.grad(objective(want_out, want_lse),
                                                                                 [q, k, v]))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        error = ((a - b).abs().max() / b.abs().max()).item()
        assert error <= rtol, f"{name}: {error:.2e} relative"


def test_range_attention_keeps_nothing_quadratic(verifier):
    """What `attend_ranges` keeps for the backward grows with the block tokens plus the context, not their product;
    SDPA with the dense anchored mask keeps an (A*N, T + A*N) mask (the check can fail)."""
    drafter = make(verifier)
    attn = drafter.layers[0].self_attn

    def kept(T, ranges):
        g = torch.Generator().manual_seed(7)
        anchors, valid = sample_anchors(torch.ones(1, T, dtype=torch.long), T // 4, generator=g)
        d, nh, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        q = torch.randn(1, nh, anchors.shape[1] * N, d, requires_grad=True)
        k, v = (torch.randn(1, nkv, anchors.shape[1] * N, d, requires_grad=True) for _ in range(2))
        context_kv = tuple(torch.randn(1, nkv, T, d, requires_grad=True) for _ in range(2))
        storages = {}

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            if ranges:
                lo, hi = anchored_context_ranges(anchors, valid, T, N)
                attn.attend_ranges(q, context_kv, k, v, lo, hi, own_block_mask(N), chunk=16)
            else:
                mask = anchored_block_mask(anchors, valid, T, N)[:, None]
                attn.attend(q, torch.cat([context_kv[0], k], 2), torch.cat([context_kv[1], v], 2), mask)
        return sum(storages.values())

    assert kept(1024, True) < 16.8 * kept(64, True)  # 16x the context and 16x the blocks: 16x the bytes
    assert kept(1024, False) > 40 * kept(64, False)


def test_cache_crop_and_engine_mask(verifier):
    drafter = make(verifier)
    cache = DFlashCache(2)
    for i in range(2):
        cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), i)
    cache.crop_to(3)
    assert cache.get_seq_length() == 3 and cache.values[1].shape[2] == 3
    with pytest.raises(DFlashError):
        cache.crop(2)
    mask = drafter.attention_mask(torch.tensor([2, 4]), 5, torch.tensor([[2, 3, 4, 5], [4, 5, 6, 7]]))
    assert mask.shape == (2, 1, N, 5 + N)
    assert mask[0, 0, 0].tolist() == [True, True, False, False, False] + [True] * N
    assert mask[1, 0, 3, :5].tolist() == [True] * 4 + [False]


def test_final_norm_starts_as_the_verifiers():
    verifier = Verifier(tiny_model("llama", num_layers=4, vocab_size=64))
    with torch.no_grad():
        verifier.norm.weight.uniform_(0.5, 2.0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=N))
    x = torch.randn(3, verifier.hidden_size)
    assert torch.allclose(drafter.norm(x), verifier.norm(x), atol=1e-5)


def test_blind_block_positions_are_warned_about_in_one_line(verifier):
    """A first layer attending within a window narrower than the block leaves positions window..N-1 seeing only mask
    tokens there; build_drafter says so (DFlashWarning), and says why they collapse to one token when the mask
    token's embedding row is zero (HF zeroes the pad token's row). A block inside the window, or a full first
    layer, builds silently."""
    import warnings

    from draftheads.models.dflash import DFlashWarning, blind_positions_warning

    layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    pad = int(verifier.config.pad_token_id)
    embed = verifier.embed_tokens.weight
    saved = embed[pad].detach().clone()
    try:
        with torch.no_grad():
            embed[pad].zero_()
        with pytest.warns(DFlashWarning) as caught:
            build_drafter(verifier, DFlashConfig(block_size=8, mask_token_id=pad, **layers))
        (line,) = [str(w.message) for w in caught]
        assert "\n" not in line and "positions 4..7" in line and "all zeros" in line
        assert f"dflash.mask_token_id={pad}" in line and "dflash.sliding_window to at least 8" in line
        nonzero = next(i for i in range(embed.shape[0]) if embed[i].ne(0).any())
        with pytest.warns(DFlashWarning, match="one and the same vector"):
            build_drafter(verifier, DFlashConfig(block_size=8, mask_token_id=nonzero, **layers))
        with warnings.catch_warnings():
            warnings.simplefilter("error", DFlashWarning)
            build_drafter(verifier, DFlashConfig(block_size=4, mask_token_id=nonzero, **layers))  # inside the window
            build_drafter(verifier, DFlashConfig(block_size=8, mask_token_id=nonzero, num_hidden_layers=2))  # all full
        resolved = DFlashConfig(block_size=16, mask_token_id=pad, **layers).resolve(verifier.config)
        assert blind_positions_warning(resolved, torch.ones(4)).startswith("dflash.block_size=16")
        assert blind_positions_warning(resolved, torch.zeros(4)).count("all zeros") == 1
    finally:
        with torch.no_grad():
            embed[pad].copy_(saved)


def test_mask_token_embedded_as_zeros_is_passed_over_or_warned_about(verifier):
    """HF zeroes the pad token's embedding row; a mask token embedded as zeros gives the first layer zero queries,
    keys and values at every mask position. The default mask token passes over it (the lowest id whose row is not
    zero); set by hand, build_drafter says so in one line (DFlashWarning)."""
    import warnings

    from draftheads.models.dflash import DFlashWarning, default_mask_token, zero_mask_warning

    pad = int(verifier.config.pad_token_id)
    embed = verifier.embed_tokens.weight
    saved = embed[: pad + 3].detach().clone()
    try:
        with torch.no_grad():
            embed[pad].fill_(0.5)  # a pad row that is not zero stays the default
        assert default_mask_token(verifier.config, embed) == pad
        with torch.no_grad():
            embed[: pad + 2].zero_()  # the pad row and the rows below pad + 2 are zero: the default is pad + 2
        assert default_mask_token(verifier.config) == pad  # without the embedding: the pad token, as before
        assert default_mask_token(verifier.config, embed) == pad + 2
        with warnings.catch_warnings():
            warnings.simplefilter("error", DFlashWarning)
            drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=4))
        assert drafter.mask_token_id == pad + 2
        with pytest.warns(DFlashWarning) as caught:
            build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=4, mask_token_id=pad))
        (line,) = [str(w.message) for w in caught]
        assert "\n" not in line and line.startswith(f"dflash.mask_token_id={pad}: ") and "all zeros" in line
        resolved = DFlashConfig(num_hidden_layers=1, block_size=4, mask_token_id=pad).resolve(verifier.config)
        assert zero_mask_warning(resolved, torch.ones(4)) is None
    finally:
        with torch.no_grad():
            embed[: pad + 3].copy_(saved)


def test_layers_start_from_the_verifiers_or_a_normal_init(verifier):
    torch.manual_seed(0)
    with torch.no_grad():
        src = verifier.layers[4]
        for norm in (src.input_layernorm, src.post_attention_layernorm, src.self_attn.q_norm, src.self_attn.k_norm):
            norm.weight.uniform_(0.5, 2.0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=N, init_layers=[4, 0]))
    for ours, source in zip(drafter.layers, (verifier.layers[4], verifier.layers[0])):
        theirs = dict(source.named_parameters())
        for key, param in ours.named_parameters():  # every weight, norms and q/k norms too (Qwen3's)
            assert torch.allclose(param, theirs[key].float(), rtol=1e-6, atol=0), key
    fresh = build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=N))
    assert not torch.equal(fresh.layers[0].mlp.up_proj.weight, verifier.layers[0].mlp.up_proj.weight)

    normal = build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=N, init_std=0.02))
    w = torch.cat([m.weight.detach().flatten() for m in normal.modules() if isinstance(m, torch.nn.Linear)])
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002

    llama = Verifier(tiny_model("llama", num_layers=4, vocab_size=64))  # no q/k norms: the drafter's stay ones
    started = build_drafter(llama, DFlashConfig(num_hidden_layers=1, block_size=N, init_layers=[3]))
    assert torch.equal(started.layers[0].self_attn.q_proj.weight, llama.layers[3].self_attn.q_proj.weight)
    assert torch.equal(started.layers[0].self_attn.q_norm.weight, torch.ones(started.cfg.head_dim))


@pytest.mark.parametrize("overrides, message", [
    ({"init_layers": [1]}, r"dflash.init_layers=\[1\]: expected one verifier layer id >= 0 per drafter layer \(2\)"),
    ({"init_layers": [1, 6]}, r"dflash.init_layers=\[1, 6\]: the verifier has 6 layers; expected ids in 0..5"),
    ({"init_layers": [0, 1], "intermediate_size": 48},
     r"dflash.init_layers: verifier layer 0: mlp.gate_proj.weight is shape \[128, 64\]; the drafter's layer needs "
     r"\[48, 64\]"),
    ({"init_std": 0.0}, r"dflash.init_std=0.0: expected a number > 0"),
])
def test_bad_init_is_refused_in_one_line(verifier, overrides, message):
    with pytest.raises(DFlashError, match=message) as err:
        build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=N, **overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_own_lm_head_loss_matches_slow_reference(verifier, loss):
    """dflash.draft_vocab_size: the loss over the drafter's own lm_head; a target outside the draft vocabulary is
    not trained (the slow reference: those positions masked, the logits over the draft columns)."""
    counts = torch.arange(64) % 7
    torch.manual_seed(0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=N, loss=loss, draft_vocab_size=40),
                            token_counts=counts).eval()
    cols = drafter.draft_token_ids()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    loss_mask = torch.ones(2, 12, dtype=torch.long)
    anchors = sample_anchors(loss_mask, 5, generator=g)
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    out = drafter.training_loss(ids, feats, loss_mask, anchors=anchors)
    greedy = verifier.lm_head(feats.final).argmax(-1)  # (B, T): the verifier's greedy token after each position
    targets = ids if drafter.cfg.targets == "data" else torch.cat([ids[:, :1], greedy[:, :-1]], 1)
    assert not drafter.t2d[targets].all()  # some targets are outside the draft vocabulary
    with torch.no_grad():
        hidden = drafter.anchored_hidden(ids, torch.cat(feats.layers, -1), *anchors)
        logits = drafter.logits(hidden[:, :, 1:])[..., cols]
        teacher = verifier.lm_head(feats.final)[..., cols] if loss == "kl" else None
    rank = torch.cumsum(drafter.t2d.long(), 0) - 1
    expected = slow_loss(logits, rank[ids].clamp(min=0), loss_mask * drafter.t2d[targets], *anchors,
                         drafter.cfg.loss_gamma, teacher)
    assert torch.allclose(out.loss.double(), expected, atol=1e-5)
    out.loss.backward()
    assert drafter.lm_head.weight.grad.abs().sum() > 0 and verifier.lm_head.weight.grad is None


def test_hidden_act_is_one_vllm_serves():
    """A misspelt or unsupported activation is one line naming the key before anything loads (it was a KeyError
    from transformers' ACT2FN once the data had loaded); vLLM's DFlash MLP is SiluAndMul."""
    from draftheads.models.dflash.config import DFlashConfig, DFlashError

    with pytest.raises(DFlashError, match=r"dflash.hidden_act='swishy': expected silu .*qwen3_dflash"):
        DFlashConfig(hidden_act="swishy")
    assert DFlashConfig(hidden_act="silu").hidden_act == "silu" and DFlashConfig().hidden_act is None
