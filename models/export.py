"""The one export / load entry point for drafter folders: the trainers write through it, the engine, the train/serve
check and the scripts read through it.

    save_medusa(folder, heads, verifier, tree=..., training_summary=...)     Medusa-1/2 (vLLM's layout)
    heads, meta = load_medusa(folder, verifier)
    verifier = load_medusa_verifier(folder, verifier)                        Medusa-2: the adapter merged in
    export_eagle(drafter, folder, verifier, training=..., engine="vllm")    EAGLE-1/3: vllm | sglang | speculators
    drafter = load_eagle(folder, verifier)
    check_eagle_engine(cfg, engine)                                          at config time, before any training
    export_dflash(drafter, folder, verifier, training=..., engine="vllm")   DFlash: vllm (= sglang) | speculators;
                                                                             DSpark (markov_rank): vllm | speculators
    drafter = load_dflash(folder, verifier)
    check_dflash_engine(cfg, engine)                                         at config time, before any training
    check_dflash_verifier(engine, verifier)                                  once the verifier is read
    export_mtp(drafter, folder, verifier, training=...)                      a verifier's own MTP layer, fine-tuned:
                                                                             the whole checkpoint (`<family>_mtp`)

A folder is `config.json` (the engine's fields plus our `draftheads` block: method, verifier name + fingerprint,
layer ids, the engine layout, training summary) and `model.safetensors`, written atomically. Which fields and
names each engine reads is in models/layouts/ (one module per flavour); this module picks the layout, adds the
metadata (which records the layout, `engine`), and on load rebuilds the drafter from the metadata, checks the
file against what that drafter would write in that layout, and refuses a drafter trained for another verifier,
naming the field. A drafter that an engine would read differently from how it was trained is refused before
anything is written (`check_eagle_engine`, `check_dflash_engine`; trainers call them when they parse their config).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import torch

from draftheads.models.eagle import Eagle1Drafter, Eagle3Drafter, EagleConfig, EagleDrafter, EagleError
from draftheads.models.layouts import (
    dflash_speculators,
    dflash_vllm,
    dspark_speculators,
    dspark_vllm,
    eagle_sglang,
    eagle_speculators,
    eagle_vllm,
    llama_draft,
    medusa_vllm,
)
from draftheads.models.layouts.folder import (
    CONFIG_NAME,
    METADATA_KEY,
    WEIGHTS_NAME,
    DrafterFormatError,
    metadata_block,
    read_drafter,
    read_metadata,
    require_keys,
    write_drafter,
)
from draftheads.models.medusa import MedusaHeads, as_rows, check_tree, lora_model
from draftheads.models.verifier import Verifier, VerifierError, check_drafter_matches

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "DrafterFormatError", "ENGINES", "DFLASH_ENGINES", "check_dflash_engine",
           "check_dflash_verifier", "export_dflash", "export_eagle", "load_dflash", "load_eagle", "load_medusa",
           "load_medusa_verifier", "read_drafter", "read_metadata", "save_medusa", "export_mtp"]

EAGLE_LAYOUTS = {layout.NAME: layout for layout in (eagle_vllm, eagle_sglang, eagle_speculators)}
ENGINES = tuple(EAGLE_LAYOUTS)
DFLASH_LAYOUTS = {"vllm": dflash_vllm, "sglang": dflash_vllm, "speculators": dflash_speculators}
"""SGLang reads z-lab's layout as vLLM does (models/layouts/dflash_vllm.py), so engine sglang writes that folder."""
DFLASH_ENGINES = tuple(DFLASH_LAYOUTS)
DSPARK_LAYOUTS = {"vllm": dspark_vllm, "speculators": dspark_speculators}
"""DSpark (a DFlash drafter with `markov_rank`): vLLM's Qwen3DSparkModel and speculators' dspark format; SGLang's
reading of DSpark is not checked here, so engine sglang is refused for it."""
MEDUSA = "medusa"


