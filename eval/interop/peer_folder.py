"""Import an EAGLE-3 drafter folder from another trainer: say what vLLM would read differently from how it was
trained, and write a fixed copy that vLLM and our engine read as trained.

    draftheads import-peer --verifier V --draft D [--layer-ids 1,2,3] [--fix OUT] [--dtype float32]

Which folders, and what each says about how it was trained:
  draftheads   our exports: the `draftheads` block records the layer ids, the options and the layout;
  speculators  the speculators library's format (0.9): `speculators_config`, `transformer_layer_config`, its
               top-level layer ids (vLLM's convention), its norm flags with *its* defaults (norm_before_residual
               false, where vLLM reads a missing one as true), the verifier's embedding saved beside the weights
               (bf16 by default, so no longer equal to the verifier's: vLLM then keeps it as the drafter's own);
  specforge    SpecForge 0.2's SGLang export (`midlayer.*` weights, no speculators_config): it writes no top-level
               layer ids (vLLM's V2 runner then takes its default), always writes d2t / t2d (vLLM refuses a d2t with
               the whole vocabulary) and saves bf16; its capture layers are eagle_config's ids + 1 (SGLang counts
               layer outputs) or, without them, the inputs of layers 2, L//2, L-3; its `norm_output` means "lm_head
               reads the final norm" (true, the default, is plain EAGLE-3), not vLLM's EAGLE 3.1 option;
  eagle3       any other vLLM-layout EAGLE-3 folder: taken as its config.json says.
`--layer-ids` overrides the trained layer ids (our convention: the inputs of those verifier layers, vLLM's top-level
ids) when the folder does not record them (a SpecForge run given `aux_hidden_state_layer_ids`).

Without --fix it prints one line per finding (the key, what vLLM reads, how it was trained, the fix) and exits 1
when there is one. With --fix OUT it writes OUT in our vLLM layout (models/export.py, with a `draftheads` block
recording the import and its fixes), which `draftheads serve-check` then proves in real vLLM. A finding with no fix
(weights the file lacks, an option no draftheads drafter computes) refuses the fix, naming it.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftheads.eval.interop.vllm_reading import (
    NORM_FLAGS,
    Reading,
    Unreadable,
    is_speculators,
    layer_config,
    vllm_reading,
)
from draftheads.models.export import DrafterFormatError, export_eagle, load_eagle
from draftheads.models.layouts.folder import METADATA_KEY, read_drafter

KINDS = ("draftheads", "speculators", "specforge", "eagle3")


class PeerFolderError(ValueError):
    """A folder that cannot be imported or fixed; the message names the file, key or flag."""


@dataclass
class Finding:
    """One thing vLLM reads differently from how the drafter was trained."""

    key: str
    vllm: str
    trained: str
    fix: str | None
    """What --fix does about it; None: it cannot be fixed."""

    def line(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix else "; cannot be fixed"
        return f"{self.key}: vLLM reads {self.vllm}, trained as {self.trained}{fix}"


@dataclass
class Inspection:
    """A folder read twice: as vLLM builds it (`served`) and as it was trained (`trained`), and how they differ."""

    folder: Path
    kind: str
    served: Reading
    trained: Reading
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loader_error: str | None = None
    """draftheads' own loader's refusal of a draftheads folder (config.json no longer what the record says)."""


def folder_kind(config: dict, tensors: dict) -> str:
    if isinstance(config.get(METADATA_KEY), dict):
        return "draftheads"
    if is_speculators(config):
        return "speculators"
    if any(k.startswith("midlayer.") for k in tensors):
        return "specforge"
    return "eagle3"


def is_eagle3(config: dict) -> bool:
    """Whether vLLM would serve this folder as an EAGLE-3 drafter."""
    if is_speculators(config):
        return config.get("speculators_model_type") == "eagle3"
    meta = config.get(METADATA_KEY)
    if isinstance(meta, dict):
        return meta.get("method") == "eagle3"
    arch = " ".join(config.get("architectures") or [])
    return "Eagle3" in arch or "draft_vocab_size" in config


def inspect(folder: str | Path, verifier, layer_ids: list[int] | None = None, parallel: bool | None = None
            ) -> Inspection:
    """Read an EAGLE-3 folder as vLLM does and as it was trained; `layer_ids` overrides the trained ids."""
    folder = Path(folder)
    try:
        config, tensors = read_drafter(folder)
    except DrafterFormatError as err:
        raise PeerFolderError(str(err)) from None
    if not is_eagle3(config):
        raise PeerFolderError(f"{folder / 'config.json'}: not an EAGLE-3 drafter (architectures "
                           f"{config.get('architectures')}, speculators_model_type "
                           f"{config.get('speculators_model_type')})")
    kind = folder_kind(config, tensors)
    meta = config.get(METADATA_KEY) or {}
    if parallel is None:
        parallel = bool((meta.get("eagle") or {}).get("parallel"))
    served = vllm_reading(config, tensors, verifier, parallel=parallel)
    inspection = Inspection(folder, kind, served, copy.copy(served))
    inspection.trained.refused = None
    TRAINED[kind](inspection, config, tensors, verifier)
    trained = inspection.trained
    if layer_ids is not None:
        trained.layer_ids, trained.layer_ids_from = sorted(layer_ids), "--layer-ids"
    if "d2t" not in tensors and "t2d" in tensors and trained.d2t is not None:  # the trained map is t2d's
        kept = torch.nonzero(tensors["t2d"].bool()).flatten()
        if kept.numel() == trained.d2t.numel():
            trained.d2t = kept - torch.arange(kept.numel())
    full_vocab_map(trained, verifier.vocab_size)
    inspection.findings = compare(served, trained) + inspection.findings
    floats = sorted({str(v.dtype).removeprefix("torch.") for v in tensors.values() if v.is_floating_point()})
    if len(floats) > 1:
        inspection.notes.append(f"weights mix {' and '.join(floats)}: vLLM casts each to the serving dtype; a fixed "
                                "folder holds them in one dtype (--dtype)")
    elif floats and floats[0] != "float32":
        inspection.notes.append(f"weights stored in {floats[0]}: every engine reads these rounded weights")
    return inspection


# ---- how each kind of folder was trained --------------------------------------------------------------------------
def _trained_draftheads(ins: Inspection, config: dict, tensors: dict, verifier) -> None:
    meta = config[METADATA_KEY]
    eagle = meta.get("eagle") or {}
    t = ins.trained
    t.layer_ids, t.layer_ids_from = list(meta.get("layer_ids") or []), "the draftheads block's layer_ids"
    for name in NORM_FLAGS:
        setattr(t, name, bool(eagle.get(name, False)))
    t.sliding_window = eagle.get("sliding_window")
    t.own_embedding = False
    try:  # our own loader compares config.json with the record field by field
        load_eagle(ins.folder, verifier, check_fingerprint=False)
    except (DrafterFormatError, ValueError) as err:
        ins.loader_error = str(err)


def _trained_speculators(ins: Inspection, config: dict, tensors: dict, verifier) -> None:
    t = ins.trained
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    L = verifier.num_layers
    if ids:
        t.layer_ids, t.layer_ids_from = sorted(ids), "speculators' eagle_aux_hidden_state_layer_ids"
    else:
        t.layer_ids, t.layer_ids_from = [2, L // 2, L - 3], "speculators' default (2, L//2, L-3)"
    # speculators' own defaults (models/eagle3/config.py), which its trainer used
    t.norm_before_residual = bool(config.get("norm_before_residual", False))
    for name in ("norm_before_fc", "fc_norm", "norm_output"):
        setattr(t, name, bool(config.get(name, False)))
    t.own_embedding = bool(config.get("embed_requires_grad", False))
    if t.sliding_window is not None and config.get("speculators_model_type") == "eagle3":
        ins.notes.append(f"sliding_window {t.sliding_window}: speculators' EAGLE-3 trainer windows draft step k from "
                         "the stream position t, vLLM (and draftheads) from the step's own position t+k, so steps "
                         "after the first were trained seeing up to k more prefix tokens than they are served")
    verifier_path = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if verifier_path and not Path(str(verifier_path)).exists():
        ins.notes.append(f"speculators_config names verifier {verifier_path!r}, which is not here: "
                         "`vllm serve` on this folder would load that one")


def _trained_specforge(ins: Inspection, config: dict, tensors: dict, verifier) -> None:
    t = ins.trained
    listed = (layer_config(config).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = verifier.num_layers
    if listed:  # SGLang's convention: the layer whose output is the feature, our id - 1
        t.layer_ids, t.layer_ids_from = sorted(i + 1 for i in listed), "eagle_config's ids + 1 (SGLang convention)"
    else:
        t.layer_ids, t.layer_ids_from = [2, L // 2, L - 3], "SpecForge's default capture (outputs of 1, L//2-1, L-4)"
    t.norm_before_residual = False  # SpecForge's layer has no such option (the residual is the un-normed input)
    t.norm_before_fc = False
    t.fc_norm = bool(config.get("fc_norm", False))
    t.norm_output = False  # its norm_output is "lm_head reads the final norm": plain EAGLE-3 when true
    if config.get("norm_output") is False:
        ins.findings.append(Finding("norm_output", "false (EAGLE 3.1's option off: lm_head reads the final norm)",
                                    "false in SpecForge's sense: lm_head read the un-normed hidden", None))
    t.own_embedding = False  # SpecForge freezes the verifier's embedding and exports none


def _trained_eagle3(ins: Inspection, config: dict, tensors: dict, verifier) -> None:
    ins.notes.append("no record of how it was trained: taken as its config.json says (pass --layer-ids if the "
                     "feature layers were others)")


TRAINED = {"draftheads": _trained_draftheads, "speculators": _trained_speculators,
           "specforge": _trained_specforge, "eagle3": _trained_eagle3}


def full_vocab_map(reading: Reading, vocab_size: int) -> None:
    """A trained map over the whole vocabulary is a permutation of it: renumber lm_head's rows so draft id = target
    id, and drop the map (what vLLM needs: no d2t with the whole vocabulary)."""
    if reading.d2t is None or reading.d2t.numel() != vocab_size:
        return
    targets = torch.arange(vocab_size) + reading.d2t
    if sorted(targets.tolist()) != list(range(vocab_size)):
        raise PeerFolderError("d2t over the whole vocabulary is not a permutation of it")
    weights = dict(reading.weights)
    if "lm_head.weight" in weights:
        head = torch.empty_like(weights["lm_head.weight"])
        head[targets] = weights["lm_head.weight"]
        weights["lm_head.weight"] = head
    reading.weights, reading.d2t = weights, None


def compare(served: Reading, trained: Reading) -> list[Finding]:
    out = []
    if served.refused:
        out.append(Finding("d2t" if "d2t" in served.refused else "config.json", f"nothing: it refuses the folder "
                           f"({served.refused})", "a drafter it could serve",
                           "drop d2t / t2d (the whole vocabulary needs no map)" if "d2t" in served.refused else None))
    if served.layer_ids != trained.layer_ids:
        out.append(Finding("eagle_aux_hidden_state_layer_ids", f"{served.layer_ids} ({served.layer_ids_from})",
                           f"{trained.layer_ids} ({trained.layer_ids_from})",
                           "write the trained ids at the top level (vLLM's V2 runner reads only those)"))
    if not served.refused:
        s, t = served.d2t, trained.d2t
        if (s is None) != (t is None) or (s is not None and not torch.equal(s, t)):
            out.append(Finding("d2t", "no d2t: draft id i as target id i" if s is not None and not s.any()
                               else "another draft vocabulary map", "the map in the file's d2t / t2d",
                               "write d2t"))
    for name in NORM_FLAGS:
        if getattr(served, name) != getattr(trained, name):
            out.append(Finding(name, str(getattr(served, name)).lower(), str(getattr(trained, name)).lower(),
                               f"write {name}: {str(getattr(trained, name)).lower()}"))
    if served.sliding_window != trained.sliding_window:
        out.append(Finding("sliding_window", f"{served.sliding_window or 'none (full attention)'}",
                           f"{trained.sliding_window or 'none (full attention)'}",
                           "write layer_types and sliding_window as trained"))
    if served.own_embedding and not trained.own_embedding:
        out.append(Finding("embed_tokens.weight", "the file's copy of the verifier's embedding as the drafter's own "
                           "(it is not equal to the verifier's, e.g. rounded to bf16)",
                           "the verifier's embedding", "leave it out (vLLM then shares the verifier's)"))
    if served.dropped and not trained.norm_before_fc:
        out.append(Finding(", ".join(served.dropped), "nothing: it drops the weight (norm_before_fc is false)",
                           "a norm the drafter applied before fc (its config.json does not say norm_before_fc)",
                           None))
    if served.uninitialised:
        out.append(Finding(", ".join(served.uninitialised[:3]), "weights the file lacks, left at their initial "
                           "values", "trained weights", None))
    return out


def findings(ins: Inspection) -> list[Finding]:
    """All findings, with our own loader's refusal of a draftheads folder (its config.json edited after export:
    the loader compares every field an engine reads with what the record's drafter writes)."""
    out = list(ins.findings)
    if ins.loader_error:
        out.append(Finding("config.json", f"a config.json that draftheads' loader refuses ({ins.loader_error})",
                           "what the draftheads block records", "rewrite config.json from the record"))
    return out


