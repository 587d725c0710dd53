"""The trainer pieces both methods share: the verifier-feature seam and held-out sums."""

import pytest
import torch
from torch import nn

from draftheads.models.verifier import Verifier
from draftheads.train.config import RunConfig, WandbConfig
from draftheads.train.features import batch_tokens, feature_source, online_features
from draftheads.train.heldout import heldout_sums
from draftheads.train.tracking import build_accelerator
from tests.utils import reset_accelerate

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def test_online_features_keep_only_what_was_asked(llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    ids = torch.randint(3, verifier.vocab_size, (2, 9))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    feats = online_features(verifier, layer_ids=[3, 1])(batch)
    reference = verifier.model(ids, output_hidden_states=True)
    assert [f.shape for f in feats.layers] == [(2, 9, verifier.hidden_size)] * 2 and feats.logits is None
    torch.testing.assert_close(feats.layers[0], reference.hidden_states[3])
    torch.testing.assert_close(feats.layers[1], reference.hidden_states[1])
    assert not feats.final.requires_grad
    with_logits = online_features(verifier, return_logits=True)(batch)
    assert with_logits.layers == [] and with_logits.logits.shape == (2, 9, verifier.vocab_size)
    assert int(batch_tokens({"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})) == 3


def test_offline_features_without_a_cache_are_refused_clearly(llama_dir, tmp_path):
    from draftheads.data.hidden_states import CacheError

    cfg = RunConfig(features="offline", feature_cache=str(tmp_path))
    with pytest.raises(CacheError, match=r"index\.json: no such file.*draftheads dump-features"):
        feature_source(cfg, Verifier.from_pretrained(llama_dir))


def test_heldout_sums_count_batches_and_restore_the_mode(tmp_path):
    accelerator = build_accelerator(RunConfig(output_dir=str(tmp_path), wandb=WandbConfig(enabled=False)))
    model = nn.Dropout(0.5).train()
    seen_modes = []

    def measure(batch):
        seen_modes.append(model.training)
        return {"total": batch.sum(), "per_column": batch.sum(0)}

    data = [torch.full((2, 3), float(i)) for i in range(5)]
    sums = heldout_sums(accelerator, model, data, max_batches=3, measure=measure)
    assert seen_modes == [False] * 3 and model.training
    assert float(sums["batches"]) == 3 and float(sums["total"]) == 6 * (0 + 1 + 2)
    assert sums["per_column"].tolist() == [6.0, 6.0, 6.0]
    assert float(heldout_sums(accelerator, model, data, 0, measure)["batches"]) == 5  # 0: all
    assert heldout_sums(accelerator, model, [], 8, measure) == {}


def test_resume_restores_the_random_stream_a_training_step_draws_from(tmp_path):
    """A step that draws noise (EAGLE-1 features, LoRA dropout) resumes exactly: starting a data-loader iterator
    must not consume the global RNG, or the resumed run's noise is shifted by one draw."""
    from draftheads.train.config import TrainConfig
    from draftheads.train.loaders import make_dataloaders
    from draftheads.train.loop import TrainLoop
    from draftheads.train.optim import build_optimizer, cosine_schedule

    class Crash(Exception):
        pass

    rows = [{"x": torch.full((3,), float(i))} for i in range(12)]

    def collate(batch):
        return {"x": torch.stack([r["x"] for r in batch])}

    def train(folder, crash_at=None):
        reset_accelerate()
        cfg = RunConfig(output_dir=str(folder), wandb=WandbConfig(enabled=False),
                        train=TrainConfig(max_steps=8, batch_size=2, save_every=3, log_every=1, lr=0.1,
                                          warmup_steps=1))
        accelerator = build_accelerator(cfg)
        model = nn.Linear(3, 1)
        optimizer = build_optimizer(model, cfg)
        scheduler = cosine_schedule(optimizer, cfg)
        train_dl, _ = make_dataloaders(rows, rows[:2], cfg, collate)
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
        accelerator.register_for_checkpointing(scheduler)
        loop = TrainLoop(accelerator, cfg, model, optimizer, scheduler, train_dl)
        loop.resume()
        for batch in loop.batches():
            loss = model(batch["x"] + torch.rand_like(batch["x"])).pow(2).mean()
            accelerator.backward(loss)
            loop.step(loss)
            if loop.state.step == crash_at:
                raise Crash
        return accelerator.unwrap_model(model).weight.detach().clone()

    straight = train(tmp_path / "a")
    with pytest.raises(Crash):
        train(tmp_path / "b", crash_at=4)  # resumes from step 3, in the second epoch's first iterator
    torch.testing.assert_close(train(tmp_path / "b"), straight, rtol=0, atol=0)


@pytest.mark.parametrize("script", ["medusa.py", "eagle.py", "dflash.py"])
def test_trainer_runs_as_a_file_from_any_folder(script, tmp_path):
    """`accelerate launch train/X.py` runs the file as a script, from any folder: it finds the installed
    `draftheads` package (no sys.path edits, no PYTHONPATH)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(root / "train" / script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--train.max_steps" in proc.stdout
