"""Decode benchmark on the embedded default verifier: every method, chain and tree, at T=0 and T=1 on HumanEval.

    PYTHONPATH=. python scripts/bench_decode.py --out results/bench [--num-prompts 40] [--max-new-tokens 128]
        [--threads 1] [--runs runs/bench] [--temperatures 0 1] [--repeats 1] [--variants eagle3-chain4 ...]
        [--compare vllm] [--eagle3-extra LABEL=DIR ...] [--extra-chains 1 4] [--dflash-extra LABEL=DIR ...]

Verifier: `tiny-code` (built on first use). Drafters, trained with the project's own configs if missing under
`--runs` (or given with --medusa / --eagle1 / --eagle3 / --draft-model):
  medusa-tiny   `python train/medusa.py --config configs/medusa-tiny.yaml`   (4 heads, tree from its accuracies)
  eagle1-tiny   `python train/eagle.py --config configs/eagle1-tiny.yaml`
  eagle3-tiny   `python train/eagle.py --config configs/eagle3-tiny.yaml`
                By default (`--drafter-data selfdistill`) with `--data.source=` the verifier's own greedy
                continuations of stdlib functions cut after their docstring (scripts/selfdistill_data.py): the
                configs' stdlib text is not what the verifier writes after a HumanEval prompt, and a drafter
                trained on it accepts less (measured: EAGLE-3 chain-4 tau 2.38 vs 2.18 on 8 HumanEval prompts).
  draft-1layer  `python scripts/train_draft_model.py --layers 1`: tiny-code cut to its first decoder layer and
                distilled on the stdlib drafter split: one layer + a full-vocabulary lm_head per draft token, about
                an EAGLE drafter's cost, so HF assisted generation with it is the "draft model of similar cost".
Methods (`VARIANTS`, CPU-sized; verifying N+1 tokens costs far more than one on a CPU): autoregressive, ngram,
lookahead decoding (W/N/G small: a step runs 1 + (G + W)(N - 1) tokens),
draft-model chain, Medusa chain and small trees, EAGLE-1 and EAGLE-3 chains and dynamic trees, HF generate,
HF assisted generation with the draft model and with prompt lookup. All on the same prompts, taking turns batch by
batch (eval/measure/harness.py).

`--compare vllm` also runs the chain variants and plain decoding in real vLLM (its CPU build, .venv-vllm:
`bash scripts/setup_vllm.sh`) on the same verifier, drafters and prompts at T=0, at batch 1 and batch 4, and prints
tokens/s and tau (1 + accepted / drafts) beside ours at the same batch sizes, measured in the same run (bench.json
`vllm`). vLLM takes the first token from its prefill, our bench from its first verification step (eval/engine/decoder.py),
so taus differ by that step's share; the interop suite compares the counts in one convention, exactly.

Writes DIR/bench.json (settings, environment, per temperature the full summary of every method, per-step time
profile, the goals with their measured values) and DIR/T{t}/ report.md + plots; prints per method tau, speedup,
efficiency and the throughput ratio to HF assisted generation, then a per-step profile (draft / verify / other
milliseconds per verifier call, against one autoregressive step) and the goals.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: label -> (method, which drafter, options). Sized for CPUs (see README, "Tree sizes on CPU").
VARIANTS: dict[str, tuple[str, str | None, dict]] = {
    "autoregressive": ("autoregressive", None, {}),
    "ngram": ("ngram", None, {"num_draft_tokens": 4}),
    "lookahead-w4n3g4": ("lookahead", None, {"window": 4, "ngram_size": 3, "guesses": 4}),
    "lookahead-w3n4g2": ("lookahead", None, {"window": 3, "ngram_size": 4, "guesses": 2}),
    "draft-model-chain3": ("draft-model", "draft-model", {"num_draft_tokens": 3}),
    "medusa-chain3": ("medusa", "medusa", {"chain": 3}),
    "medusa-tree8": ("medusa", "medusa", {"tree_budget": 8}),
    "medusa-tree16": ("medusa", "medusa", {"tree_budget": 16}),
    "eagle1-chain4": ("eagle", "eagle1", {"chain": 4}),
    "eagle1-tree-d6k2n10": ("eagle", "eagle1", {"depth": 6, "top_k": 2, "total_tokens": 10}),
    "eagle3-chain4": ("eagle", "eagle3", {"chain": 4}),
    "eagle3-chain6": ("eagle", "eagle3", {"chain": 6}),
    "eagle3-tree-d6k2n10": ("eagle", "eagle3", {"depth": 6, "top_k": 2, "total_tokens": 10}),
    "eagle3-tree-d7k3n16": ("eagle", "eagle3", {"depth": 7, "top_k": 3, "total_tokens": 16}),
    "hf": ("hf", None, {}),
    "hf-assisted": ("hf-assisted", None, {"assistant": "draft-model"}),
    "hf-assisted-lookup": ("hf-assisted", None, {"assistant": "prompt-lookup"}),
}
TRAINED = {"medusa": ("train/medusa.py", "configs/medusa-tiny.yaml", "medusa-tiny"),
           "eagle1": ("train/eagle.py", "configs/eagle1-tiny.yaml", "eagle1-tiny"),
           "eagle3": ("train/eagle.py", "configs/eagle3-tiny.yaml", "eagle3-tiny")}
GOALS = {"eagle3_tau_T0": 4.5, "medusa_tau_T0": 2.8, "best_speedup_T0": 2.0, "efficiency_of_best_T0": 0.6,
         "best_over_hf_assisted_T0": 1.5}


def say(*args):
    print(*args, file=sys.stderr, flush=True)


def run_child(cmd: list[str], what: str, threads: int) -> None:
    """Run a training command in a child process (its own progress bar on stderr); fail with its exit code."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS=str(threads))
    say(f"[bench] training {what}: {' '.join(cmd)}")
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"[bench] training {what} failed (exit code {proc.returncode}); command: {' '.join(cmd)}")
    say(f"[bench] {what} trained in {time.perf_counter() - started:.0f} s")


