"""Will my drafter work in vLLM? Load it there, decode a few prompts with it and with our engine, and say.

    draftheads serve-check --verifier V --draft D [D ...] [--prompts humaneval] [--num-prompts 4]
        [--max-new-tokens 32] [-k 3] [--dtype float32] [--method eagle3|eagle|medusa]

For each drafter folder (ours or another trainer's, in vLLM's EAGLE-1 / EAGLE-3 / Medusa layouts or the speculators
format) it prints: loaded or refused (with vLLM's own message); per prompt, whether vLLM's greedy output equals
plain greedy decoding of the verifier, or the first position where it differs; the accepted draft tokens per
position, ours beside vLLM's; and a verdict line. Our side decodes the same prompts with the same k in vLLM's
convention (the first token from the prefill, `first_token="prefill"`), so for a draftheads export the counts must
be equal, request by request; for a folder we cannot read (another trainer's) vLLM's outputs are still checked
against plain greedy decoding. Exit status: 0 when every drafter passes, 1 when one does not, 2 for a usage error
or when vLLM is not available (`bash scripts/setup_vllm.sh`).

What parts the two engines is a difference in *reading* (layer ids, a dropped weight, a norm option): a drafter
broken in its weights decodes alike in both, and this check then passes with its (low) acceptance shown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

METHODS = ("eagle3", "eagle", "medusa")


class UsageError(ValueError):
    pass


@dataclass
class Report:
    """What serve-check found for one drafter."""

    draft: str
    method: str | None
    ours: bool
    """Whether draftheads reads the folder (else only vLLM's outputs are checked)."""
    loaded: bool = False
    error: str | None = None
    outputs_equal: list[bool] = field(default_factory=list)
    first_difference: list[int | None] = field(default_factory=list)
    accepted_ours: list[int] = field(default_factory=list)
    """Per position k: steps that accepted at least k draft tokens (draftheads)."""
    accepted_vllm: list[int] = field(default_factory=list)
    steps_equal: list[bool] = field(default_factory=list)
    """Per prompt: whether the accepted counts per verification step are the same in both engines."""
    drafts: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.loaded and all(self.outputs_equal) and (not self.ours or all(self.steps_equal))


def detect_method(folder: Path) -> tuple[str | None, bool]:
    """(vLLM method or None for a speculators folder, whether it is a speculators folder) from config.json."""
    from draftheads.models.layouts.folder import DrafterFormatError, read_config

    path = folder / "config.json"
    try:
        config = read_config(folder)
    except DrafterFormatError as err:
        raise UsageError(f"--draft {folder}: {err}") from None
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


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def per_position(accepted: list[list[int]], k: int) -> list[int]:
    steps = [a for row in accepted for a in row]
    return [sum(a > i for a in steps) for i in range(k)]


def check(verifier, drafts: list[str], prompts: list[list[int]], max_new_tokens: int, k: int, dtype: str,
          method: str | None = None, say=print) -> list[Report]:
    """Decode `prompts` with each drafter in vLLM and in our engine; one Report per drafter."""
    from draftheads.eval import SpeculativeDecoder, build_decoder
    from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm
    from draftheads.models.export import DrafterFormatError
    from draftheads.models.layouts.folder import read_drafter, read_metadata

    plain = SpeculativeDecoder(verifier, first_token="prefill").generate(prompts, max_new_tokens, eos_token_id=None)
    reports, cases, ours_runs = [], [], []
    for draft in drafts:
        folder = Path(draft)
        vllm_method, speculators = detect_method(folder)
        vllm_method = method or vllm_method
        report = Report(draft, vllm_method or "eagle3 (speculators)", ours=False)
        ours = None
        options = {}
        try:
            config, _ = read_drafter(folder)
            meta = read_metadata(config, folder / "config.json")
            kind = meta.get("method", "")
            if (meta.get("eagle") or {}).get("parallel"):  # vLLM drafts in parallel only when asked
                options["parallel_drafting"] = True
                report.notes.append("a parallel drafter: served with speculative_config parallel_drafting: true")
            engine_method = "medusa" if kind == "medusa" else "eagle"
            dec = build_decoder(verifier, draft=str(folder), method=engine_method,
                                                     first_token="prefill",
                                                     chain=k if engine_method == "eagle" else True)
            if dec.drafter.num_draft_tokens != k:
                report.notes.append(f"draftheads drafts {dec.drafter.num_draft_tokens} tokens a step here (the "
                                    f"heads it has), vLLM {k}")
            ours = dec.generate(prompts, max_new_tokens, eos_token_id=None)
            report.ours = True
        except (DrafterFormatError, ValueError) as err:
            report.notes.append(f"draftheads does not read this folder ({err}); checking vLLM's outputs only")
        reports.append(report)
        ours_runs.append(ours)
        cases.append(VllmCase(folder.name, str(verifier.path), str(folder), vllm_method, batches=[prompts], k=k,
                              dtype=dtype, max_tokens=max_new_tokens, serve_drafter=speculators and method is None,
                              max_model_len=max(map(len, prompts)) + max_new_tokens + 2 * k + 8,
                              speculative_options=options))
    say(f"[serve-check] running {len(cases)} drafter(s) in vLLM")
    result = run_vllm(cases)
    for report, ours, theirs in zip(reports, ours_runs, result["cases"]):
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
    return reports


def render(report: Report, k: int) -> list[str]:
    lines = [f"== {report.draft} (vLLM method {report.method}; "
             f"{'draftheads export' if report.ours else 'not a draftheads export'})"]
    lines += [f"   note: {n}" for n in report.notes]
    if not report.loaded:
        lines.append(f"   vLLM REFUSED it: {report.error}")
        lines.append(f"VERDICT {report.draft}: FAIL - vLLM does not load this drafter")
        return lines
    lines.append("   loaded in vLLM")
    for i, (equal, at) in enumerate(zip(report.outputs_equal, report.first_difference)):
        same = "" if not report.ours else ("; accepted per step: same" if report.steps_equal[i]
                                           else "; accepted per step: DIFFERENT")
        lines.append(f"   prompt {i}: output {'equals plain greedy' if equal else f'DIFFERS at token {at}'}{same}")
    lines.append(f"   position  {'draftheads':>10}  {'vLLM':>6}   (steps accepting at least k; {report.drafts} drafts)")
    for i in range(k):
        mine = f"{report.accepted_ours[i]:>10}" if report.ours else f"{'-':>10}"
        lines.append(f"   k={i + 1:<7}  {mine}  {report.accepted_vllm[i]:>6}")
    if report.passed:
        tail = "and accepts exactly what draftheads accepts" if report.ours else "(acceptance not compared: not ours)"
        lines.append(f"VERDICT {report.draft}: PASS - vLLM loads it, its outputs equal plain greedy decoding on "
                     f"{len(report.outputs_equal)} of {len(report.outputs_equal)} prompts, {tail}")
    else:
        why = []
        if not all(report.outputs_equal):
            why.append(f"outputs differ from plain greedy on {report.outputs_equal.count(False)} prompt(s)")
        if report.ours and not all(report.steps_equal):
            why.append(f"vLLM accepts {sum(report.accepted_vllm)} draft tokens where draftheads accepts "
                       f"{sum(report.accepted_ours)} (it reads the drafter differently: layer ids, a weight, a norm)")
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
