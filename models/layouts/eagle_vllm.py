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
           attention_bias, mlp_bias, norm_before_residual, the feature layer ids at the top level
           (`eagle_aux_hidden_state_layer_ids`, our ids: the inputs of those layers) and eagle_config
           {eagle_aux_hidden_state_layer_ids: our ids - 1, use_aux_hidden_state: true}.
           weights: fc.weight [H, 3H], layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], layers.0.self_attn.o_proj
           .weight, layers.0.mlp.{gate,up,down}_proj.weight, layers.0.{input_layernorm,hidden_norm,
           post_attention_layernorm}.weight, norm.weight, lm_head.weight [Vd, H], and only when the draft
           vocabulary is smaller than the verifier's, d2t int64 [Vd] (target id - draft id) and t2d bool [V].
           No embed_tokens.
  EAGLE 3.1  (vLLM `fc_norm`, `norm_output`; top-level booleans, false when absent) fc_norm.{0,1,2}.weight [H]: an
           RMS norm on each feature layer's H-wide block before fc; norm_output: no weight, the next draft step
           reads the final norm's output.
  P-EAGLE  (vLLM's parallel drafting, PR #32887) top-level mask_token_id; mask_hidden [3H], the feature-space input
           of the mask positions (vLLM runs it through fc_norm and fc once at load). vLLM drafts in parallel only
           when asked: speculative_config {"method": "eagle3", "parallel_drafting": true, ...}; without the flag
           it warns, skips mask_hidden and drafts autoregressively, which this drafter was not trained for.

What vLLM 0.32's loader does (and why the layout is as it is):
  - Layer ids: Model Runner V2 (the default for EAGLE) reads only the top-level `eagle_aux_hidden_state_layer_ids`
    and silently falls back to (2, L//2, L-3) without it; the Llama drafter counts the feature layers from
    eagle_config. It concatenates the features in increasing layer order, whatever order the config lists them
    (so our layer ids must be increasing: EagleConfig refuses others). SGLang reads only eagle_config's copy and
    adds 1 to it (its ids name the layer whose *output* is the feature), so that copy holds our ids - 1: one folder
    then serves both engines with the same layers.
  - d2t: with a draft vocabulary as large as the verifier's, vLLM builds no `draft_id_to_target_id` and a d2t in
    the file fails the load ("There is no module or parameter named 'draft_id_to_target_id'"); with a smaller one,
    a missing d2t leaves the map at zero: draft id i read as target id i, silently. So d2t is written exactly when
    the draft vocabulary is pruned.
  - Biases: its Llama attention takes `attention_bias` (or `bias`!) for q/k/v *and* o_proj (see llama_draft.py for
    the zero placeholders); its EAGLE-1 fc has no bias and an fc.bias in the file is dropped without a word (every
    unexpected `.bias` is), so an EAGLE-1 trained with one is refused here (`check`), not exported.
  - Names: un-prefixed; both `layers.0.*` and `midlayer.*` are accepted. There is no missing-weight check: a
    tensor it expects and the file lacks stays at its initial value.
"""

from __future__ import annotations

import torch

from draftheads.models.eagle import EagleError
from draftheads.models.layouts import llama_draft

NAME = "vllm"
#: config.json fields a reader compares with the drafter it rebuilt from the metadata.
CHECKED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "eagle_config", "fc_norm",
                  "norm_output", "mask_token_id")


def check(cfg, qkv_bias: bool | None = None) -> None:
    """Refuse an EagleConfig (or a drafter's) that vLLM would read differently from how it trains."""
    if cfg.version == 1 and cfg.use_fc_bias:
        raise EagleError("eagle.fc_bias=true with engine vllm: vLLM's EAGLE-1 builds fc without a bias and drops "
                         "fc.bias from the file without a word, so the drafter would be served wrong; train with "
                         "eagle.fc_bias=false (exact in vLLM and SGLang), or export for engine sglang")


def resolve(cfg) -> None:
    """Nothing to choose: the drafter's defaults (no fc bias) are what vLLM builds."""


def config(drafter, verifier=None, num_speculative_tokens: int = 3) -> dict:
    if drafter.version == 1:
        return {"architectures": ["LlamaForCausalLM"], **llama_draft.config(drafter), "bias": drafter.cfg.use_fc_bias}
    return llama_draft.eagle3_config(drafter, top_level_ids=list(drafter.layer_ids),
                                     eagle_config_ids=[i - 1 for i in drafter.layer_ids])


def tensors(drafter) -> dict[str, torch.Tensor]:
    return llama_draft.tensors(drafter)


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors under the drafter's module names (vLLM's names are ours)."""
    return dict(tensors)