# ---- Medusa --------------------------------------------------------------------------------------------------------
def save_medusa(folder: str | os.PathLike, heads: MedusaHeads, verifier: Verifier,
                tree: Sequence[Sequence[int]] | None = None, training_summary: dict | None = None,
                rank_accuracy=None) -> Path:
    """Export heads (and, when the verifier carries LoRA adapters, the adapter) as a vLLM-loadable drafter folder.

    tree: the static tree (`build_medusa_tree`); rank_accuracy (K, R): what it was built from, kept so the
    engine can rebuild a tree for another budget; training_summary: any JSON-able dict (steps, losses, accuracy).
    Returns the folder.
    """
    if (heads.hidden_size, heads.vocab_size) != (verifier.hidden_size, verifier.vocab_size):
        raise VerifierError(
            f"heads are for hidden_size={heads.hidden_size}, vocab_size={heads.vocab_size}, but verifier "
            f"{verifier.name!r} has hidden_size={verifier.hidden_size}, vocab_size={verifier.vocab_size}")
    paths = check_tree(tree, heads.num_heads) if tree is not None else None
    if rank_accuracy is not None:
        rank_accuracy = as_rows(rank_accuracy)
    adapter = lora_model(verifier)
    config = {
        **medusa_vllm.config(heads),
        "draftheads": metadata_block(
            MEDUSA, verifier, engine=medusa_vllm.NAME,
            num_heads=heads.num_heads, num_layers=heads.num_layers, bias=heads.bias,
            adapter=medusa_vllm.ADAPTER_DIR if adapter is not None else None,
            tree=[list(p) for p in paths] if paths is not None else None,
            rank_accuracy=rank_accuracy,
            training=training_summary or {},
        ),
    }
    extra = medusa_vllm.adapter_files(adapter) if adapter is not None else None
    return write_drafter(folder, config, medusa_vllm.tensors(heads), extra)


def load_medusa(folder: str | os.PathLike, verifier: Verifier | None = None,
                device: str | torch.device | None = None) -> tuple[MedusaHeads, dict]:
    """Read a drafter folder back: (heads, the `draftheads` metadata with `tree` as a list of tuples or None).

    Weights come back bit-exactly in their stored dtype (on `device`, else the verifier's, else CPU). With a
    verifier, a drafter trained for another one (fingerprint, hidden size, layers, vocab) is refused by name.
    """
    folder = Path(folder)
    config, tensors = read_drafter(folder, expect_method=MEDUSA)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    shape = medusa_vllm.check_config(config, config_path)
    meta = read_metadata(config, config_path)
    if verifier is not None:
        check_drafter_matches(meta.get("verifier", {}), verifier, folder)
        for key in ("hidden_size", "vocab_size"):
            if config[key] != getattr(verifier, key):
                raise VerifierError(f"drafter {str(folder)!r} has {key}={config[key]}, but verifier "
                                    f"{verifier.name!r} has {key}={getattr(verifier, key)}")
    if shape["shared_lm_head"] and medusa_vllm.SHARED_HEAD not in tensors and "lm_heads.0.weight" in tensors:
        tensors[medusa_vllm.SHARED_HEAD] = tensors.pop("lm_heads.0.weight")  # vLLM reads either name
    # the heads' dtype from their own tensors (a shared head may be stored in another)
    dtype = next((t.dtype for k, t in sorted(tensors.items()) if k != medusa_vllm.SHARED_HEAD), torch.float32)
    heads = MedusaHeads(shape["hidden_size"], shape["vocab_size"], shape["num_heads"], shape["num_layers"],
                        shape["bias"], dtype=dtype, shared_lm_head=shape["shared_lm_head"])
    require_keys(tensors, medusa_vllm.tensor_shapes(heads), str(weights_path))
    shared = tensors.pop(medusa_vllm.SHARED_HEAD) if heads.shared_lm_head else None
    heads.load_state_dict(tensors, strict=True)
    heads.shared_head = shared  # the file's, as vLLM serves it
    target = device if device is not None else (verifier.device if verifier is not None else None)
    if target is not None:
        heads = heads.to(target)
        heads.place_shared_head(target)
    meta = dict(meta)
    try:
        meta["tree"] = check_tree(meta["tree"], heads.num_heads) if meta.get("tree") is not None else None
    except (ValueError, TypeError) as err:
        raise DrafterFormatError(f"{config_path}: bad `draftheads.tree`: {err}") from None
    return heads, meta