# ---- the fix -------------------------------------------------------------------------------------------------------
def fix(ins: Inspection, out: str | Path, verifier, dtype: torch.dtype = torch.float32) -> Path:
    """Write the drafter as trained into `out`, in our vLLM layout; PeerFolderError when a finding cannot be fixed."""
    blocked = [f for f in findings(ins) if f.fix is None]
    if blocked:
        raise PeerFolderError(f"{ins.folder}: cannot fix {blocked[0].key}: {blocked[0].line()}")
    try:
        drafter = ins.trained.drafter(verifier, dtype)
    except Unreadable as err:
        raise PeerFolderError(f"{ins.folder}: cannot fix: {err}") from None
    training = {"imported": {"from": str(ins.folder.resolve()), "kind": ins.kind,
                             "fixes": [f.line() for f in findings(ins)], "notes": ins.notes}}
    return export_eagle(drafter, out, verifier, training=training)


# ---- the command ---------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftheads import-peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", required=True, help="the verifier the drafter was trained for (a folder or name)")
    p.add_argument("--draft", required=True, help="the drafter folder (SpecForge, speculators, draftheads, vLLM)")
    p.add_argument("--layer-ids", help="the trained feature layers, comma-separated (inputs of those layers, "
                   "vLLM's top-level convention), when the folder does not record them")
    p.add_argument("--fix", metavar="OUT", help="write a folder vLLM and draftheads read as trained")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the fixed folder's dtype")
    p.add_argument("--retarget", action="store_true", help="take a draftheads drafter recorded for another verifier "
                   "(same shapes) as one for --verifier; without it, such a folder is refused")
    return p


