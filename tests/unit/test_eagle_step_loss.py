"""EAGLE-3's per-step token loss (models/eagle/losses.py `HeadLoss`: the head's backward in the forward, chunked,
over the positions read; the later TTT steps over the positions still read): the same loss, step losses, counts and
gradients as the plain loop over every position's whole logits (copied here as the slow reference), no (B, n, Vd)
tensor of any TTT step kept for backward, and a second backward refused."""

import pytest
import torch

from draftheads.models.draft_losses import masked_mean, soft_cross_entropy, step_weights, token_loss
from draftheads.models.eagle import EagleConfig, build_drafter
from draftheads.models.eagle import losses as eagle_losses
from draftheads.models.eagle.losses import HeadLoss, add_uniform_noise, draft_targets
from draftheads.models.eagle.metrics import EagleOutput, step_counts
from draftheads.models.verifier import Verifier


def reference_training_loss(self, input_ids, features, loss_mask, position_ids=None) -> EagleOutput:
    """Eagle3Drafter.training_loss as it was before the chunked step loss: every step's (B, n, Vd) logits whole."""
    B, T = input_ids.shape
    feats = torch.cat(features.layers, dim=-1).to(self.dtype)  # (B, T, 3H)
    if self.training and self.cfg.input_noise > 0:
        feats = add_uniform_noise(feats, self.cfg.input_noise)
    outs = self.ttt_unroll(input_ids, self.project_features(feats), position_ids)
    with torch.no_grad():
        target_logp, target_ids, in_draft = draft_targets(self._target_logits(features), self.d2t, self.t2d)
        # forward_kl weighted without the measured acceptance needs only p: exp'd once for every step
        fused = self.cfg.loss == "forward_kl" and self.cfg.step_weights != "reach"
        if fused:
            target_p = target_logp.exp()  # (B, T, Vd)
            target_mass = target_p.sum(-1)
    K = len(outs)
    correct = torch.zeros(K, B, T, dtype=torch.bool, device=input_ids.device)  # aligned on stream position t
    valid = torch.zeros_like(correct)
    zero = torch.zeros((), device=input_ids.device)
    step_losses, step_alpha = [], []
    kept = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # parallel: chains still trained
    align = self.cfg.align_topk is not None and self.training  # a training mask: held-out losses stay comparable
    aligned = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # align_topk: chains still verified
    for k, out in enumerate(outs):
        n = T - 2 - k  # stream positions t = 0..n-1 predict x_{t+2+k}, which exists
        if n <= 0:
            step_losses.append(outs[0].sum() * 0)
            step_alpha.append(zero)
            continue
        logits = self.logits(out[:, :n])  # (B, n, Vd)
        scored, trained = self.loss_positions(loss_mask, position_ids, in_draft, k)  # (B, n)
        if self.parallel and k > 0 and self.training:  # P-EAGLE: chains kept with chance f_k / f_{k-1}
            ratio = self.keep_fraction(k) / self.keep_fraction(k - 1)
            kept = kept & (torch.rand(kept.shape, device=kept.device) < ratio)
            trained = trained & kept[:, :n]
        if align:
            trained = trained & aligned[:, :n]
        if fused:
            per_position = soft_cross_entropy(logits, target_p[:, 1 + k:T - 1], target_mass[:, 1 + k:T - 1])
            step_alpha.append(zero)  # unread: the step weights are fixed
        else:
            per_position, alpha = token_loss(self.cfg.loss, logits, target_logp[:, 1 + k:T - 1],
                                             self.cfg.lk_eta)
            step_alpha.append(masked_mean(alpha, trained))
        step_losses.append(masked_mean(per_position, trained))
        with torch.no_grad():
            draft = logits.max(-1).indices  # argmax (the first maximum), about 2x faster on a CPU
            correct[k, :, :n] = self.to_target_ids(draft) == target_ids[:, 1 + k:T - 1]
            valid[k, :, :n] = scored
            if align:  # the chain from t goes on past step k iff the verifier's argmax is drafted
                hit = correct[k, :, :n]
                if self.cfg.align_topk > 1:
                    top = logits.topk(min(self.cfg.align_topk, logits.shape[-1]), dim=-1).indices
                    hit = (self.to_target_ids(top) == target_ids[:, 1 + k:T - 1, None]).any(-1)
                aligned[:, :n] &= hit
    weights = step_weights(self.cfg.step_weights, K, self.cfg.decay, torch.stack(step_alpha)).to(zero.device)
    loss = (weights * torch.stack(step_losses)).sum()
    step_losses = [x.detach() for x in step_losses]
    return EagleOutput(loss=loss, step_losses=torch.stack(step_losses), counts=step_counts(correct, valid))


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dirs):
    return Verifier.from_pretrained(tiny_verifier_dirs["llama"])