def ensure_selfdistill(args) -> Path:
    """The self-distillation data the drafters train on (`--drafter-data selfdistill`), generated once."""
    data = Path(args.runs) / "selfdistill.jsonl"
    if not data.is_file():
        run_child([sys.executable, "scripts/selfdistill_data.py", "--verifier", args.verifier, "--out", str(data)],
                  "self-distillation data", args.threads)
    return data


def ensure_drafters(args, needed: set[str]) -> dict[str, str]:
    """Drafter folders by key; trained with the tiny configs when missing under --runs (on self-distilled data
    unless --drafter-data config)."""
    runs = Path(args.runs)
    found: dict[str, str] = {}
    for key, (script, config, name) in TRAINED.items():
        if key not in needed:
            continue
        given = getattr(args, key)
        run_dir = runs / (name if args.drafter_data == "config" else f"{name}-selfdistill")
        folder = Path(given) if given else run_dir / "drafter"
        if not (folder / "config.json").is_file():
            if given:
                raise SystemExit(f"--{key} {given}: no exported drafter there (config.json missing)")
            data = []
            if args.drafter_data == "selfdistill":
                data = [f"--data.source={ensure_selfdistill(args)}", "--data.eval_rows=8"]
            run_child([sys.executable, script, "--config", config, "--verifier", args.verifier,
                       "--output_dir", str(run_dir), "--wandb.enabled=false", *data], run_dir.name, args.threads)
        found[key] = str(folder)
    if "draft-model" in needed:
        folder = Path(args.draft_model) if args.draft_model else runs / "draft-1layer"
        if not (folder / "config.json").is_file():
            if args.draft_model:
                raise SystemExit(f"--draft-model {args.draft_model}: no model folder there")
            run_child([sys.executable, "scripts/train_draft_model.py", "--verifier", args.verifier, "--out",
                       str(folder), "--layers", "1", "--steps", str(args.draft_model_steps),
                       "--threads", str(args.threads)], "draft-1layer", args.threads)
        found["draft-model"] = str(folder)
    return found


