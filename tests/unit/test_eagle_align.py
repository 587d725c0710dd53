"""eagle.align_topk (GRIFFIN's token-alignable training): step k of a chain trains only where the verifier's argmax
was among the drafter's top-k at every earlier step of that chain; checked against a slow reference built from the
drafter's own unroll."""

import pytest
import torch

from draftheads.models.draft_losses import masked_mean, token_loss
from draftheads.models.eagle import EagleConfig, EagleError, build_drafter
from draftheads.models.eagle.losses import draft_targets
from draftheads.models.verifier import Verifier


def reference_step_losses(drafter, ids, feats, loss_mask, topk):
    """Each step's loss the slow way: per-position forward KL, positions kept by the chain's earlier top-k hits."""
    outs = drafter.ttt_unroll(ids, drafter.project_features(torch.cat(feats.layers, -1)), None)
    logp, target_ids, in_draft = draft_targets(drafter._target_logits(feats), drafter.d2t, drafter.t2d)
    B, T = ids.shape
    alive = torch.ones(B, T, dtype=torch.bool)
    losses, survivors = [], []
    for k, out in enumerate(outs):
        n = T - 2 - k
        logits = drafter.logits(out[:, :n])
        _, trained = drafter.loss_positions(loss_mask, None, in_draft, k)
        if topk is not None:
            trained = trained & alive[:, :n]
        per_position, _ = token_loss("forward_kl", logits, logp[:, 1 + k:T - 1])
        losses.append(masked_mean(per_position, trained))
        survivors.append(int(trained.sum()))
        if topk is not None:
            top = logits.topk(topk, dim=-1).indices
            hit = torch.zeros(B, n, dtype=torch.bool)
            for b in range(B):
                for t in range(n):
                    drafted = {int(drafter.to_target_ids(top[b, t, i])) for i in range(topk)}
                    hit[b, t] = int(target_ids[b, 1 + k + t]) in drafted
            alive[:, :n] &= hit
    return torch.stack(losses), survivors


@pytest.fixture(scope="module")
def fitted(tiny_verifier_dirs):
    """A drafter fitted for a few steps to one batch, so that its top-1 drafts match the verifier's argmax at some
    positions of each step (a random one matches none); the whole vocabulary as draft vocabulary, so that every
    position trains at step 0 and a chain ends only where a draft misses."""
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])
    torch.manual_seed(0)
    ids = torch.randint(3, verifier.vocab_size, (2, 14))
    counts = torch.bincount(ids.flatten(), minlength=verifier.vocab_size)
    torch.manual_seed(1)
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=3, draft_vocab_size=None), token_counts=counts).train()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    mask = torch.ones_like(ids)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(25):
        optimizer.zero_grad()
        drafter.training_loss(ids, feats, mask).loss.backward()
        optimizer.step()
    return drafter, ids, feats, mask


def test_aligned_step_losses_match_the_reference(fitted):
    drafter, ids, feats, mask = fitted
    with torch.no_grad():
        unaligned, _ = reference_step_losses(drafter, ids, feats, mask, None)
    survivors = {}
    for topk in (None, 1, 30):
        drafter.cfg.align_topk = topk
        with torch.no_grad():
            got = drafter.train().training_loss(ids, feats, mask).step_losses  # EAGLE-3 draws no noise
            want, survivors[topk] = reference_step_losses(drafter, ids, feats, mask, topk)
            held_out = drafter.eval().training_loss(ids, feats, mask).step_losses
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # a training mask: in eval mode every position counts, as without it
        torch.testing.assert_close(held_out, unaligned, rtol=1e-5, atol=1e-6)
    drafter.cfg.align_topk = None
    # the test means something: each step keeps some chains and drops others, and a top-30 hit is more lenient
    top1, top30 = survivors[1], survivors[30]
    assert top1[0] > top1[1] + 1 and top1[1] >= top1[2] > 0, top1
    assert top30[1] > top1[1] and top30[2] >= top1[2], (top30, top1)


def test_align_topk_is_checked():
    with pytest.raises(EagleError, match=r"eagle.align_topk=0: expected a positive number of drafts or null"):
        EagleConfig(align_topk=0)
    with pytest.raises(EagleError, match=r"eagle.align_topk=1 is an EAGLE-3 option; eagle.version is 1"):
        EagleConfig(version=1, align_topk=1)