def batch(verifier, B=2, T=12, seed=0, prompts=(3, 0)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, verifier.vocab_size, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for row, prompt in enumerate(prompts[:B]):
        mask[row, :prompt] = 0  # a prompt
    return ids, mask


def run(drafter, ids, feats, mask, loss_fn, seed=0):
    torch.manual_seed(seed)  # input noise and P-EAGLE's kept chains draw from the global RNG
    drafter.zero_grad(set_to_none=True)
    out = loss_fn(drafter, ids, feats, mask)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


CASES = {
    "forward_kl": {},
    "forward_kl reach": {"step_weights": "reach"},
    "reverse_kl": {"loss": "reverse_kl"},
    "lk_hybrid": {"loss": "lk_hybrid"},
    "align top-2": {"align_topk": 2},
    "parallel": {"parallel": True},
    "norm_output": {"norm_output": True, "loss": "jsd"},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_rows", [None, 3])
@pytest.mark.parametrize("prompts", [(3, 0), (5, 7)])  # (5, 7): no row reads positions 0..1, later steps a tail
def test_chunked_step_loss_equals_the_whole_logits_loop(verifier, monkeypatch, case, chunk_rows, prompts):
    ids, mask = batch(verifier, prompts=prompts)
    counts = torch.bincount(ids.flatten(), minlength=verifier.vocab_size) + 1
    torch.manual_seed(1)
    cfg = EagleConfig(ttt_steps=3, draft_vocab_size=96, noise=0.1, **CASES[case])
    drafter = build_drafter(verifier, cfg, token_counts=counts).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    if chunk_rows:  # 3 positions per chunk: several chunks per step, the last one short
        monkeypatch.setattr(eagle_losses, "CHUNK_BYTES", 4 * drafter.draft_vocab_size * ids.shape[0] * chunk_rows)
        monkeypatch.setattr(eagle_losses, "GRAD_BLOCK_ROWS", 7)  # lm_head's gradient in blocks, the last short
    new, new_grads = run(drafter, ids, feats, mask, type(drafter).training_loss)
    ref, ref_grads = run(drafter, ids, feats, mask, reference_training_loss)
    torch.testing.assert_close(new.loss, ref.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(new.step_losses, ref.step_losses, rtol=1e-5, atol=1e-7)
    for a, b in zip(vars(new.counts).values(), vars(ref.counts).values()):
        assert torch.equal(a, b)
    assert new_grads.keys() == ref_grads.keys() and "lm_head.weight" in new_grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(new_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs (saved_tensors_hooks)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[(s.data_ptr(), t.device)] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_no_step_keeps_its_draft_vocabulary_logits_for_backward(verifier):
    """The reference keeps each step's fp32 softmax (B, n, Vd) for backward; HeadLoss keeps the gradients of the
    steps' hidden rows (B, R, H) and nothing of the logits: the bytes kept drop by at least those softmaxes."""
    B, T, K = 2, 48, 3
    ids, mask = batch(verifier, B, T)
    torch.manual_seed(1)
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=K, draft_vocab_size=None), token_counts=None).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    Vd = drafter.draft_vocab_size
    softmaxes = sum(4 * B * (T - 2 - k) * Vd for k in range(K))
    ref = saved_bytes(lambda: reference_training_loss(drafter, ids, feats, mask))
    out = []
    new = saved_bytes(lambda: out.append(drafter.training_loss(ids, feats, mask)))
    held = sum(g.nbytes for g in out[0].loss.grad_fn.head.input_grads)  # the hidden rows' gradients, (B, R, H)
    assert ref - (new + held) >= softmaxes, (ref, new, held, softmaxes)


@pytest.mark.parametrize("case", ["packed", "window"])
def test_packed_rows_and_windows_equal_the_whole_logits_loop(verifier, case):
    """Packed documents (a chain that runs into the next document is not read) and a sliding window: the later
    steps' rows are then not a prefix, and their attention takes `where`'s masked path."""
    ids, mask = batch(verifier, T=16, prompts=(2, 4))
    positions = torch.tensor([list(range(6)) + list(range(10)), list(range(9)) + list(range(7))])
    torch.manual_seed(1)
    cfg = EagleConfig(ttt_steps=4, draft_vocab_size=None, sliding_window=5 if case == "window" else None)
    drafter = build_drafter(verifier, cfg).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    pos = positions if case == "packed" else None

    def loss_of(fn):
        return lambda d, *a: fn(d, *a, position_ids=pos)

    new, new_grads = run(drafter, ids, feats, mask, loss_of(type(drafter).training_loss))
    ref, ref_grads = run(drafter, ids, feats, mask, loss_of(reference_training_loss))
    torch.testing.assert_close(new.loss, ref.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(new.step_losses, ref.step_losses, rtol=1e-5, atol=1e-7)
    for a, b in zip(vars(new.counts).values(), vars(ref.counts).values()):
        assert torch.equal(a, b)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(new_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_frozen_lm_head_gets_no_gradient_and_the_rest_equal(verifier):
    ids, mask = batch(verifier, prompts=(4, 2))
    counts = torch.bincount(ids.flatten(), minlength=verifier.vocab_size) + 1
    torch.manual_seed(1)
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=3, draft_vocab_size=96, freeze_lm_head=True),
                            token_counts=counts).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    new, new_grads = run(drafter, ids, feats, mask, type(drafter).training_loss)
    ref, ref_grads = run(drafter, ids, feats, mask, reference_training_loss)
    assert "lm_head.weight" not in new_grads and new_grads.keys() == ref_grads.keys()
    torch.testing.assert_close(new.loss, ref.loss, rtol=1e-5, atol=1e-7)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(new_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_second_backward_is_refused(verifier):
    ids, mask = batch(verifier)
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=2, draft_vocab_size=None)).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    loss = drafter.training_loss(ids, feats, mask).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the EAGLE-3 head loss"):
        loss.backward()


def test_head_loss_equals_autograd_and_refuses_bad_shapes():
    """HeadLoss alone, fp64, two steps over chosen rows, against autograd over the whole logits."""
    g = torch.Generator().manual_seed(0)
    B, n, H, V = 2, 9, 6, 11
    norm = torch.nn.RMSNorm(H, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    weight = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    hidden = [torch.randn(B, n, H, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2)]
    p = torch.softmax(torch.randn(B, n, V, dtype=torch.float64, generator=g), -1)
    rows = [torch.tensor([1, 2, 5, 8]), torch.arange(3, 7)]  # gathered; consecutive from 3 (a slice)
    masks = [torch.rand(B, n, generator=g) > 0.3 for _ in range(2)]
    head = HeadLoss(norm, weight, chunk_rows=3)
    for k, (h, r, m) in enumerate(zip(hidden, rows, masks)):
        m[:, ~torch.isin(torch.arange(n), r)] = False
        head.step(h[:, r], p, m[:, r].double() / m.sum(), p.sum(-1), r, step_weight=0.8 ** k)
    got = torch.autograd.grad(head.loss(), [*hidden, weight, norm.weight])
    want_loss = sum(0.8 ** k * masked_mean(soft_cross_entropy(torch.nn.functional.linear(norm(h), weight), p), m)
                    for k, (h, m) in enumerate(zip(hidden, masks)))
    want = torch.autograd.grad(want_loss, [*hidden, weight, norm.weight])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="expected \\(B, R, H\\), \\(B, R\\), \\(R,\\)"):
        HeadLoss(norm, weight).step(hidden[0], p, torch.ones(B, n - 1, dtype=torch.float64))


def test_a_batch_with_nothing_to_train_gives_zero_gradients(verifier):
    ids, mask = batch(verifier, prompts=(12, 12))  # every target a prompt's
    torch.manual_seed(1)
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=3, draft_vocab_size=None)).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    new, new_grads = run(drafter, ids, feats, mask, type(drafter).training_loss)
    ref, ref_grads = run(drafter, ids, feats, mask, reference_training_loss)
    assert new.loss.item() == ref.loss.item() == 0.0 and new_grads.keys() == ref_grads.keys()
    assert all(not g.any() for g in new_grads.values())


