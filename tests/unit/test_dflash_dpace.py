"""dflash.loss=dpace (models/dflash/losses.py: `dpace_weights`, `dpace_loss`): the weights by hand, the loss and its
gradients against the slow reference by loops (tests/dflash_reference.py), and the drafter's choice wired: dpace is
neither ce nor kl, on the verifier's lm_head and on an own one."""

import pytest
import torch

from draftheads.models.dflash import (
    DFlashConfig,
    DFlashError,
    block_targets,
    build_drafter,
    dflash_loss,
    dpace_loss,
    dpace_weights,
    sample_anchors,
)
from draftheads.models.verifier import Verifier
from tests.dflash_reference import slow_dpace_loss
from tests.unit.test_dflash import make  # a drafter with lively weights, block N
from tests.utils import tiny_model

N = 4  # block size of the drafters here: K = 3 drafted positions


@pytest.fixture(scope="module")
def verifier():
    return Verifier(tiny_model("qwen3", num_layers=6, vocab_size=64))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_weights_by_hand():
    t = torch.tensor([True, True, True, True])
    ones, zeros = torch.ones(4), torch.zeros(4)
    # sure of every target (or alpha 1, confidence ignored): position k counts the trained positions from k on
    assert dpace_weights(ones, t, 0.5).tolist() == [4, 3, 2, 1]
    assert dpace_weights(zeros, t, 1.0).tolist() == [4, 3, 2, 1]
    # unsure of every target: the chain halves at each position (alpha 0.5)
    assert dpace_weights(zeros, t, 0.5).tolist() == [0.9375, 0.4375, 0.1875, 0.0625]
    # a loss-masked position passes the chain through and has no weight
    masked = torch.tensor([True, False, True, True])
    assert dpace_weights(zeros, masked, 0.5).tolist() == [0.875, 0.0, 0.375, 0.125]
    # on the chain but not trained (a target outside an own draft vocabulary): confidence 0 there, no weight
    assert dpace_weights(torch.tensor([1.0, 0.0, 1.0, 1.0]), masked, 0.5, chained=t).tolist() == [2, 0, 1, 0.5]
    # any leading dimensions; a block with nothing trained weighs nothing
    batch = dpace_weights(torch.rand(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.bool), 0.5)
    assert batch.shape == (2, 3, 4) and not batch.any()
    with pytest.raises(ValueError, match=r"alpha=0: expected a number in \(0, 1\]"):
        dpace_weights(ones, t, 0)


@pytest.mark.parametrize("with_chain", [False, True])
def test_loss_and_gradients_equal_the_slow_reference(with_chain):
    g = torch.Generator().manual_seed(0)
    B, A, K, H, V = 2, 3, 5, 8, 16
    hidden = torch.randn(B, A, K, H, generator=g).requires_grad_()
    lm_weight = torch.randn(V, H, generator=g).requires_grad_()
    targets = torch.randint(0, V, (B, A, K), generator=g)
    trained = torch.rand(B, A, K, generator=g) < 0.8
    trained[0, 1] = False  # a padding block
    trained[1, 2, 3:] = False  # a block past the end of its document
    trained[1, 0, 0] = True
    trained[1, 0, 1] = False  # a loss-masked position inside a block
    chained = trained | (torch.rand(B, A, K, generator=g) < 0.5) if with_chain else None
    with torch.no_grad():  # a few confident targets, so that the weights are not all the unsure ones
        lm_weight[targets[0, 0, :2]] += 3 * hidden[0, 0, :2]
    loss, step_losses, argmax = dpace_loss(hidden, lm_weight, targets, trained, 0.5, chained)
    gh, gw = torch.autograd.grad(loss, (hidden, lm_weight))

    hidden_r, lm_weight_r = hidden.detach().clone().requires_grad_(), lm_weight.detach().clone().requires_grad_()
    logits = hidden_r @ lm_weight_r.T  # (B, A, K, V)
    expected = slow_dpace_loss(logits, targets, trained, 0.5, chained)
    rh, rw = torch.autograd.grad(expected, (hidden_r, lm_weight_r))
    assert rel(loss, expected) < 1e-6 and rel(gh, rh) < 1e-6 and rel(gw, rw) < 1e-6, (rel(loss, expected),
                                                                                      rel(gh, rh), rel(gw, rw))
    with torch.no_grad():
        assert torch.equal(argmax, logits.argmax(-1))
        ce = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)  # (B, A, K)
        mean_ce = (ce * trained).sum((0, 1)) / trained.sum((0, 1))
        assert rel(step_losses, mean_ce) < 1e-6  # each position's mean CE, for the logs