def extra_exports(method: str, what: str, entries: list[str], drafters: dict) -> list[str]:
    """The labels of `--{method}-extra LABEL=DIR` entries, each DIR registered as drafter `{method}:LABEL`; an entry
    that is not LABEL=DIR with config.json in DIR is refused in one line."""
    labels = []
    for entry in entries:
        label, sep, folder = entry.partition("=")
        if not sep or not label or not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"--{method}-extra {entry}: expected LABEL=DIR with {what} in DIR")
        drafters[f"{method}:{label}"] = folder
        labels.append(label)
    return labels


def add_extra_eagle3(entries: list[str], chains: list[int], drafters: dict) -> list[str]:
    """Register `--eagle3-extra LABEL=DIR` exports as drafters `eagle3:LABEL` with variants eagle3-LABEL-chainK."""
    added = []
    for label in extra_exports("eagle3", "an exported drafter", entries, drafters):
        for k in chains:
            VARIANTS[f"eagle3-{label}-chain{k}"] = ("eagle", f"eagle3:{label}", {"chain": k})
            added.append(f"eagle3-{label}-chain{k}")
    return added


def add_extra_dflash(entries: list[str], drafters: dict) -> list[str]:
    """Register `--dflash-extra LABEL=DIR` exports (export_dflash) as drafters `dflash:LABEL` with variants
    dflash-LABEL: one block of the drafter's block_size per step (scripts/bench_dflash.sh)."""
    added = []
    for label in extra_exports("dflash", "an exported DFlash drafter", entries, drafters):
        VARIANTS[f"dflash-{label}"] = ("dflash", f"dflash:{label}", {})
        added.append(f"dflash-{label}")
    return added


def parallel_draft_cost(profile: dict, drafters: dict) -> dict:
    """Drafter time per step of each parallel drafter's chain against one autoregressive draft pass: the draft
    milliseconds of an autoregressive EAGLE-3 chain of 1 (one drafter forward over the committed tokens and one
    lm_head) in the same run. {variant: {draft_ms, reference, reference_draft_ms, ratio}}."""
    parallel = {key for key, folder in drafters.items() if key.startswith("eagle3")
                and json.loads((Path(folder) / "config.json").read_text()).get("draftheads", {})
                .get("eagle", {}).get("parallel")}
    references = [v for v in profile if v.endswith("-chain1") and VARIANTS.get(v, ("", None))[1] not in parallel
                  and VARIANTS.get(v, ("", None))[0] == "eagle"]
    if not references:
        return {}
    ref = references[0]
    return {v: {"draft_ms": r["draft_ms"], "reference": ref, "reference_draft_ms": profile[ref]["draft_ms"],
                "ratio": r["draft_ms"] / profile[ref]["draft_ms"]}
            for v, r in profile.items() if VARIANTS.get(v, ("", None))[1] in parallel}


def step_profile(summary: dict) -> dict:
    """Per verifier call: drafter, verifier and other milliseconds (engine methods, from the timed calls), and the
    step's cost relative to one autoregressive step."""
    rows = {}
    for label, row in summary.items():
        phases, calls = row.get("phase_seconds"), row.get("verifier_calls")
        if not phases or not calls:
            continue
        decode = phases["draft"] + phases["verify"] + phases["other"]
        rows[label] = {"draft_ms": 1e3 * phases["draft"] / calls, "verify_ms": 1e3 * phases["verify"] / calls,
                       "other_ms": 1e3 * phases["other"] / calls, "step_ms": 1e3 * decode / calls,
                       "prefill_ms_per_prompt": 1e3 * phases["prefill"] / max(row["num_samples"], 1)}
    base = rows.get("autoregressive", {}).get("step_ms")
    for r in rows.values():
        r["x_autoregressive_step"] = r["step_ms"] / base if base else None
    return rows


