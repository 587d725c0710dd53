"""Re-check a results.json: every greedy, lossless run's output ids must equal plain greedy decoding of the verifier.

    draftheads recheck results/eagle3/results.json [--verifier tiny-code] [--device cpu]

The reference is Hugging Face `generate` with do_sample=False on the verifier alone (its own KV cache, no draft),
for each prompt's `prompt_ids`, the run's max_new_tokens and the verifier's EOS: an implementation independent of
this engine. The verifier loads as in the run (name and dtype from results.json's config; a Medusa-2 run's adapter
is merged again, as the run did). Sampled runs (temperature > 0) are skipped: their check is distributional (the
engine's chi-square tests). Exit code 1 and the first differing token of each mismatch if any output differs.

A near-tie is not a mismatch: where an output first differs, the reference's logit for its token and for ours are
compared at that position (one forward over the prompt and the reference's tokens before it); when they are within
`TIE_TOLERANCE` of each other (relative to the logit, by dtype: float32 1e-5), the verifier itself cannot tell
them apart, and a forward over several tokens at once (verification) rounds differently from one over a single token
(plain decoding). Such outputs are listed as near-ties with the gap, and do not fail the check.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Mismatch:
    label: str
    prompt_id: str
    position: int
    """Index of the first differing new token."""
    got: list[int]
    expected: list[int]
    tie_gap: float | None = None
    """At a near-tie: the reference's logit of its token minus that of ours, at `position` (else None)."""

    def __str__(self):
        if self.tie_gap is not None:
            return (f"{self.label} / {self.prompt_id}: diverges at new token {self.position} at a near-tie of the "
                    f"verifier's logits ({self.got[self.position]} vs plain greedy's {self.expected[self.position]}, "
                    f"gap {self.tie_gap:.1e}): float rounding, not a drafting error")
        lo = max(self.position - 2, 0)
        return (f"{self.label} / {self.prompt_id}: differs at new token {self.position}: got "
                f"{self.got[lo: self.position + 3]}, plain greedy {self.expected[lo: self.position + 3]}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    """Plain greedy decoding with HF generate; new tokens only, up to and including the first EOS."""
    from transformers import GenerationConfig

    from draftheads.eval.measure.harness import cut_at_eos

    device = next(model.parameters()).device
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_length=0,
                              eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, repetition_penalty=1.0,
                              no_repeat_ngram_size=0, suppress_tokens=[], begin_suppress_tokens=[])
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return cut_at_eos(out[0, len(prompt):].tolist(), eos)


TIE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
"""Largest logit gap, relative to max(1, |logit|), that counts as a tie in each dtype."""


@torch.inference_mode()
def tie_gap(model, context: list[int], got: int, expected: int) -> float | None:
    """The gap between the logits of `expected` (the reference's argmax) and `got` after `context`, when it is within
    the tie tolerance of the model's dtype; None when `got` is clearly worse."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([context], device=device)).logits[0, -1]
    tolerance = TIE_TOLERANCE.get(logits.dtype, 1e-5)
    logits = logits.double()
    gap = float(logits[expected] - logits[got])
    return gap if gap <= tolerance * max(1.0, abs(float(logits[expected]))) else None


def load_run_verifier(results: dict, verifier=None, device: str | None = None):
    """The verifier the run decoded with: its name and dtype from the config, plus a Medusa-2 adapter if a medusa
    run carried one (merged, as the engine does)."""
    from draftheads.models.verifier import Verifier, VerifierError, check_content

    cfg = results["config"]
    if verifier is None or isinstance(verifier, str):
        dtype = cfg.get("args", {}).get("dtype", "float32")
        verifier = Verifier.from_pretrained(verifier or cfg["verifier"], dtype=dtype, device=device or "cpu")
    for m in cfg.get("methods", []):
        if m.get("method") == "medusa" and m.get("draft") and Path(m["draft"]).is_dir():
            from draftheads.data.identity import folder_digest
            from draftheads.models.export import load_medusa_verifier

            recorded, now = m.get("draft_digest"), folder_digest(m["draft"])
            if recorded and recorded != now:  # another adapter merged in would blame the outputs, not the folder
                raise VerifierError(f"--draft {m['draft']}: the drafter folder the run decoded with had content "
                                    f"digest {recorded}, the folder there now has {now} (replaced since); its "
                                    "Medusa-2 adapter is part of the verifier the run decoded with, so the outputs "
                                    "cannot be re-checked against this one: restore that folder")

            load_medusa_verifier(m["draft"], verifier, merge=True)  # a no-op for Medusa-1
            break
    if cfg.get("verifier_fingerprint") and verifier.fingerprint != cfg["verifier_fingerprint"]:
        raise VerifierError(f"verifier {verifier.name!r} has fingerprint {verifier.fingerprint}, the run's had "
                            f"{cfg['verifier_fingerprint']}: not the same weights; pass the run's verifier "
                            "(--verifier)")
    check_content(cfg.get("verifier_files"), verifier, "the run", "measured with",
                  "pass the run's verifier (--verifier); outputs re-checked on another one would differ")
    return verifier


def recheck(results: dict, verifier=None, device: str | None = None
            ) -> tuple[int, list[Mismatch], list[Mismatch]]:
    """(outputs checked, mismatches, near-ties) over every greedy lossless run of `results` (a results.json dict)."""
    from draftheads.eval.measure.harness import eos_ids

    settings = results["config"]["settings"]
    if settings["temperature"] != 0:
        return 0, [], []
    labels = [label for label, row in results["summary"].items() if row.get("lossless", True)]
    verifier = load_run_verifier(results, verifier, device)
    eos = eos_ids(verifier)
    checked, mismatches, ties = 0, [], []
    for sample in results["samples"]:
        expected = greedy_reference(verifier.model, sample["prompt_ids"], settings["max_new_tokens"], eos)
        for label in labels:
            got = sample["runs"][label]["output_ids"]
            checked += 1
            pos = first_difference(got, expected)
            if pos is None:
                continue
            gap = None
            if pos < len(got) and pos < len(expected):
                gap = tie_gap(verifier.model, sample["prompt_ids"] + expected[:pos], got[pos], expected[pos])
            (mismatches if gap is None else ties).append(Mismatch(label, sample["id"], pos, got, expected, gap))
    return checked, mismatches, ties


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftheads recheck", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="results.json (or its folder)")
    p.add_argument("--verifier", default=None, help="default: the run's --verifier")
    p.add_argument("--device", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    from draftheads.eval.measure.cli_common import report_errors

    return report_errors(run, parser().parse_args(argv))


def run(args) -> int:
    from draftheads.eval.measure.report import read_results

    results = read_results(args.results)
    if results["config"]["settings"]["temperature"] != 0:
        print(f"{args.results}: sampled run (temperature {results['config']['settings']['temperature']}); only "
              "greedy runs re-check token for token")
        return 0
    checked, mismatches, ties = recheck(results, args.verifier, args.device)
    for m in mismatches + ties:
        print(m)
    print(f"{checked - len(mismatches) - len(ties)} of {checked} outputs equal plain greedy decoding of the verifier"
          + (f"; {len(ties)} more up to a near-tie of its logits, where either token is its greedy choice"
             if ties else ""))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
