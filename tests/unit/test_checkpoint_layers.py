"""Activation checkpointing of the drafters' layers (`eagle.checkpoint_layers`, `dflash.checkpoint_layers`): the same
loss and gradients as without it, and fewer bytes kept for the backward."""

import pytest
import torch

from draftheads.models import dflash, eagle
from draftheads.models.dflash import DFlashConfig, sample_anchors
from draftheads.models.eagle import EagleConfig, EagleError
from draftheads.models.verifier import Verifier
from tests.utils import tiny_model

T = 24
POSITIONS = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, T)  # packed rows: two documents each


@pytest.fixture(scope="module")
def verifiers():
    return {"llama": Verifier(tiny_model("llama", vocab_size=64)),  # GQA: 4 query heads, 2 kv heads
            "qwen3": Verifier(tiny_model("qwen3", num_layers=6, vocab_size=64))}


def eagle3(verifier, **overrides):
    torch.manual_seed(0)
    cfg = EagleConfig(version=3, ttt_steps=4, draft_vocab_size=None, **overrides)
    return eagle.build_drafter(verifier, cfg).train()


def dflash_drafter(verifier):
    torch.manual_seed(0)
    drafter = dflash.build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=4, num_anchors=6))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    return drafter.train()


def eagle_loss(drafter, verifier, position_ids):
    ids = torch.randint(3, 64, (2, T), generator=torch.Generator().manual_seed(1))
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True, position_ids=position_ids)
    return lambda: drafter.training_loss(ids, feats, torch.ones(2, T, dtype=torch.long), position_ids).loss


def dflash_loss(drafter, verifier, position_ids):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, T), generator=g)
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True, position_ids=position_ids)
    loss_mask = torch.ones(2, T, dtype=torch.long)
    anchors = sample_anchors(loss_mask, 6, generator=g)
    return lambda: drafter.training_loss(ids, feats, loss_mask, anchors=anchors, position_ids=position_ids).loss


CASES = {"eagle3": (eagle3, eagle_loss, "llama"), "dflash": (dflash_drafter, dflash_loss, "qwen3")}


def loss_and_grads(drafter, loss_fn, checkpointed):
    drafter.cfg.checkpoint_layers = checkpointed
    drafter.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_checkpointing_gives_the_same_loss_and_gradients(verifiers, case, packed):
    build, make_loss, family = CASES[case]
    drafter = build(verifiers[family])
    loss_fn = make_loss(drafter, verifiers[family], POSITIONS if packed else None)
    loss, grads = loss_and_grads(drafter, loss_fn, False)
    loss_ck, grads_ck = loss_and_grads(drafter, loss_fn, True)
    torch.testing.assert_close(loss_ck, loss, rtol=1e-5, atol=0)
    assert grads.keys() == grads_ck.keys() and len(grads) == len(list(drafter.parameters()))
    for name, grad in grads.items():
        error = ((grads_ck[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-30)).item()
        assert error <= 1e-5, f"{name}: {error:.2e} relative"


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages that autograd keeps for the backward of fn() (what a checkpointed region keeps
    is its inputs, alive anyway as other steps' inputs and outputs)."""
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("case", CASES)
def test_checkpointing_keeps_fewer_bytes_for_the_backward(verifiers, case):
    build, make_loss, family = CASES[case]
    drafter = build(verifiers[family])
    loss_fn = make_loss(drafter, verifiers[family], None)
    drafter.cfg.checkpoint_layers = False
    plain = saved_bytes(loss_fn)
    drafter.cfg.checkpoint_layers = True
    checkpointed = saved_bytes(loss_fn)
    assert checkpointed < 0.6 * plain, f"{checkpointed} bytes kept with checkpointing, {plain} without"
    with torch.no_grad():  # inference: nothing to checkpoint, nothing kept
        assert saved_bytes(loss_fn) == 0


def test_eagle1_refuses_checkpoint_layers():
    with pytest.raises(EagleError, match="eagle.checkpoint_layers=true is an EAGLE-3 option"):
        EagleConfig(version=1, checkpoint_layers=True)
