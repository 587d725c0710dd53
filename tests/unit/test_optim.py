"""train/optim.py: `train.optimizer: muon` trains an EAGLE-3 drafter's hidden matrices with torch's Muon update and
everything else with torch's AdamW update, in one optimizer whose state survives a checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch

from draftheads.models.eagle import EagleConfig, EagleTrainModule, build_drafter
from draftheads.models.verifier import Verifier
from draftheads.train.config import ConfigError, RunConfig
from draftheads.train.optim import MuonAdamW, build_optimizer, muon_split
from tests.utils import tiny_model


@pytest.fixture(scope="module")
def module():
    torch.manual_seed(0)
    verifier = Verifier(tiny_model("llama").float())
    return EagleTrainModule(build_drafter(verifier, EagleConfig(draft_vocab_size=None, layer_ids=[1, 2, 3],
                                                                parallel=True)))


def steps(model, optimizer, n: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


def test_split_and_updates_equal_torchs(module):
    muon, adamw = muon_split(module)
    names = {id(p): n for n, p in module.named_parameters()}
    assert {names[id(p)] for p in muon} >= {"drafter.fc.weight", "drafter.layers.0.self_attn.q_proj.weight",
                                             "drafter.layers.0.mlp.down_proj.weight"}
    assert all(p.ndim == 2 and "lm_head" not in names[id(p)] for p in muon)
    assert {"drafter.lm_head.weight", "drafter.mask_hidden", "drafter.norm.weight"} <= {names[id(p)] for p in adamw}
    cfg = RunConfig()
    cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay = "muon", 0.02, 0.1
    ours = copy.deepcopy(module)
    optimizer = build_optimizer(ours, cfg)
    assert isinstance(optimizer, MuonAdamW) and optimizer.ns_dtype in (torch.float32, torch.bfloat16)
    optimizer.ns_dtype = torch.bfloat16  # torch's Muon orthogonalises in bf16: then the update is torch's to the bit
    steps(ours, optimizer)
    theirs = copy.deepcopy(module)
    t_muon, t_adamw = muon_split(theirs)
    torch_opts = [torch.optim.Muon(t_muon, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                  torch.optim.AdamW(t_adamw, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in theirs.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=g)
        for opt in torch_opts:
            opt.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(a, dict(module.named_parameters())[name]), name  # every parameter moved


def test_state_survives_a_checkpoint_and_param_groups_are_refused(module):
    cfg = RunConfig()
    cfg.train.optimizer = "muon"
    a, b = copy.deepcopy(module), copy.deepcopy(module)
    opt_a = build_optimizer(a, cfg)
    steps(a, opt_a, 2)
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, cfg)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    steps(a, opt_a, 2, seed=7)
    steps(b, opt_b, 2, seed=7)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    with pytest.raises(ConfigError, match=r"train\.optimizer=muon.*parameter groups"):
        build_optimizer([{"params": list(module.parameters())}], cfg)


def test_adamw_is_torchs_fused_kernel_and_the_same_update(module):
    """train.optimizer=adamw runs torch's fused AdamW on CPU tensors (one pass a tensor, about 9x faster at 8B
    shapes on two cores) and updates the weights as torch's default AdamW does, within float rounding."""
    cfg = RunConfig()
    cfg.train.lr, cfg.train.weight_decay = 0.01, 0.1
    ours = copy.deepcopy(module)
    optimizer = build_optimizer(ours, cfg)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    steps(ours, optimizer)
    theirs = copy.deepcopy(module)
    steps(theirs, torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=0.01,
                                    betas=tuple(cfg.train.betas), weight_decay=0.1))
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # a group as a generator is read once; an integer tensor is no parameter of the fused kernel
    groups = build_optimizer([{"params": (p for p in [torch.zeros(3, requires_grad=True)])}], cfg).param_groups
    assert len(groups[0]["params"]) == 1
    from draftheads.train.optim import fusable
    assert not fusable([torch.zeros(3, dtype=torch.long)]) and not fusable([])