def goals(results: dict) -> dict:
    """The issue's goals, measured (at T=0), each with its target and whether it was met."""
    s = results.get("0.0", {}).get("summary")
    if not s:
        return {}
    engine = {k: v for k, v in s.items() if v["method"] not in ("hf", "hf-assisted", "autoregressive")}
    pick = lambda prefix: max((v["tau"] for k, v in s.items() if k.startswith(prefix)), default=None)  # noqa: E731
    best = max(engine, key=lambda k: engine[k]["speedup"] or 0.0) if engine else None
    measured = {"eagle3_tau_T0": pick("eagle3"), "medusa_tau_T0": pick("medusa"),
                "best_speedup_T0": engine[best]["speedup"] if best else None,
                "efficiency_of_best_T0": engine[best]["efficiency"] if best else None,
                "best_over_hf_assisted_T0": (engine[best]["tokens_per_s"] / s["hf-assisted"]["tokens_per_s"]
                                             if best and "hf-assisted" in s else None)}
    return {k: {"measured": measured[k], "goal": g, "met": measured[k] is not None and measured[k] >= g,
                **({"method": best} if k in ("best_speedup_T0", "efficiency_of_best_T0",
                                             "best_over_hf_assisted_T0") else {})}
            for k, g in GOALS.items()}


