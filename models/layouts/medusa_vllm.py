"""Medusa heads in the layout vLLM's Medusa loader reads (checked against vLLM's
`transformers_utils/configs/medusa.py` and `model_executor/models/medusa.py`); our engine reads the same folder.

    config.json         architectures ["MedusaModel"], model_type "medusa", hidden_size, vocab_size, num_heads,
                        num_hidden_layers (ResBlocks per head), medusa_fc_bias, torch_dtype, and our `draftheads`
                        block (method, verifier describe() incl. fingerprint, tree, rank accuracies, training summary)
    model.safetensors   blocks.{h}.layers.{l}.weight (+ .bias), lm_heads.{h}.weight   (H x H and V x H)
                        shared_lm_head: lm_head.weight once (V x H) and `original_lm_head: true` in config.json
    adapter/            Medusa-2 only: peft's adapter_config.json + adapter_model.safetensors

Notes from vLLM's source: its ResBlock linears default to bias=False when `medusa_fc_bias` is absent, so we always
write it; its lm_heads have no bias; `MedusaConfig.from_pretrained` renames any top-level key containing "num" and
"heads" to `num_heads` (and "num" + "layers" to `num_hidden_layers`), so config.json must hold no other such key
(ours are nested inside `draftheads`); it ignores unknown weight names and strips a `medusa_heads.` prefix; it
drafts only the top-1 chain (no tree), so the tree is for our engine. `MedusaHeads`' module names are vLLM's
checkpoint names, so the tensors are its state dict as it is. With `original_lm_head` vLLM builds one `lm_head`
that every head uses and reads it from `lm_head.weight` (or `lm_heads.0.weight`) in the drafter's own file, not from
the verifier; `load_medusa` reads either name too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from draftheads.models.dtypes import dtype_name
from draftheads.models.layouts.folder import DrafterFormatError

NAME = "vllm"
ADAPTER_DIR = "adapter"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
SHARED_HEAD = "lm_head.weight"
REQUIRED_CONFIG_FIELDS = ("architectures", "model_type", "hidden_size", "vocab_size", "num_heads",
                          "num_hidden_layers", "medusa_fc_bias")


def config(heads) -> dict:
    """The engine-facing config.json fields of `MedusaHeads` (the caller adds the `draftheads` block)."""
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "medusa_fc_bias": heads.bias,
        "torch_dtype": dtype_name(heads.dtype),
        **({"original_lm_head": True} if heads.shared_lm_head else {}),
    }


def tensors(heads) -> dict[str, torch.Tensor]:
    """The file's tensors: the heads' state dict, and the shared lm_head in the heads' dtype."""
    out = heads.state_dict()
    if heads.shared_lm_head:
        out[SHARED_HEAD] = heads.head_weight(0).detach().to(heads.dtype)
    return out


def tensor_shapes(heads) -> dict[str, tuple[int, ...]]:
    """What `tensors(heads)` gives, by shape: for checking a file against heads built bare."""
    shapes = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    if heads.shared_lm_head:
        shapes[SHARED_HEAD] = (heads.vocab_size, heads.hidden_size)
    return shapes


def check_config(config: dict, where) -> dict:
    """The heads' shape from a config.json: {hidden_size, vocab_size, num_heads, num_layers, bias, shared_lm_head};
    refuses a folder vLLM's loader would not read as Medusa heads."""
    for key in REQUIRED_CONFIG_FIELDS:
        if key not in config:
            raise DrafterFormatError(f"{where}: missing field {key!r} (vLLM's Medusa loader needs it)")
    if "MedusaModel" not in config["architectures"] or config["model_type"] != "medusa":
        raise DrafterFormatError(f"{where}: architectures={config['architectures']}, model_type="
                                 f"{config['model_type']!r}; expected ['MedusaModel'] and 'medusa'")
    shared = config.get("original_lm_head", False)
    if not isinstance(shared, bool):
        raise DrafterFormatError(f"{where}: original_lm_head={shared!r}; expected true or false")
    if shared and config["num_hidden_layers"] < 1:
        raise DrafterFormatError(f"{where}: original_lm_head with num_hidden_layers={config['num_hidden_layers']}: "
                                 "every head would be the same; expected num_hidden_layers >= 1")
    return {"hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
            "num_heads": config["num_heads"], "num_layers": config["num_hidden_layers"],
            "bias": bool(config["medusa_fc_bias"]), "shared_lm_head": shared}


def adapter_files(peft_model) -> dict[str, bytes]:
    """Medusa-2's adapter in peft's own format (adapter_config.json + adapter_model.safetensors), as the extra files
    of the drafter folder."""
    with tempfile.TemporaryDirectory(prefix="medusa-adapter-") as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
        return {f"{ADAPTER_DIR}/{name}": (Path(tmp) / name).read_bytes() for name in ADAPTER_FILES}
