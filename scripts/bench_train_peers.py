"""Training throughput side by side: our EAGLE-3 trainer (features online and offline) against speculators 0.9.0 and
SpecForge 0.2.0 on the same rows with the peer bench's matched settings, each trainer one thread, in rounds.

    python scripts/bench_train_peers.py --verifier tiny-micro --out runs/thr-tiny-micro [--rows 96] [--epochs 1]
        [--rounds 2] [--batch 4] [--flags '--train.x=y'] [--peers speculators specforge]

The rows, the features in each peer's format, and every trainer's command are scripts/bench_peers.py's (its
functions, imported): `--batch` documents per optimizer step for every trainer (ours packs them into rows of
256 tokens, document masks on; the peers' own packing / one row per micro-batch), 7 TTT steps, KL on the draft
vocabulary, fp32, AdamW; `--flags` adds options to our trainer's command. Nothing is served: this is the training
loop's speed only. Every trainer runs with OMP_NUM_THREADS=1 (one torch thread each: on a shared
machine two OpenMP threads spin against the other processes and slow down unevenly), one after the other, in
`--rounds` rounds whose order alternates. Reported per trainer: the median over rounds of training tokens per
second of wall clock and per second of its process's CPU time (ours: `train/tokens_per_cpu_s` weighted over its
log intervals; the peers: the tokens their loops saw over the process time of those loops, from their runners),
and ours over each peer. The CPU-time rate is the one a loaded machine bends least; JSON to OUT/speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import torch

import bench_peers as peers  # this script's folder is on the path: the peer bench's rows, dumps and trainer commands


def our_rates(run_dir: Path) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second) of one of our runs, from its metrics.jsonl: the log intervals'
    rates combined as total tokens over total time (an interval's tokens are proportional to its steps)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows, last = [], 0
    for r in records:
        if "train/tokens_per_s" in r:
            rows.append((r["step"] - last, r["train/tokens_per_s"], r["train/tokens_per_cpu_s"]))
            last = r["step"]
    steps = sum(n for n, _, _ in rows)
    return steps / sum(n / wall for n, wall, _ in rows), steps / sum(n / cpu for n, _, cpu in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="tiny-micro")
    p.add_argument("--out", required=True)
    p.add_argument("--peers", nargs="*", default=list(peers.PEERS), choices=peers.PEERS)
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="rows (documents) per optimizer step, for every trainer")
    p.add_argument("--seed", type=int, default=0, help="every trainer's seed")
    p.add_argument("--flags", default="",
                   help="extra options for our trainer, split as a shell would, e.g. '--data.packing=stream'")
    args = p.parse_args(argv)
    try:
        flags = tuple(shlex.split(args.flags))
    except ValueError as e:
        p.error(f"--flags {args.flags!r}: cannot split it as a shell would ({e})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.reuse = False  # every round trains afresh: the rounds are the measurement
    os.environ["OMP_NUM_THREADS"] = "1"  # every trainer below inherits it

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from draftheads.models.verifier import Verifier, resolve_verifier

    args.verifier_path = resolve_verifier(args.verifier)
    verifier = Verifier.from_pretrained(args.verifier_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(verifier.path)
    layer_ids, vocab = peers.drafter_settings(verifier)
    rows = peers.our_rows(tokenizer, peers.write_docs_jsonl(tokenizer, args.rows, args.seq_len, args.batch, out), args.rows,
                          args.seq_len)
    args.rows = len(rows)
    tokens = sum(len(r["input_ids"]) for r in rows)
    peers.say(f"{len(rows)} rows, {tokens} tokens, {args.epochs} epoch(s), {args.rounds} rounds, one thread each")

    def ours(features: str) -> dict:
        run = peers.train_ours(args, out, layer_ids, vocab, tokens, features, f"draftheads-{features}",
                               flags=flags)
        wall, cpu = our_rates(out / f"draftheads-{features}")
        return {"wall": wall, "cpu": cpu, "how": run["how"]}

    def peer(name: str) -> dict:
        data = out / f"{name}-data"
        if name == "speculators":
            r = peers.train_speculators(args, out, data, layer_ids, vocab, tokens, name)
            rep = json.loads((out / "speculators-report.json").read_text())
        else:
            r = peers.train_specforge(args, out, data, layer_ids, vocab, tokens, verifier, name)
            rep = json.loads((out / "specforge-report.json").read_text())
            rep["tokens"] = r["tokens"]
        return {"wall": rep["tokens"] / rep["seconds"], "cpu": rep["tokens"] / rep["cpu_seconds"], "how": r["how"]}

    trainers = {"draftheads (online)": lambda: ours("online"), "draftheads (offline)": lambda: ours("offline")}
    trainers.update({f"{name} {'0.9.0' if name == 'speculators' else '0.2.0'}": (lambda n=name: peer(n))
                     for name in args.peers})
    results: dict[str, list[dict]] = {name: [] for name in trainers}
    results["draftheads (online)"].append(ours("online"))  # first: its export holds the draft vocabulary map
    exported = load_file(out / "draftheads-online" / "drafter" / "model.safetensors")
    for name in args.peers:
        data = out / f"{name}-data"
        if not (data / ".done").exists():
            (peers.dump_speculators if name == "speculators" else peers.dump_specforge)(
                rows, verifier, layer_ids, exported["d2t"], exported["t2d"], data)
            (data / ".done").write_text("done")
    for r in range(args.rounds):
        order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
        for name in order:
            if r == 0 and name == "draftheads (online)":
                continue  # ran above
            peers.say(f"round {r + 1}: {name}")
            results[name].append(trainers[name]())
            last = results[name][-1]
            peers.say(f"  {last['wall']:,.0f} tokens/s wall, {last['cpu']:,.0f} per CPU second")

    summary = {"verifier": args.verifier, "rows": len(rows), "tokens": tokens, "epochs": args.epochs,
               "batch": args.batch, "seed": args.seed, "flags": args.flags, "rounds": args.rounds, "threads": 1,
               "runs": results}
    med = {name: {k: statistics.median(run[k] for run in runs) for k in ("wall", "cpu")}
           for name, runs in results.items()}
    summary["median"] = med
    print(f"| trainer | tokens/s (wall) | tokens per CPU second | ours online / it (CPU) | ours offline / it (CPU) |")
    print("|---|---:|---:|---:|---:|")
    for name, m in med.items():
        on, off = med["draftheads (online)"]["cpu"], med["draftheads (offline)"]["cpu"]
        print(f"| {name} | {m['wall']:,.0f} | {m['cpu']:,.0f} | {on / m['cpu']:.2f} | {off / m['cpu']:.2f} |")
    (out / "speed.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