def test_dpace_is_neither_ce_nor_kl():
    """The same inputs, three losses: the weights differ, so the gradients' directions do, not only their scale."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 4, 3, 8, generator=g).requires_grad_()
    lm_weight = torch.randn(16, 8, generator=g)
    targets = torch.randint(0, 16, (2, 4, 3), generator=g)
    trained = torch.ones(2, 4, 3, dtype=torch.bool)
    teacher = torch.randn(2, 4, 3, 16, generator=g)
    dpace = dpace_loss(hidden, lm_weight, targets, trained, 0.5)[0]
    ce = dflash_loss(hidden, lm_weight, targets, trained, 2.0)[0]
    kl = dflash_loss(hidden, lm_weight, targets, trained, 2.0, lambda k: teacher[:, :, k])[0]
    grads = [torch.autograd.grad(value, hidden)[0].flatten() for value in (dpace, ce, kl)]
    assert len({round(float(v.detach()), 4) for v in (dpace, ce, kl)}) == 3
    for other in grads[1:]:
        assert torch.cosine_similarity(grads[0], other, 0) < 0.99


def batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    loss_mask = torch.ones(2, 12, dtype=torch.long)
    loss_mask[0, :4] = 0
    loss_mask[1, 9] = 0
    return ids, loss_mask, sample_anchors(loss_mask, 5, generator=g)


def test_drafter_trains_dpace_when_asked(verifier):
    """dflash.loss=dpace reaches the loss: the drafter's loss equals the slow reference over its own logits, and the
    same drafter with ce or kl gives another loss."""
    ids, loss_mask, anchors = batch()
    feats = verifier.features(ids, layer_ids=make(verifier).feature_layers)
    losses = {}
    for loss in ("ce", "kl", "dpace"):
        drafter = make(verifier, loss=loss, dpace_alpha=0.3)
        losses[loss] = drafter.training_loss(ids, feats, loss_mask, anchors=anchors).loss
    with torch.no_grad():
        hidden = drafter.anchored_hidden(ids, torch.cat(feats.layers, -1), *anchors)
        logits = drafter.logits(hidden[:, :, 1:])
    targets, trained = block_targets(ids, loss_mask, *anchors, N)
    expected = slow_dpace_loss(logits.double(), targets, trained, 0.3)
    assert rel(losses["dpace"], expected) < 1e-5
    values = {name: float(value.detach()) for name, value in losses.items()}
    assert abs(values["dpace"] - values["ce"]) > 1e-3 and abs(values["dpace"] - values["kl"]) > 1e-3
    losses["dpace"].backward()
    assert drafter.fc.weight.grad.abs().sum() > 0 and verifier.lm_head.weight.grad is None


def test_own_lm_head_keeps_out_of_vocabulary_targets_on_the_chain(verifier):
    """With dflash.draft_vocab_size, a target outside the draft vocabulary has no loss term but stays on the
    acceptance chain with confidence 0 (the drafter cannot draft it), so the positions after it weigh less."""
    torch.manual_seed(0)
    cfg = DFlashConfig(num_hidden_layers=2, block_size=N, loss="dpace", draft_vocab_size=40)
    drafter = build_drafter(verifier, cfg, token_counts=torch.arange(64) % 7).eval()
    ids, loss_mask, anchors = batch()
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    out = drafter.training_loss(ids, feats, loss_mask, anchors=anchors)
    targets, trained = block_targets(ids, loss_mask, *anchors, N)
    in_vocab = drafter.t2d[targets]
    assert (trained & ~in_vocab).any()  # some trained targets are outside the draft vocabulary
    with torch.no_grad():
        hidden = drafter.anchored_hidden(ids, torch.cat(feats.layers, -1), *anchors)
        logits = drafter.logits(hidden[:, :, 1:])[..., drafter.draft_token_ids()].double()
    rank = torch.cumsum(drafter.t2d.long(), 0) - 1
    draft_targets = rank[targets].clamp(min=0)
    expected = slow_dpace_loss(logits, draft_targets, trained & in_vocab, 0.5, chained=trained)
    assert rel(out.loss, expected) < 1e-5
    off_chain = slow_dpace_loss(logits, draft_targets, trained & in_vocab, 0.5)  # the miss passed through instead
    assert float(off_chain) > float(expected) + 1e-4


@pytest.mark.parametrize("values, message", [
    ({"loss": "pace"}, "dflash.loss='pace': expected one of ce, kl, dpace"),
    ({"dpace_alpha": 0.0}, r"dflash.dpace_alpha=0.0: expected a number in \(0, 1\]"),
    ({"dpace_alpha": 1.5}, r"dflash.dpace_alpha=1.5: expected a number in \(0, 1\]"),
])
def test_bad_dpace_config_is_one_line(values, message):
    with pytest.raises(DFlashError, match=message) as err:
        DFlashConfig(**values)
    assert "\n" not in str(err.value)
    assert DFlashConfig(loss="dpace", dpace_alpha=1.0).loss_alpha == 1.0 and DFlashConfig().loss_alpha == 0.5


def test_a_run_started_before_dpace_is_the_same_run():
    """dpace_alpha defaults to null, so a run (or a bench folder) recorded before the key existed continues."""
    from draftheads.train.run_folder import differences

    new = DFlashConfig().to_dict()
    old = {key: value for key, value in new.items() if key != "dpace_alpha"}
    assert new["dpace_alpha"] is None and differences(old, new) == []
