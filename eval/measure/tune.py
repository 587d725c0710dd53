"""Choose the method and draft length from measurements: `draftheads tune`.

    draftheads tune --verifier tiny-code --candidate ngram --candidate medusa=runs/medusa-tiny/drafter \\
        --candidate eagle=runs/eagle3-tiny/drafter --prompts humaneval --num-prompts 8 --max-new-tokens 64 \\
        --max-draft 6 --out results/tune          (also --candidate dflash=EXPORT: a DFlash drafter's block)

What the choice depends on, measured on the given prompts (greedy, or `--temperature`):
  1. each drafter's per-position acceptance p_k = P(a step accepts at least k drafts), k = 1..K, from one decode
     with a chain of K = --max-draft (the expected tokens per verifier call of a chain of N is 1 + p_1 + .. + p_N);
  2. the verifier's cost of one forward over n = 1..K+1 new tokens at the prompts' mean context (`verifier_costs`;
     the prediction uses the least-squares line through them, `fit_line`: single forwards jitter on a shared CPU);
  3. each drafter's cost per step at N = 1 and N = K (its time in the decode loop: draft passes, its own
     bookkeeping, and the loop's acceptance and commit), hence its cost per extra draft token (the slope);
  4. the plain decoding baseline: prefill time and step time.
The prediction for a chain of N: time = prefill + (new tokens / E_N) x (verifier(N+1) + drafter(N)), against
prefill + new tokens x plain step; speedup = the ratio. Every (method, N) is predicted; the `--confirm` best (and
each other candidate's best) are then decoded for real, each beside plain decoding, and the table shows predicted against measured speedup and
tau. Medusa exports also get static trees of `--tree-budgets` nodes predicted: the export's per-head rank
accuracies (held-out, from training), scaled head by head so the top-1 chain accepts what was measured, give each
tree's expected tau (`calibrated_ranks`, `medusa_tree_tau`); its nodes cost the loop what as many chain tokens do.
The winner among the confirmed is printed, and the best confirmed chain (what vLLM and SGLang serve) as a vLLM
`speculative_config` and SGLang flags. EAGLE's dynamic trees are not predicted (no per-budget model yet). Writes
DIR/tune.json and DIR/tune.png (predicted speedup against chain length per candidate, measured points marked).

The brief's exercise lives here too: `expected_tokens(alpha, n)` = (1 - alpha^(n+1)) / (1 - alpha) for i.i.d.
acceptance at rate alpha, and `optimal_draft_length(alpha, cost)` under a draft cost of `cost` verifier calls per
draft token (tests/integration/test_tune.py checks both against simulation; scripts/plot_draft_length.py draws them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


# ---- the brief's exercise ------------------------------------------------------------------------------------------
def expected_tokens(alpha: float, n: int) -> float:
    """Expected tokens per verifier call with n draft tokens each accepted with probability alpha (independently,
    stopping at the first rejection), the bonus/corrected token included: (1 - alpha^(n+1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1 or n < 0:
        raise ValueError(f"alpha={alpha}, n={n}: expected 0 <= alpha <= 1 and n >= 0")
    return float(n + 1) if alpha == 1 else (1 - alpha ** (n + 1)) / (1 - alpha)


def simulated_tokens(alpha: float, n: int, steps: int = 100_000, seed: int = 0) -> float:
    """The same by simulation: mean of 1 + (accepted drafts), drafts accepted one by one with probability alpha."""
    g = torch.Generator().manual_seed(seed)
    accepted = torch.rand(steps, n, generator=g, dtype=torch.float64) < alpha  # (steps, n)
    run = accepted.cumprod(1).sum(1)  # drafts accepted before the first rejection
    return float((1 + run.double()).mean())


def speedup_iid(alpha: float, n: int, cost: float) -> float:
    """Speedup over plain decoding when a step costs one verifier call plus n draft tokens at `cost` each."""
    return expected_tokens(alpha, n) / (1 + cost * n)


def optimal_draft_length(alpha: float, cost: float, max_n: int = 64) -> int:
    """The n in 0..max_n with the largest `speedup_iid` (0: speculation does not pay)."""
    return max(range(max_n + 1), key=lambda n: speedup_iid(alpha, n, cost))


# ---- measurements --------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    label: str
    method: str
    draft: str | None = None


@dataclass
class DrafterProfile:
    """What one candidate's measurement decodes gave."""

    label: str
    method: str
    draft: str | None
    per_position: list[float]
    """p_k, k = 1..K (chain of K)."""
    step_s: dict[int, float]
    """N -> decode-phase seconds per verifier call (the whole step) at chain N (N = 1 and K)."""
    drafter_s: dict[int, float] = field(default_factory=dict)
    """N -> the step minus the verifier's forward over N+1 tokens: drafter + loop bookkeeping per step."""
    rank_accuracy: list[list[float]] | None = None
    """Medusa: the export's per-head rank accuracies (`draftheads.rank_accuracy`), for tree predictions."""

    def drafter_cost(self, n: int) -> float:
        """The line through the measured points, at n draft tokens (never below zero)."""
        lo = min(self.drafter_s)
        return max(0.0, self.drafter_s[lo] + self.cost_per_draft_token * (n - lo))

    @property
    def cost_per_draft_token(self) -> float:
        lo, hi = min(self.drafter_s), max(self.drafter_s)
        return (self.drafter_s[hi] - self.drafter_s[lo]) / (hi - lo) if hi > lo else 0.0


def method_options(method: str, n: int, tree: bool = False) -> dict:
    """The engine options for a chain of n draft tokens (or Medusa's static tree of n nodes)."""
    if tree:
        return {"tree_budget": n}
    if method in ("ngram", "draft-model", "dflash"):
        return {"num_draft_tokens": n}
    if method in ("medusa", "eagle"):
        return {"chain": n}
    raise ValueError(f"method {method!r} has no draft length to tune")


def longest_chain(verifier, candidate: Candidate, k: int) -> int:
    """k, or fewer where the drafter cannot draft that far (Medusa: one token per head; DFlash: its trained block,
    block_size - 1 mask positions)."""
    if candidate.method not in ("medusa", "dflash"):
        return k
    from draftheads.eval.drafters import make_drafter

    if candidate.method == "dflash":
        return min(k, make_drafter("dflash", verifier, candidate.draft).num_draft_tokens)
    return min(k, make_drafter("medusa", verifier, candidate.draft, chain=True).num_draft_tokens)


def decoder_for(verifier, candidate: Candidate, n: int | None, tree: bool = False):
    from draftheads.eval.drafters import make_drafter
    from draftheads.eval.engine.decoder import SpeculativeDecoder

    if n is None:
        return SpeculativeDecoder(verifier, method="autoregressive")
    options = method_options(candidate.method, n, tree)
    return SpeculativeDecoder(verifier, make_drafter(candidate.method, verifier, candidate.draft, **options),
                              candidate.method)


@dataclass
class DecodeRun:
    seconds: float
    prefill_s: float
    new_tokens: int
    verifier_calls: int
    accepted: int
    per_position: list[float]

    @property
    def tau(self) -> float:
        return (self.accepted + self.verifier_calls) / self.verifier_calls if self.verifier_calls else 0.0

    @property
    def step_s(self) -> float:
        return (self.seconds - self.prefill_s) / max(1, self.verifier_calls)


def decode(decoder, prompts: list[list[int]], max_new_tokens: int, temperature: float, depth: int,
           repeats: int = 1, seed: int = 0) -> DecodeRun:
    """Every prompt one by one; the fastest of `repeats` passes counts (the decisions are the same each pass)."""
    from draftheads.eval.measure.metrics import per_position_acceptance

    best = None
    for _ in range(repeats):
        seconds = prefill = 0.0
        new = calls = accepted = 0
        steps: list[int] = []
        for i, p in enumerate(prompts):
            out = decoder.generate([p], max_new_tokens, temperature=temperature, seed=seed + i, eos_token_id=None)
            s = out.stats
            seconds += s.time_total_s
            prefill += s.time_prefill_s
            new += sum(s.new_tokens)
            calls += s.verifier_calls
            accepted += sum(map(sum, s.accepted))
            steps += [a for row in s.accepted for a in row]
        run = DecodeRun(seconds, prefill, new, calls, accepted, per_position_acceptance([steps], depth))
        if best is None or run.seconds < best.seconds:
            best = run
    return best


def verifier_costs(verifier, context: int, max_tokens: int, repeats: int = 20) -> dict[int, float]:
    """Seconds of one verifier forward over n = 1..max_tokens new tokens (a chain) after `context` cached tokens,
    batch 1: the median of `repeats` timed forwards each (after a warm-up)."""
    from draftheads.eval.engine.generic_runtime import make_runner
    from draftheads.eval.engine.runtime import bucket, causal_mask

    runner = make_runner(verifier.model, "verifier")
    dev = runner.device
    cache = runner.new_cache(1, bucket(context + max_tokens + 1))
    ids = torch.arange(context + max_tokens, device=dev)[None] % verifier.vocab_size
    pos = torch.arange(context, device=dev)[None]
    costs = {}
    with torch.inference_mode():
        runner(cache, ids[:, :context], pos, pos, causal_mask(context, bucket(context), dev))
        for n in range(1, max_tokens + 1):
            new_pos = torch.arange(context, context + n, device=dev)[None]
            window = bucket(context + n)
            mask = torch.arange(window, device=dev)[None, None, :] <= new_pos[0, :, None][None]
            times = []
            for r in range(repeats + 2):
                t0 = time.perf_counter()
                runner(cache, ids[:, context: context + n], new_pos, new_pos, mask)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if r >= 2:
                    times.append(time.perf_counter() - t0)
            costs[n] = statistics.median(times)
    return costs


def fit_line(costs: dict[int, float]) -> dict[int, float]:
    """The least-squares line through (n, seconds), evaluated at the same n: single forwards on a shared CPU jitter
    by more than the growth from one token count to the next, the line keeps the trend."""
    ns = sorted(costs)
    if len(ns) < 2:
        return dict(costs)
    mean_n = sum(ns) / len(ns)
    mean_c = sum(costs[n] for n in ns) / len(ns)
    slope = sum((n - mean_n) * (costs[n] - mean_c) for n in ns) / sum((n - mean_n) ** 2 for n in ns)
    return {n: mean_c + slope * (n - mean_n) for n in ns}


# ---- prediction ----------------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    label: str
    method: str
    draft: str | None
    n: int
    """Draft tokens per step: the chain's length, or the tree's node budget."""
    tau: float
    speedup: float
    measured_tau: float | None = None
    measured_speedup: float | None = None
    tree: bool = False
    """A static tree of n nodes (Medusa's `tree_budget`) rather than a chain."""

    @property
    def shape(self) -> str:
        return f"tree of {self.n}" if self.tree else f"chain of {self.n}"

    @property
    def error(self) -> float | None:
        if self.measured_speedup is None:
            return None
        return (self.speedup - self.measured_speedup) / self.measured_speedup


def predict(profiles: list[DrafterProfile], verify_s: dict[int, float], baseline: DecodeRun,
            max_draft: int, tree_budgets: tuple[int, ...] = ()) -> list[Prediction]:
    """Predicted tau and speedup of every (candidate, chain length 1..max_draft) and, for Medusa exports with rank
    accuracies, every static tree of `tree_budgets` nodes; best first."""
    new_per_prompt = baseline.new_tokens
    plain = baseline.seconds
    rows = []

    def add(prof, n, tau, tree=False):
        step = verify_s[n + 1] + prof.drafter_cost(n)  # a tree's nodes cost the loop what a chain's tokens do
        seconds = baseline.prefill_s + new_per_prompt / tau * step
        rows.append(Prediction(prof.label, prof.method, prof.draft, n, tau, plain / seconds, tree=tree))

    for prof in profiles:
        for n in range(1, min(max_draft, len(prof.per_position)) + 1):
            add(prof, n, 1 + sum(prof.per_position[:n]))
        if prof.rank_accuracy:
            for b in tree_budgets:
                add(prof, b, medusa_tree_tau(prof.rank_accuracy, prof.per_position, b), tree=True)
    return sorted(rows, key=lambda r: -r.speedup)


def calibrated_ranks(rank_acc: list[list[float]], per_position: list[float]) -> list[list[float]]:
    """The export's per-head rank accuracies (held-out, from training) scaled head by head so that the top-1 chain
    accepts what the measured chain accepted: head i's row times (p_{i+1} / p_i) / acc[i][0], capped at 1."""
    rows, prev = [], 1.0
    for i, row in enumerate(rank_acc):
        if i >= len(per_position) or row[0] <= 0 or prev <= 0:
            rows.append(list(row))
            continue
        scale = (per_position[i] / prev) / row[0]
        prev = per_position[i]
        rows.append([min(1.0, p * scale) for p in row])
    return rows


def medusa_tree_tau(rank_acc: list[list[float]], per_position: list[float], budget: int) -> float:
    """tau of the best static tree of `budget` nodes under the calibrated rank accuracies (head independence)."""
    from draftheads.models.medusa import build_medusa_tree, expected_accepted_length

    rows = calibrated_ranks(rank_acc, per_position)
    return 1 + expected_accepted_length(build_medusa_tree(rows, budget), rows)


def serve_config(pred: Prediction) -> tuple[dict, str]:
    """(vLLM speculative_config, SGLang flags) for a chain of pred.n with this method."""
    n = pred.n
    if pred.method == "ngram":
        return ({"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
                f"--speculative-algorithm NGRAM --speculative-num-draft-tokens {n + 1}")
    if pred.method == "medusa":
        return ({"method": "medusa", "model": pred.draft, "num_speculative_tokens": n},
                "(SGLang serves no Medusa heads)")
    if pred.method == "eagle":
        from draftheads.models.layouts.folder import read_config

        config = read_config(Path(pred.draft))
        method = "eagle3" if (config.get("draftheads") or {}).get("method") == "eagle3" or \
            "Eagle3" in " ".join(config.get("architectures", [])) else "eagle"
        return ({"method": method, "model": pred.draft, "num_speculative_tokens": n},
                f"--speculative-algorithm {method.upper()} --speculative-draft-model-path {pred.draft} "
                f"--speculative-num-steps {n} --speculative-eagle-topk 1 --speculative-num-draft-tokens {n + 1}")
    if pred.method == "dflash":  # SGLang counts the block: the verified token and n mask positions
        return ({"method": "dflash", "model": pred.draft, "num_speculative_tokens": n},
                f"--speculative-algorithm DFLASH --speculative-draft-model-path {pred.draft} "
                f"--speculative-num-draft-tokens {n + 1}")
    return ({"method": "draft_model", "model": pred.draft, "num_speculative_tokens": n},
            f"--speculative-algorithm STANDALONE --speculative-draft-model-path {pred.draft} "
            f"--speculative-num-steps {n} --speculative-eagle-topk 1 --speculative-num-draft-tokens {n + 1}")


# ---- the command ---------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftheads tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", required=True)
    p.add_argument("--candidate", action="append", required=True, metavar="METHOD[=DRAFT]",
                   help="ngram, medusa=EXPORT, eagle=EXPORT, dflash=EXPORT or draft-model=FOLDER; repeatable")
    p.add_argument("--prompts", required=True, help="humaneval, mt-bench, or a .jsonl sample of your traffic")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-draft", type=int, default=6, help="longest chain to consider (K)")
    p.add_argument("--tree-budgets", type=int, nargs="*", default=[4, 8, 16],
                   help="Medusa static trees of these many nodes are predicted too (from the export's rank "
                        "accuracies, calibrated by the measured chain)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--confirm", type=int, default=3,
                   help="decode this many of the best predictions for real (and each other candidate's best)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per decode, the fastest counts")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--out", required=True)
    return p


def parse_candidates(entries: list[str]) -> list[Candidate]:
    from draftheads.eval.measure.cli_common import UsageError

    out = []
    for entry in entries:
        method, _, draft = entry.partition("=")
        if method not in ("ngram", "medusa", "eagle", "dflash", "draft-model"):
            raise UsageError(f"--candidate {entry}: expected ngram, medusa=EXPORT, eagle=EXPORT, dflash=EXPORT or "
                             "draft-model=FOLDER")
        if (method == "ngram") == bool(draft):
            raise UsageError(f"--candidate {entry}: " + ("ngram takes no drafter" if draft else
                                                         f"{method} needs a drafter: {method}=PATH"))
        if draft and not Path(draft).exists():
            raise UsageError(f"--candidate {entry}: {draft} does not exist")
        label = method if method == "ngram" else f"{method}:{Path(draft).parent.name or Path(draft).name}"
        out.append(Candidate(label, method, draft or None))
    return out


def check_args(args) -> None:
    from draftheads.eval.measure.cli_common import UsageError

    for flag in ("num_prompts", "max_new_tokens", "max_draft", "confirm", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected a positive number")
    if args.temperature < 0:
        raise UsageError(f"--temperature {args.temperature}: expected >= 0 (0 = greedy)")
    if any(b < 1 for b in args.tree_budgets):
        raise UsageError(f"--tree-budgets {' '.join(map(str, args.tree_budgets))}: expected positive node counts")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {args.out}: cannot create it ({err.strerror})") from None


def table(rows: list[Prediction], ranked: list[Prediction]) -> str:
    """Markdown rows; rank = the place in `ranked` (all predictions, best first)."""
    lines = ["| rank | candidate | draft | tau predicted | tau measured | speedup predicted | speedup measured | error |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        i = ranked.index(r) + 1
        m_tau = f"{r.measured_tau:.2f}" if r.measured_tau is not None else ""
        m_sp = f"{r.measured_speedup:.2f}x" if r.measured_speedup is not None else ""
        err = f"{100 * r.error:+.0f}%" if r.error is not None else ""
        lines.append(f"| {i} | {r.label} | {r.shape} | {r.tau:.2f} | {m_tau} | {r.speedup:.2f}x | {m_sp} | {err} |")
    return "\n".join(lines)


def plot(predictions: list[Prediction], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(p.label for p in predictions):
        rows = sorted((p for p in predictions if p.label == label and not p.tree), key=lambda p: p.n)
        line, = ax.plot([p.n for p in rows], [p.speedup for p in rows], marker="o", label=f"{label} (predicted)")
        done = [p for p in rows if p.measured_speedup is not None]
        if done:
            ax.scatter([p.n for p in done], [p.measured_speedup for p in done], marker="x", s=80,
                       color=line.get_color(), label=f"{label} (measured)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft length N (chain)")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from draftheads.eval.measure.cli_common import hold_out_folder, report_errors

    args = parser().parse_args(argv)

    def checked_run():
        with hold_out_folder(args.out, "tune"):
            check_args(args)
            return run(args, parse_candidates(args.candidate))

    return report_errors(checked_run)


def run(args, candidates: list[Candidate]) -> int:
    from draftheads.data.progress import quiet
    from draftheads.data.prompts import load_prompts
    from draftheads.eval.measure.cli_common import encode_prompts, load_tokenizer
    from draftheads.models.verifier import Verifier

    say = (lambda *a: None) if quiet() else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    verifier = Verifier.from_pretrained(args.verifier, device=device)
    tokenizer = load_tokenizer(verifier)
    prompts = [ids for _, ids in encode_prompts(load_prompts(args.prompts, args.num_prompts), tokenizer,
                                                args.chat_template,
                                                getattr(verifier.config, "max_position_embeddings", None),
                                                args.max_new_tokens)]
    K, T, M = args.max_draft, args.temperature, args.max_new_tokens

    def measure(decoder, depth=K):
        return decode(decoder, prompts, M, T, depth, args.repeats)

    say(f"[tune] {len(prompts)} prompts; measuring plain decoding and the verifier's cost for 1..{K + 1} tokens")
    plain_decoder = decoder_for(verifier, Candidate("autoregressive", "autoregressive"), None)
    measure(plain_decoder, 0)  # warm-up
    baseline = measure(plain_decoder, 0)
    context = round(sum(map(len, prompts)) / len(prompts) + M / 2)
    budgets = tuple(sorted(set(args.tree_budgets))) if any(c.method == "medusa" for c in candidates) else ()
    measured_verify_s = verifier_costs(verifier, context, max([K, *budgets]) + 1)
    verify_s = fit_line(measured_verify_s)
    profiles = []
    for cand in candidates:
        k = longest_chain(verifier, cand, K)
        say(f"[tune] {cand.label}: acceptance at chain {k}, cost at chains 1 and {k}")
        runs = {n: measure(decoder_for(verifier, cand, n), k) for n in sorted({1, k})}
        prof = DrafterProfile(cand.label, cand.method, cand.draft, runs[k].per_position,
                              {n: r.step_s for n, r in runs.items()})
        prof.drafter_s = {n: max(0.0, s - verify_s[n + 1]) for n, s in prof.step_s.items()}
        if cand.method == "medusa":
            from draftheads.models.layouts.folder import read_config

            prof.rank_accuracy = (read_config(Path(cand.draft)).get("draftheads") or {}).get("rank_accuracy")
        profiles.append(prof)
    predictions = predict(profiles, verify_s, baseline, K, budgets)
    top = predictions[: args.confirm]
    for label in dict.fromkeys(p.label for p in predictions):  # and each other candidate's best, measured too
        if all(p.label != label for p in top):
            top.append(next(p for p in predictions if p.label == label))
    say(f"[tune] confirming the best {len(top)} by decoding, each beside plain decoding")
    for pred in top:
        cand = Candidate(pred.label, pred.method, pred.draft)
        run_ = measure(decoder_for(verifier, cand, pred.n, pred.tree))
        plain = measure(plain_decoder, 0)
        pred.measured_tau = run_.tau
        pred.measured_speedup = plain.seconds / run_.seconds
    winner = max(top, key=lambda p: p.measured_speedup)
    chains = [p for p in top if not p.tree]  # what vLLM and SGLang serve: chains (vLLM drafts Medusa's top-1 chain)
    served = max(chains, key=lambda p: p.measured_speedup) if chains else None
    vllm, sglang = serve_config(served) if served else (None, "(no chain among the confirmed)")
    out = Path(args.out)
    plot(predictions, out / "tune.png")
    result = {"verifier": args.verifier, "prompts": args.prompts, "num_prompts": len(prompts),
              "max_new_tokens": M, "temperature": T, "max_draft": K, "context": context,
              "verifier_seconds": {str(n): s for n, s in measured_verify_s.items()},
              "verifier_seconds_fitted": {str(n): s for n, s in verify_s.items()},
              "baseline": asdict(baseline) | {"step_s": baseline.step_s},
              "profiles": [asdict(p) | {"cost_per_draft_token_s": p.cost_per_draft_token} for p in profiles],
              "predictions": [asdict(p) | {"error": p.error} for p in predictions],
              "winner": asdict(winner), "served": asdict(served) if served else None,
              "vllm_speculative_config": vllm, "sglang_flags": sglang}
    from draftheads.models.atomic import write_text

    write_text(out / "tune.json", json.dumps(result, indent=2))
    print("verifier forward (ms) by new tokens: " +
          ", ".join(f"{n}: {1000 * s:.2f}" for n, s in measured_verify_s.items()) +
          f" (fitted: {1000 * verify_s[1]:.2f} + {1000 * (verify_s[2] - verify_s[1]):.2f} per token)" +
          f"; plain step {1000 * baseline.step_s:.2f} ms")
    for p in profiles:
        print(f"{p.label}: per-position acceptance " + " ".join(f"{x:.2f}" for x in p.per_position) +
              f"; drafter + loop per step {1000 * p.drafter_s[min(p.drafter_s)]:.2f} ms at N=1, "
              f"+{1000 * p.cost_per_draft_token:.2f} ms per extra draft token")
    print()
    print(table(top + [p for p in predictions if p not in top][:6], predictions))
    print(f"\nwinner (measured): {winner.label}, {winner.shape}: {winner.measured_speedup:.2f}x, "
          f"tau {winner.measured_tau:.2f}")
    if served is not None and served is not winner:
        print(f"the engines serve chains: best confirmed chain {served.label}, {served.shape}: "
              f"{served.measured_speedup:.2f}x")
    print(f"vLLM: speculative_config={json.dumps(vllm)}")
    print(f"SGLang: {sglang}")
    print(f"\nwrote {out / 'tune.json'} and {out / 'tune.png'}")
    return 0
