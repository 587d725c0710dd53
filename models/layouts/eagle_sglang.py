"""EAGLE-1 and EAGLE-3 drafters in SGLang's layout (read from SGLang `llama_eagle.py`, `llama_eagle3.py`,
`llama.py`): vLLM's layout (eagle_vllm.py) with SGLang's differences.

  - Key names: SGLang's EAGLE-3 loader only knows `midlayer.*` and silently skips other names, so the layer is
    written as `midlayer.*` (EAGLE-1 keeps `layers.0.*`).
  - Layer ids: SGLang adds 1 to explicit aux layer ids (its ids are layer *outputs*), so we write ours - 1; layer 0
    (the embeddings) cannot be expressed.
  - EAGLE-1: the class is `LlamaForCausalLMEagle`; its fc always has a bias (a zero fc.bias is written when the
    drafter has none), and `bias` must stay false: its Llama attention reads `attention_bias or bias`, so `bias:
    true` would build q/k/v/o biases that no tensor fills (found by running SGLang 0.5.23's own loader).
  - EAGLE-3 (0.5.23): layer 0's qkv_proj is built without a bias and the loader skips unknown names, so q/k/v
    biases would be dropped silently: refused (`check`), and left out by default for this engine (`resolve`).
    There is no `norm_before_residual` (the residual is always the un-normed fc output): refused when true. Its
    Llama attention takes no sliding window (no layer_types read): eagle.sliding_window is refused.
    The loader never reports a missing weight.
"""

from __future__ import annotations

import torch

from draftheads.models.eagle import EagleError
from draftheads.models.layouts import llama_draft

NAME = "sglang"
CHECKED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "eagle_config")
MIDLAYER = "midlayer."


def check(cfg, qkv_bias: bool | None = None) -> None:
    """Refuse an EagleConfig that SGLang would read differently from how it trains; `qkv_bias` is what the drafter
    has (None: as the config says)."""
    if cfg.version != 3:
        return
    for key in ("parallel", "fc_norm", "norm_output"):
        if getattr(cfg, key):
            raise EagleError(f"eagle.{key}=true with engine sglang: SGLang's EAGLE-3 (0.5.23) has no such option "
                             f"and would serve the drafter without it; export for engine vllm")
    if cfg.sliding_window is not None:
        raise EagleError(f"eagle.sliding_window={cfg.sliding_window} with engine sglang: SGLang's Llama attention (the "
                         "EAGLE-3 draft layer) builds its RadixAttention without a window and reads no layer_types, so "
                         "the drafter would be served with full attention; export for engine vllm or speculators")
    if cfg.norm_before_residual:
        raise EagleError("eagle.norm_before_residual=true with engine sglang: SGLang's EAGLE-3 has no such option "
                         "(its residual is always the un-normed fc output), so the drafter would be served wrong; "
                         "train with eagle.norm_before_residual=false or export for engine vllm")
    if cfg.qkv_bias if qkv_bias is None else qkv_bias:
        raise EagleError("eagle.qkv_bias=true with engine sglang: SGLang's EAGLE-3 layer has no q/k/v bias and drops "
                         "them from the file without a word; train with eagle.qkv_bias=false")
    if cfg.layer_ids is not None and min(cfg.layer_ids) < 1:
        raise EagleError(f"eagle.layer_ids={list(cfg.layer_ids)} with engine sglang: SGLang names the features by "
                         "the layer that *outputs* them (our id - 1), so layer 0 (the embeddings) cannot be "
                         "expressed")


def resolve(cfg) -> None:
    """This engine's choice for settings left unset (None): EAGLE-3 without q/k/v biases (SGLang has none)."""
    if cfg.version == 3 and cfg.qkv_bias is None:
        cfg.qkv_bias = False


def config(drafter, verifier=None, num_speculative_tokens: int = 3) -> dict:
    if drafter.version == 1:
        # SGLang's EAGLE-1 fc always has a bias (nn.Linear's default) whatever the config says, while its Llama
        # attention reads `attention_bias or bias`: `bias: true` would build q/k/v/o biases no tensor fills
        return {"architectures": ["LlamaForCausalLMEagle"], **llama_draft.config(drafter), "bias": False}
    ids = list(drafter.layer_ids)
    if min(ids) < 1:
        raise EagleError(f"layer ids {ids}: SGLang names the features by the layer that *outputs* them "
                         "(our id - 1), so layer 0 (the embeddings) cannot be expressed")
    return llama_draft.eagle3_config(drafter, top_level_ids=None, eagle_config_ids=[i - 1 for i in ids])


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
