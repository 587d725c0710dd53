"""Small synthetic drafter folders shaped as other trainers write them, from one of our EAGLE-3 drafters, so the
importer (eval/interop/peer_folder.py) and serve-check meet each peer's defects without the peers installed.

    specforge_folder(drafter, out, ...)     SpecForge 0.2's SGLang export: the Llama config it was given
                                            (architectures LlamaForCausalLMEagle3, draft_vocab_size, no top-level
                                            layer ids; eagle_config's ids in SGLang's convention when it had them),
                                            `midlayer.*` weights, d2t + t2d always, everything in bf16
    speculators_folder(drafter, verifier, out, ...)
                                            speculators 0.9's format: our speculators export, then saved as its
                                            checkpointer does (bf16, the verifier's embedding copied in)

Each option plants one defect a user meets; the docstrings of the two functions say which.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftheads.models.export import export_eagle
from draftheads.models.layouts import llama_draft


def _write(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def specforge_folder(drafter, out: str | Path, dtype: torch.dtype = torch.bfloat16, eagle_config_ids: bool = True,
                     norm_output=None, drop: tuple[str, ...] = (), maps: bool = True) -> Path:
    """SpecForge's export of `drafter`. eagle_config_ids: the draft config named the capture layers (SGLang's
    convention, ours - 1) else nothing names them; norm_output: SpecForge's key (None: absent); drop: weights
    left out; maps=False: no d2t (only t2d)."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_draft.config(drafter),
              "draft_vocab_size": drafter.draft_vocab_size, "torch_dtype": str(dtype).removeprefix("torch.")}
    if eagle_config_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.layer_ids]}
    if norm_output is not None:
        config["norm_output"] = norm_output
    state = {k: v.detach() for k, v in drafter.state_dict().items()}  # d2t / t2d always, as SpecForge's buffers
    tensors = {}
    for name, tensor in state.items():
        if name in drop or (name == "d2t" and not maps):
            continue
        name = name.replace(llama_draft.LAYER, "midlayer.")
        tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return _write(Path(out), config, tensors)


def speculators_folder(drafter, verifier, out: str | Path, dtype: torch.dtype = torch.bfloat16,
                       drop_keys: tuple[str, ...] = (), set_keys: dict | None = None) -> Path:
    """speculators' checkpoint of `drafter`: every float in `dtype` (its checkpointer's bf16 by default, the copy
    of the verifier's embedding included); drop_keys / set_keys edit config.json's top level (an older or
    hand-written folder)."""
    out = Path(out)
    export_eagle(drafter, out, verifier, engine="speculators")
    from safetensors.torch import load_file

    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(out / "model.safetensors").items()}
    config = json.loads((out / "config.json").read_text())
    del config["draftheads"]
    for key in drop_keys:
        config.pop(key, None)
    config.update(set_keys or {})
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "model.safetensors").unlink()
    return _write(out, config, tensors)