def load_medusa_verifier(folder: str | os.PathLike, verifier: Verifier, merge: bool = True) -> Verifier:
    """The verifier a Medusa drafter was trained with: for Medusa-2, `verifier` plus the stored LoRA adapter.

    Modifies `verifier` in place and returns it: with merge=True the adapter is folded into the linear weights
    (plain forward speed); with merge=False `verifier.model` becomes the peft model. The fingerprint stays the base
    verifier's, the one the drafter records. A Medusa-1 drafter (no adapter) returns `verifier` unchanged.
    """
    from peft import PeftModel

    folder = Path(folder)
    config, _ = read_drafter(folder, expect_method=MEDUSA)
    meta = read_metadata(config, folder / CONFIG_NAME)
    check_drafter_matches(meta.get("verifier", {}), verifier, folder)
    if not meta.get("adapter"):
        return verifier
    if lora_model(verifier) is not None:
        raise VerifierError(f"verifier {verifier.name!r} already carries LoRA adapters; pass the base verifier")
    adapter_dir = folder / meta["adapter"]
    for name in medusa_vllm.ADAPTER_FILES:
        if not (adapter_dir / name).is_file():
            raise DrafterFormatError(f"drafter {str(folder)!r} is Medusa-2 but has no {meta['adapter']}/{name}")
    try:
        peft_model = PeftModel.from_pretrained(verifier.model, str(adapter_dir), is_trainable=False)
    except Exception as err:  # wrong shapes or module names: say which folder
        raise DrafterFormatError(f"{adapter_dir}: cannot load the LoRA adapter onto verifier {verifier.name!r} "
                                 f"({type(err).__name__}: {err})") from None
    verifier.model = peft_model.merge_and_unload() if merge else peft_model
    verifier.model.eval().requires_grad_(False)
    verifier.name = f"{verifier.name}+{meta['adapter']}"
    return verifier


# ---- EAGLE ---------------------------------------------------------------------------------------------------------
def _eagle_layout(engine: str):
    if engine not in EAGLE_LAYOUTS:
        raise EagleError(f"engine={engine!r}: expected one of {', '.join(ENGINES)}")
    return EAGLE_LAYOUTS[engine]


def check_eagle_engine(cfg: EagleConfig, engine: str, qkv_bias: bool | None = None) -> EagleConfig:
    """Settle what `engine` decides among the settings left unset, then refuse what it would read differently from
    how the drafter trains (an EagleError naming the key and the engine). Returns `cfg`, changed in place."""
    layout = _eagle_layout(engine)
    layout.resolve(cfg)
    layout.check(cfg, qkv_bias)
    return cfg


def export_eagle(drafter: EagleDrafter, folder: str | os.PathLike, verifier, training: dict | None = None,
                 engine: str = "vllm", num_speculative_tokens: int = 3) -> Path:
    """Write the drafter for an inference engine (atomically) in that engine's layout (models/layouts/).
    `num_speculative_tokens` goes into the speculators format (what `vllm serve DRAFTER_DIR` drafts per step)."""
    layout = _eagle_layout(engine)
    layout.check(drafter.cfg, qkv_bias=drafter.layer.self_attn.q_proj.bias is not None)
    method = f"eagle{drafter.version}"
    eagle = dataclasses.asdict(drafter.cfg)
    if getattr(drafter, "parallel", False):
        eagle["mask_token_id"] = drafter.mask_token_id  # resolved, so a reader needs no verifier config to know it
    meta = metadata_block(method, verifier, layer_ids=drafter.feature_layers, engine=engine, eagle=eagle,
                          training=training or {})
    config = {**layout.config(drafter, verifier, num_speculative_tokens), "draftheads": meta}
    return write_drafter(folder, config, layout.tensors(drafter))


def _read_record(config: dict, folder: Path, verifier, section: str, layouts: dict, check_fingerprint: bool):
    """(the `draftheads` block, its engine) of an export's config.json: the block must have a `verifier` section
    that matches `verifier` and a method `section`, and name one of `layouts`' engines."""
    where = str(folder / CONFIG_NAME)
    meta = read_metadata(config, where)
    if not isinstance(meta.get("verifier"), dict) or not isinstance(meta.get(section), dict):
        raise DrafterFormatError(f"{where}: the draftheads block has no `verifier` / `{section}` section")
    check_drafter_matches(meta["verifier"], verifier, folder, check_fingerprint=check_fingerprint)
    engine = meta.get("engine", "vllm")
    if engine not in layouts:
        raise DrafterFormatError(f"{where}: draftheads.engine is {engine!r}, expected one of {tuple(layouts)}")
    return meta, engine


