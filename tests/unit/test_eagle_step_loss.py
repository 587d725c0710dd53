"""EAGLE-3's per-step token loss chunked over positions (models/eagle/losses.py `step_token_loss`): the same loss,
step losses, counts and gradients as the unchunked loop it replaced (copied here as the slow reference), and no
(B, n, Vd) tensor of any TTT step kept for backward."""

import pytest
import torch

from draftheads.models.draft_losses import masked_mean, soft_cross_entropy, step_weights, token_loss
from draftheads.models.eagle import EagleConfig, build_drafter
from draftheads.models.eagle import losses as eagle_losses
from draftheads.models.eagle.losses import add_uniform_noise, draft_targets
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


def batch(verifier, B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, verifier.vocab_size, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a prompt
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
def test_chunked_step_loss_equals_the_whole_logits_loop(verifier, monkeypatch, case, chunk_rows):
    ids, mask = batch(verifier)
    counts = torch.bincount(ids.flatten(), minlength=verifier.vocab_size) + 1
    torch.manual_seed(1)
    cfg = EagleConfig(ttt_steps=3, draft_vocab_size=96, noise=0.1, **CASES[case])
    drafter = build_drafter(verifier, cfg, token_counts=counts).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    if chunk_rows:  # 3 positions per chunk: several chunks per step, the last one short
        monkeypatch.setattr(eagle_losses, "CHUNK_BYTES", 4 * drafter.draft_vocab_size * ids.shape[0] * chunk_rows)
    new, new_grads = run(drafter, ids, feats, mask, type(drafter).training_loss)
    ref, ref_grads = run(drafter, ids, feats, mask, reference_training_loss)
    torch.testing.assert_close(new.loss, ref.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(new.step_losses, ref.step_losses, rtol=1e-5, atol=1e-7)
    for a, b in zip(vars(new.counts).values(), vars(ref.counts).values()):
        assert torch.equal(a, b)
    assert new_grads.keys() == ref_grads.keys() and "lm_head.weight" in new_grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(new_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    if chunk_rows is None:  # one chunk: the same arithmetic, bit for bit
        assert torch.equal(new.loss, ref.loss)


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
    """The reference keeps each step's fp32 softmax (B, n, Vd) for backward; the chunked loss keeps only hidden
    states: the saved bytes drop by at least the sum of those softmaxes."""
    B, T, K = 2, 48, 3
    ids, mask = batch(verifier, B, T)
    torch.manual_seed(1)
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=K, draft_vocab_size=None), token_counts=None).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    Vd = drafter.draft_vocab_size
    softmaxes = sum(4 * B * (T - 2 - k) * Vd for k in range(K))
    ref = saved_bytes(lambda: reference_training_loss(drafter, ids, feats, mask))
    new = saved_bytes(lambda: drafter.training_loss(ids, feats, mask))
    assert ref - new >= softmaxes, (ref, new, softmaxes)
