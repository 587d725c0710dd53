"""Where a trainer's verifier features come from: the one seam between the training step and the verifier.

    features = feature_source(cfg, verifier, layer_ids=drafter.feature_layers)
    for batch in loop.batches():
        feats = features(batch)        # VerifierFeatures: final (B, T, H), layers [(B, T, H)], logits (B, T, V) | None

`features: online` (the default) runs the frozen verifier inside the step, under no-grad, keeping only what the
drafter asked for: the final post-norm hidden state always, the inputs of `layer_ids` (forward hooks, never all of
`output_hidden_states`), and the logits only with `return_logits`. `features: offline` reads the same tensors from
the hidden-state cache (the Scale issue): the trainer code does not change, only which source this returns.
"""

from __future__ import annotations

from typing import Callable

import torch

from models.verifier import VerifierFeatures
from train.config import ConfigError, RunConfig

FeatureSource = Callable[[dict], VerifierFeatures]


def online_features(verifier, layer_ids: list[int] | tuple[int, ...] = (), return_logits: bool = False
                    ) -> FeatureSource:
    """A source that runs `verifier` on each batch (no grad): batch {input_ids, attention_mask} -> features."""
    layer_ids = list(layer_ids)
    verifier.check_layer_ids(layer_ids)

    def features(batch: dict) -> VerifierFeatures:
        return verifier.features(batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                 layer_ids=layer_ids, return_logits=return_logits)

    return features


def feature_source(cfg: RunConfig, verifier, layer_ids: list[int] | tuple[int, ...] = (),
                   return_logits: bool = False) -> FeatureSource:
    """The feature source a run config asks for (`features: online | offline`)."""
    if cfg.features == "online":
        return online_features(verifier, layer_ids, return_logits)
    raise ConfigError(
        f"features=offline (feature_cache={cfg.feature_cache!r}): the offline hidden-state cache is not available "
        "in this version; use features=online")


def batch_tokens(batch: dict) -> torch.Tensor:
    """Real (non-padding) tokens in a batch, as a device scalar, for tokens/s."""
    return batch["attention_mask"].sum()
