"""Does the backend that captured a feature cache change the drafter trained from it? EAGLE-3 on the embedded micro
verifier, trained from a Hugging Face cache and from the cache of `draftheads regenerate --backend vllm --capture`
(one vLLM engine answers and captures), same rows and seeds; their acceptance lengths side by side.

    python scripts/capture_backend_tau.py --seeds 0 1 2 --steps 80 --rows 96 \\
        --write docs/benchmarks/capture-backend-tau.md

Per seed s (train.seed decides the rows' order and the held-out split, which a cache records, so each seed has its
own caches): `regenerate --backend vllm --capture` answers --rows stdlib rows (the first --prefix-tokens tokens of a
file, continued for --max-new-tokens at T = 0) into seed-s/regen.jsonl and captures the training rows into
seed-s/one-pass; `dump-features` (HF) captures the same rows into seed-s/hf, and for the first seed also
`dump-features --backend vllm` into seed-0/vllm. Then `train/eagle.py --features=offline` from each cache, the same
config and seed; tau is the trainer's own end-of-run figure (eval/tau: the exported drafter decoding the held-out
rows greedily through our engine, counting the bonus token). Features are compared at the rows' real tokens (the
one-pass cache stores padding as zeros). Work files go under --work (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSISTENCY_NEW_TOKENS = 64


def config_args(out: Path, output_dir: Path, seed: int, args) -> list[str]:
    """The training run, as `--key=value` overrides of configs/eagle3-tiny.yaml for the micro verifier."""
    return ["--config", str(ROOT / "configs" / "eagle3-tiny.yaml"), "--verifier=tiny-micro",
            f"--data.source={out}", f"--output_dir={output_dir}", f"--data.seq_len={args.seq_len}",
            f"--data.eval_rows={args.eval_rows}", f"--train.seed={seed}", f"--train.max_steps={args.steps}",
            "--train.save_every=0", "--train.eval_every=0", f"--train.log_every={args.steps}",
            "--train.mixed_precision=no", f"--train.warmup_steps={max(1, args.steps // 10)}",
            "--eagle.layer_ids=[1,2,3]",
            "--eagle.draft_vocab_size=512", "--wandb.enabled=false", f"--consistency.num_prompts={args.eval_rows}",
            f"--consistency.max_new_tokens={CONSISTENCY_NEW_TOKENS}"]


def real_diff(a: Path, b: Path) -> float:
    """Max abs difference of two caches' features at the real tokens of every row (token columns must agree)."""
    import torch
    from safetensors.torch import load_file

    worst = 0.0
    for path in sorted(a.glob("*.safetensors")):
        x, y = load_file(path), load_file(b / path.name)
        if not torch.equal(x["input_ids"], y["input_ids"]):
            raise SystemExit(f"{path.name}: the caches hold other rows")
        real = x["attention_mask"].bool()  # (N, T)
        worst = max(worst, float((x["final"][real] - y["final"][real]).abs().max()))
        worst = max(worst, float((x["layers"].transpose(1, 2)[real] - y["layers"].transpose(1, 2)[real]).abs().max()))
    return worst


