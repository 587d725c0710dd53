"""Evaluate drafters: tau, per-position acceptance and wall-clock speedup beside plain decoding and Hugging Face.
(`draftheads tune ...` chooses a method and draft length from measurements: eval/measure/tune.py.)

    draftheads eval --verifier tiny-code --method eagle --draft runs/eagle3-tiny/drafter \\
        --prompts humaneval --num-prompts 20 --max-new-tokens 128 --out results/eagle3 \\
        [--compare hf,hf-assisted] [--option depth=5 --option top_k=3] [--wandb]

    # several drafters in one table: --method/--draft pairs (a draft goes to the next method that takes one)
    draftheads eval --verifier tiny-code --method medusa --draft runs/medusa-tiny/drafter \\
        --method eagle3=eagle --draft runs/eagle3-tiny/drafter --option eagle3.chain=3 --prompts humaneval ...

Always runs `autoregressive` too (the speedup is over it, measured in the same run on the same prompts; methods
take turns batch by batch). Writes DIR/results.json (summary per method, one sample per prompt with its
prompt_ids / output_ids / accepted counts per verifier call, the command, settings and environment), DIR/report.md
and PNG plots, prints the markdown table; `--wandb` logs the same to wandb (offline without an API key).
`draftheads recheck DIR/results.json` re-checks greedy outputs against plain greedy decoding.

Methods and options (`--option KEY=VALUE` for every method that has KEY, `--option LABEL.KEY=VALUE` for one;
values are YAML: 3, true, [3, 2, 1], [[0], [1], [0, 0]]):
    autoregressive
    ngram         num_draft_tokens=4 max_ngram=3 min_ngram=1
    lookahead     window=4 ngram_size=3 guesses=4 context_pool=true (lookahead decoding: W, N, G)
    draft-model   num_draft_tokens=4 | branching=[3,2,1]; tree_sampling=sample|topk
    medusa        (the export's tree) | paths=[[0],[1],[0,0]] | tree_budget=N | chain=K; acceptance=typical
    eagle         depth=6 top_k=4 total_tokens=16 (EAGLE-2 dynamic tree) | chain=K
    dflash        num_draft_tokens=K (default: the drafter's block_size - 1, drafted in one forward)
    hf            Hugging Face generate (greedy / sampling exactly as the engine)
    hf-assisted   HF assisted generation: assistant_model = the draft-model run's model, else prompt lookup;
                  assistant=draft-model|prompt-lookup prompt_lookup_num_tokens=4 max_matching_ngram_size=3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from draftheads.eval.measure.cli_common import (  # shared with eval/measure/tune.py
    UsageError,
    encode_prompts,
    hold_out_folder,
    load_tokenizer,
    report_errors,
)
from draftheads.models.atomic import folder_problem

ENGINE_METHODS = ("autoregressive", "ngram", "lookahead", "draft-model", "medusa", "eagle", "dflash", "mtp")
NEEDS_DRAFT = ("draft-model", "medusa", "eagle", "dflash")
COMPARE = ("autoregressive", "hf", "hf-assisted")
HF_ASSISTED_OPTIONS = ["assistant", "prompt_lookup_num_tokens", "max_matching_ngram_size"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftheads eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", required=True, help="model folder, hub id, or embedded name (tiny-code, tiny-micro)")
    p.add_argument("--method", action="append", default=None, metavar="[LABEL=]METHOD",
                   help=f"one of {', '.join(ENGINE_METHODS)}; repeat for several (default autoregressive)")
    p.add_argument("--draft", action="append", default=[], metavar="PATH",
                   help="drafter of the next --method that takes one (draft model folder, Medusa/EAGLE/DFlash export)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="[LABEL.]KEY=VALUE",
                   help="method option (YAML value); repeatable")
    p.add_argument("--prompts", required=True, help="humaneval, mt-bench, a question.jsonl or any .jsonl/.json file")
    p.add_argument("--num-prompts", type=int, default=None, help="first K prompts (default all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--out", required=True, help="output folder (results.json, report.md, *.png)")
    p.add_argument("--compare", default="", help=f"comma list of {', '.join(COMPARE)} (autoregressive always runs)")
    p.add_argument("--wandb", action="store_true", help="log to wandb (offline unless an API key is configured)")
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--seed", type=int, default=0, help="batch i samples with seed + i")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--fused", action="store_true", help="the engine's fused CUDA decode loop")
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="verifier and drafter dtype (float32: greedy output is exactly the verifier's)")
    p.add_argument("--repeats", type=int, default=1, help="time each batch this many times, keep the fastest")
    p.add_argument("--chat-template", default=None, help="for chat prompts: a template file or string")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def _yaml_value(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def method_specs(methods: list[str] | None, drafts: list[str], options: list[str], compare: str, fused: bool):
    """The MethodSpecs of a command line: --method/--draft pairs, options, the comparisons; autoregressive is put
    first if not asked for (it is the baseline)."""
    import inspect

    from draftheads.eval.drafters import METHODS
    from draftheads.eval.measure.harness import MethodSpec

    specs, drafts = [], list(drafts)
    for entry in methods or ["autoregressive"]:
        label, _, method = entry.rpartition("=")
        if method not in ENGINE_METHODS:
            raise UsageError(f"--method {entry}: unknown method {method!r}; expected one of {', '.join(ENGINE_METHODS)}"
                             + (" (hf and hf-assisted go in --compare)" if method in COMPARE else ""))
        draft = None
        if method in NEEDS_DRAFT:
            if not drafts:
                raise UsageError(f"--method {entry} needs a --draft (give one --draft per draft-model/medusa/eagle "
                                 "method, in order)")
            draft = drafts.pop(0)
        specs.append(MethodSpec(method, draft, {}, label or None, fused=fused))
    if drafts:
        raise UsageError(f"--draft {' '.join(drafts)}: more drafts than methods that take one "
                         f"({', '.join(NEEDS_DRAFT)})")
    for name in [c.strip() for c in compare.split(",") if c.strip()]:
        if name not in COMPARE:
            raise UsageError(f"--compare {compare}: unknown {name!r}; expected a comma list of {', '.join(COMPARE)}")
        if name not in [s.label for s in specs]:
            specs.append(MethodSpec(name))
    if "autoregressive" not in [s.label for s in specs]:
        specs.insert(0, MethodSpec("autoregressive"))
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise UsageError(f"--method: the label(s) {', '.join(dup)} appear twice; name them, e.g. "
                         f"--method {dup[0]}2={dup[0]}")
    accepted = {s.label: list(inspect.signature(METHODS[s.method]).parameters)[4:] if s.method in METHODS else
                HF_ASSISTED_OPTIONS if s.method == "hf-assisted" else [] for s in specs}
    for entry in options:
        key, eq, value = entry.partition("=")
        if not eq or not key:
            raise UsageError(f"--option {entry}: expected KEY=VALUE or LABEL.KEY=VALUE")
        target, _, name = key.rpartition(".")
        if target and target not in accepted:
            raise UsageError(f"--option {entry}: no method labelled {target!r} (labels: {', '.join(accepted)})")
        targets = [target] if target else [label for label, names in accepted.items() if name in names]
        if not targets or name not in accepted[targets[0]]:
            where = f"method {target!r}" if target else "any method of this run"
            have = {label: names for label, names in accepted.items() if names}
            raise UsageError(f"--option {entry}: {where} has no option {name!r}; options: {have}")
        for label in targets:
            next(s for s in specs if s.label == label).options[name] = _yaml_value(value)
    return specs


def check_draft_tokenizer(specs, tokenizer) -> None:
    """A draft model must share the verifier's tokens: refuse a folder whose tokenizer differs."""
    from transformers import AutoTokenizer

    for spec in specs:
        if spec.method != "draft-model" or not isinstance(spec.draft, str) or not Path(spec.draft).is_dir():
            continue
        folder = Path(spec.draft)
        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            continue
        theirs = AutoTokenizer.from_pretrained(folder)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise UsageError(f"--draft {spec.draft}: its tokenizer differs from the verifier's ({len(theirs)} vs "
                             f"{len(tokenizer)} tokens); a draft model must use the verifier's tokenizer")


