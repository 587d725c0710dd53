"""EAGLE-3 drafters in the speculators library's own format (vllm-project/speculators 0.9, read from its
`models/eagle3/config.py`, `models/eagle3/core.py`, and vLLM 0.32's `transformers_utils/configs/speculators/`).

A folder in this format is served with no speculative flags, `vllm serve DRAFTER_DIR` or `LLM(model=DRAFTER_DIR)`:
vLLM sees `speculators_config`, serves the verifier named in it and drafts `speculative_tokens` tokens a step; and
the speculators library loads it with its own classes (`Eagle3DraftModel.from_pretrained`), no conversion step.

  config.json   architectures ["Eagle3Speculator"], speculators_model_type "eagle3", speculators_version,
                speculators_config {algorithm "eagle3", proposal_methods [{proposal_type "greedy",
                speculative_tokens K, verifier_accept_k 1, accept_tolerance 0.0}], default_proposal_method "greedy",
                verifier {name_or_path, architectures}}, transformer_layer_config (the one Llama layer, with
                model_type "llama"), draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids (top
                level, our ids: the inputs of those layers; a sliding window as layer_types + sliding_window inside
                transformer_layer_config, where vLLM and the library read it), and every norm flag written out:
                norm_before_residual (vLLM reads a *missing* one as true here), norm_before_fc (false), fc_norm,
                norm_output (EAGLE 3.1).
  weights       embed_tokens.weight (the verifier's, so the library computes our logits without being handed the
                verifier's embeddings by hand), layers.0.*, fc.weight, norm.weight, lm_head.weight [Vd, H], and d2t
                (int64 offsets) + t2d (bool) only with a pruned draft vocabulary (the library registers them only
                then; vLLM refuses a d2t for a whole vocabulary).

`verifier.name_or_path` is the hub id when the verifier came from the hub, else its local folder (absolute): vLLM
loads the verifier from there, so it must resolve where the folder is served. EAGLE-1 has no speculators format.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftheads.models.eagle import EagleError
from draftheads.models.layouts import llama_draft
from draftheads.models.verifier import EMBEDDED_VERIFIERS

NAME = "speculators"
FORMAT_VERSION = "0.9.0"
"""The speculators release whose format this writes."""
CHECKED_FIELDS = ("speculators_model_type", "draft_vocab_size", "target_hidden_size",
                  "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "fc_norm", "norm_output")
EMBEDDING = "embed_tokens.weight"
LAYER_SECTION = "transformer_layer_config"
"""Where the layer's own fields (its sliding window among them) sit in config.json."""


def check(cfg, qkv_bias: bool | None = None) -> None:
    if cfg.version != 3:
        raise EagleError("engine=speculators with eagle.version=1: the speculators library has no EAGLE-1 format; "
                         "export EAGLE-1 for engine vllm or sglang")
    if cfg.parallel:
        raise EagleError("eagle.parallel=true with engine speculators: the speculators library's P-EAGLE format "
                         "(speculators_model_type peagle) is not written yet; export for engine vllm and serve with "
                         "parallel_drafting: true")


def resolve(cfg) -> None:
    """Nothing to choose: every norm flag is written out explicitly."""


def verifier_reference(verifier) -> str:
    """What vLLM and speculators load the verifier from: the hub id it came from, else its folder (absolute)."""
    name, path = str(verifier.name or ""), verifier.path
    if path is None:
        return name
    local = Path(name).expanduser()
    hub_id = (name.count("/") == 1 and not name.startswith((".", "/", "~")) and not local.exists()
              and name not in EMBEDDED_VERIFIERS)
    return name if hub_id else str(Path(path).resolve())


def config(drafter, verifier, num_speculative_tokens: int = 3) -> dict:
    if num_speculative_tokens < 1:
        raise EagleError(f"num_speculative_tokens={num_speculative_tokens}: expected at least 1")
    layer = {k: v for k, v in llama_draft.config(drafter).items() if k not in ("torch_dtype", "dtype")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": FORMAT_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_reference(verifier),
                         "architectures": list(getattr(verifier.config, "architectures", None) or [])},
        },
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **layer},
        "draft_vocab_size": drafter.draft_vocab_size,
        "target_hidden_size": drafter.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(drafter.layer_ids),
        "norm_before_residual": drafter.cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": drafter.cfg.fc_norm,
        "norm_output": drafter.cfg.norm_output,
        "embed_requires_grad": False,
        "torch_dtype": layer_dtype(drafter),
        "dtype": layer_dtype(drafter),
    }


def layer_dtype(drafter) -> str:
    return str(drafter.dtype).removeprefix("torch.")


def tensors(drafter) -> dict[str, torch.Tensor]:
    out = llama_draft.tensors(drafter)
    out[EMBEDDING] = drafter.token_embedding.detach().to(drafter.dtype)
    return out


def state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors under the drafter's module names: all but the verifier's embedding, which the drafter
    reads from the verifier (the caller checks the file's copy is that embedding)."""
    return {k: v for k, v in tensors.items() if k != EMBEDDING}