def _one_dtype(tensors: dict[str, torch.Tensor], where: str) -> torch.dtype:
    """The one floating-point dtype of an export's weights (a mix is refused)."""
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    if len(floats) != 1:
        raise DrafterFormatError(f"{where}: weights mix dtypes {sorted(map(str, floats))}; expected one")
    return floats.pop()


def load_eagle(folder: str | os.PathLike, verifier, check_fingerprint: bool = True) -> EagleDrafter:
    """Read a drafter written by `export_eagle` back exactly, for `verifier` (refused if it is another one)."""
    folder = Path(folder)
    config, tensors = read_drafter(folder, expect_method=("eagle1", "eagle3"))
    where = str(folder / CONFIG_NAME)
    weights = folder / WEIGHTS_NAME
    meta, engine = _read_record(config, folder, verifier, "eagle", EAGLE_LAYOUTS, check_fingerprint)
    layout = EAGLE_LAYOUTS[engine]
    try:
        cfg = EagleConfig(**meta["eagle"])
    except (TypeError, EagleError) as err:
        raise DrafterFormatError(f"{where}: draftheads.eagle is not a valid EAGLE config ({err})") from None
    if f"eagle{cfg.version}" != meta.get("method"):
        raise DrafterFormatError(f"{where}: method {meta.get('method')!r} but eagle.version {cfg.version}")

    dtype = _one_dtype(tensors, where)
    pruned = False
    if cfg.version == 1:
        drafter = Eagle1Drafter(verifier, cfg)
    else:
        pruned = config.get("draft_vocab_size") != verifier.vocab_size  # else no maps: the whole vocabulary
        for key, kind in (("d2t", torch.long), ("t2d", torch.bool)) if pruned else ():
            if key not in tensors or tensors[key].dtype != kind:
                raise DrafterFormatError(f"{weights}: `{key}` missing or not {kind} (draft_vocab_size "
                                         f"{config.get('draft_vocab_size')} < the verifier's {verifier.vocab_size})")
        if pruned and tensors["t2d"].numel() != verifier.vocab_size:
            raise DrafterFormatError(f"{where}: t2d has {tensors['t2d'].numel()} entries, the verifier's vocab "
                                     f"{verifier.vocab_size}")
        try:
            drafter = Eagle3Drafter(verifier, cfg, d2t=tensors["d2t"] if pruned else None,
                                    t2d=tensors["t2d"] if pruned else None)
        except EagleError as err:
            raise DrafterFormatError(f"{weights}: {err}") from None
    drafter = drafter.to(dtype=dtype)
    mine = layout.config(drafter, verifier, num_speculative_tokens=1)
    for key in layout.CHECKED_FIELDS:
        if key in mine and config.get(key) != mine[key]:
            raise DrafterFormatError(f"{where}: {key} is {config.get(key)!r}; this verifier's drafter has {mine[key]!r}")
    section = getattr(layout, "LAYER_SECTION", None)  # the sliding window, present or absent, as the engine reads it
    theirs, ours = (config.get(section) or {}, mine[section]) if section else (config, mine)
    for key in llama_draft.WINDOW_FIELDS:
        if theirs.get(key) != ours.get(key):
            raise DrafterFormatError(f"{where}: {key} is {theirs.get(key)!r}, but draftheads.eagle.sliding_window is "
                                     f"{cfg.sliding_window!r} (expected {ours.get(key)!r})")
    fill_eagle(drafter, tensors, engine, weights)
    return drafter.to(device=verifier.device)


