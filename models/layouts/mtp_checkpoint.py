"""A verifier checkpoint's own multi-token-prediction (MTP) layer, read and written under the checkpoint's names.

    weights = read_mtp_layer(folder)                        # MtpWeights: the family, the layer index, its tensors
    write_mtp_checkpoint(folder, out, tensors, metadata)    # the same checkpoint with new MTP tensors, in `out`

The families (FAMILIES; GLM-4.5 / 4.6 / 4.7, glm4_moe) ship their MTP layer the DeepSeek-V3 way, inside the
checkpoint as one more decoder layer: `model.layers.{L}.*` with L = config.json's num_hidden_layers (which counts
the verifier's layers only) and `num_nextn_predict_layers` such layers. Besides the ordinary decoder-layer weights
(self_attn.*, mlp.*, with MoE experts one tensor per expert: `mlp.experts.{e}.{gate,up,down}_proj.weight`,
input_layernorm, post_attention_layernorm) it holds `enorm` (on the token embedding), `hnorm` (on the previous
hidden state), `eh_proj` (2H -> H over [enorm(embedding); hnorm(hidden)]), `shared_head.norm`, and optionally its
own copies `shared_head.head` (the LM head) and `embed_tokens`.

What vLLM 0.32 builds from it (model_executor/models/glm4_moe_mtp.py, deepseek_mtp.py; the target checkpoint itself
is read, `speculative_config={"method": FAMILIES[t], "num_speculative_tokens": K}` with no separate model):
  - the MTP layer reads the target's final post-norm hidden state h_p and the embedding of token x_{p+1} at
    position p (zeroed where p == 0), runs the decoder layer with its own KV cache, adds the residual, and its
    logits are head(shared_head.norm(out)); draft k+1 reads out (not normed) with the embedding of draft k, one
    position later: the one layer is reused for every draft (spec_step_idx modulo num_nextn_predict_layers).
  - deepseek_mtp takes the LM head from the layer's `shared_head.head` (required); glm4_moe_mtp loads both the
    target's `lm_head.weight` and the layer's `shared_head.head` into the one head, whichever it reads last, so a
    GLM checkpoint whose two differ is refused here. The embedding is the layer's `embed_tokens` when it has one,
    else the target's.
  - glm4_moe: a GLM-4.5-shaped model needs at least one MoE layer (first_k_dense_replace <= num_hidden_layers)
    and a `head_dim` in config.json. deepseek_v3: the CPU build's MLA kernel needs kv_lora_rank + qk_rope_head_dim
    = 576.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: verifier model_type -> vLLM's speculative method for its shipped MTP layer: the families proven served exactly
#: (tests/e2e/interop/test_vllm_mtp.py). DeepSeek-V3 (deepseek_mtp) shares the layout and vLLM's CPU build serves
#: it, but its plain greedy decoding of a tiny DeepSeek-V3 differs from transformers', so it is not offered yet.
FAMILIES = {"glm4_moe": "glm4_moe_mtp"}
#: The MTP-only weights around the decoder block, under the layer's prefix.
MTP_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
#: Copies of the verifier's shared weights a layer may carry; read (what vLLM serves), never trained.
SHARED_COPIES = ("shared_head.head.weight", "embed_tokens.weight")
METADATA_FILE = "draftheads_mtp.json"
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class MtpCheckpointError(ValueError):
    """A checkpoint whose MTP layer cannot be read or written; the message names the file or key."""


@dataclass
class MtpWeights:
    """One checkpoint's MTP layer as stored."""

    folder: Path
    model_type: str
    """The verifier family (a FAMILIES key)."""
    layer_index: int
    """L: the layer's index in the checkpoint's names (`model.layers.{L}.`)."""
    tensors: dict[str, torch.Tensor]
    """Every tensor under the layer's prefix, by its name in the checkpoint (prefix included)."""
    files: dict[str, str] = field(default_factory=dict)
    """Tensor name -> the safetensors file (in `folder`) that holds it."""

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_index}."

    @property
    def method(self) -> str:
        """vLLM's speculative method that serves this layer."""
        return FAMILIES[self.model_type]

    def local(self) -> dict[str, torch.Tensor]:
        """The tensors by their name inside the layer (prefix stripped)."""
        return {k[len(self.prefix):]: v for k, v in self.tensors.items()}


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise MtpCheckpointError(f"{path}: no config.json; expected a Hugging Face model folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MtpCheckpointError(f"{path}: not JSON ({err})") from None


def _weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the shard index or the one model.safetensors."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise MtpCheckpointError(f"{index}: expected a safetensors index with a weight_map ({err})") from None
    single = folder / "model.safetensors"
    if not single.is_file():
        raise MtpCheckpointError(f"{folder}: no model.safetensors(.index.json); the MTP layer is read from "
                                 "safetensors weights only")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    except Exception as err:  # a truncated or foreign file: name it
        raise MtpCheckpointError(f"{single}: unreadable safetensors file ({err})") from None


def family_of(folder: str | os.PathLike) -> str:
    """The checkpoint's model_type if draftheads fine-tunes its MTP layer, else MtpCheckpointError (one line)."""
    folder = Path(folder)
    model_type = _config(folder).get("model_type")
    if model_type not in FAMILIES:
        raise MtpCheckpointError(
            f"{folder / 'config.json'}: model_type {model_type!r} has no MTP layer draftheads fine-tunes; expected "
            f"one of {', '.join(sorted(FAMILIES))} (vLLM methods {', '.join(FAMILIES[t] for t in sorted(FAMILIES))})")
    return model_type


def read_mtp_layer(folder: str | os.PathLike) -> MtpWeights:
    """The first MTP layer of the checkpoint in `folder`; MtpCheckpointError (one line, naming the file and what was
    expected) for a family without one here, a config without num_nextn_predict_layers, or weights without it."""
    from safetensors import safe_open

    folder = Path(folder)
    model_type = family_of(folder)
    config = _config(folder)
    n = config.get("num_nextn_predict_layers", config.get("num_mtp_layers"))
    if not isinstance(n, int) or n < 1:
        raise MtpCheckpointError(f"{folder / 'config.json'}: num_nextn_predict_layers is {n!r}; expected >= 1 (a "
                                 "checkpoint that ships its MTP layer says how many it has)")
    L = config.get("num_hidden_layers")
    if not isinstance(L, int) or L < 1:
        raise MtpCheckpointError(f"{folder / 'config.json'}: num_hidden_layers is {L!r}; expected a positive integer")
    prefix = f"model.layers.{L}."
    files = {k: f for k, f in _weight_files(folder).items() if k.startswith(prefix)}
    missing = [f"{prefix}{p}" for p in MTP_PARTS if f"{prefix}{p}" not in files]
    if missing:
        what = "no MTP weights" if not files else f"no {', '.join(missing)}"
        raise MtpCheckpointError(f"{folder}: {what} in its safetensors (config.json says num_nextn_predict_layers="
                                 f"{n}); expected the MTP layer as {prefix}{{{','.join(MTP_PARTS)}, decoder layer}}: "
                                 "was the checkpoint saved without it (e.g. by transformers, which drops it)?")
    tensors = {}
    for name in sorted(set(files.values())):
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                if key in files:
                    tensors[key] = f.get_tensor(key)
    return MtpWeights(folder, model_type, L, tensors, files)


def fuse_experts(local: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`experts.{e}.gate_proj.weight`, ...) as a module with fused experts holds
    them (`experts.gate_up_proj` (E, 2I, H): gate rows then up rows; `experts.down_proj` (E, H, I)); unchanged when
    `fused` is False (a transformers version that keeps one module per expert)."""
    if not fused:
        return dict(local)
    out, groups = {}, {}
    for key, value in local.items():
        m = _EXPERT.match(key)
        if m is None:
            out[key] = value
        else:
            groups.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["proj"]] = value
    for prefix, experts in groups.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[e]) != 3 for e in ids):
            raise MtpCheckpointError(f"{prefix}: experts {ids} do not each have gate_proj, up_proj and down_proj")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                     for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    return out


def split_experts(local: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_experts`: a module's tensors under the checkpoint's per-expert `names`."""
    out = {}
    for key, value in local.items():
        if key.endswith(".experts.gate_up_proj") and key not in names:
            prefix = key[: -len(".gate_up_proj")]
            for e, rows in enumerate(value):
                gate, up = rows.chunk(2, 0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif key.endswith(".experts.down_proj") and key not in names:
            prefix = key[: -len(".down_proj")]
            for e, m in enumerate(value):
                out[f"{prefix}.{e}.down_proj.weight"] = m
        else:
            out[key] = value
    return out


def _place(src: Path, dst: Path) -> None:
    """dst as a copy of src: a hard link when the file system allows (unchanged shards of a large checkpoint cost
    nothing), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_mtp_checkpoint(source: MtpWeights, out: str | os.PathLike, tensors: dict[str, torch.Tensor],
                         metadata: dict) -> Path:
    """The checkpoint `source` was read from, in a new folder `out` (replaced atomically), with `tensors` (full
    checkpoint names, exactly the names the layer had) in place of its MTP layer, in the dtype each had there.

    Every other file is the source's, byte for byte (hard-linked where possible); only the safetensors file(s)
    holding the MTP layer are rewritten. `metadata` goes to draftheads_mtp.json (vLLM and transformers ignore it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from draftheads.models.atomic import atomic_dir

    if set(tensors) != set(source.tensors):
        extra, missing = sorted(set(tensors) - set(source.tensors)), sorted(set(source.tensors) - set(tensors))
        raise MtpCheckpointError(f"MTP weights for {source.folder} differ from its layer's names: "
                                 f"{len(missing)} missing ({', '.join(missing[:3])}), {len(extra)} extra "
                                 f"({', '.join(extra[:3])})")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(source.tensors[name].shape):
            raise MtpCheckpointError(f"{name}: shape {tuple(value.shape)}, the checkpoint's is "
                                     f"{tuple(source.tensors[name].shape)}")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise MtpCheckpointError(f"refusing to write {out}: {name} holds non-finite values (the training "
                                     "diverged: lower train.lr)")
    rewrite = set(source.files.values())
    with atomic_dir(out) as tmp:
        for path in sorted(source.folder.iterdir()):
            if path.name == METADATA_FILE or not path.is_file():
                continue
            if path.name not in rewrite:
                _place(path, tmp / path.name)
                continue
            with safe_open(str(path), framework="pt") as f:
                stored = {k: f.get_tensor(k) for k in f.keys()}
                file_metadata = f.metadata() or {"format": "pt"}
            for name in stored:
                if name in tensors:
                    stored[name] = tensors[name].detach().to("cpu", stored[name].dtype).contiguous()
            save_file(stored, str(tmp / path.name), metadata=file_metadata)
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    return Path(out)