def train_tau(cfg_args: list[str], cache: Path) -> float:
    from draftheads.train.config import parse_config
    from draftheads.train.eagle import EagleRunConfig, main
    from draftheads.train.tracking import reset_accelerate

    reset_accelerate()
    main(parse_config(EagleRunConfig, [*cfg_args, "--features=offline", f"--feature_cache={cache}"]))
    reset_accelerate()
    output_dir = Path(next(a.split("=", 1)[1] for a in cfg_args if a.startswith("--output_dir=")))
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["eval/tau"] for r in reversed(records) if "eval/tau" in r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--rows", type=int, default=96, help="stdlib rows answered (before the held-out split)")
    p.add_argument("--eval-rows", type=int, default=8, help="held-out rows: tau's prompts")
    p.add_argument("--prefix-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--write", type=Path, default=None, help="write the table as a markdown page here")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from draftheads.data.hidden_states import read_index
    from draftheads.train.config import parse_config
    from draftheads.train.dump_features import dump
    from draftheads.train.eagle import EagleRunConfig
    from draftheads.train.regenerate import main as regenerate
    from draftheads.train.tracking import reset_accelerate

    work = args.work or Path(tempfile.mkdtemp(prefix="capture-backend-tau-"))
    started = time.perf_counter()
    rows, diffs, served = [], {}, []
    for seed in args.seeds:
        here = work / f"seed-{seed}"
        out = here / "regen.jsonl"
        cfg_args = config_args(out, here / "run-one-pass", seed, args)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            regenerate(["--backend", "vllm", "--source", "stdlib", "--out", str(out), "--num-rows", str(args.rows),
                        "--prefix-tokens", str(args.prefix_tokens), "--max-new-tokens", str(args.max_new_tokens),
                        "--capture", str(here / "one-pass"), "--capture-dtype", "float32", *cfg_args])
        served.append(printed.getvalue().strip().splitlines()[-1].split("prefix cache served ")[1].split(" of")[0])
        print(f"[tau] seed {seed}: {printed.getvalue().strip().splitlines()[-1]}", flush=True)
        cfg = parse_config(EagleRunConfig, cfg_args)
        backends = ["hf", "vllm"] if seed == args.seeds[0] else ["hf"]
        for backend in backends:
            reset_accelerate()
            dump(cfg, here / backend, dtype="float32", say=lambda *a, **k: None, backend=backend)
        reset_accelerate()
        if seed == args.seeds[0]:
            diffs = {"dump-features --backend vllm": real_diff(here / "one-pass", here / "vllm")}
        diffs[f"HF, seed {seed}"] = real_diff(here / "one-pass", here / "hf")
        taus = {}
        for name, cache in (("hf", here / "hf"), ("one-pass", here / "one-pass")):
            taus[name] = train_tau(config_args(out, here / f"run-{name}", seed, args), cache)
        n_train = read_index(here / "one-pass")["splits"]["train"]["rows"]
        rows.append((seed, n_train, taus["hf"], taus["one-pass"]))
        print(f"[tau] seed {seed}: tau HF cache {taus['hf']:.3f}, one-pass vLLM cache {taus['one-pass']:.3f} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)

    result = {"rows": rows, "diffs": diffs, "served": served, "seconds": round(time.perf_counter() - started),
              "settings": {k: getattr(args, k) for k in ("seeds", "steps", "rows", "eval_rows")}}
    (work / "result.json").write_text(json.dumps(result, indent=1))
    page = render(result)
    print(page)
    if args.write:
        from draftheads.models.atomic import write_text

        write_text(args.write, page)
        print(f"wrote {args.write} (the figures: {work / 'result.json'})")
    return 0


def render(result: dict) -> str:
    """The markdown page of one run's figures (`result.json` under --work)."""
    import textwrap

    rows, diffs, served, settings = result["rows"], result["diffs"], result["served"], result["settings"]
    hf_diff = max(v for k, v in diffs.items() if k.startswith("HF"))
    table = ["| seed | train rows | tau, HF cache | tau, one-pass vLLM cache |", "|---:|---:|---:|---:|"]
    table += [f"| {s} | {n} | {a:.3f} | {b:.3f} |" for s, n, a, b in rows]
    table.append(f"| mean | | {statistics.mean(r[2] for r in rows):.3f} | {statistics.mean(r[3] for r in rows):.3f} |")
    seeds = " ".join(map(str, settings["seeds"]))
    command = (f"python scripts/capture_backend_tau.py --seeds {seeds} --steps {settings['steps']} "
               f"--rows {settings['rows']}")

    def para(text: str) -> str:
        return textwrap.fill(" ".join(text.split()), width=118, break_on_hyphens=False, break_long_words=False)

    intro = para(f"""EAGLE-3 trained from the cache that `draftheads regenerate --backend vllm --capture` writes (one
        vLLM engine answers the rows and captures their hidden states) against EAGLE-3 trained from the Hugging Face cache
        of the same rows, same config and seed: the embedded micro verifier (4 layers, hidden 128), {settings['steps']}
        steps, fp32, this CPU. tau is the trainer's end-of-run figure: the exported drafter on {settings['eval_rows']}
        held-out rows, {CONSISTENCY_NEW_TOKENS} new tokens each, greedy, the bonus token counted.""")
    summary = para(f"""Max abs feature difference at the rows' real tokens, the one-pass cache against `dump-features
        --backend vllm` of the same rows: {diffs['dump-features --backend vllm']:.3g}; against the HF cache:
        {hf_diff:.3g} (fp32). vLLM's prefix cache served {', '.join(served)} of the captured tokens (seeds
        {', '.join(map(str, settings['seeds']))}).""")
    how = para(f"""`{command}` ({result['seconds']} s on 2 shared CPU cores); each seed answers and captures its own
        rows, as train.seed orders them and picks the held-out ones.""")
    return "# Capture backend and tau\n\n" + intro + "\n\n" + "\n".join(table) + "\n\n" + summary + "\n\n" + how + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
