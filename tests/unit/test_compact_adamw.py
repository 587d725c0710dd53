"""models/adamw.py: AdamW with bf16 moments (`train.optimizer_state: bfloat16`) updates as torch's AdamW does,
within a stated tolerance on a toy problem, stores its moments in bf16 (bytes counted), and resumes exactly."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from draftheads.models.adamw import CompactAdamW, stochastic_round_bf16
from draftheads.train.config import ConfigError, RunConfig, TrainConfig
from draftheads.train.optim import build_optimizer


def memory_split(modules, optimizers) -> dict:
    """The scale bench's count of weights, gradients and optimizer state (scripts/scale_meter.py)."""
    spec = importlib.util.spec_from_file_location(
        "scale_meter", Path(__file__).resolve().parents[2] / "scripts" / "scale_meter.py")
    meter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(meter)
    return meter.memory_split(modules, optimizers)


def toy(seed: int = 0):
    """A least-squares problem with an MLP: (model, x, y)."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(256, 16, generator=g)
    y = torch.sin(x[:, :4] * 2)
    return model, x, y


def train(model, optimizer, x, y, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fp32_state_is_torchs_adamw_and_bf16_state_follows_it():
    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1}
    model, x, y = toy()
    ref, ours32, ours16 = model, copy.deepcopy(model), copy.deepcopy(model)
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), **kw), x, y, 100)
    # fp32 state, small chunks: torch's update to rounding (the chunking changes no arithmetic)
    train(ours32, CompactAdamW(ours32.parameters(), state_dtype=torch.float32, chunk=100, **kw), x, y, 100)
    for a, b in zip(ours32.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # bf16 state: each step's moments carry bf16's relative error (2^-8); over 100 steps the weights stay within
    # 2% of the fp32 run's weight scale, and the loss ends within 2% of it
    losses = train(ours16, CompactAdamW(ours16.parameters(), chunk=100, **kw), x, y, 100)
    for a, b in zip(ours16.parameters(), ref.parameters()):
        assert (a - b).abs().max() <= 0.02 * b.abs().max(), (a - b).abs().max()
    assert ref_losses[-1] < 0.2 * ref_losses[0]  # it learned: the comparison is not of two idle runs
    assert abs(losses[-1] - ref_losses[-1]) <= 0.02 * ref_losses[-1], (losses[-1], ref_losses[-1])


def test_the_check_fails_on_a_wrong_update():
    """The tolerance above is tight enough to see an update that is off: beta2 0.99 instead of 0.999."""
    model, x, y = toy()
    a, b = model, copy.deepcopy(model)
    train(a, torch.optim.AdamW(a.parameters(), lr=1e-2, betas=(0.9, 0.999)), x, y, 100)
    train(b, CompactAdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.99)), x, y, 100)
    assert max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(b.parameters(), a.parameters())) > 0.02


def test_moments_are_stored_in_bf16_bytes_counted_also_after_loading():
    model, x, y = toy()
    n, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    opt = CompactAdamW(model.parameters(), lr=1e-3)
    train(model, opt, x, y, 2)
    # two bf16 moments per weight and one fp32 step count per tensor: half of torch's AdamW state
    assert memory_split([], [opt])["optimizer_bytes"] == 2 * 2 * n + 4 * tensors
    ref = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-3)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    ref.step()
    assert memory_split([], [ref])["optimizer_bytes"] == 2 * 4 * n + 4 * tensors
    # torch's load_state_dict casts state to the parameter's dtype (fp32): CompactAdamW keeps it bf16
    again = CompactAdamW(model.parameters(), lr=1e-3)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(s[k].dtype == torch.bfloat16 for s in again.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert memory_split([], [again])["optimizer_bytes"] == 2 * 2 * n + 4 * tensors


def test_resumed_from_its_state_dict_it_continues_exactly():
    model, x, y = toy()
    a, b = model, copy.deepcopy(model)
    opt_a = CompactAdamW(a.parameters(), lr=1e-2, seed=3)
    train(a, opt_a, x, y, 5)
    b.load_state_dict(a.state_dict())
    opt_b = CompactAdamW(b.parameters(), lr=1e-2, seed=3)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    train(a, opt_a, x, y, 5)
    train(b, opt_b, x, y, 5)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(opt_a.state.values(), opt_b.state.values()):
        assert all(torch.equal(s[k], t[k]) for k in s)


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_stalls():
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of a bf16 step above 1.0
    rounded = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - (1.0 + 2**-10)) < 2e-5
    assert x.to(torch.bfloat16).float().unique().tolist() == [1.0]  # to nearest: the quarter step is lost
    negative = stochastic_round_bf16(-x, torch.Generator().manual_seed(0)).float()
    assert abs(negative.mean().item() + (1.0 + 2**-10)) < 2e-5
    # a second moment with beta2 = 0.999 and g^2 = 2 v: +0.1% a step; the stored bf16 value grows only by rounding
    # stochastically (to nearest it would stay at 1.0 for ever)
    g = torch.Generator().manual_seed(1)
    v_sr, v_rn = torch.ones(10_000, dtype=torch.bfloat16), torch.ones(10_000, dtype=torch.bfloat16)
    for _ in range(50):
        v_sr = stochastic_round_bf16(v_sr.float() * 0.999 + 0.001 * 2 * v_sr.float(), g)
        v_rn = (v_rn.float() * 0.999 + 0.001 * 2 * v_rn.float()).to(torch.bfloat16)
    assert v_rn.float().unique().tolist() == [1.0]
    assert abs(v_sr.float().mean().item() - 1.001 ** 50) < 2e-3


def test_config_key_builds_it_and_refuses_muon():
    cfg = RunConfig()
    cfg.train.optimizer_state = "bfloat16"
    opt = build_optimizer(torch.nn.Linear(4, 4), cfg)
    assert isinstance(opt, CompactAdamW) and opt.state_dtype == torch.bfloat16 and opt.seed == cfg.train.seed
    assert type(build_optimizer(torch.nn.Linear(4, 4), RunConfig())) is torch.optim.AdamW
    with pytest.raises(ConfigError, match=r"train\.optimizer_state=bfloat16 with train\.optimizer=muon"):
        TrainConfig(optimizer="muon", optimizer_state="bfloat16")
