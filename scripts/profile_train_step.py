"""Where an EAGLE or DFlash training step's time goes: the trainer's own pieces on its own batches, each phase timed.

    python scripts/profile_train_step.py --verifier tiny-micro --data.source=runs/peers-tiny-micro/docs.jsonl
    python scripts/profile_train_step.py ... --features=offline --feature_cache=runs/peers-tiny-micro/draftheads-cache
    python scripts/profile_train_step.py ... --ops 25          # also torch.profiler's top ops by self CPU time
    python scripts/profile_train_step.py ... --against aa13174 --rounds 3   # before / after, side by side
    python scripts/profile_train_step.py --trainer dflash --verifier tiny-code --dflash.block_size=16 \
        --data.source=runs/bench-dflash-d4-2000-s1/selfdistill.jsonl --steps 2    # train/dflash.py's step

Defaults are the peer bench's settings for our trainer (configs/eagle3-tiny.yaml with 8 packed rows of 256 tokens,
7 TTT steps, fp32, document masks on); `--trainer dflash`: configs/dflash-tiny.yaml with the same rows (its 128
anchors per row). Any trainer option is passed through to the config. The step is the one train/eagle.py (or
train/dflash.py) runs (features, the drafter's loss, backward, TrainLoop's guard, clipping and AdamW), split into
phases: data (the loader: collation, cached-feature reads), features (the verifier forward online; offline only
the cast of the cached tensors), forward (TTT unroll + losses), backward, update (clip + optimizer + the finite
check), sync (the one host sync per optimizer step). Each phase's CPU time (process time: robust to a loaded
machine when single-threaded) and wall time are summed over `--steps` steps after `--warmup`, and printed with
the training tokens per CPU second.

`--against REF` measures the same thing for the code at git commit REF (exported with `git archive` into a
temporary folder and imported in its place) and for this tree, in alternating runs, `--rounds` of each, and
prints each round's CPU time per step and the median ratio REF / this tree (the speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ["--train.batch_size=8", "--data.seq_len=256", "--train.mixed_precision=no", "--eagle.ttt_steps=7",
         "--eagle.decay=0.8", "--wandb.enabled=false"]


class Phases:
    """Per-phase sums of CPU and wall seconds."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self._t = None

    def start(self):
        self._t = (time.process_time(), time.perf_counter())

    def mark(self, name: str):
        c, w = time.process_time(), time.perf_counter()
        self.cpu[name] = self.cpu.get(name, 0.0) + c - self._t[0]
        self.wall[name] = self.wall.get(name, 0.0) + w - self._t[1]
        self._t = (c, w)


DFLASH_BENCH = ["--train.batch_size=8", "--data.seq_len=256", "--train.mixed_precision=no", "--wandb.enabled=false"]
#: each trainer's config and the bench settings laid over it
SETTINGS = {"eagle": ("configs/eagle3-tiny.yaml", BENCH), "dflash": ("configs/dflash-tiny.yaml", DFLASH_BENCH)}


