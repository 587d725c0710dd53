"""DSpark drafters in the speculators library's format (speculators 0.9: `models/dspark/config.py`, a DFlash config
with speculators_model_type "dspark"; read by vLLM 0.32 through `transformers_utils/configs/speculators/algos.py:
update_dspark`, which builds a Qwen3DSparkModel from it).

  config.json   the DFlash speculators format (models/layouts/dflash_speculators.py) with architectures
                ["DSparkSpeculator"], speculators_model_type and algorithm "dspark", and the DSpark keys
                markov_rank, markov_head_type "vanilla", enable_confidence_head, confidence_head_with_markov,
                sample_from_anchor false (written out: the library's default is true, vLLM's reading of the format
                false).
  weights       the vLLM layout's (models/layouts/dspark_vllm.py): speculators' MarkovHead / ConfidenceHead use the
                same names (markov_head.markov_w1 / markov_w2, confidence_head.proj).
Served as the DFlash format is (`LLM(model=FOLDER)`, method dspark): by vLLM's V2 runner only, so not on its CPU
build.
"""

from __future__ import annotations

import torch

from draftheads.models.layouts import dflash_speculators, dspark_vllm

NAME = "speculators"
CHECKED_FIELDS = (*dflash_speculators.CHECKED_FIELDS, "architectures", "markov_rank", "markov_head_type",
                  "enable_confidence_head", "confidence_head_with_markov")


def check(cfg) -> None:
    dflash_speculators.check(cfg)


def resolve(cfg) -> None:
    """Nothing to choose."""


def config(drafter, verifier, num_speculative_tokens: int | None = None) -> dict:
    out = dflash_speculators.config(drafter, verifier, num_speculative_tokens)
    out["architectures"] = ["DSparkSpeculator"]
    out["speculators_model_type"] = "dspark"
    out["speculators_config"] = {**out["speculators_config"], "algorithm": "dspark"}
    return {**out, **dspark_vllm.dspark_fields(drafter.cfg)}


def tensors(drafter) -> dict[str, torch.Tensor]:
    return dspark_vllm.tensors(drafter)


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(tensors)
