"""DFlash drafters in the speculators library's format (vllm-project/speculators 0.9: `models/dflash/config.py`,
`models/dflash/core.py`; read by vLLM 0.32 through `transformers_utils/configs/speculators/algos.py: update_dflash`).

A folder in this format is served with no speculative flags, `vllm serve DRAFTER_DIR` or `LLM(model=DRAFTER_DIR)`:
vLLM serves the verifier named in it and drafts `speculative_tokens` tokens a step (method dflash).

  config.json   architectures ["DFlashSpeculator"], speculators_model_type "dflash", speculators_version,
                speculators_config {algorithm "dflash", proposal_methods [{proposal_type "greedy",
                speculative_tokens K (default block_size - 1), ...}], verifier {name_or_path, architectures}},
                transformer_layer_config (the drafter's Qwen3 layers: dflash_vllm.layer_config), draft_vocab_size
                (the verifier's: no pruned vocabulary), block_size, target_hidden_size, aux_hidden_state_layer_ids
                (the *inputs* of the verifier layers read: our target_layer_ids + 1; vLLM subtracts the 1 again
                for dflash_config.target_layer_ids), mask_token_id, sliding_window_non_causal, sample_from_anchor
                false (the anchor is the verified token; only the mask positions draft).
  weights       the vLLM layout's (bare names; no embed_tokens, no lm_head: the library rebuilds both from the
                verifier for a whole-vocabulary drafter, and vLLM shares the verifier's).

A DFlash2 drafter (dflash.variant dflash2) is written as speculators' DFlash2 format (`models/dflash2/config.py`):
speculators_model_type and algorithm "dflash2", architectures ["DFlash2DraftModel"], and conv_kernel_size,
conv_group_size, selector_rank, selector_top_k at the top level, which vLLM's `update_dflash2` copies into
dflash_config (and serves as method dflash with that architecture); the weights are vLLM's DFlash2 layout's.

`sliding_window_non_causal` is written out because vLLM reads it as the causality of *every* layer
(dflash_config.causal = not sliding_window_non_causal, default true), where the library reads it for the sliding
layers only (full layers are always bidirectional): true for a drafter without sliding layers (all bidirectional),
false for one whose layers are all sliding (all causal). A drafter mixing the two cannot be written so that both
readers agree with how it trains, and is refused (`check`).
"""

from __future__ import annotations

import torch

from draftheads.models.dtypes import dtype_name
from draftheads.models.layouts import dflash_vllm
from draftheads.models.layouts.eagle_speculators import FORMAT_VERSION, verifier_reference

NAME = "speculators"
CHECKED_FIELDS = ("speculators_model_type", "architectures", "conv_kernel_size", "conv_group_size", "selector_rank",
                  "selector_top_k", "transformer_layer_config", "draft_vocab_size", "block_size",
                  "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
                  "sample_from_anchor")


def check(cfg) -> None:
    dflash_vllm.check(cfg)
    if cfg.draft_vocab_size is not None:
        raise dflash_vllm.error(
            f"dflash.draft_vocab_size={cfg.draft_vocab_size} with engine speculators: this layout writes drafters "
            "that read the verifier's lm_head (its own lm_head is written and checked for engine vllm only); "
            "export for engine vllm, or set dflash.draft_vocab_size=null")
    types = {cfg.layer_type(i) for i in range(cfg.num_hidden_layers)}
    if types == {"full_attention", "sliding_attention"}:
        raise dflash_vllm.error(
            f"dflash.layer_types={[cfg.layer_type(i) for i in range(cfg.num_hidden_layers)]} with engine "
            "speculators: vLLM reads the format's one flag, sliding_window_non_causal, as the causality of every "
            "layer, so causal sliding layers beside bidirectional full layers cannot be written; export for engine "
            "vllm")


def resolve(cfg) -> None:
    """Nothing to choose."""


def config(drafter, verifier, num_speculative_tokens: int | None = None) -> dict:
    cfg = drafter.cfg
    k = cfg.block_size - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
    if k < 1:
        raise dflash_vllm.error(f"num_speculative_tokens={k}: expected at least 1")
    sliding = any(cfg.layer_type(i) == "sliding_attention" for i in range(cfg.num_hidden_layers))
    kind, architecture, extra = "dflash", "DFlashSpeculator", {}
    if cfg.variant == "dflash2":  # speculators' DFlash2SpeculatorConfig: its type, architecture and four fields
        from draftheads.models.layouts import dflash2_vllm

        kind, architecture, extra = "dflash2", dflash2_vllm.ARCHITECTURE, dflash2_vllm.dflash_config(cfg)
    return {
        "architectures": [architecture],
        "speculators_model_type": kind,
        "speculators_version": FORMAT_VERSION,
        **extra,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_reference(verifier),
                         "architectures": list(getattr(verifier.config, "architectures", None) or [])},
        },
        "transformer_layer_config": {"architectures": ["Qwen3ForCausalLM"], **dflash_vllm.layer_config(cfg)},
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": not sliding,
        "sample_from_anchor": False,
        "torch_dtype": dtype_name(drafter.dtype),
        "dtype": dtype_name(drafter.dtype),
    }


def tensors(drafter) -> dict[str, torch.Tensor]:
    return dflash_vllm.tensors(drafter)


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(tensors)