def build(argv: list[str], name: str = "eagle"):
    from draftheads.cli import trainer
    from draftheads.models.eagle import EagleTrainModule, build_drafter
    from draftheads.train.config import parse_config
    from draftheads.train.eagle import draft_vocab_counts
    from draftheads.train.features import feature_source
    from draftheads.train.loaders import get_dataloaders
    from draftheads.train.optim import build_optimizer
    from draftheads.train.placement import load_verifier

    config, bench = SETTINGS[name]
    cfg = parse_config(trainer(name)[0], ["--config", str(ROOT / config), *bench, *argv])
    torch.manual_seed(cfg.train.seed)
    verifier, tokenizer = load_verifier(cfg, torch.device("cpu"))
    train_dl, _ = get_dataloaders(cfg, tokenizer)
    if name == "dflash":
        from draftheads.models.dflash import DFlashTrainModule
        from draftheads.models.dflash import build_drafter as build_dflash

        counts = (draft_vocab_counts(train_dl.dataset, verifier.vocab_size)
                  if cfg.dflash.draft_vocab_size is not None else None)
        model = DFlashTrainModule(build_dflash(verifier, cfg.dflash, token_counts=counts)).train()
    else:
        counts = draft_vocab_counts(train_dl.dataset, verifier.vocab_size)
        model = EagleTrainModule(build_drafter(verifier, cfg.eagle, token_counts=counts)).train()
    optimizer = build_optimizer(model, cfg)
    features = feature_source(cfg, verifier, layer_ids=model.drafter.feature_layers)
    return cfg, verifier, train_dl, model, optimizer, features


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other options go to the trainer's config (train/eagle.py or "
                                            "train/dflash.py).")
    parser.add_argument("--trainer", choices=tuple(SETTINGS), default="eagle", help="whose step to time")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--ops", type=int, default=0, help="print torch.profiler's top N ops of one more step")
    parser.add_argument("--against", metavar="REF", help="also time git commit REF's code, alternating runs")
    parser.add_argument("--rounds", type=int, default=2, help="with --against: runs of each side")
    parser.add_argument("--json", help="write {cpu_ms_per_step, tokens_per_cpu_s, phases} here")
    args, rest = parser.parse_known_args(argv)
    if args.against:
        return against(args, rest)
    torch.set_num_threads(args.threads)
    from draftheads.train.loop import all_finite

    try:
        cfg, verifier, train_dl, model, optimizer, features = build(rest, args.trainer)
    except ValueError as err:  # ConfigError, VerifierError, EagleError, DFlashError, DataError: options that do not fit
        raise SystemExit(f"[profile] {err}") from None
    params = [p for p in model.parameters() if p.requires_grad]
    phases, tokens, done = Phases(), 0, 0
    ok = torch.ones((), dtype=torch.bool)

    def one(batch: dict, phases: Phases) -> None:
        nonlocal ok
        feats = features(batch)
        phases.mark("features")
        out = model(batch["input_ids"], feats, batch["loss_mask"], position_ids=batch.get("position_ids"))
        phases.mark("forward")
        out.loss.backward()
        phases.mark("backward")
        ok = torch.stack([torch.isfinite(out.loss.detach()), ok]).all()
        phases.mark("metrics")
        ok.tolist()  # TrainLoop's one host sync per optimizer step
        phases.mark("sync")
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        ok = all_finite(params)
        optimizer.zero_grad(set_to_none=True)
        phases.mark("update")

    total = args.warmup + args.steps
    while done < total:
        it = iter(train_dl)
        phases.start()
        for batch in it:
            if done >= args.warmup:
                phases.mark("data")
                tokens += int(batch["attention_mask"].sum())
                one(batch, phases)
            else:
                scratch = Phases()
                scratch.start()
                one(batch, scratch)
            done += 1
            if done >= total:
                break
            phases.start()
    cpu, wall = sum(phases.cpu.values()), sum(phases.wall.values())
    print(f"[profile] {cfg.verifier}, features {cfg.features}, B={cfg.train.batch_size} T={cfg.data.seq_len}, "
          + (f"block {model.drafter.block_size}, {cfg.dflash.num_anchors} anchors" if args.trainer == "dflash"
             else f"TTT {cfg.eagle.ttt_steps}")
          + f", {torch.get_num_threads()} thread(s), {args.steps} steps, {tokens} tokens")
    for name in phases.cpu:
        print(f"  {name:9s} cpu {1e3 * phases.cpu[name] / args.steps:8.1f} ms/step ({phases.cpu[name] / cpu:6.1%})"
              f"   wall {1e3 * phases.wall[name] / args.steps:8.1f} ms/step")
    print(f"  total     cpu {1e3 * cpu / args.steps:8.1f} ms/step: {tokens / cpu:,.0f} tokens per CPU second "
          f"(wall {tokens / wall:,.0f} tokens/s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_ms_per_step": 1e3 * cpu / args.steps,
                                               "tokens_per_cpu_s": tokens / cpu, "phases_cpu_s": phases.cpu}))
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        batch = next(iter(train_dl))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one(batch, _started())
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    return 0


def against(args, rest: list[str]) -> int:
    """Alternate runs of this script on REF's code and on this tree; print the rounds and the median speed-up."""
    tmp = Path(tempfile.mkdtemp(prefix="profile-against-"))
    try:
        tree, package = tmp / "tree", tmp / "pkg" / "draftheads"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        shutil.copytree(tree / "draftheads", package)  # the package's rooms are top-level folders (pyproject.toml)
        for room in ("data", "eval", "models", "train"):
            (package / room).symlink_to(tree / room)
        common = [sys.executable, str(Path(__file__).resolve()), "--trainer", args.trainer, "--steps", str(args.steps),
                  "--warmup", str(args.warmup), "--threads", str(args.threads), *rest]
        times: dict[str, list[float]] = {args.against: [], "this tree": []}
        for r in range(args.rounds):
            sides = [args.against, "this tree"] if r % 2 == 0 else ["this tree", args.against]
            for side in sides:
                out = tmp / f"{side.replace('/', '_')}-{r}.json"
                env = dict(os.environ)
                if side == args.against:  # its package first on the path (the script's own folder holds none)
                    env["PYTHONPATH"] = os.pathsep.join([str(package.parent), env.get("PYTHONPATH", "")])
                subprocess.run([*common, "--json", str(out)], env=env, check=True, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                times[side].append(json.loads(out.read_text())["cpu_ms_per_step"])
                print(f"[against] round {r + 1}: {side}: {times[side][-1]:.1f} CPU ms per step", flush=True)
        ratios = [a / b for a, b in zip(times[args.against], times["this tree"])]
        before, after = statistics.median(times[args.against]), statistics.median(times["this tree"])
        print(f"[against] {args.against} / this tree: median {statistics.median(ratios):.2f}x "
              f"(rounds {' '.join(f'{x:.2f}' for x in ratios)}); CPU ms per step {before:.1f} -> {after:.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _started() -> Phases:
    p = Phases()
    p.start()
    return p


if __name__ == "__main__":
    sys.exit(main())