def check_trained_for(folder: str | Path, verifier, retarget: bool = False) -> None:
    """A draftheads folder records the verifier it was trained for: another verifier (another fingerprint or other
    files) is refused, naming both, unless `retarget` (the user says the drafter is meant for this one). Other
    trainers' folders record no fingerprint to compare."""
    from draftheads.models.layouts.folder import read_config
    from draftheads.models.verifier import VerifierError, check_drafter_matches

    try:
        block = read_config(folder).get(METADATA_KEY)
    except DrafterFormatError as err:
        raise PeerFolderError(str(err)) from None
    if not (isinstance(block, dict) and isinstance(block.get("verifier"), dict)) or retarget:
        return
    try:
        check_drafter_matches(block["verifier"], verifier, folder)
    except VerifierError as err:
        stored = block["verifier"]
        raise PeerFolderError(
            f"--draft {folder}: trained for verifier {stored.get('name')!r} (fingerprint {stored.get('fingerprint')}), "
            f"not --verifier {verifier.name!r} (fingerprint {verifier.describe()['fingerprint']}): "
            f"{str(err).split(': ', 1)[-1] if 'fingerprint' not in str(err) else 'other weights'}; pass the verifier it "
            "was trained for, or --retarget if it is meant for this one") from None


def parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise PeerFolderError(f"--layer-ids {text}: expected comma-separated layer ids, e.g. 1,2,3") from None
    if len(ids) != 3 or len(set(ids)) != 3:
        raise PeerFolderError(f"--layer-ids {text}: expected three distinct layer ids")
    return ids


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from draftheads.models.outputs import OutputInTheWay, claim_output
    from draftheads.models.verifier import Verifier, VerifierError

    try:
        ids = parse_layer_ids(args.layer_ids)
        if not Path(args.draft).is_dir():
            raise PeerFolderError(f"--draft {args.draft}: no such folder")
        if args.fix:  # before anything loads: the fixed folder replaces OUT whole
            claim_output(args.fix, "drafter", "--fix")
        verifier = Verifier.from_pretrained(args.verifier, dtype=torch.float32)
        if ids is not None:
            verifier.check_layer_ids(ids, key="--layer-ids")
        check_trained_for(args.draft, verifier, args.retarget)
        ins = inspect(args.draft, verifier, ids)
        print(f"== {ins.folder} ({ins.kind} folder)")
        print(f"   vLLM reads layer ids {ins.served.layer_ids} ({ins.served.layer_ids_from}); trained with "
              f"{ins.trained.layer_ids} ({ins.trained.layer_ids_from})")
        for note in ins.notes:
            print(f"   note: {note}")
        found = findings(ins)
        for finding in found:
            print(f"   FINDING {finding.line()}")
        if not args.fix:
            print(f"{len(found)} finding(s)" + ("; --fix OUT writes a folder read as trained" if found else
                                                 ": vLLM reads it as trained"))
            return 1 if found else 0
        out = fix(ins, args.fix, verifier, getattr(torch, args.dtype))
        print(f"wrote {out}: {len(found)} fix(es); check it in vLLM with `draftheads serve-check --verifier "
              f"{args.verifier} --draft {out}`")
        return 0
    except (PeerFolderError, VerifierError, OutputInTheWay) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
