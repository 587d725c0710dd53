"""The shared loop machinery on a toy regression drafter: resume equality, atomic checkpoints, the guard."""

import json
import math

import pytest
import torch
from torch import nn

from draftheads.train.checkpoint import complete_checkpoints
from draftheads.train.config import RunConfig, TrainConfig, WandbConfig
from draftheads.train.loaders import make_dataloaders
from draftheads.train.loop import NonFiniteLossError, NonFiniteWeightsError, TrainLoop
from draftheads.train.optim import build_optimizer, cosine_schedule
from draftheads.train.tracking import build_accelerator

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class Crash(Exception):
    pass


def run(tmp_path, max_steps, resume="auto", poison=lambda step: False, grad_accum=1, crash_at=None,
        extra_loss=lambda model, step: 0, **train):
    cfg = RunConfig(output_dir=str(tmp_path), wandb=WandbConfig(enabled=False),
                    train=TrainConfig(max_steps=max_steps, batch_size=4, grad_accum=grad_accum, lr=0.05,
                                      save_every=3, keep_last=2, resume=resume, log_every=1, warmup_steps=2,
                                      **train))
    accelerator = build_accelerator(cfg)
    model = nn.Linear(6, 1)
    optimizer = build_optimizer(model, cfg)
    scheduler = cosine_schedule(optimizer, cfg)
    train_dl, _ = make_dataloaders(Rows(), Rows(8), cfg, collate)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    accelerator.register_for_checkpointing(scheduler)
    loop = TrainLoop(accelerator, cfg, model, optimizer, scheduler, train_dl)
    loop.resume()
    for batch in loop.batches():
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"]) + extra_loss(model, loop.state.step)
            if poison(loop.state.step):
                loss = loss * float("nan")
            accelerator.backward(loss)
            loop.step(loss)
        if loop.state.step == crash_at:
            raise Crash
    loop.finish()
    return accelerator.unwrap_model(model).state_dict(), loop


def losses(folder):
    return [r["train/loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("state", ["float32", "bfloat16"])
def test_resume_gives_the_same_weights_and_losses(tmp_path, state):
    straight, _ = run(tmp_path / "a", max_steps=16, optimizer_state=state)  # 1.6 epochs: resume crosses an epoch
    with pytest.raises(Crash):
        run(tmp_path / "b", max_steps=16, crash_at=8, optimizer_state=state)  # last checkpoint: step 6
    resumed, loop = run(tmp_path / "b", max_steps=16, optimizer_state=state)
    assert loop.state.step == 16 and loop.state.epoch == 1
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    moments = [v for s in loop.optimizer.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments and {v.dtype for v in moments} == {getattr(torch, state)}  # still bf16 after load_state
    # the crashed run logged steps 1..8, the resumed one 7..16: steps 7 and 8 twice, with the same values
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(b) == 18 and b[:8] + b[10:] == a and b[6:8] == b[8:10]


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    run(tmp_path, max_steps=10)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["step-000009", "step-000010"]
    assert not list(tmp_path.glob(".step-*"))
    state = json.loads((tmp_path / "step-000010" / "train_state.json").read_text())
    assert (state["step"], state["epoch"], state["consumed"]) == (10, 0, 10)  # the epoch ended with the run
    # a half-written checkpoint (no COMPLETE marker) is never picked up
    half = tmp_path / "step-000099"
    half.mkdir()
    (half / "train_state.json").write_text("{}")
    assert complete_checkpoints(tmp_path)[-1].name == "step-000010"


def test_grad_accumulation_counts_optimizer_steps(tmp_path):
    _, loop = run(tmp_path, max_steps=4, grad_accum=2)
    assert loop.state.step == 4 and loop.state.consumed == 8


def test_nonfinite_loss_is_skipped_and_counted(tmp_path):
    _, loop = run(tmp_path, max_steps=6, poison=lambda step: step == 2)
    assert loop.state.bad_steps == 1
    assert all(torch.isfinite(p).all() for p in loop.model.parameters())
    logged = losses(tmp_path)
    assert math.isnan(logged[2]) and all(map(math.isfinite, logged[3:]))  # the bad step is logged, then finite


def test_too_many_nonfinite_steps_stop_with_the_last_checkpoint_intact(tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"3 consecutive.*step-000003"):
        run(tmp_path, max_steps=20, poison=lambda step: step >= 4, max_bad_steps=3)
    assert complete_checkpoints(tmp_path)[-1].name == "step-000003"


def nan_gradient(model) -> torch.Tensor:
    """0 in the forward, NaN in the backward (sqrt'(0) = inf, times 0): a finite loss whose update is NaN, as a norm
    of a zero vector gives."""
    return 0 * torch.sqrt(0 * model.weight.sum())


def test_an_update_that_wrecks_the_weights_stops_before_they_are_saved(tmp_path):
    """Step 5's loss is finite but its gradient is NaN: the update wrecks the weights; the run stops at the next sync
    point, before the checkpoint of step 6 would be written, and the newest checkpoint (step 3) holds finite
    weights."""
    with pytest.raises(NonFiniteWeightsError, match=r"step 5: the update made the drafter's weights non-finite .* "
                                                    r"Last good checkpoint: .*step-000003"):
        run(tmp_path, max_steps=20, extra_loss=lambda model, step: nan_gradient(model) if step == 4 else 0)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003"]
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "step-000003" / "model.safetensors")
    assert saved and all(torch.isfinite(t).all() for t in saved.values())


def test_the_last_update_is_checked_before_the_final_checkpoint(tmp_path):
    """The wrecking update is the run's last: no sync point follows, so the final checkpoint (and the export after it)
    is what the check guards."""
    with pytest.raises(NonFiniteWeightsError, match=r"step 4: .*Last good checkpoint: .*step-000003"):
        run(tmp_path, max_steps=4, extra_loss=lambda model, step: nan_gradient(model) if step == 3 else 0)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003"]


def test_a_run_that_ends_in_non_finite_losses_is_not_exported(tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"all 3 steps had a non-finite loss, so nothing was trained"):
        run(tmp_path / "all", max_steps=3, poison=lambda step: True)
    assert complete_checkpoints(tmp_path / "all") == []
    with pytest.raises(NonFiniteLossError, match=r"the run's last 2 step\(s\) had a non-finite loss; .*step-000003"):
        run(tmp_path / "tail", max_steps=5, poison=lambda step: step >= 3)
    assert [p.name for p in complete_checkpoints(tmp_path / "tail")] == ["step-000003"]
