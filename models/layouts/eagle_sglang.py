"""EAGLE-1 and EAGLE-3 drafters in SGLang's layout (read from SGLang `llama_eagle.py`, `llama_eagle3.py`,
`llama.py`): vLLM's layout (eagle_vllm.py) with SGLang's differences.

  - Key names: SGLang's EAGLE-3 loader only knows `midlayer.*` and silently skips other names, so the layer is
    written as `midlayer.*` (EAGLE-1 keeps `layers.0.*`).
  - Layer ids: SGLang adds 1 to explicit aux layer ids (its ids are layer *outputs*), so we write ours - 1; layer 0
    (the embeddings) cannot be expressed.
  - EAGLE-1: the class is `LlamaForCausalLMEagle` and always has an fc bias (`bias: true`; a zero fc.bias when
    trained without one). EAGLE-3: qkv_proj never has a bias there (q/k/v biases are ignored): train with
    qkv_bias=false for SGLang.
"""

from __future__ import annotations

import torch

from models.eagle import EagleError
from models.layouts import llama_draft

NAME = "sglang"
CHECKED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "eagle_config")
MIDLAYER = "midlayer."


def config(drafter) -> dict:
    if drafter.version == 1:
        return {"architectures": ["LlamaForCausalLMEagle"], **llama_draft.config(drafter), "bias": True}
    ids = list(drafter.layer_ids)
    if min(ids) < 1:
        raise EagleError(f"layer ids {ids}: SGLang names the features by the layer that *outputs* them "
                          "(our id - 1), so layer 0 (the embeddings) cannot be expressed")
    return {"architectures": ["LlamaForCausalLMEagle3"], **llama_draft.config(drafter),
            "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.hidden_size, "bias": False,
            "norm_before_residual": drafter.cfg.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}}


def tensors(drafter) -> dict[str, torch.Tensor]:
    out = llama_draft.tensors(drafter)
    if drafter.version == 1:
        if "fc.bias" not in out:
            out["fc.bias"] = torch.zeros(drafter.hidden_size, dtype=drafter.dtype)  # SGLang's EAGLE-1 fc has one
        return out
    layer = llama_draft.LAYER
    return {(MIDLAYER + k[len(layer):] if k.startswith(layer) else k): v for k, v in out.items()}


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors under the drafter's module names (`midlayer.*` -> `layers.0.*`)."""
    layer = llama_draft.LAYER
    return {(layer + k[len(MIDLAYER):] if k.startswith(MIDLAYER) else k): v for k, v in tensors.items()}
