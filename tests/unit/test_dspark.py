"""DSpark (models/dflash/dspark.py, `dflash.markov_rank`): the low-rank logit term of linear_loss against autograd,
the left-to-right Markov chain against the whole transition table, the training loss (token loss through the Markov
bias, the confidence head against the overlap) and its gradients against the slow reference by loops
(tests/dspark_reference.py), the export round trip in vLLM's and speculators' layouts, and bad values in one line."""

import json

import pytest
import torch

from draftheads.models.dflash import (DFlashConfig, DFlashError, build_drafter, markov_chain, sample_anchors,
                                      token_overlap)
from draftheads.models.export import DrafterFormatError, check_dflash_engine, export_dflash, load_dflash
from draftheads.models.linear_loss import linear_loss
from draftheads.models.verifier import Verifier
from tests.dspark_reference import slow_dspark_loss, slow_markov_chain
from tests.unit.test_dflash import make  # a drafter with lively weights, block N
from tests.utils import tiny_model

N = 4


@pytest.fixture(scope="module")
def verifier():
    return Verifier(tiny_model("qwen3", num_layers=6, vocab_size=64))


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_linear_loss_extra_term_equals_autograd_and_leaves_a_frozen_head_alone():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 8, generator=g).requires_grad_(), torch.randn(16, 8, generator=g)  # w frozen
    x2, w2 = torch.randn(10, 3, generator=g).requires_grad_(), torch.randn(16, 3, generator=g).requires_grad_()
    target, weight = torch.randint(0, 16, (10,), generator=g), torch.rand(10, generator=g)
    teacher = torch.randn(10, 16, generator=g)
    for kl in (0.0, 1.0):
        out = linear_loss(x, w, target, weight, teacher_logits=teacher, ce_weight=1 - kl, kl_weight=kl,
                          chunk_rows=3, argmax=True, extra=(x2, w2))
        grads = torch.autograd.grad(out.loss, (x, x2, w2))
        logits = x @ w.T + x2 @ w2.T
        log_q = torch.log_softmax(logits, -1)
        log_p = torch.log_softmax(teacher, -1)
        per_row = (1 - kl) * -log_q.gather(-1, target[:, None])[:, 0] + kl * (log_p.exp() * (log_p - log_q)).sum(-1)
        want = (weight * per_row).sum()
        assert rel(out.loss, want) < 1e-6
        for got, ref in zip(grads, torch.autograd.grad(want, (x, x2, w2))):
            assert rel(got, ref) < 1e-5
        assert torch.equal(out.argmax, logits.argmax(-1))
    with pytest.raises(ValueError, match=r"extra x2 \(10, 3\) and weight2 \(15, 3\)"):
        linear_loss(x, w, target, weight, extra=(x2, w2[:15]))


def test_markov_chain_equals_the_whole_transition_table(verifier):
    drafter = make(verifier, markov_rank=8)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(10)  # a bias strong enough to change drafts
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(3, N - 1, verifier.hidden_size, generator=g)
        roots = torch.tensor([5, 9, 60])
        tokens, logits = drafter.draft_block(hidden, roots, lambda step, k: step.argmax(-1))
        base = drafter.logits(hidden)
        w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
        for b in range(3):
            assert tokens[b].tolist() == slow_markov_chain(base[b], int(roots[b]), w1, w2)
        assert not torch.equal(tokens, base.argmax(-1)), "the bias changed nothing: the check is empty"
        # the distributions returned are the biased ones, each given the drafts before it
        prev = torch.cat([roots[:, None], tokens[:, :-1]], 1)
        torch.testing.assert_close(logits, base + drafter.markov_head.bias(drafter.markov_head.embed(prev)))
        # a zero bias drafts as DFlash does
        drafter.markov_head.markov_w2.weight.zero_()
        plain, _, _ = markov_chain(base, roots, drafter.markov_head, lambda step, k: step.argmax(-1))
        assert torch.equal(plain, base.argmax(-1))


