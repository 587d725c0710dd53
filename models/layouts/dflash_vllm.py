"""DFlash drafters in z-lab's layout, which vLLM, SGLang and the reference package all read (read from vLLM 0.32's
`model_executor/models/qwen3_dflash.py`, `v1/spec_decode/dflash.py`, `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`,
`config/speculative.py`; SGLang 0.5.23's `srt/models/dflash.py` and `srt/speculative/dflash_utils.py`; the `dflash`
0.1.0 package's `DFlashDraftModel`). Weights in the drafter's dtype.

  config  architectures ["DFlashDraftModel"], model_type "qwen3" (so transformers builds a Qwen3Config), the
          drafter's layer dims (hidden_size, intermediate_size, num_hidden_layers = drafter layers,
          num_attention_heads, num_key_value_heads, head_dim, hidden_act, rms_norm_eps, max_position_embeddings),
          rope (`rope_theta` and transformers 5's `rope_parameters`), attention_bias, layer_types, use_sliding_window
          / sliding_window, vocab_size (the verifier's), tie_word_embeddings false, num_target_layers, block_size,
          and dflash_config {mask_token_id, target_layer_ids}.
  weights fc.weight [H, nH], hidden_norm.weight, norm.weight, and per layer i layers.i.self_attn.{q,k,v,o}_proj
          .weight (+ .bias with attention_bias), layers.i.self_attn.{q_norm,k_norm}.weight [head_dim],
          layers.i.mlp.{gate,up,down}_proj.weight, layers.i.{input_layernorm,post_attention_layernorm}.weight.
          No embed_tokens and no lm_head: every reader shares the verifier's (the mask token is the verifier's
          embedding row `mask_token_id`), and no mask_hidden (vLLM asserts there is none).
          A drafter with its own lm_head (`dflash.draft_vocab_size`, not z-lab's) adds lm_head.weight [Vd, H], the
          config's draft_vocab_size, and for a pruned vocabulary d2t [Vd] (target id - draft id) and t2d [V]: vLLM
          keeps a file's lm_head that differs from the verifier's (`has_own_lm_head`), maps d2t into
          draft_id_to_target_id when draft_vocab_size differs from the verifier's vocabulary, and skips t2d.

What vLLM 0.32 does with the folder (and why the layout is as it is):
  - Serving: speculative_config {"method": "dflash", "model": FOLDER, "num_speculative_tokens": K}. K is required
    (vLLM reads no block_size) and sets the block: one query of [the verified token, mask x K]; serve with
    K = block_size - 1, the block the drafter was trained on (a shorter block changes what the masks see).
  - Layer ids: the verifier's aux hidden states are the *inputs* of the listed layers (hidden + residual before
    layer i); without a top-level `eagle_aux_hidden_state_layer_ids` it takes dflash_config.target_layer_ids + 1,
    the outputs of those layers. So nothing is written at the top level: one list, in the reference's meaning.
    They are collected in the forward's layer order, whatever order the config lists them, while fc reads its
    blocks in the listed order: target_layer_ids must increase (`check`). The last layer's output is not one of
    them: vLLM would hand fc its pre-norm output where HF's hidden_states[L] (the reference) is after the norm
    (DFlashConfig refuses it).
  - Context: fc over the features, hidden_norm, then each layer's k_proj / v_proj, k_norm and RoPE at the
    context positions, straight into that layer's KV cache (no input_layernorm), as the reference computes its
    context keys; the block's queries attend to context + block, bidirectionally unless a layer is a sliding
    one (`layer_types`; causal, within the window).
  - Rope: `rope_parameters` from the config, and a missing rope_theta defaults to 1e6 (Qwen3's), so the theta is
    always written. `is_neox_style` defaults to true (HF's rotate_half).
  - Names: bare (vLLM prefixes `model.`); q/k/v and gate/up are stacked on load. There is no missing-weight check.
  - Refused by vLLM itself: a `mask_hidden` weight (assertion), mixed sliding/full layers outside the V2 runner.
SGLang 0.5.23 parses the same fields (`parse_dflash_draft_config`: block_size top level or in dflash_config,
target_layer_ids = layer outputs, mask_token_id) and the same bare names, so one folder serves both.
"""

from __future__ import annotations

import torch

from draftheads.models.dtypes import dtype_name

NAME = "vllm"
ARCHITECTURE = "DFlashDraftModel"
#: config.json fields a reader compares with the drafter it rebuilt from the metadata.
CHECKED_FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                  "rope_parameters", "attention_bias", "layer_types", "sliding_window", "vocab_size",
                  "num_target_layers", "block_size", "dflash_config", "draft_vocab_size")


def error(message: str) -> Exception:
    from draftheads.models.dflash import DFlashError

    return DFlashError(message)


def check(cfg) -> None:
    """Refuse a DFlashConfig that vLLM (or SGLang) would read differently from how the drafter trains."""
    ids = cfg.target_layer_ids
    if ids is not None and list(ids) != sorted(ids):
        raise error(f"dflash.target_layer_ids={list(ids)} with engine vllm: vLLM (and SGLang) hand fc the "
                    "verifier's layers in increasing order whatever order the config lists, while the drafter "
                    f"reads them as listed; list them increasing ({sorted(ids)})")


def resolve(cfg) -> None:
    """Nothing to choose: the drafter's defaults are what vLLM builds."""


def layer_config(cfg) -> dict:
    """The Qwen3 config fields of the drafter's layers (resolved DFlashConfig), as transformers' Qwen3Config reads
    them back: explicit layer_types, and use_sliding_window so that a sliding_window survives the parse."""
    types = [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)]
    sliding = "sliding_attention" in types
    theta = float(cfg.rope_theta)
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": bool(cfg.attention_bias),
        "attention_dropout": 0.0,
        "layer_types": types,
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
        "max_window_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
    }


def config(drafter, verifier=None, num_speculative_tokens: int | None = None) -> dict:
    cfg = drafter.cfg
    own = {} if cfg.draft_vocab_size is None else {"draft_vocab_size": cfg.draft_vocab_size}
    architecture, extra = ARCHITECTURE, {}
    if cfg.variant == "dflash2":  # DFlash2: its architecture and dflash_config fields (dflash2_vllm.py)
        from draftheads.models.layouts import dflash2_vllm

        architecture, extra = dflash2_vllm.ARCHITECTURE, dflash2_vllm.dflash_config(cfg)
    return {"architectures": [architecture], **layer_config(cfg), **own, "num_target_layers": cfg.num_target_layers,
            "block_size": cfg.block_size,
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                              **extra},
            "torch_dtype": dtype_name(drafter.dtype), "dtype": dtype_name(drafter.dtype)}


def tensors(drafter) -> dict[str, torch.Tensor]:
    """The drafter's weights under its module names, which are z-lab's (and so vLLM's and SGLang's)."""
    return {k: v.detach() for k, v in drafter.state_dict().items()}


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors under the drafter's module names (the same names)."""
    return dict(tensors)
