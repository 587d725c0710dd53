"""DSpark drafters (a DFlash drafter with a Markov head, `dflash.markov_rank`) in vLLM's layout for qwen3_dspark
(read from vLLM 0.32's `model_executor/models/qwen3_dspark.py`, `v1/worker/gpu/spec_decode/dspark/speculator.py`,
`v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`, `config/vllm.py`).

  config  z-lab's DFlash config (models/layouts/dflash_vllm.py: the Qwen3 layer fields, dflash_config
          {mask_token_id, target_layer_ids}, block_size) with architectures ["Qwen3DSparkModel"], markov_rank,
          markov_head_type "vanilla" (the one kind Qwen3DSparkModel builds), enable_confidence_head,
          confidence_head_with_markov (written out: vLLM's default is false, speculators' true), and
          sample_from_anchor false.
  weights the DFlash layout's, plus markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [Vd, r] and,
          with the confidence head, confidence_head.proj.weight [1, H (+ r)] and confidence_head.proj.bias [1]: our
          module names are vLLM's (load_weights prefixes `model.`; lm_head and d2t as for DFlash). No t2d: vLLM's
          DSpark load_weights drops it (training-only), so the folder holds nothing it skips; reading the folder back
          rebuilds it from d2t.

What vLLM 0.32 does with the folder:
  - Serving: speculative_config {"method": "dspark", "model": FOLDER, "num_speculative_tokens": block_size - 1}.
    Only the V2 GPU model runner drafts DSpark (config/vllm.py refuses it on V1), and V2 needs Triton: its CPU build
    cannot serve this folder (tests/e2e/interop/test_vllm_dspark.py constructs and runs the model class instead).
  - sample_from_anchor false: the block is DFlash's [verified token, MASK x K] and mask position k drafts token k,
    as we train (vLLM's default, true, is DeepSpec's layout where the anchor itself predicts the first draft).
  - Drafting: base logits of every position from one forward, then left to right logits_k + markov_w2
    markov_w1[previous token] (the verified token first, then each sampled draft, as a verifier id), in the
    draft vocabulary before d2t; the confidence head reads [hidden; markov_w1[previous]] in fp32, through a
    sigmoid, for adaptive verification (enable_adaptive_verification).
  - Layer ids, rope, names: as DFlash's (dflash_vllm's docstring). embed_tokens and lm_head are the verifier's,
    shared by load_dspark_model.
"""

from __future__ import annotations

import torch

from draftheads.models.layouts import dflash_vllm

NAME = "vllm"
ARCHITECTURE = "Qwen3DSparkModel"
CHECKED_FIELDS = (*dflash_vllm.CHECKED_FIELDS, "markov_rank", "markov_head_type", "enable_confidence_head",
                  "confidence_head_with_markov", "sample_from_anchor")


def check(cfg) -> None:
    """Refuse what vLLM would read differently (DFlash's rules: increasing target layers)."""
    dflash_vllm.check(cfg)


def resolve(cfg) -> None:
    """Nothing to choose."""


def dspark_fields(cfg) -> dict:
    """The DSpark keys vLLM (and speculators' dspark config) read."""
    return {"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": cfg.has_confidence_head,
            "confidence_head_with_markov": bool(cfg.has_confidence_head and cfg.confidence_with_markov),
            "sample_from_anchor": False}


def config(drafter, verifier=None, num_speculative_tokens: int | None = None) -> dict:
    return {**dflash_vllm.config(drafter, verifier, num_speculative_tokens), "architectures": [ARCHITECTURE],
            **dspark_fields(drafter.cfg)}


def tensors(drafter) -> dict[str, torch.Tensor]:
    return {k: v for k, v in dflash_vllm.tensors(drafter).items() if k != "t2d"}


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's state dict: the file's tensors, and t2d (V,) from d2t where the drafter has a pruned vocabulary
    (V is markov_w1's rows, the verifier's vocabulary)."""
    from draftheads.models.eagle.vocab import draft_to_target, maps_problem

    out = dict(tensors)
    if "d2t" in out:
        d2t = out["d2t"]
        vocab_size = out["markov_head.markov_w1.weight"].shape[0]
        targets = draft_to_target(torch.arange(d2t.numel()), d2t)
        if bool(((targets < 0) | (targets >= vocab_size)).any()):
            raise dflash_vllm.error(f"d2t maps draft ids outside the verifier's vocabulary of {vocab_size}")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[targets] = True
        problem = maps_problem(d2t, t2d, vocab_size)
        if problem:
            raise dflash_vllm.error(f"d2t: {problem}")
        out["t2d"] = t2d
    return out