def test_overlap_by_hand():
    x, w = torch.eye(3), torch.eye(3)  # q = softmax of a one-hot row
    same = token_overlap(x, w, torch.eye(3))
    assert torch.allclose(same, torch.ones(3))
    far = token_overlap(x * 50, w, torch.eye(3).roll(1, 0) * 50)
    assert bool((far < 1e-6).all())
    part = token_overlap(torch.zeros(1, 3), w, torch.tensor([[50.0, 0, 0]]))  # uniform q against a sure p: 1/3
    assert abs(float(part[0]) - 1 / 3) < 1e-6


@pytest.mark.parametrize("loss, with_markov", [("ce", True), ("kl", True), ("ce", False)])
def test_loss_and_gradients_equal_the_slow_reference(verifier, loss, with_markov):
    drafter = make(verifier, markov_rank=8, loss=loss, confidence_with_markov=with_markov, confidence_weight=0.7)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    loss_mask = torch.ones(2, 12, dtype=torch.long)
    loss_mask[0, :4] = 0
    loss_mask[1, 9] = 0
    anchors = sample_anchors(loss_mask, 4, generator=g)
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    params = [drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight,
              drafter.confidence_head.proj.weight, drafter.confidence_head.proj.bias, drafter.fc.weight]
    got = drafter.training_loss(ids, feats, loss_mask, anchors=anchors).loss
    got_grads = torch.autograd.grad(got, params)
    hidden = drafter.anchored_hidden(ids, torch.cat(feats.layers, -1), *anchors)[:, :, 1:]
    with torch.no_grad():
        teacher = verifier.model(ids).logits
    want = slow_dspark_loss(hidden, verifier.lm_head.weight, *params[:4], ids, loss_mask, *anchors,
                            drafter.cfg.loss_gamma, teacher, with_markov=with_markov, kl=loss == "kl",
                            confidence_weight=0.7)
    assert rel(got, want) < 1e-5, (float(got), float(want))
    for name, a, b in zip(("w1", "w2", "proj", "proj bias", "fc"), got_grads, torch.autograd.grad(want, params)):
        assert rel(a, b) < 1e-4, name


def test_export_round_trips_in_both_layouts(verifier, tmp_path):
    for engine, arch in (("vllm", "Qwen3DSparkModel"), ("speculators", "DSparkSpeculator")):
        drafter = make(verifier, markov_rank=8, target_layer_ids=[1, 3])
        folder = export_dflash(drafter, tmp_path / engine, verifier, engine=engine)
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == [arch]
        assert {k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                       "confidence_head_with_markov", "sample_from_anchor")} == \
            {"markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True, "sample_from_anchor": False}
        back = load_dflash(folder, verifier)
        for key, value in drafter.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), key
    own = build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=N, markov_rank=4, draft_vocab_size=32),
                        token_counts=torch.arange(64))  # a pruned vocabulary: no t2d in the file
    folder = export_dflash(own, tmp_path / "own", verifier)
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    assert "t2d" not in tensors and tensors["markov_head.markov_w2.weight"].shape == (32, 4)
    assert torch.equal(load_dflash(folder, verifier).t2d, own.t2d)
    tensors["d2t"][3] = 500  # a draft id mapped past the vocabulary
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(DrafterFormatError, match="model.safetensors: d2t maps draft ids outside the verifier's "
                                                 "vocabulary of 64"):
        load_dflash(folder, verifier)


@pytest.mark.parametrize("values, message", [
    ({"markov_rank": 0}, r"dflash.markov_rank=0: expected a positive integer or null"),
    ({"confidence_head": True}, r"dflash.confidence_head=true needs dflash.markov_rank"),
    ({"markov_rank": 8, "confidence_weight": -1}, r"dflash.confidence_weight=-1: expected a number >= 0"),
])
def test_bad_dspark_config_is_one_line(values, message):
    with pytest.raises(DFlashError, match=message):
        DFlashConfig(**values)


def test_an_engine_that_does_not_read_dspark_is_refused():
    with pytest.raises(DFlashError, match=r"dflash.markov_rank=8 \(DSpark\) with engine sglang: .* export for "
                                          "engine vllm or speculators"):
        check_dflash_engine(DFlashConfig(markov_rank=8), "sglang")
    assert DFlashConfig(markov_rank=8).has_confidence_head and not DFlashConfig().has_confidence_head
    assert not DFlashConfig(markov_rank=8, confidence_head=False).has_confidence_head
