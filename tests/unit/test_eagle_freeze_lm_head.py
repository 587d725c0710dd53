"""eagle.freeze_lm_head: EAGLE-3's lm_head stays the verifier's rows while the rest of the drafter trains."""

import pytest
import torch

from draftheads.models.eagle import EagleConfig, EagleError, build_drafter
from draftheads.models.verifier import Verifier


def test_frozen_lm_head_keeps_the_verifiers_rows(tiny_verifier_dirs):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])
    torch.manual_seed(0)
    counts = torch.randint(0, 50, (verifier.vocab_size,))
    drafter = build_drafter(verifier, EagleConfig(ttt_steps=2, draft_vocab_size=100, freeze_lm_head=True),
                            token_counts=counts)
    head = drafter.lm_head.weight.detach().clone()
    torch.testing.assert_close(head, verifier.lm_head.weight.detach().float()[torch.arange(100) + drafter.d2t])
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    assert all(p is not drafter.lm_head.weight for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(3, verifier.vocab_size, (2, 12))
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    fc = drafter.fc.weight.detach().clone()
    drafter.train().training_loss(ids, feats, torch.ones_like(ids)).loss.backward()
    optimizer.step()
    assert torch.equal(drafter.lm_head.weight, head) and not torch.equal(drafter.fc.weight, fc)


def test_freeze_lm_head_is_an_eagle3_option():
    with pytest.raises(EagleError, match="eagle.freeze_lm_head=true is an EAGLE-3 option"):
        EagleConfig(version=1, freeze_lm_head=True)
