"""Where a trainer's verifier features come from: the one seam between the training step and the verifier.

    features = feature_source(cfg, verifier, layer_ids=drafter.feature_layers)
    for batch in loop.batches():
        feats = features(batch)        # VerifierFeatures: final (B, T, H), layers [(B, T, H)], logits (B, T, V) | None

`features: online` (the default) runs the frozen verifier inside the step, under no-grad, with the batch's
`position_ids` (packed rows: restarting per document, so no token attends across a boundary), keeping only what the
drafter asked for: the final post-norm hidden state always, the inputs of `layer_ids` (forward hooks, never all of
`output_hidden_states`), and the logits only with `return_logits`. `features: offline` reads the same tensors from
the hidden-state cache (`draftheads dump-features`, with `feature_cache: DIR`): the batches then come from
the cache's loader and carry the features; the trainer code does not change, only which source this returns.
"""

from __future__ import annotations

from typing import Callable

import torch

from draftheads.models.verifier import VerifierFeatures
from draftheads.train.config import ConfigError, RunConfig

FeatureSource = Callable[[dict], VerifierFeatures]


def online_features(verifier, layer_ids: list[int] | tuple[int, ...] = (), return_logits: bool = False
                    ) -> FeatureSource:
    """A source that runs `verifier` on each batch (no grad): batch {input_ids, attention_mask} -> features."""
    layer_ids = list(layer_ids)
    verifier.check_layer_ids(layer_ids)

    def features(batch: dict) -> VerifierFeatures:  # packed rows: position_ids restart per document
        return verifier.features(batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                 layer_ids=layer_ids, return_logits=return_logits,
                                 position_ids=batch.get("position_ids"))

    return features


def offline_features(verifier, folder, layer_ids: list[int] | tuple[int, ...] = (), return_logits: bool = False
                     ) -> FeatureSource:
    """A source that reads each batch's features from the hidden-state cache (`data.hidden_states`): batches come
    from its loader (`train.loaders.get_dataloaders` with features=offline) with `final` (B, T, H) and `layers`
    (B, L, T, H) attached, and `argmax` (B, T) where the cache stored the verifier's (EAGLE-3, DFlash). The verifier is
    never run: only its lm_head, for the logits, which are lm_head(final)."""
    from draftheads.data.hidden_states import check_verifier, read_index

    index = read_index(folder)
    check_verifier(index, verifier, folder)
    missing = [i for i in layer_ids if i not in index["layer_ids"]]
    if missing:
        raise ConfigError(f"feature_cache={str(folder)!r} holds layers {index['layer_ids']} ({index['method']} "
                          f"cache); this run needs layers {list(layer_ids)}: dump the cache with this run's config")
    positions = [index["layer_ids"].index(i) for i in layer_ids]

    def features(batch: dict) -> VerifierFeatures:
        final = batch["final"].to(verifier.dtype)  # (B, T, H)
        layers = [batch["layers"][:, p].to(verifier.dtype) for p in positions]  # (B, T, H) each
        logits = None
        if return_logits:
            with torch.no_grad():
                logits = verifier.lm_head(final)  # (B, T, V), as the online forward computes them
        argmax = batch["argmax"].long() if "argmax" in batch else None  # (B, T), EAGLE-3 and DFlash caches
        return VerifierFeatures(final=final, layers=layers, logits=logits, argmax=argmax)

    return features


def feature_source(cfg: RunConfig, verifier, layer_ids: list[int] | tuple[int, ...] = (),
                   return_logits: bool = False) -> FeatureSource:
    """The feature source a run config asks for (`features: online | offline`)."""
    if cfg.features == "online":
        if cfg.data.pack and cfg.data.document_mask:
            verifier.check_document_mask()  # one short forward: refuse a model that would attend across
        return online_features(verifier, layer_ids, return_logits)
    return offline_features(verifier, cfg.feature_cache, layer_ids, return_logits)


def cache_stores_argmax(cfg: RunConfig) -> bool:
    """Whether the run reads cached features that store the verifier's argmax (EAGLE-3 and DFlash caches dumped by
    this version): an EAGLE-3 run may then hold only its draft vocabulary's rows of lm_head."""
    if cfg.features != "offline":
        return False
    from draftheads.data.hidden_states import read_index

    return bool(read_index(cfg.feature_cache).get("argmax"))


def batch_tokens(batch: dict) -> torch.Tensor:
    """Real (non-padding) tokens in a batch, as a device scalar, for tokens/s."""
    return batch["attention_mask"].sum()
