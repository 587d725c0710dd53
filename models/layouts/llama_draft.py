"""What the EAGLE layouts share: the drafter's one decoder layer written as a one-layer Llama, which is what vLLM
and SGLang both build for an EAGLE drafter whatever the verifier's family (Llama, Qwen2, Mistral).

  - config fields: the layer's dims, activation, norm eps, rope (both `rope_theta`/`rope_scaling` and
    transformers 5's `rope_parameters`), vocab_size (the verifier's), token ids, dtype.
  - sliding window (eagle.sliding_window): `layer_types` ["sliding_attention"] and `sliding_window` W, a query
    seeing the W positions up to its own; vLLM's Llama layer reads them (its EAGLE-3 drafter indexes layer_types
    from 0 for the draft layer), the speculators library from transformer_layer_config.
  - biases: the engines' Llama attention takes one flag (`attention_bias`) for q/k/v *and* o_proj, so a family with
    q/k/v biases only (Qwen2) is written with attention_bias true and a zero `o_proj.bias`; every bias the engine
    expects but the drafter lacks is written as zeros (and must be zero when read back).
"""

from __future__ import annotations

import torch

from draftheads.models.dtypes import dtype_name

LAYER = "layers.0."
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
WINDOW_FIELDS = ("layer_types", "sliding_window")
"""The layer's sliding window as vLLM (`llama.py`: layer_types[i] == "sliding_attention" takes `sliding_window`) and
the speculators library read it; written only for a windowed drafter, so a full-attention export is unchanged."""


def bias_layout(drafter) -> tuple[bool, bool]:
    """(attention_bias as the engines read it, mlp_bias)."""
    attn, mlp = drafter.layer.self_attn, drafter.layer.mlp
    return any(getattr(attn, n).bias is not None for n in PROJECTIONS), mlp.gate_proj.bias is not None


def config(drafter) -> dict:
    """The Llama config.json fields of the drafter's layer (without architectures and method fields)."""
    vc = drafter.layer_config
    attention_bias, mlp_bias = bias_layout(drafter)
    rope = dict(getattr(vc, "rope_parameters", None) or {})
    rope_theta = rope.get("rope_theta", getattr(vc, "rope_theta", None))
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", "default") == "default":
        rope_scaling = None
    window = getattr(drafter.cfg, "sliding_window", None)
    windowed = {} if window is None else {"layer_types": ["sliding_attention"], "sliding_window": window}
    return {
        **windowed,
        "model_type": "llama",
        "hidden_size": drafter.hidden_size,
        "intermediate_size": drafter.layer.mlp.gate_proj.out_features,
        "num_hidden_layers": 1,
        "num_attention_heads": drafter.num_heads,
        "num_key_value_heads": drafter.num_kv_heads,
        "head_dim": drafter.head_dim,
        "hidden_act": vc.hidden_act,
        "rms_norm_eps": vc.rms_norm_eps,
        "max_position_embeddings": vc.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope or None,
        "vocab_size": drafter.verifier_vocab_size,
        "attention_bias": attention_bias,
        "mlp_bias": mlp_bias,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(vc, "bos_token_id", None),
        "eos_token_id": getattr(vc, "eos_token_id", None),
        "pad_token_id": getattr(vc, "pad_token_id", None),
        "torch_dtype": dtype_name(drafter.dtype),
        "dtype": dtype_name(drafter.dtype),
    }


def eagle3_config(drafter, top_level_ids: list[int] | None, eagle_config_ids: list[int]) -> dict:
    """EAGLE-3's config.json fields: the layer's, the draft vocabulary, the norm options (EAGLE 3.1's fc_norm and
    norm_output at the top level, where vLLM reads them), a parallel drafter's mask_token_id (top level, vLLM's
    parallel drafting), and the feature layer ids (at the top level for vLLM when given, and inside eagle_config in
    the convention of the engine that reads it)."""
    ids = {} if top_level_ids is None else {"eagle_aux_hidden_state_layer_ids": top_level_ids}
    parallel = {"mask_token_id": drafter.mask_token_id} if drafter.parallel else {}
    return {"architectures": ["LlamaForCausalLMEagle3"], **config(drafter),
            "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.hidden_size, "bias": False,
            "norm_before_residual": drafter.cfg.norm_before_residual, "fc_norm": drafter.cfg.fc_norm,
            "norm_output": drafter.cfg.norm_output, **parallel, **ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": eagle_config_ids, "use_aux_hidden_state": True}}


def tensors(drafter) -> dict[str, torch.Tensor]:
    """The drafter's weights under its module names (`layers.0.*`, `fc.*`, ...), plus zero attention biases where
    the engine's shared flag expects one the drafter lacks. EAGLE-3's d2t / t2d only with a pruned draft
    vocabulary: with the whole vocabulary the engines build no map (vLLM refuses a d2t then)."""
    out = {k: v.detach() for k, v in drafter.state_dict().items()}
    if getattr(drafter, "full_vocab", False):
        out.pop("d2t", None)
        out.pop("t2d", None)
    if bias_layout(drafter)[0]:
        for name in PROJECTIONS:
            key = f"{LAYER}self_attn.{name}.bias"
            if key not in out:
                out[key] = torch.zeros(getattr(drafter.layer.self_attn, name).out_features, dtype=drafter.dtype)
    return out
