"""How vLLM reads an EAGLE-3 drafter folder, in draftheads' terms, and a drafter of ours that computes what vLLM
builds from it, so our engine can decode any folder (ours or another trainer's) the way vLLM serves it.

    reading = vllm_reading(config, tensors, verifier)      # a Reading: what vLLM builds from the folder
    drafter = reading.drafter(verifier, dtype)              # an Eagle3Drafter computing the same (or Unreadable)

The facts, read from vLLM 0.32 (.venv-vllm):
  - model_executor/models/llama_eagle3.py: the layer from config.json's Llama fields (num_hidden_layers layers,
    attention_bias on q/k/v); `norm_before_residual` (false when absent), `norm_before_fc` (eagle_config's, else the
    top level's; one RMS norm over all the features, weight `input_norm.weight`), `fc_norm`, `norm_output` (top
    level, false when absent); `draft_vocab_size` (the verifier's vocabulary when absent). With a draft vocabulary
    as large as the verifier's there is no `draft_id_to_target_id`, and a `d2t` in the file fails the load; with a
    smaller one a missing `d2t` leaves the map at zero (draft id i read as target id i). `t2d` is skipped.
    `midlayer.*` is read as `layers.0.*`; a weight the file lacks keeps its initial value (no missing-weight check).
  - v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (Model Runner V2, the runner EAGLE takes): the feature layers
    are the top-level `eagle_aux_hidden_state_layer_ids`, else eagle_config's `layer_ids`, else the model's default
    (2, L//2, L-3); model_executor/models/interfaces.py sorts and deduplicates them, and fc reads the features
    concatenated in that order. fc's width is `num_aux_hidden_states`, else the length of eagle_config's ids, else
    3 features.
  - v1/worker/gpu/spec_decode/eagle/utils.py: an `embed_tokens` / `lm_head` in the file is the drafter's own
    unless it equals the verifier's (after the cast to the serving dtype); without one the verifier's is shared.
  - transformers_utils/configs/speculators/: a speculators-format folder is read from `transformer_layer_config` plus
    the top-level fields, and there a missing `norm_before_residual` reads as *true*.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from draftheads.models.eagle import Eagle3Drafter, EagleConfig, EagleError
from draftheads.models.export import DrafterFormatError, fill_eagle
from draftheads.models.layouts import llama_draft
from draftheads.models.verifier import VerifierError

NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
#: The layer fields vLLM builds the drafter's layer from; ours is the verifier's layer, so they must agree.
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "rope_theta", "mlp_bias")
MIDLAYER = "midlayer."


class Unreadable(ValueError):
    """vLLM builds something from this folder that no draftheads drafter computes; the message says what."""


@dataclass
class Reading:
    """An EAGLE-3 drafter as one reader builds it from a folder (vLLM, or what the folder says it was trained as)."""

    layer_ids: list[int]
    """Verifier layers whose inputs feed fc, in the order fc reads them (our convention: HF hidden_states[i])."""
    layer_ids_from: str
    """Where the ids come from (a config key, a default)."""
    d2t: torch.Tensor | None
    """int64 [Vd]: target id - draft id, as the reader maps draft ids; None: the whole vocabulary, no map."""
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    attention_bias: bool = False
    fc_features: int = 3
    """How many features fc takes (its width / the verifier's hidden size)."""
    num_layers: int = 1
    """Decoder layers built (EAGLE-3 has one)."""
    layer: dict = field(default_factory=dict)
    """The Llama fields the layer is built from (LAYER_FIELDS)."""
    own_embedding: bool = False
    """True: the drafter embeds tokens with its own table (not the verifier's)."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """The tensors the reader loads, under our module names (layers.0.*, fc.*, norm.*, lm_head.*, fc_norm.*)."""
    uninitialised: list[str] = field(default_factory=list)
    """Weights the reader builds but the file lacks (vLLM leaves them at their initial values)."""
    dropped: list[str] = field(default_factory=list)
    """Weights in the file the reader skips without a word."""
    refused: str | None = None
    """Why the reader refuses the folder (vLLM fails the load), else None."""
    parallel: bool = False
    """Parallel drafting (P-EAGLE): served with `parallel_drafting: true`, `mask_hidden` read."""
    mask_token_id: int | None = None
    sliding_window: int | None = None
    """The layer's sliding window (layer_types[0] "sliding_attention" with `sliding_window`); None: full attention."""

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.d2t is None else self.d2t.numel()

    def drafter(self, verifier, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
        """Our drafter computing what this reading builds, in `dtype` (vLLM casts every weight to the serving dtype);
        Unreadable when no draftheads drafter does."""
        if self.refused:
            raise Unreadable(f"it is refused ({self.refused})")
        reasons = self.unsupported(verifier)
        if reasons:
            raise Unreadable(reasons[0])
        flags = {name: getattr(self, name) for name in NORM_FLAGS if name in EAGLE_FIELDS}
        cfg = EagleConfig(version=3, layer_ids=list(self.layer_ids), draft_vocab_size=None,
                          qkv_bias=self.attention_bias, init_from_verifier=False, parallel=self.parallel,
                          mask_token_id=self.mask_token_id if self.parallel else None,
                          sliding_window=self.sliding_window, **flags)
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.weights.items()}
        d2t, t2d = None, None
        if self.d2t is not None and self.d2t.numel() < verifier.vocab_size:
            rows = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else None
            if rows is not None and rows != self.d2t.numel():  # never drop (or invent) trained lm_head rows
                raise Unreadable(f"d2t maps {self.d2t.numel()} draft ids but lm_head.weight has {rows} rows: the "
                                 "draft vocabulary is not what was trained (a fix would drop or invent rows)")
            d2t, t2d, order = monotone_maps(self.d2t, verifier.vocab_size)
            weights["lm_head.weight"] = weights["lm_head.weight"][order]
            weights.update(d2t=d2t, t2d=t2d)
        try:
            drafter = Eagle3Drafter(verifier, cfg, d2t=d2t, t2d=t2d).to(dtype=dtype)
            fill_eagle(drafter, weights, "vllm", "the folder's weights as read")
        except (EagleError, DrafterFormatError, VerifierError) as err:
            raise Unreadable(str(err)) from None
        return drafter.to(device=verifier.device)

    def unsupported(self, verifier) -> list[str]:
        """What this reading builds that no draftheads drafter computes (empty: `drafter` can build it)."""
        out = []
        if self.num_layers != 1:
            out.append(f"num_hidden_layers is {self.num_layers}; a draftheads EAGLE-3 drafter has one layer")
        if self.fc_features != len(self.layer_ids) or len(set(self.layer_ids)) != 3:
            out.append(f"fc takes {self.fc_features} features and vLLM captures layers {self.layer_ids}; a "
                       "draftheads EAGLE-3 drafter reads three distinct layers")
        for name in NORM_FLAGS:
            if getattr(self, name) and name not in EAGLE_FIELDS:
                out.append(f"{name} is true; draftheads drafters have no {name} option")
        if self.own_embedding:
            out.append("embed_tokens.weight is the drafter's own token embedding (not the verifier's); draftheads "
                       "drafters embed with the verifier's")
        if self.uninitialised:
            out.append(f"the file lacks {', '.join(self.uninitialised[:3])}: vLLM leaves them at their initial "
                       "(unset) values")
        mine = llama_layer_fields(verifier)
        for key in LAYER_FIELDS:
            if key in self.layer and self.layer[key] != mine[key]:
                out.append(f"{key} is {self.layer[key]!r}; the verifier's layer (what draftheads drafts with) has "
                           f"{mine[key]!r}")
        if "lm_head.weight" not in self.weights:
            out.append("no lm_head.weight: vLLM shares the verifier's, which draftheads EAGLE-3 drafters do not")
        return out


EAGLE_FIELDS = {f.name for f in fields(EagleConfig)}
"""The drafter options draftheads has (a norm flag outside it is a reading no drafter of ours computes)."""


def llama_layer_fields(verifier) -> dict:
    """LAYER_FIELDS of the drafter layer draftheads builds for `verifier` (llama_draft.config's values)."""
    probe = Eagle3Drafter(verifier, EagleConfig(version=3, draft_vocab_size=None, init_from_verifier=False))
    fields_ = llama_draft.config(probe)
    return {**{k: fields_.get(k) for k in LAYER_FIELDS}, "rope_theta": rope_theta(fields_)}


def rope_theta(config: dict) -> float | None:
    """RoPE's base, from `rope_parameters` (transformers 5) or the top-level `rope_theta`; vLLM reads either."""
    params = config.get("rope_parameters") or {}
    value = params.get("rope_theta", config.get("rope_theta"))
    return None if value is None else float(value)


def monotone_maps(d2t: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d2t, t2d, order) with draft ids renumbered in increasing target-id order (what draftheads' maps need);
    `order` permutes lm_head's rows to match. The renumbering changes no drafted token. Unreadable when two draft
    ids map to one target id or a target id is out of range."""
    targets = torch.arange(d2t.numel()) + d2t.long()
    if targets.min() < 0 or targets.max() >= vocab_size:
        raise Unreadable(f"d2t maps a draft id to target id {int(targets.max() if targets.max() >= vocab_size else targets.min())}, "
                         f"outside the verifier's vocabulary of {vocab_size}")
    if targets.unique().numel() != targets.numel():
        raise Unreadable("d2t maps two draft ids to one target id")
    order = torch.argsort(targets)
    ordered = targets[order]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ordered] = True
    return (ordered - torch.arange(ordered.numel())).long(), t2d, order


# ---- vLLM's reading ------------------------------------------------------------------------------------------------
def is_speculators(config: dict) -> bool:
    return config.get("speculators_config") is not None


def layer_config(config: dict) -> dict:
    """The config vLLM builds the layer from: a speculators folder's `transformer_layer_config`, else config.json."""
    if is_speculators(config):
        layer = config.get("transformer_layer_config")
        return layer if isinstance(layer, dict) else {}
    return config


def layer_fields(layer: dict) -> dict:
    """LAYER_FIELDS as vLLM reads them (head_dim defaults to hidden_size // num_attention_heads)."""
    out = {k: layer[k] for k in LAYER_FIELDS if k in layer}
    if "head_dim" not in out and "hidden_size" in layer and layer.get("num_attention_heads"):
        out["head_dim"] = layer["hidden_size"] // layer["num_attention_heads"]
    theta = rope_theta(layer)
    if theta is not None:
        out["rope_theta"] = theta
    out.setdefault("mlp_bias", False)
    return out


def vllm_flags(config: dict) -> dict:
    """The norm flags as vLLM reads them."""
    eagle_config = layer_config(config).get("eagle_config") or {}
    if is_speculators(config):  # speculators/algos.py: update_eagle3
        return {"norm_before_residual": bool(config.get("norm_before_residual", True)),
                "norm_before_fc": bool(config.get("norm_before_fc", False)),
                "fc_norm": bool(config.get("fc_norm", False)), "norm_output": bool(config.get("norm_output", False))}
    return {"norm_before_residual": bool(config.get("norm_before_residual", False)),
            "norm_before_fc": bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc", False))),
            "fc_norm": bool(config.get("fc_norm", False)), "norm_output": bool(config.get("norm_output", False))}


def vllm_layer_ids(config: dict, num_layers: int) -> tuple[list[int], str]:
    """(the feature layers in the order fc reads them, where vLLM took them)."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = layer_config(config).get("eagle_config") or {}
    if top:
        ids, source = list(top), "config.json eagle_aux_hidden_state_layer_ids"
    elif eagle_config.get("layer_ids"):
        ids, source = list(eagle_config["layer_ids"]), "config.json eagle_config.layer_ids"
    else:
        ids = [2, num_layers // 2, num_layers - 3]
        source = f"vLLM's default (2, L//2, L-3) for L={num_layers}: no top-level eagle_aux_hidden_state_layer_ids"
    return sorted(set(int(i) for i in ids)), source


def vllm_reading(config: dict, tensors: dict[str, torch.Tensor], verifier, parallel: bool = False) -> Reading:
    """What vLLM 0.32 builds from an EAGLE-3 folder (config.json + its tensors) served beside `verifier`
    (`parallel`: with `parallel_drafting: true`, which reads `mask_hidden` and the top-level `mask_token_id`)."""
    layer = layer_config(config)
    eagle_config = layer.get("eagle_config") or {}
    flags = vllm_flags(config)
    V = verifier.vocab_size
    ids, source = vllm_layer_ids(config, verifier.num_layers)
    listed = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    fc_features = int(layer.get("num_aux_hidden_states") or (len(listed) if listed else 3))
    draft_vocab = config.get("draft_vocab_size") if is_speculators(config) else layer.get("draft_vocab_size")
    draft_vocab = int(draft_vocab or layer.get("vocab_size") or V)
    reading = Reading(layer_ids=ids, layer_ids_from=source, d2t=None, fc_features=fc_features,
                      num_layers=int(layer.get("num_hidden_layers", 1)), layer=layer_fields(layer),
                      attention_bias=bool(layer.get("attention_bias", False)), parallel=parallel,
                      mask_token_id=config.get("mask_token_id") if parallel else None, **flags)
    if (layer.get("layer_types") or [None])[0] == "sliding_attention":  # llama.py: the draft layer is index 0
        reading.sliding_window = layer.get("sliding_window")
    if eagle_config.get("use_aux_hidden_state") is False:
        reading.refused = "eagle_config.use_aux_hidden_state is false: vLLM builds no fc"
    weights = {}
    for name, tensor in tensors.items():
        if name.endswith("t2d") or (name == "mask_hidden" and not parallel):
            continue  # vLLM skips t2d, and mask_hidden unless it drafts in parallel
        if name.endswith("d2t"):
            if draft_vocab == V:
                reading.refused = (f"d2t in a drafter whose draft vocabulary is the verifier's whole vocabulary "
                                   f"({V}): vLLM fails the load (\"There is no module or parameter named "
                                   "'draft_id_to_target_id'\")")
            reading.d2t = tensor.long()
            continue
        name = name.replace(MIDLAYER, llama_draft.LAYER)
        if name.startswith("input_norm.") and not flags["norm_before_fc"]:
            reading.dropped.append(name)  # vLLM drops it without a word
            continue
        weights[name] = tensor
    if draft_vocab < V and reading.d2t is None:  # vLLM's map stays zero: draft id i is target id i
        reading.d2t = torch.zeros(draft_vocab, dtype=torch.long)
    elif draft_vocab == V and reading.refused is None:
        reading.d2t = None  # no map: the whole vocabulary (a refused folder keeps its d2t, for the record)
    embedding = weights.pop("embed_tokens.weight", None)
    if embedding is not None:
        table = verifier.embed_tokens.weight.detach().cpu()
        reading.own_embedding = embedding.shape != table.shape or not torch.equal(
            embedding.to(table.dtype), table)
    reading.weights = weights
    reading.uninitialised = sorted(set(expected_weights(reading)) - set(weights))
    return reading


def expected_weights(reading: Reading) -> list[str]:
    """The weights vLLM's EAGLE-3 Llama drafter builds (and reads from the file) for this reading."""
    names = []
    for i in range(reading.num_layers):
        layer = f"layers.{i}."
        names += [f"{layer}self_attn.{p}.weight" for p in llama_draft.PROJECTIONS]
        names += [f"{layer}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        names += [f"{layer}{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")]
        if reading.attention_bias:  # vLLM's Llama attention: q/k/v *and* o_proj take `attention_bias`
            names += [f"{layer}self_attn.{p}.bias" for p in llama_draft.PROJECTIONS]
        if reading.layer.get("mlp_bias"):
            names += [f"{layer}mlp.{p}.bias" for p in ("gate_proj", "up_proj", "down_proj")]
    names += [f"{llama_draft.LAYER}hidden_norm.weight", "fc.weight", "norm.weight"]
    if reading.norm_before_fc:
        names.append("input_norm.weight")
    if reading.fc_norm:
        names += [f"fc_norm.{i}.weight" for i in range(reading.fc_features)]
    return names


# ---- DFlash --------------------------------------------------------------------------------------------------------
#: The Qwen3 layer fields vLLM's DFlash drafter is built from (model_executor/models/qwen3_dflash.py).
DFLASH_LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                       "attention_bias", "max_position_embeddings")


@dataclass
class DFlashReading:
    """A DFlash drafter as vLLM 0.32 builds it from a folder (or as the folder says it was trained).

    The facts (vLLM 0.32, .venv-vllm):
      - v1/worker/gpu/spec_decode/eagle/eagle3_utils.py: the verifier's aux hidden states are the top-level
        `eagle_aux_hidden_state_layer_ids` (layer inputs), else dflash_config.target_layer_ids + 1, else a top-level
        target_layer_ids + 1, else dflash_config's `layer_ids`; they are captured in layer order (interfaces.py
        `_maybe_add_hidden_state`), and fc is as wide as that list.
      - model_executor/models/qwen3_dflash.py: the layers from the Qwen3 fields (head_dim defaults to hidden /
        heads, a missing rope_theta to 1e6); a layer is causal when top-level `is_causal` or dflash_config.causal
        says so, else when layer_types marks it sliding_attention; sliding when layer_types says so (or
        dflash_config.use_swa), with dflash_config.swa_window_size else sliding_window; the mask token is
        dflash_config.mask_token_id else the top-level mask_token_id; `embed_tokens` / `lm_head` in the file are
        the drafter's own (else the verifier's are shared), a d2t maps a pruned draft vocabulary, t2d is skipped,
        `mask_hidden` fails an assertion, dflash_config.attention_sink_bias / attention_value_scale add weights
        and a scale, `is_neox_style: false` another rope.
      - transformers_utils/configs/speculators/algos.py (update_dflash): a speculators folder's
        `aux_hidden_state_layer_ids` become the top-level ids (and target_layer_ids = them - 1), its mask_token_id
        dflash_config's, and dflash_config.causal = not sliding_window_non_causal (default true): every layer.
    """

    target_layer_ids: list[int]
    """Verifier layers whose outputs feed fc, in fc's order (the reference's convention: inputs of id + 1)."""
    target_layer_ids_from: str
    mask_token_id: int | None
    layer: dict = field(default_factory=dict)
    """DFLASH_LAYER_FIELDS as read."""
    layer_types: list[str] = field(default_factory=list)
    """Per layer: full_attention (bidirectional), sliding_attention (causal, windowed), or what no draftheads
    drafter computes: causal_full, bidirectional_window."""
    sliding_window: int | None = None
    block_size: int | None = None
    draft_vocab_size: int | None = None
    d2t: torch.Tensor | None = None
    """The file's d2t (target id - draft id), which vLLM loads as draft_id_to_target_id for a pruned vocabulary."""
    own_embedding: bool = False
    own_lm_head: bool = False
    extras: list[str] = field(default_factory=list)
    """Options vLLM applies that no draftheads drafter has (sink bias, value scale, another rope style...)."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    uninitialised: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    refused: str | None = None

    def unsupported(self, verifier) -> list[str]:
        out = list(self.extras)
        if self.refused:
            out.insert(0, f"it is refused ({self.refused})")
        odd = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        if odd:
            out.append(f"layers read as {sorted(set(odd))}: draftheads DFlash layers are bidirectional (full) or "
                       "causal within a window (sliding)")
        if self.own_embedding:
            out.append("the file holds the drafter's own embed_tokens; draftheads DFlash drafters read the verifier's")
        pruned = self.draft_vocab_size is not None and self.draft_vocab_size != verifier.vocab_size
        head = self.weights.get("lm_head.weight")
        if pruned and not self.own_lm_head:
            out.append(f"draft_vocab_size {self.draft_vocab_size} with no lm_head of its own: vLLM would read the "
                       f"verifier's {verifier.vocab_size}-token lm_head as the draft vocabulary's")
        elif self.own_lm_head and head is not None and head.shape[0] != (self.draft_vocab_size or verifier.vocab_size):
            out.append(f"lm_head.weight has {head.shape[0]} rows but vLLM builds {self.draft_vocab_size} (config.json "
                       "draft_vocab_size, else the verifier's vocabulary)")
        elif pruned and self.d2t is None:
            out.append(f"draft_vocab_size {self.draft_vocab_size} without a d2t: vLLM maps draft id i to token i")
        if self.mask_token_id is None:
            out.append("no mask_token_id (dflash_config.mask_token_id or mask_token_id)")
        if self.uninitialised:
            out.append(f"the file lacks {', '.join(self.uninitialised[:3])}: vLLM leaves them at their initial "
                       "(unset) values")
        if self.layer.get("hidden_size") not in (None, verifier.hidden_size):
            out.append(f"hidden_size {self.layer['hidden_size']}: the verifier's is {verifier.hidden_size}")
        fc = self.weights.get("fc.weight")
        if fc is not None and fc.shape[1] != len(self.target_layer_ids) * verifier.hidden_size:
            out.append(f"fc.weight is {tuple(fc.shape)} but vLLM feeds it {len(self.target_layer_ids)} layers "
                       f"({self.target_layer_ids_from})")
        bad = [i for i in self.target_layer_ids if not 0 <= i <= verifier.num_layers - 2]
        if bad:
            out.append(f"target layers {bad}: outside 0..{verifier.num_layers - 2} (vLLM reads the last layer's "
                       "output before the final norm, which no draftheads drafter is trained on)")
        return out

    def config(self, verifier):
        """The DFlashConfig of the drafter this reading builds (unsupported readings: Unreadable)."""
        from draftheads.models.dflash import DFlashConfig, DFlashError

        reasons = self.unsupported(verifier)
        if reasons:
            raise Unreadable(reasons[0])
        layer = dict(self.layer)
        try:
            return DFlashConfig(
                num_hidden_layers=int(layer["num_hidden_layers"]), block_size=int(self.block_size or 16),
                target_layer_ids=list(self.target_layer_ids), mask_token_id=int(self.mask_token_id),
                hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
                num_attention_heads=layer["num_attention_heads"], num_key_value_heads=layer["num_key_value_heads"],
                head_dim=layer["head_dim"], rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer["rope_theta"],
                max_position_embeddings=layer["max_position_embeddings"], hidden_act=layer["hidden_act"],
                attention_bias=bool(layer["attention_bias"]), layer_types=list(self.layer_types),
                sliding_window=self.sliding_window, num_target_layers=verifier.num_layers,
                vocab_size=verifier.vocab_size,
                draft_vocab_size=(self.draft_vocab_size or verifier.vocab_size) if self.own_lm_head else None)
        except (DFlashError, KeyError, TypeError) as err:
            raise Unreadable(f"not a DFlash drafter draftheads builds ({err})") from None

    def drafter(self, verifier, dtype: torch.dtype = torch.float32):
        """Our drafter computing what this reading builds, in `dtype`; Unreadable when none does."""
        from draftheads.models.dflash import DFlashDrafter, DFlashError

        cfg = self.config(verifier)
        weights = {k: v.to(dtype) for k, v in self.weights.items()}
        maps = {}
        if self.own_lm_head and self.d2t is not None and cfg.draft_vocab_size < verifier.vocab_size:
            d2t, t2d, order = monotone_maps(self.d2t, verifier.vocab_size)  # as the EAGLE-3 reading does
            weights["lm_head.weight"] = weights["lm_head.weight"][order]
            maps = {"d2t": d2t, "t2d": t2d}
        try:
            drafter = DFlashDrafter(cfg, verifier, **maps).to(dtype=dtype)
            weights.update(maps)
            expected = drafter.state_dict()
            require_keys_like(weights, expected)
            drafter.load_state_dict(weights, strict=True)
        except (DFlashError, DrafterFormatError, RuntimeError) as err:
            raise Unreadable(str(err)) from None
        return drafter.to(device=verifier.device)


def require_keys_like(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    from draftheads.models.layouts.folder import require_keys

    require_keys(weights, {k: tuple(v.shape) for k, v in expected.items()}, "the folder's weights as read")


def is_dflash(config: dict) -> bool:
    arch = " ".join(config.get("architectures") or [])
    return ("DFlash" in arch or config.get("speculators_model_type") == "dflash"
            or isinstance(config.get("dflash_config"), dict) or is_dspark(config))


def is_dspark(config: dict) -> bool:
    """A DSpark folder (a DFlash drafter with a Markov head): vLLM's Qwen3DSparkModel or speculators' dspark."""
    arch = " ".join(config.get("architectures") or [])
    return "DSpark" in arch or config.get("speculators_model_type") == "dspark"


def dflash_pretrained(config: dict) -> dict:
    """The config vLLM builds the drafter from: a speculators folder converted as update_dflash does, else
    config.json itself."""
    if config.get("speculators_model_type") != "dflash":
        return config
    out = dict(config.get("transformer_layer_config") or {})
    out["architectures"] = ["DFlashDraftModel"]
    aux = config.get("aux_hidden_state_layer_ids") or []
    out["draft_vocab_size"] = config.get("draft_vocab_size")
    out["eagle_aux_hidden_state_layer_ids"] = aux
    out["dflash_config"] = {"mask_token_id": config.get("mask_token_id"), "target_layer_ids": [i - 1 for i in aux],
                            "causal": not config.get("sliding_window_non_causal", True)}
    out["block_size"] = config.get("block_size")
    return out


def dflash_layer_ids(config: dict) -> tuple[list[int], str]:
    """(target layer ids in fc's order, reference convention; where vLLM took them) from a pretrained config."""
    dflash_config = config.get("dflash_config") or {}
    if config.get("eagle_aux_hidden_state_layer_ids"):
        ids, source = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]], \
            "config.json eagle_aux_hidden_state_layer_ids (layer inputs), minus 1"
    elif dflash_config.get("target_layer_ids"):
        ids, source = list(dflash_config["target_layer_ids"]), "config.json dflash_config.target_layer_ids"
    elif config.get("target_layer_ids"):
        ids, source = list(config["target_layer_ids"]), "config.json target_layer_ids"
    elif dflash_config.get("layer_ids"):
        ids, source = [i - 1 for i in dflash_config["layer_ids"]], \
            "config.json dflash_config.layer_ids (layer inputs), minus 1"
    else:
        return [], "nowhere: vLLM captures no verifier layer for this folder"
    return sorted(set(int(i) for i in ids)), source


def dflash_reading(config: dict, tensors: dict[str, torch.Tensor], verifier) -> DFlashReading:
    """What vLLM 0.32 builds from a DFlash folder (config.json + its tensors) served beside `verifier`."""
    pre = dflash_pretrained(config)
    dflash_config = dict(pre.get("eagle_config") or {})
    dflash_config.update(pre.get("dflash_config") or {})
    ids, source = dflash_layer_ids(pre)
    layer = {k: pre.get(k) for k in DFLASH_LAYER_FIELDS}
    if layer["head_dim"] is None and pre.get("hidden_size") and pre.get("num_attention_heads"):
        layer["head_dim"] = pre["hidden_size"] // pre["num_attention_heads"]
    layer["rope_theta"] = rope_theta(pre) or 1e6  # vLLM: set_default_rope_theta(config, 1000000)
    layer["attention_bias"] = bool(pre.get("attention_bias", False))
    layer["num_key_value_heads"] = layer["num_key_value_heads"] or layer["num_attention_heads"]
    n = int(layer["num_hidden_layers"] or 0)
    types = pre.get("layer_types")
    use_swa = bool(dflash_config.get("use_swa", False))
    causal_override = pre.get("is_causal", dflash_config.get("causal"))
    window = dflash_config.get("swa_window_size", pre.get("sliding_window"))
    kinds = []
    for i in range(n):
        any_sliding = bool(types) and "sliding_attention" in types
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == "sliding_attention"
        causal = bool(causal_override) if causal_override is not None else bool(types) and \
            types[i] == "sliding_attention"
        kinds.append({(False, False): "full_attention", (True, True): "sliding_attention",
                      (False, True): "causal_full", (True, False): "bidirectional_window"}[(sliding, causal)])
    reading = DFlashReading(target_layer_ids=ids, target_layer_ids_from=source,
                            mask_token_id=dflash_config.get("mask_token_id", pre.get("mask_token_id")),
                            layer=layer, layer_types=kinds,
                            sliding_window=window if "sliding_attention" in kinds else None,
                            block_size=pre.get("block_size") or dflash_config.get("block_size"),
                            draft_vocab_size=pre.get("draft_vocab_size") or pre.get("vocab_size"))
    if dflash_config.get("use_aux_hidden_state") is False:
        reading.refused = "dflash_config.use_aux_hidden_state is false: vLLM builds no fc"
    for key, what in (("attention_sink_bias", "an attention sink bias"), ("attention_value_scale", "a value scale")):
        if dflash_config.get(key):
            reading.extras.append(f"dflash_config.{key} is set: vLLM adds {what}, which draftheads drafters lack")
    if pre.get("is_neox_style") is False:
        reading.extras.append("is_neox_style is false: vLLM rotates interleaved pairs, draftheads drafters halves")
    if float(pre.get("logit_scale", 1.0) or 1.0) != 1.0:
        reading.extras.append(f"logit_scale {pre['logit_scale']}: vLLM scales the draft logits")
    weights = {}
    for name, tensor in tensors.items():
        if name.endswith("t2d"):
            reading.dropped.append(name)
            continue
        if "mask_hidden" in name:
            reading.refused = "a mask_hidden weight: vLLM's DFlash loader asserts there is none"
            continue
        if name.endswith("d2t"):
            reading.draft_vocab_size, reading.d2t = tensor.numel(), tensor
            continue
        name = name.replace(MIDLAYER, "layers.0.").replace("encoder.output_norm_enc.", "hidden_norm.") \
            .replace("encoder.fc.", "fc.")
        if name.startswith("embed_tokens."):
            table = verifier.embed_tokens.weight.detach().cpu()
            reading.own_embedding = tensor.shape != table.shape or not torch.equal(tensor.to(table.dtype), table)
            continue
        if name.startswith("lm_head."):  # kept as the drafter's own when it differs from the verifier's (vLLM shares an
            head = verifier.lm_head.weight.detach().cpu()  # equal one)
            reading.own_lm_head = tensor.shape != head.shape or not torch.equal(tensor.to(head.dtype), head)
            if reading.own_lm_head:
                weights[name] = tensor
            continue
        weights[name] = tensor
    reading.weights = weights
    reading.uninitialised = sorted(set(dflash_expected_weights(reading)) - set(weights))
    return reading


def dflash_expected_weights(reading: DFlashReading) -> list[str]:
    """The weights vLLM's DFlashQwen3Model builds (and reads from the file) for this reading."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(int(reading.layer.get("num_hidden_layers") or 0)):
        layer = f"layers.{i}."
        names += [f"{layer}self_attn.{p}.weight" for p in llama_draft.PROJECTIONS]
        names += [f"{layer}self_attn.{n}.weight" for n in ("q_norm", "k_norm")]
        names += [f"{layer}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        names += [f"{layer}{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")]
        if reading.layer.get("attention_bias"):  # q/k/v and o_proj, as vLLM's DFlash attention builds them
            names += [f"{layer}self_attn.{p}.bias" for p in llama_draft.PROJECTIONS]
    return names