def fill_eagle(drafter: EagleDrafter, tensors: dict[str, torch.Tensor], engine: str = "vllm",
               where: str | os.PathLike = WEIGHTS_NAME) -> EagleDrafter:
    """Load a file's tensors, in `engine`'s layout and the drafter's dtype, into `drafter` (built for them): the keys,
    shapes and dtypes must be exactly what the drafter would write, and placeholders the engines need but the
    drafter lacks must be zero. Errors (DrafterFormatError) name `where` and the key."""
    layout = _eagle_layout(engine)
    expected = layout.tensors(drafter)
    require_keys(tensors, {k: tuple(v.shape) for k, v in expected.items()}, str(where))
    for key, ref in expected.items():
        if tensors[key].dtype != ref.dtype:
            raise DrafterFormatError(f"{where}: weight {key!r} is {tensors[key].dtype}, expected {ref.dtype}")
    embedding = tensors.get(eagle_speculators.EMBEDDING)
    if embedding is not None and not torch.equal(embedding, drafter.token_embedding.detach().to(embedding.device,
                                                                                                embedding.dtype)):
        raise DrafterFormatError(f"{where}: {eagle_speculators.EMBEDDING!r} is not the verifier's token embedding; "
                                 "this drafter embeds tokens its own way, which the engines would serve but "
                                 "draftheads does not train or decode")
    # Back to module names; placeholders the engines need but the drafter lacks must be zero.
    state = layout.state_dict(tensors)
    if drafter.version == 3 and drafter.full_vocab:  # no maps in the file: the drafter's are the identity
        state.update({k: v for k, v in drafter.state_dict().items() if k in ("d2t", "t2d")})
    own = drafter.state_dict()
    for key in sorted(set(state) - set(own)):
        if state[key].count_nonzero():
            raise DrafterFormatError(f"{where}: {key!r} is non-zero, but this drafter has no such parameter (it is "
                                     "written as a zero placeholder for the engines)")
        del state[key]
    drafter.load_state_dict(state, strict=True)
    return drafter


# ---- DFlash --------------------------------------------------------------------------------------------------------
def _dflash_layout(engine: str, cfg=None):
    """The layout module for `engine`; a DSpark config (`markov_rank`) gets its DSpark layout."""
    from draftheads.models.dflash import DFlashError

    if engine not in DFLASH_LAYOUTS:
        raise DFlashError(f"engine={engine!r}: expected one of {', '.join(DFLASH_ENGINES)}")
    if cfg is not None and cfg.dspark:
        if engine not in DSPARK_LAYOUTS:
            raise DFlashError(f"dflash.markov_rank={cfg.markov_rank} (DSpark) with engine {engine}: how {engine} "
                              f"reads a DSpark drafter is not checked here; export for engine "
                              f"{' or '.join(DSPARK_LAYOUTS)}")
        return DSPARK_LAYOUTS[engine]
    return DFLASH_LAYOUTS[engine]


def check_dflash_engine(cfg, engine: str):
    """Refuse a DFlashConfig that `engine` would read differently from how the drafter trains (a DFlashError naming
    the key and the engine). Returns `cfg`."""
    layout = _dflash_layout(engine, cfg)
    layout.resolve(cfg)
    layout.check(cfg)
    _check_sglang_own_head(cfg, engine)
    return cfg


def _check_sglang_own_head(cfg, engine: str) -> None:
    from draftheads.models.dflash import DFlashError

    if engine == "sglang" and cfg.variant != "dflash":
        raise DFlashError(f"dflash.variant={cfg.variant} with engine sglang: how SGLang reads a DFlash2 drafter (its "
                          "convolutions and candidate selector) is not checked here (vLLM's reading is); export for "
                          "engine vllm")
    if engine == "sglang" and cfg.draft_vocab_size is not None:
        raise DFlashError(f"dflash.draft_vocab_size={cfg.draft_vocab_size} with engine sglang: how SGLang reads a "
                          "DFlash drafter's own lm_head is not checked here (vLLM's reading is); export for engine "
                          "vllm, or set dflash.draft_vocab_size=null")


#: Verifier model types whose SGLang 0.5.23 class has no DFlash capture hook (`set_dflash_layers_to_capture`): its
#: server refuses to start DFLASH with them. Checked with SGLang's own code: qwen2 (tests/e2e/interop/test_sglang.py).
SGLANG_NO_DFLASH_CAPTURE = ("qwen2",)


def check_dflash_verifier(engine: str, verifier) -> None:
    """Refuse a verifier the engine cannot serve a DFlash drafter of (a DFlashError naming the engine and the
    verifier's model type); the trainer asks as soon as the verifier is loaded, before any step."""
    from draftheads.models.dflash import DFlashError

    model_type = getattr(verifier.config, "model_type", None)
    if engine == "sglang" and model_type in SGLANG_NO_DFLASH_CAPTURE:
        raise DFlashError(f"engine sglang with a {model_type} verifier: SGLang 0.5.23 has no DFlash capture of a "
                          f"{model_type} target's layers and refuses to start; export for engine vllm or speculators")