def draft_digest(draft) -> str | None:
    """A drafter folder by content (data/identity.py): what results.json records of each --draft."""
    if not isinstance(draft, str) or not Path(draft).is_dir():
        return None
    from draftheads.data.identity import folder_digest

    return folder_digest(draft)


def check_args(args) -> None:
    """Every flag in range and the output folder writable, before anything is loaded or decoded."""
    positive = {"--max-new-tokens": args.max_new_tokens, "--batch-size": args.batch_size, "--repeats": args.repeats}
    if args.num_prompts is not None:
        positive["--num-prompts"] = args.num_prompts
    if args.threads is not None:
        positive["--threads"] = args.threads
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} {value}: expected a positive number")
    if args.temperature < 0:
        raise UsageError(f"--temperature {args.temperature}: expected >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: expected 0 < top_p <= 1")
    out = Path(args.out)
    problem = folder_problem(out, f"--out {args.out}")
    if problem:
        raise UsageError(problem)
    args.wandb_mode = None
    if args.wandb:  # no API key, no network, a read-only HOME: settled now, not after the run
        from draftheads.eval.measure.wandb_check import TrackingError, prepare_wandb

        try:
            args.wandb_mode, notes = prepare_wandb("auto", out, "WANDB_MODE")
        except TrackingError as err:
            raise UsageError(str(err)) from None
        for note in notes:
            print(note, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:  # draftheads tune ...: choose the method and draft length (eval/measure/tune.py)
        from draftheads.eval.measure.tune import main as tune

        return tune(argv[1:])
    args = parser().parse_args(argv)

    def checked_run():
        with hold_out_folder(args.out):
            check_args(args)
            return run(args, argv)

    return report_errors(checked_run)


def run(args, argv=None) -> int:
    import torch

    from draftheads.data.progress import quiet
    from draftheads.data.prompts import load_prompts
    from draftheads.eval.measure.harness import RunSettings, run_methods
    from draftheads.eval.measure.report import (
        build_results,
        command_line,
        environment,
        log_wandb,
        summary_table,
        write_report,
    )
    from draftheads.models.verifier import Verifier

    say = (lambda *a: None) if quiet() else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    specs = method_specs(args.method, args.draft, args.option, args.compare, args.fused)
    primary = specs[0].label if not args.method else args.method[0].rpartition("=")[0] or args.method[0]
    settings = RunSettings(args.max_new_tokens, args.temperature, args.top_p, args.batch_size, args.seed,
                           args.repeats)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()

    say(f"[eval] loading verifier {args.verifier} ({device}, {args.dtype})")
    verifier = Verifier.from_pretrained(args.verifier, dtype=dtype, device=device,
                                        trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(verifier, args.trust_remote_code)
    check_draft_tokenizer(specs, tokenizer)
    prompts = encode_prompts(load_prompts(args.prompts, args.num_prompts), tokenizer, args.chat_template,
                             getattr(verifier.config, "max_position_embeddings", None), args.max_new_tokens)
    say(f"[eval] {len(prompts)} prompts from {args.prompts}; methods: {', '.join(s.label for s in specs)}; "
        f"{torch.get_num_threads()} torch thread(s)")
    runs = run_methods(verifier, specs, prompts, settings, dtype=dtype)

    content = verifier.content()
    config = {"command": command_line(sys.argv[1:] if argv is None else list(argv)),
              "verifier": args.verifier, "verifier_fingerprint": verifier.fingerprint,
              "verifier_digest": content["digest"] if content else None,
              "verifier_files": content["files"] if content else None, "prompts": args.prompts,
              "num_prompts": len(prompts), "settings": vars(settings),
              "methods": [{"label": s.label, "method": s.method, "draft": str(s.draft) if s.draft else None,
                           "draft_digest": draft_digest(s.draft), "options": s.options} for s in specs],
              "args": vars(args)}
    results = build_results(runs, config, environment(device, dtype), primary=primary)
    results["wall_time_s"] = round(time.perf_counter() - started, 1)
    paths = write_report(results, args.out)
    print(summary_table(results["summary"]))
    print(f"\nwrote {paths['results']}, {paths['report']} and {len(paths) - 2} plots")
    if args.wandb:
        folder = log_wandb(results, args.out, project=args.wandb_project, mode=args.wandb_mode)
        print(f"wandb: logged to {folder}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