def print_tables(temperature: str, summary: dict, profile: dict) -> None:
    hf_tps = summary.get("hf-assisted", {}).get("tokens_per_s")
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    print(f"\n### T = {temperature}\n")
    print("| method | tau | speedup | efficiency | tokens/s | x HF assisted | per-position acceptance |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, row in summary.items():
        ratio = row["tokens_per_s"] / hf_tps if hf_tps and row["tokens_per_s"] else None
        pos = row.get("per_position_acceptance")
        print(f"| {label} | {f(row['tau'])} | {f(row['speedup'])}x | {f(row['efficiency'])} | "
              f"{f(row['tokens_per_s'], 1)} | {f(ratio)} | {' '.join(f'{p:.2f}' for p in pos) if pos else '-'} |")
    print("\nPer verifier call (ms): draft | verify | other | step | x autoregressive step\n")
    print("| method | draft | verify | other | step | x AR step |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in profile.items():
        print(f"| {label} | {r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['other_ms']:.2f} | {r['step_ms']:.2f} | "
              f"{f(r['x_autoregressive_step'])} |")


VLLM_BATCHES = (1, 4)


def vllm_method(variant: str) -> tuple[str | None, int] | None:
    """(vLLM's speculative method or None for plain decoding, k) of a variant vLLM can run: plain and chains."""
    method, drafter, options = VARIANTS[variant]
    if method == "autoregressive":
        return None, 0
    if "chain" not in options or method not in ("medusa", "eagle"):
        return None
    return ("medusa" if method == "medusa" else drafter.split(":")[0]), options["chain"]


def compare_vllm(args, verifier, drafters: dict, prompts: list, variants: list[str]) -> dict:
    """Chains and plain decoding in vLLM and in our engine at VLLM_BATCHES, T = 0: tokens/s and tau side by side."""
    from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm
    from draftheads.eval.measure.harness import MethodSpec, RunSettings, run_methods
    from draftheads.eval.measure.metrics import summarize

    chosen = [v for v in variants if vllm_method(v) is not None]
    ids = [p[1] for p in prompts]
    cases = []
    for v in chosen:
        method, k = vllm_method(v)
        method = {"eagle1": "eagle", "eagle3": "eagle3"}.get(method, method)
        for B in VLLM_BATCHES:
            cases.append(VllmCase(f"{v}@{B}", str(verifier.path), drafters.get(VARIANTS[v][1]), method,
                                  batches=[ids[i:i + B] for i in range(0, len(ids), B)], k=max(k, 1),
                                  max_tokens=args.max_new_tokens, repeat=args.repeats, ignore_eos=False,
                                  max_model_len=max(map(len, ids)) + args.max_new_tokens + 16))
    say(f"[bench] vLLM: {len(cases)} runs ({', '.join(chosen)} at batch {' and '.join(map(str, VLLM_BATCHES))})")
    theirs = {c["name"]: c for c in run_vllm(cases)["cases"]}
    rows = []
    for B in VLLM_BATCHES:
        specs = [MethodSpec(VARIANTS[v][0], drafters.get(VARIANTS[v][1]), dict(VARIANTS[v][2]), label=v)
                 for v in chosen]
        ours = {run.label: run for run in run_methods(verifier, specs, prompts, RunSettings(
            args.max_new_tokens, 0.0, 1.0, B, args.seed, args.repeats), desc=f"ours@{B}")}
        for v in chosen:
            mine, case = summarize(ours[v]), theirs[f"{v}@{B}"]
            row = {"variant": v, "batch": B, "ours_tokens_per_s": mine["tokens_per_s"], "ours_tau": mine["tau"]}
            if case["ok"]:
                tokens = sum(b["tokens"] for b in case["batches"])
                seconds = sum(b["generate_s"] for b in case["batches"])
                drafts = sum(b["metrics"].get("vllm:spec_decode_num_drafts", 0) for b in case["batches"])
                accepted = sum(b["metrics"].get("vllm:spec_decode_num_accepted_tokens", 0) for b in case["batches"])
                row.update(vllm_tokens_per_s=tokens / seconds, vllm_tau=1 + accepted / drafts if drafts else 1.0)
            else:
                row["vllm_error"] = case.get("error")
            rows.append(row)
    print("\nvLLM beside our engine (T = 0, the same prompts; tokens/s of whole generate calls):\n")
    print("| variant | batch | ours tokens/s | vLLM tokens/s | vLLM / ours | ours tau | vLLM tau |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "vllm_error" in r:
            print(f"| {r['variant']} | {r['batch']} | {r['ours_tokens_per_s']:.1f} | refused: {r['vllm_error'][:80]} "
                  f"| - | {r['ours_tau']:.2f} | - |")
            continue
        print(f"| {r['variant']} | {r['batch']} | {r['ours_tokens_per_s']:.1f} | {r['vllm_tokens_per_s']:.1f} | "
              f"{r['vllm_tokens_per_s'] / r['ours_tokens_per_s']:.2f} | {r['ours_tau']:.2f} | {r['vllm_tau']:.2f} |")
    return {"rows": rows, "batches": list(VLLM_BATCHES)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--verifier", default="tiny-code")
    p.add_argument("--runs", default="runs/bench", help="where missing drafters (and their data) are trained")
    p.add_argument("--medusa", default=None, help="an existing Medusa export (skips training)")
    p.add_argument("--eagle1", default=None, help="an existing EAGLE-1 export")
    p.add_argument("--eagle3", default=None, help="an existing EAGLE-3 export")
    p.add_argument("--draft-model", default=None, help="an existing draft model folder")
    p.add_argument("--draft-model-steps", type=int, default=200)
    p.add_argument("--drafter-data", choices=["selfdistill", "config"], default="selfdistill",
                   help="train missing drafters on HumanEval-shaped self-distillation data "
                        "(scripts/selfdistill_data.py), or on the configs' own data (stdlib text)")
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: see the README on shared CPUs)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--compare", choices=["vllm"], help="also run plain decoding and the chains in real vLLM")
    p.add_argument("--eagle3-extra", nargs="+", default=[], metavar="LABEL=DIR",
                   help="more EAGLE-3 exports side by side (recipes, scripts/bench_eagle_recipes.sh): variants "
                        "eagle3-LABEL-chainK for each --extra-chains K")
    p.add_argument("--extra-chains", type=int, nargs="+", default=[4])
    p.add_argument("--dflash-extra", nargs="+", default=[], metavar="LABEL=DIR",
                   help="DFlash exports side by side (scripts/bench_dflash.sh): variants dflash-LABEL, a block per step")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from draftheads.data.prompts import load_prompts, prompt_ids
    from draftheads.eval.measure.harness import MethodSpec, RunSettings, run_methods
    from draftheads.eval.measure.report import build_results, environment, write_report
    from draftheads.models.verifier import Verifier

    torch.set_num_threads(args.threads)
    variants = ["autoregressive"] + [v for v in args.variants if v != "autoregressive"]
    needed = {VARIANTS[v][1] for v in variants} - {None}
    if "hf-assisted" in variants:
        needed.add("draft-model")
    extra: dict[str, str] = {}
    variants += add_extra_eagle3(args.eagle3_extra, args.extra_chains, extra)  # refused before anything trains
    variants += add_extra_dflash(args.dflash_extra, extra)
    drafters = {**ensure_drafters(args, needed), **extra}
    if "hf-assisted" in variants and not any(VARIANTS[v][0] == "draft-model" for v in variants):
        variants.insert(1, "draft-model-chain3")  # HF's assistant is the draft-model run's model

    verifier = Verifier.from_pretrained(args.verifier, dtype=torch.float32)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier.path)
    prompts = [(p.id, prompt_ids(p, tokenizer)) for p in load_prompts(args.prompts, args.num_prompts)]
    specs = [MethodSpec(VARIANTS[v][0], drafters.get(VARIANTS[v][1]), dict(VARIANTS[v][2]), label=v)
             for v in variants]
    started = time.perf_counter()
    bench = {"command": " ".join(["python scripts/bench_decode.py", *(sys.argv[1:] if argv is None else argv)]),
             "verifier": args.verifier, "verifier_fingerprint": verifier.fingerprint, "drafters": drafters,
             "variants": {v: {"method": VARIANTS[v][0], "drafter": VARIANTS[v][1], "options": VARIANTS[v][2]}
                          for v in variants},
             "settings": {"prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                          "threads": args.threads, "repeats": args.repeats, "seed": args.seed},
             "environment": environment("cpu", torch.float32), "results": {}}
    for t in args.temperatures:
        settings = RunSettings(args.max_new_tokens, t, 1.0, 1, args.seed, args.repeats)
        say(f"[bench] T={t}: {len(variants)} methods x {len(prompts)} prompts, {args.threads} thread(s)")
        runs = run_methods(verifier, specs, prompts, settings, desc=f"T={t}")
        config = {"command": bench["command"], "verifier": args.verifier, "prompts": args.prompts,
                  "settings": vars(settings), "methods": bench["variants"]}
        results = build_results(runs, config, environment("cpu", torch.float32))
        write_report(results, Path(args.out) / f"T{t:g}")
        profile = step_profile(results["summary"])
        cost = parallel_draft_cost(profile, drafters)
        bench["results"][str(float(t))] = {"summary": results["summary"], "step_profile": profile,
                                           "parallel_draft_cost": cost}
        print_tables(str(t), results["summary"], profile)
        for v, c in cost.items():
            print(f"- {v}: drafter {c['draft_ms']:.2f} ms per step = {c['ratio']:.2f}x one autoregressive draft "
                  f"pass ({c['reference']}: {c['reference_draft_ms']:.2f} ms)")
    if args.compare == "vllm":
        bench["vllm"] = compare_vllm(args, verifier, drafters, prompts, variants)
    bench["goals"] = goals(bench["results"])
    bench["wall_time_s"] = round(time.perf_counter() - started, 1)
    bench["environment"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")
    print("\nGoals (T = 0):\n")
    for k, g in bench["goals"].items():
        m = g["measured"]
        print(f"- {k}: {'-' if m is None else f'{m:.2f}'} (goal >= {g['goal']}) {'met' if g['met'] else 'MISSED'}"
              + (f" [{g['method']}]" if g.get("method") else ""))
    print(f"\nwrote {out / 'bench.json'} ({bench['wall_time_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