def export_dflash(drafter, folder: str | os.PathLike, verifier, training: dict | None = None, engine: str = "vllm",
                  num_speculative_tokens: int | None = None) -> Path:
    """Write a DFlash drafter (`draftheads.models.dflash.DFlashDrafter`) for an inference engine, atomically, in
    that engine's layout (models/layouts/dflash_*.py). `num_speculative_tokens` goes into the speculators format
    (what `vllm serve DRAFTER_DIR` drafts per step; default block_size - 1)."""
    layout = _dflash_layout(engine, drafter.cfg)
    layout.check(drafter.cfg)
    _check_sglang_own_head(drafter.cfg, engine)
    check_dflash_verifier(engine, verifier)
    cfg = drafter.cfg.to_dict()
    meta = metadata_block("dflash", verifier, layer_ids=list(drafter.cfg.target_layer_ids), engine=engine,
                          dflash=cfg, training=training or {})
    config = {**layout.config(drafter, verifier, num_speculative_tokens), "draftheads": meta}
    return write_drafter(folder, config, layout.tensors(drafter))


def load_dflash(folder: str | os.PathLike, verifier, check_fingerprint: bool = True):
    """Read a drafter written by `export_dflash` back exactly, for `verifier` (refused if it is another one): the
    drafter is rebuilt from the `draftheads` block, every field the engine reads is compared with what that drafter
    writes, and the weights must be exactly its keys, shapes and one dtype."""
    from draftheads.models.dflash import DFlashConfig, DFlashError
    from draftheads.models.dflash2 import drafter_class

    folder = Path(folder)
    config, tensors = read_drafter(folder, expect_method="dflash")
    where, weights = str(folder / CONFIG_NAME), folder / WEIGHTS_NAME
    meta, engine = _read_record(config, folder, verifier, "dflash", DFLASH_LAYOUTS, check_fingerprint)
    try:
        cfg = DFlashConfig.from_dict(meta["dflash"], where=f"{where}: draftheads.dflash")
        layout = _dflash_layout(engine, cfg)
        drafter = drafter_class(cfg)(cfg, verifier)
    except DFlashError as err:
        raise DrafterFormatError(f"{where}: draftheads.dflash is not a DFlash drafter for this verifier ({err})") \
            from None
    drafter = drafter.to(dtype=_one_dtype(tensors, where))
    mine = layout.config(drafter, verifier)
    for key in layout.CHECKED_FIELDS:
        if key in mine and config.get(key) != mine[key]:
            raise DrafterFormatError(f"{where}: {key} is {config.get(key)!r}; the drafter its draftheads block "
                                     f"describes has {mine[key]!r}")
    expected = layout.tensors(drafter)
    require_keys(tensors, {k: tuple(v.shape) for k, v in expected.items()}, str(weights))
    for key, ref in expected.items():
        if tensors[key].dtype != ref.dtype:
            raise DrafterFormatError(f"{weights}: weight {key!r} is {tensors[key].dtype}, expected {ref.dtype}")
    try:
        state = layout.state_dict(tensors)
    except DFlashError as err:
        raise DrafterFormatError(f"{weights}: {err}") from None
    drafter.load_state_dict(state, strict=True)
    return drafter.to(device=verifier.device)


def export_mtp(drafter, folder: str | os.PathLike, verifier, training: dict | None = None) -> Path:
    """Write the checkpoint an `MtpDrafter` was read from, with its (fine-tuned) MTP layer under the checkpoint's own
    names, into `folder` (models/layouts/mtp_checkpoint.py): vLLM serves it as the target model with
    `speculative_config={"method": "<family>_mtp", "num_speculative_tokens": K}`. The `draftheads` block goes to
    draftheads_mtp.json beside the weights (the verifier it was trained on: the source checkpoint)."""
    from draftheads.models.layouts.mtp_checkpoint import FAMILIES, read_mtp_layer, write_mtp_checkpoint

    source = read_mtp_layer(drafter.folder)
    meta = metadata_block("mtp", verifier, vllm_method=FAMILIES[drafter.model_type], mtp_layer=drafter.layer_index,
                          mtp=drafter.cfg.to_dict(), training=training or {})
    return write_mtp_checkpoint(source, folder, drafter.checkpoint_tensors(), {METADATA_KEY: meta})
