"""Will my drafter work in vLLM as trained? Read it as vLLM reads it, load it there, decode a few prompts with it
and with our engine, and say.

    draftheads serve-check --verifier V --draft D [D ...] [--prompts humaneval] [--num-prompts 4]
        [--max-new-tokens 32] [-k 3] [--dtype float32] [--method eagle3|eagle|medusa|dflash]

Any folder, ours or another trainer's (vLLM's EAGLE-1 / EAGLE-3 / Medusa / DFlash layouts, the speculators format,
a SpecForge export, z-lab's DFlash checkpoints). For each it prints: what vLLM reads from config.json that disagrees with how the drafter was
trained (the folder's `draftheads` block, or the conventions of the trainer that wrote it: eval/interop/
peer_folder.py), naming the fields; loaded or refused (with vLLM's own message); per prompt, whether vLLM's greedy
output equals plain greedy decoding of the verifier, and whether the accepted draft tokens per verification step
equal our engine's; the accepted tokens per position, ours beside vLLM's (and, when the readings disagree, the
drafter as trained beside them); and a verdict line.

Our side decodes an EAGLE-3 folder *as vLLM reads it* (eval/interop/vllm_reading.py: its layer ids, draft vocabulary
map, norm flags, embedding), with the same k and vLLM's convention for the first token (from the prefill), so the
counts must be equal request by request: that proves our reading of vLLM's reading, and the comparison with the
training record then says whether vLLM serves the drafter as trained. A DFlash folder is read the same way
(vllm_reading.dflash_reading: the layers vLLM captures, the mask token, each layer's causality and window) and
compared with its `draftheads` block (a folder without one is taken as its config.json says); -k is vLLM's
num_speculative_tokens, the block less its first token, and our engine drafts the same block. EAGLE-1 and Medusa
folders are decoded
through our loader, which compares config.json with the record field by field. A folder no draftheads drafter can
decode as vLLM reads it is NOT JUDGED. Exit status: 0 when every drafter passes, 1 when one does not (or is not
judged), 2 for a usage error or when vLLM is not available (`bash scripts/setup_vllm.sh`).
`draftheads import-peer --fix OUT` writes a folder that vLLM reads as trained.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

METHODS = ("eagle3", "eagle", "medusa", "dflash")


class UsageError(ValueError):
    pass


@dataclass
class Report:
    """What serve-check found for one drafter."""

    draft: str
    method: str | None
    kind: str = "draftheads"
    """Who wrote the folder (peer_folder.KINDS), or "unknown"."""
    loaded: bool = False
    error: str | None = None
    findings: list[str] = field(default_factory=list)
    """What vLLM reads differently from how the drafter was trained, one line each (naming the field)."""
    unjudged: str | None = None
    """Why our engine cannot decode the folder as vLLM reads it (then nothing is compared)."""
    outputs_equal: list[bool] = field(default_factory=list)
    first_difference: list[int | None] = field(default_factory=list)
    accepted_ours: list[int] = field(default_factory=list)
    """Per position k: steps that accepted at least k draft tokens (draftheads, reading the folder as vLLM does)."""
    accepted_vllm: list[int] = field(default_factory=list)
    accepted_trained: list[int] = field(default_factory=list)
    """As accepted_ours for the drafter as trained, when the readings disagree."""
    steps_equal: list[bool] = field(default_factory=list)
    """Per prompt: whether the accepted counts per verification step are the same in both engines."""
    drafts: int = 0
    notes: list[str] = field(default_factory=list)
    not_run: str | None = None
    """Why the folder was not run in vLLM at all (a layout this machine's vLLM cannot serve, unreadable weights)."""

    @property
    def passed(self) -> bool:
        return (self.loaded and self.unjudged is None and not self.findings and all(self.outputs_equal)
                and len(self.steps_equal) > 0 and all(self.steps_equal))


@dataclass
class Subject:
    """A folder read for the check: how vLLM serves it, and our engine's decoders for it."""

    method: str
    """vLLM's speculative method."""
    kind: str
    served: object | None = None
    """What our engine decodes as vLLM reads the folder: a folder path or an EagleDrafter; None: unjudged."""
    trained: object | None = None
    """The drafter as trained, when vLLM reads it otherwise."""
    findings: list[str] = field(default_factory=list)
    unjudged: str | None = None
    options: dict = field(default_factory=dict)
    serve_drafter: bool = False
    notes: list[str] = field(default_factory=list)
    not_here: str | None = None
    """Why vLLM cannot serve this folder on this machine (said before vLLM starts; nothing is run in it)."""


def detect_method(folder: Path) -> tuple[str | None, bool]:
    """(vLLM method or None for a speculators folder, whether it is a speculators folder) from config.json."""
    from draftheads.models.layouts.folder import DrafterFormatError, read_config

    path = folder / "config.json"
    try:
        config = read_config(folder)
    except DrafterFormatError as err:
        raise UsageError(f"--draft {folder}: {err}") from None
    from draftheads.eval.interop.vllm_reading import is_dflash

    if is_dflash(config):
        return "dflash", config.get("speculators_config") is not None
    if config.get("speculators_config") is not None:
        return None, True
    arch = " ".join(config.get("architectures") or [])
    if "Medusa" in arch or config.get("model_type") == "medusa":
        return "medusa", False
    if "Eagle3" in arch or "draft_vocab_size" in config or "eagle_config" in config:
        return "eagle3", False
    if config.get("num_hidden_layers") == 1:
        return "eagle", False
    raise UsageError(f"{path}: not an EAGLE-1, EAGLE-3 or Medusa drafter (architectures {arch or 'none'}); pass "
                     "--method")


def serve_speculators(subject: Subject, config: dict, verifier, k: int) -> None:
    """A speculators folder is served as `vllm serve DRAFTER` when its own proposal drafts k tokens beside this
    verifier (`subject.serve_drafter`); otherwise as a speculative_config, which a note says."""
    spec = config["speculators_config"]
    tokens = (spec.get("proposal_methods") or [{}])[0].get("speculative_tokens")
    named = (spec.get("verifier") or {}).get("name_or_path")
    here = named is not None and Path(str(named)).resolve() == Path(verifier.path).resolve()
    subject.serve_drafter = tokens == k and here
    if not subject.serve_drafter:
        subject.notes.append(f"served as speculative_config {{method: {subject.method}, model: the folder}} (its own "
                             f"proposal drafts {tokens} tokens beside {named!r}; this check drafts {k} beside "
                             "--verifier)")


def read_eagle3(folder: Path, verifier, k: int, dtype: str) -> Subject:
    """An EAGLE-3 folder of any trainer: vLLM's reading, the training record, and our drafters for both."""
    import torch

    from draftheads.eval.interop.peer_folder import PeerFolderError, findings, inspect
    from draftheads.eval.interop.vllm_reading import Unreadable
    from draftheads.models.layouts.folder import read_config

    try:
        ins = inspect(folder, verifier)
    except PeerFolderError as err:
        return Subject("eagle3", "unknown", unjudged=str(err))
    config = read_config(folder)
    subject = Subject("eagle3", ins.kind, findings=[f.line() for f in findings(ins)], notes=list(ins.notes))
    if ins.served.parallel:  # vLLM drafts in parallel only when asked
        subject.options["parallel_drafting"] = True
        subject.notes.append("a parallel drafter: served with speculative_config parallel_drafting: true")
    if ins.kind == "speculators":  # served as `vllm serve DRAFTER` when that drafts k tokens beside this verifier
        serve_speculators(subject, config, verifier, k)
    torch_dtype = getattr(torch, dtype)
    try:
        subject.served = ins.served.drafter(verifier, torch_dtype)
    except Unreadable as err:
        subject.unjudged = f"draftheads cannot decode it as vLLM reads it: {err}"
        return subject
    if subject.findings:
        try:
            subject.trained = ins.trained.drafter(verifier, torch_dtype)
        except Unreadable as err:
            subject.notes.append(f"the drafter as trained is not decoded here: {err}")
    return subject


def read_ours(method: str):
    """EAGLE-1 / Medusa: our loader reads the folder and compares config.json with its record field by field."""

    def read(folder: Path, verifier, k: int, dtype: str) -> Subject:
        from draftheads.models.export import DrafterFormatError
        from draftheads.models.layouts.folder import read_drafter, read_metadata

        subject = Subject(method, "draftheads")
        try:
            config, _ = read_drafter(folder)
            read_metadata(config, folder / "config.json")
        except DrafterFormatError as err:
            subject.kind, subject.unjudged = "unknown", f"draftheads does not read this folder ({err})"
            return subject
        try:
            from draftheads.eval import build_decoder

            build_decoder(verifier, draft=str(folder), method="medusa" if method == "medusa" else "eagle",
                          first_token="prefill", chain=k if method == "eagle" else True)
        except (DrafterFormatError, ValueError) as err:
            subject.findings.append(f"config.json: draftheads' loader refuses it against its own record ({err})")
            return subject
        subject.served = str(folder)
        return subject

    return read


def read_dflash(folder: Path, verifier, k: int, dtype: str) -> Subject:
    """A DFlash folder: vLLM's reading, the training record (our `draftheads` block, if any), drafters for both."""
    import torch

    from draftheads.eval.interop.vllm_reading import Unreadable, dflash_reading
    from draftheads.models.dflash import DFlashConfig, DFlashError
    from draftheads.models.layouts.folder import DrafterFormatError, read_drafter

    try:
        config, tensors = read_drafter(folder)
    except DrafterFormatError as err:
        return Subject("dflash", "unknown", unjudged=str(err))
    from draftheads.eval.interop.vllm_reading import is_dspark

    if is_dspark(config):
        return Subject("dspark", "dspark", not_here=DSPARK_NOT_HERE)
    block = config.get("draftheads") or {}
    kind = "draftheads" if block.get("method") == "dflash" else \
        "speculators" if config.get("speculators_config") is not None else "dflash"
    if "DFlash2DraftModel" in (config.get("architectures") or []) or \
            config.get("speculators_model_type") == "dflash2":
        return dflash2_subject(kind)
    served = dflash_reading(config, tensors, verifier)
    subject_not_here = mixed_layers_not_here(served.layer_types)
    subject = Subject("dflash", kind, not_here=subject_not_here)
    trained = None
    if kind == "draftheads":
        try:
            trained = DFlashConfig.from_dict(block.get("dflash") or {}, where=f"{folder}/config.json draftheads.dflash")
        except (DFlashError, TypeError) as err:
            subject.notes.append(f"the draftheads block is not a DFlash config ({err})")
    if trained is not None:
        subject.findings = dflash_findings(served, trained)
    if config.get("speculators_config") is not None:
        serve_speculators(subject, config, verifier, k)
    if served.block_size and k != served.block_size - 1:
        subject.notes.append(f"-k {k}: vLLM drafts a block of {k + 1}, the drafter was trained on blocks of "
                             f"{served.block_size} (serve with num_speculative_tokens {served.block_size - 1})")
    torch_dtype = getattr(torch, dtype)
    try:
        subject.served = served.drafter(verifier, torch_dtype)
    except Unreadable as err:
        subject.unjudged = f"draftheads cannot decode it as vLLM reads it: {err}"
        return subject
    if subject.findings:
        try:
            from draftheads.models.dflash import DFlashDrafter

            drafter = DFlashDrafter(trained.resolve(verifier.config), verifier).to(dtype=torch_dtype)
            drafter.load_state_dict({k_: v.to(torch_dtype) for k_, v in served.weights.items()}, strict=True)
            subject.trained = drafter.to(device=verifier.device)
        except (DFlashError, RuntimeError) as err:
            subject.notes.append(f"the drafter as trained is not decoded here: {err}")
    return subject


def unreadable_weights(folder: Path) -> str | None:
    """Why no engine could read the folder's weights (missing, a safetensors file that does not open), else None."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return f"{folder} has no .safetensors weights"
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    f.get_slice(key).get_shape()
        except Exception as err:  # safetensors raises its own error types for a bad header or a short file
            return f"{path}: unreadable safetensors file ({err})"
    return None


DSPARK_NOT_HERE = ("a DSpark drafter (Markov head): vLLM serves method dspark only with its V2 GPU model runner, which "
                   "vLLM's CPU build cannot run (no Triton CPU backend), and serve-check does not serve it on a GPU "
                   "yet; tests/e2e/interop/test_vllm_dspark.py runs vLLM's own Qwen3DSparkModel class on such an "
                   "export instead")


def dflash2_subject(kind: str) -> Subject:
    """A DFlash2 folder (architecture DFlash2DraftModel): vLLM 0.32 drafts its candidate selector only in its V2
    model runner (vllm/config/vllm.py refuses "DFlash candidate-head drafts" on V1), which needs Triton, and the
    CPU build has none; on a GPU, this command does not read DFlash2 as vLLM does yet (tests/e2e/interop/
    test_vllm_dflash2.py holds vLLM's own DFlash2 class to ours instead)."""
    import torch

    if torch.cuda.is_available():
        return Subject("dflash", kind, unjudged="a DFlash2 folder (DFlash2DraftModel): serve-check does not read "
                       "DFlash2 as vLLM does yet")
    return Subject("dflash", kind, not_here="a DFlash2 folder (DFlash2DraftModel): vLLM serves its candidate "
                   "selector only with its V2 model runner, which needs a Triton backend that vLLM's CPU build "
                   "lacks (its V1 runner refuses DFlash candidate-head drafts); run on a GPU")


def mixed_layers_not_here(layer_types: list[str]) -> str | None:
    """vLLM serves a DFlash drafter whose layers mix sliding and full attention only with its V2 model runner
    (several KV-cache groups: vllm/config/vllm.py refuses it on V1), and V2 needs a Triton GPU backend, which vLLM's
    CPU build does not have; None when this machine can serve the layout."""
    import torch

    sliding = sum(t == "sliding_attention" for t in layer_types)
    if not 0 < sliding < len(layer_types) or torch.cuda.is_available():
        return None
    return (f"layer_types {layer_types} mix sliding and full attention, which vLLM serves only with its V2 model "
            "runner (VLLM_USE_V2_MODEL_RUNNER=1), and V2 needs a Triton GPU backend that vLLM's CPU build lacks: "
            "run serve-check on a GPU, or train with one kind of layer (dflash.layer_types) to check it here")


def dflash_findings(served, trained) -> list[str]:
    """What vLLM's reading of a DFlash folder says otherwise than the draftheads block, one line per key."""
    out = []
    mine = {"target_layer_ids": list(trained.target_layer_ids or []), "mask_token_id": trained.mask_token_id,
            "layer_types": [trained.layer_type(i) for i in range(trained.num_hidden_layers)]}
    theirs = {"target_layer_ids": served.target_layer_ids, "mask_token_id": served.mask_token_id,
              "layer_types": served.layer_types}
    where = {"target_layer_ids": served.target_layer_ids_from}
    for key, value in mine.items():
        if theirs[key] != value:
            source = where.get(key, "config.json")
            out.append(f"{key}: vLLM reads {theirs[key]!r} ({source}), trained as {value!r} (the draftheads "
                       f"block); fix: export the drafter again (models.export.export_dflash)")
    for key in ("num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "attention_bias"):
        value = getattr(trained, key, None)
        if value is not None and served.layer.get(key) is not None and served.layer[key] != value:
            out.append(f"{key}: vLLM reads {served.layer[key]!r} (config.json), trained as {value!r} (the "
                       "draftheads block); fix: export the drafter again (models.export.export_dflash)")
    return out


#: vLLM method -> how serve-check reads a folder for it (a new method adds a reader here).
READERS = {"eagle3": read_eagle3, "eagle": read_ours("eagle"), "medusa": read_ours("medusa"), "dflash": read_dflash}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def per_position(accepted: list[list[int]], k: int) -> list[int]:
    steps = [a for row in accepted for a in row]
    return [sum(a > i for a in steps) for i in range(k)]


def decode_ours(verifier, draft, method: str, prompts, max_new_tokens: int, k: int):
    """Our engine on `draft` (a folder or an EagleDrafter), vLLM's way: first token from the prefill, a chain of k."""
    from draftheads.eval import build_decoder

    if method == "dflash":  # one block of k + 1 a step, as vLLM's num_speculative_tokens = k
        dec = build_decoder(verifier, draft=draft, method="dflash", first_token="prefill", num_draft_tokens=k)
        return dec, dec.generate(prompts, max_new_tokens, eos_token_id=None)
    engine_method = "medusa" if method == "medusa" else "eagle"
    dec = build_decoder(verifier, draft=draft, method=engine_method, first_token="prefill",
                        chain=k if engine_method == "eagle" else True)
    return dec, dec.generate(prompts, max_new_tokens, eos_token_id=None)


def check(verifier, drafts: list[str], prompts: list[list[int]], max_new_tokens: int, k: int, dtype: str,
          method: str | None = None, say=print) -> list[Report]:
    """Decode `prompts` with each drafter in vLLM and in our engine; one Report per drafter."""
    from draftheads.eval import SpeculativeDecoder
    from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm

    plain = SpeculativeDecoder(verifier, first_token="prefill").generate(prompts, max_new_tokens, eos_token_id=None)
    reports, cases, runs = [], [], []
    for draft in drafts:
        folder = Path(draft)
        detected, speculators = detect_method(folder)
        vllm_method = method or detected or "eagle3"
        subject = READERS[vllm_method](folder, verifier, k, dtype)
        report = Report(draft, vllm_method if not subject.serve_drafter else f"{vllm_method} (speculators)",
                        kind=subject.kind, findings=list(subject.findings), unjudged=subject.unjudged,
                        notes=list(subject.notes))
        ours = trained = None
        if subject.served is not None:
            dec, ours = decode_ours(verifier, subject.served, vllm_method, prompts, max_new_tokens, k)
            if dec.drafter.num_draft_tokens != k:
                report.notes.append(f"draftheads drafts {dec.drafter.num_draft_tokens} tokens a step here (the "
                                    f"heads it has), vLLM {k}")
        if subject.trained is not None:
            trained = decode_ours(verifier, subject.trained, vllm_method, prompts, max_new_tokens, k)[1]
        reports.append(report)
        unreadable = unreadable_weights(folder)
        if subject.not_here is not None or unreadable is not None:
            # nothing vLLM could show: the layout cannot run here, or the folder's weights cannot be read at all
            report.not_run = subject.not_here or unreadable
            say(f"[serve-check] {draft}: not run in vLLM: {report.not_run}")
            continue
        runs.append((ours, trained))
        cases.append(VllmCase(folder.name, str(verifier.path), str(folder), vllm_method, batches=[prompts], k=k,
                              dtype=dtype, max_tokens=max_new_tokens, serve_drafter=subject.serve_drafter,
                              max_model_len=max(map(len, prompts)) + max_new_tokens + 2 * k + 8,
                              speculative_options=subject.options))
    if not cases:
        return reports
    say(f"[serve-check] running {len(cases)} drafter(s) in vLLM")
    result = run_vllm(cases)
    to_run = [r for r in reports if r.not_run is None]
    for report, (ours, trained), theirs in zip(to_run, runs, result["cases"]):
        report.loaded = theirs["ok"]
        if not theirs["ok"]:
            report.error = theirs.get("error")
            continue
        batch = theirs["batches"][0]
        for want, got in zip(plain.output_ids, batch["outputs"]):
            report.outputs_equal.append(want == got)
            report.first_difference.append(first_difference(want, got))
        report.accepted_vllm = batch["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"]
        report.drafts = batch["metrics"]["vllm:spec_decode_num_drafts"]
        if ours is not None:
            report.accepted_ours = per_position(ours.stats.accepted, k)
            report.steps_equal = [a == b for a, b in zip(ours.stats.accepted, batch["per_step_accepted"])]
        if trained is not None:
            report.accepted_trained = per_position(trained.stats.accepted, k)
    return reports


def render(report: Report, k: int) -> list[str]:
    lines = [f"== {report.draft} (vLLM method {report.method}; {report.kind} folder)"]
    lines += [f"   note: {n}" for n in report.notes]
    lines += [f"   DISAGREES {f}" for f in report.findings]
    if report.unjudged is not None:
        lines.append(f"   not decoded here: {report.unjudged}")
    if report.not_run is not None:
        lines.append(f"VERDICT {report.draft}: NOT JUDGED - not run in vLLM: {report.not_run}")
        return lines
    if not report.loaded:
        lines.append(f"   vLLM REFUSED it: {report.error}")
        lines.append(f"VERDICT {report.draft}: FAIL - vLLM does not load this drafter"
                     + (f" ({len(report.findings)} field(s) read otherwise than trained)" if report.findings else ""))
        return lines
    lines.append("   loaded in vLLM")
    ours = report.unjudged is None
    for i, (equal, at) in enumerate(zip(report.outputs_equal, report.first_difference)):
        same = "" if not ours else ("; accepted per step: same" if report.steps_equal[i]
                                    else "; accepted per step: DIFFERENT")
        lines.append(f"   prompt {i}: output {'equals plain greedy' if equal else f'DIFFERS at token {at}'}{same}")
    trained = bool(report.accepted_trained)
    lines.append(f"   position  {'draftheads':>10}  {'vLLM':>6}" + (f"  {'as trained':>10}" if trained else "")
                 + f"   (steps accepting at least k; {report.drafts} drafts)")
    for i in range(k):
        mine = f"{report.accepted_ours[i]:>10}" if ours else f"{'-':>10}"
        extra = f"  {report.accepted_trained[i]:>10}" if trained else ""
        lines.append(f"   k={i + 1:<7}  {mine}  {report.accepted_vllm[i]:>6}{extra}")
    if report.unjudged is not None and not report.findings:
        lines.append(f"VERDICT {report.draft}: NOT JUDGED - {report.unjudged}")
    elif report.passed:
        lines.append(f"VERDICT {report.draft}: PASS - vLLM reads it as trained, its outputs equal plain greedy "
                     f"decoding on {len(report.outputs_equal)} of {len(report.outputs_equal)} prompts, and it accepts "
                     "exactly what draftheads accepts reading it the same way")
    else:
        why = []
        if report.findings:
            keys = ", ".join(f.split(":")[0] for f in report.findings)
            why.append(f"config.json disagrees with how it was trained ({keys})"
                       + (f": vLLM accepts {sum(report.accepted_vllm)} draft tokens, the drafter as trained "
                          f"{sum(report.accepted_trained)}" if trained else ""))
        if report.unjudged is not None:
            why.append(report.unjudged)
        if not all(report.outputs_equal):
            why.append(f"outputs differ from plain greedy on {report.outputs_equal.count(False)} prompt(s)")
        if not all(report.steps_equal):
            why.append(f"vLLM accepts {sum(report.accepted_vllm)} draft tokens where draftheads, reading it as vLLM "
                       f"does, accepts {sum(report.accepted_ours)} (a reading of vLLM's loader that is out of date)")
        lines.append(f"VERDICT {report.draft}: FAIL - " + "; ".join(why))
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftheads serve-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", required=True, help="the verifier: a local folder (vLLM loads it from there)")
    p.add_argument("--draft", required=True, nargs="+", help="drafter folder(s)")
    p.add_argument("--engine", default="vllm", choices=["vllm"], help="the engine to check in (vLLM's CPU build "
                   "runs here; SGLang's CPU backend does not install on these machines)")
    p.add_argument("--method", choices=METHODS, help="vLLM's speculative method (default: read from config.json)")
    p.add_argument("--prompts", default="humaneval", help="humaneval, mt-bench or a JSONL/JSON file (data.prompts)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3, dest="k")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", help="also write the reports here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from draftheads.data.config import DataError
    from draftheads.eval.interop.vllm_peer import VllmUnavailable
    from draftheads.models.verifier import VerifierError

    try:
        for key in ("num_prompts", "max_new_tokens", "k"):
            if getattr(args, key) < 1:
                flag = "-k" if key == "k" else f"--{key.replace('_', '-')}"
                raise UsageError(f"{flag} {getattr(args, key)}: expected a positive number")
        for draft in args.draft:
            if not Path(draft).is_dir():
                raise UsageError(f"--draft {draft}: no such folder")
        reports = run(args)
    except (UsageError, DataError, VerifierError, VllmUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if all(r.passed for r in reports) else 1


def run(args) -> list[Report]:
    import torch
    from transformers import AutoTokenizer

    from draftheads.data.prompts import load_prompts, prompt_ids
    from draftheads.models.verifier import Verifier

    verifier = Verifier.from_pretrained(args.verifier, dtype=getattr(torch, args.dtype))
    try:
        tokenizer = AutoTokenizer.from_pretrained(verifier.path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--verifier {args.verifier}: cannot load its tokenizer ({err})") from None
    prompts = [prompt_ids(p, tokenizer) for p in load_prompts(args.prompts, args.num_prompts)]
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    say(f"[serve-check] verifier {args.verifier}; {len(prompts)} prompts from {args.prompts}, "
        f"{args.max_new_tokens} tokens each, k={args.k}, {args.dtype}")
    reports = check(verifier, args.draft, prompts, args.max_new_tokens, args.k, args.dtype, args.method, say)
    for report in reports:
        print("\n".join(render(report, args.k)))
    if args.json:
        from dataclasses import asdict

        Path(args.json).write_text(json.dumps([{**asdict(r), "passed": r.passed} for r in reports], indent=1))
    return reports


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