@pytest.mark.parametrize("case", ["forward_kl", "align top-2"])
def test_a_zero3_partitioned_head_runs_as_modules_and_equals_the_loop(verifier, monkeypatch, case):
    """A weight DeepSpeed ZeRO-3 partitioned (marked by `ds_id`) takes the module path, chunks recomputed in
    backward: the same results (tests/e2e/test_deepspeed.py trains under ZeRO-3 itself)."""
    ids, mask = batch(verifier, prompts=(5, 7))
    counts = torch.bincount(ids.flatten(), minlength=verifier.vocab_size) + 1
    torch.manual_seed(1)
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=3, draft_vocab_size=96, **CASES[case]),
                            token_counts=counts).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    monkeypatch.setattr(eagle_losses, "CHUNK_BYTES", 4 * drafter.draft_vocab_size * ids.shape[0] * 3)
    drafter.lm_head.weight.ds_id = 0
    new, new_grads = run(drafter, ids, feats, mask, type(drafter).training_loss)
    ref, ref_grads = run(drafter, ids, feats, mask, reference_training_loss)
    assert new.loss.grad_fn.name() != "_HeadGradientsBackward"
    torch.testing.assert_close(new.loss, ref.loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(vars(new.counts).values(), vars(ref.counts).values()):
        assert torch.equal(a, b)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(new_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_head_loss_under_bf16_autocast_equals_autograd_within_bf16_rounding():
    """Under bf16 autocast the head's matmuls run in bf16 and the lm_head's gradient is summed over the steps in
    bf16 blocks (as autograd sums the gradients of autocast's cached cast): the loss and every gradient equal
    autograd's through autocast within bf16 rounding, and the weight's gradient comes back in float32."""
    g = torch.Generator().manual_seed(0)
    B, n, H, V = 2, 40, 64, 300
    norm = torch.nn.RMSNorm(H, eps=1e-6)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    hidden = [torch.randn(B, n, H, generator=g, requires_grad=True) for _ in range(3)]
    p = torch.softmax(torch.randn(B, n, V, generator=g) * 2, -1)
    rows = [torch.arange(n), torch.arange(2, n - 3), torch.tensor([0, 5, 6, 30])]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head = HeadLoss(norm, weight, chunk_rows=16)
        for k, (h, r) in enumerate(zip(hidden, rows)):
            head.step(h[:, r], p, torch.full((B, len(r)), 1.0 / (B * len(r))), p.sum(-1), r, step_weight=0.8 ** k)
        got = torch.autograd.grad(head.loss(), [*hidden, weight, norm.weight])
        want_loss = sum(0.8 ** k * soft_cross_entropy(torch.nn.functional.linear(norm(h[:, r]), weight),
                                                      p[:, r]).mean() for k, (h, r) in enumerate(zip(hidden, rows)))
        want = torch.autograd.grad(want_loss, [*hidden, weight, norm.weight])
    assert got[3].dtype == torch.float32
    for a, b in zip(got, want):
        error = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert error < 2e-2, error
