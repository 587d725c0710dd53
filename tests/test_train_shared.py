"""The trainer pieces both methods share: the verifier-feature seam and held-out sums."""

import pytest
import torch
from torch import nn

from models.verifier import Verifier
from train.config import ConfigError, RunConfig, WandbConfig
from train.features import batch_tokens, feature_source, online_features
from train.loop import build_accelerator, heldout_sums


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


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


def test_offline_features_are_refused_clearly(llama_dir, tmp_path):
    cfg = RunConfig(features="offline", feature_cache=str(tmp_path))
    with pytest.raises(ConfigError, match="features=offline"):
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
