"""EAGLE-3 options that reproduce the peers' starting point and loss: eagle.init_std, eagle.norm_init,
eagle.skip_out_of_draft (docs/peers.md measures them against speculators' drafter)."""

import pytest
import torch

from draftheads.models.eagle import EagleConfig, EagleError, build_drafter
from draftheads.models.verifier import Verifier


def _drafter(verifier, **options):
    torch.manual_seed(0)
    counts = torch.randint(0, 50, (verifier.vocab_size,))
    return build_drafter(verifier, EagleConfig(ttt_steps=2, draft_vocab_size=100, **options), token_counts=counts)


def test_init_std_draws_fc_and_the_layer_from_a_normal(tiny_verifier_dirs):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])
    default = _drafter(verifier)
    drafter = _drafter(verifier, init_std=0.5)  # far from PyTorch's default scale, so the two cannot be confused
    for name in ("fc", "layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"):
        w = drafter.get_submodule(name).weight
        assert abs(w.std().item() - 0.5) < 0.05, name
        assert default.get_submodule(name).weight.std().item() < 0.3, name
    torch.testing.assert_close(drafter.lm_head.weight, default.lm_head.weight)  # still the verifier's rows


def test_norm_init_ones_keeps_the_verifiers_lm_head(tiny_verifier_dirs):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])
    with torch.no_grad():
        verifier.norm.weight.fill_(1.7)
    drafter = _drafter(verifier, norm_init="ones")
    assert torch.equal(drafter.norm.weight, torch.ones_like(drafter.norm.weight))
    assert torch.allclose(_drafter(verifier).norm.weight, torch.full_like(drafter.norm.weight, 1.7))
    torch.testing.assert_close(drafter.lm_head.weight,
                               verifier.lm_head.weight.detach().float()[torch.arange(100) + drafter.d2t])


def test_skip_out_of_draft_false_trains_positions_outside_the_draft_vocabulary(tiny_verifier_dirs):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])
    skip, keep = _drafter(verifier), _drafter(verifier, skip_out_of_draft=False)
    keep.load_state_dict(skip.state_dict())
    ids = torch.randint(3, verifier.vocab_size, (2, 16))
    feats = verifier.features(ids, layer_ids=skip.feature_layers, return_logits=True)
    with torch.no_grad():  # the verifier's argmax outside the 100-token draft vocabulary at positions 3..7
        outside = torch.nonzero(~skip.t2d)[0, 0]
        feats.logits[0, 3:8, outside] = feats.logits[0, 3:8].max() + 10
    assert not skip.t2d[feats.logits[0, 3:8].argmax(-1)].any()
    loss_mask = torch.ones_like(ids)
    a = skip.training_loss(ids, feats, loss_mask).loss
    b = keep.training_loss(ids, feats, loss_mask).loss
    assert not torch.allclose(a, b)  # the out-of-draft positions enter the mean


@pytest.mark.parametrize("options, flag", [({"init_std": 0.0}, "eagle.init_std=0.0"),
                                           ({"init_std": -0.02}, "eagle.init_std=-0.02"),
                                           ({"norm_init": "zeros"}, "eagle.norm_init='zeros'")])
def test_bad_values_name_the_flag(options, flag):
    with pytest.raises(EagleError, match=flag.replace("[", r"\[")):
        EagleConfig(**options)
