"""EAGLE-1 and EAGLE-3 drafters in vLLM's layout (read from vLLM `llama_eagle.py`, `llama_eagle3.py`,
`transformers_utils/configs/eagle.py`, `gpu_model_runner.py`). Weights in the drafter's dtype.

  EAGLE-1  config: architectures ["LlamaForCausalLM"] (vLLM's EAGLEConfig turns it into EagleLlamaForCausalLM for
           method "eagle"), model_type "llama", num_hidden_layers 1, the verifier's layer dims, rope and vocab_size,
           `bias` (fc bias, the EAGLE repo's key), attention_bias, mlp_bias, tie_word_embeddings false.
           weights: fc.weight [H, 2H] (+ fc.bias [H]), layers.0.self_attn.{q,k,v,o}_proj.weight,
           layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight.
           No input_layernorm, no embed_tokens, no lm_head (the engine shares the verifier's).
  EAGLE-3  config: architectures ["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1, the layer dims
           (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, hidden_act,
           rms_norm_eps, rope_theta / rope_scaling / rope_parameters, max_position_embeddings), vocab_size (the
           verifier's), draft_vocab_size, target_hidden_size, tie_word_embeddings false, bias false (fc),
           attention_bias, mlp_bias, norm_before_residual, eagle_config {eagle_aux_hidden_state_layer_ids,
           use_aux_hidden_state: true}.
           weights: fc.weight [H, 3H], layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], layers.0.self_attn.o_proj
           .weight, layers.0.mlp.{gate,up,down}_proj.weight, layers.0.{input_layernorm,hidden_norm,
           post_attention_layernorm}.weight, norm.weight, lm_head.weight [Vd, H], d2t int64 [Vd], t2d bool [V].
           No embed_tokens.

What vLLM's loader does: its Llama attention takes `attention_bias` (or `bias`!) for q/k/v *and* o_proj (see
llama_draft.py for the zero placeholders); its EAGLE-1 fc has no bias (fc.bias is dropped or fails to load,
depending on the version) and it reads `bias` as attention bias: train EAGLE-1 with fc_bias=false for vLLM. It
reads `eagle_aux_hidden_state_layer_ids` (top level, else inside eagle_config) as the inputs of those layers (our
convention) and accepts both `layers.0.*` and `midlayer.*` names.
"""

from __future__ import annotations

import torch

from models.layouts import llama_draft

NAME = "vllm"
#: config.json fields a reader compares with the drafter it rebuilt from the metadata.
CHECKED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "eagle_config")


def config(drafter) -> dict:
    if drafter.version == 1:
        return {"architectures": ["LlamaForCausalLM"], **llama_draft.config(drafter), "bias": drafter.cfg.use_fc_bias}
    return {"architectures": ["LlamaForCausalLMEagle3"], **llama_draft.config(drafter),
            "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.hidden_size, "bias": False,
            "norm_before_residual": drafter.cfg.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(drafter.layer_ids),
                             "use_aux_hidden_state": True}}


def tensors(drafter) -> dict[str, torch.Tensor]:
    return llama_draft.tensors(drafter)


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors under the drafter's module names (vLLM's names are ours)."""
    return dict(tensors)
