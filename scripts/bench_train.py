"""Training throughput against the verifier's own speed: train tokens/s ÷ verifier forward-only tokens/s.

    python scripts/bench_train.py --method medusa                        # tiny-code, configs/medusa-tiny.yaml
    python scripts/bench_train.py --method medusa --verifier ./my-model --train.batch_size=4 --data.seq_len=1024
    python scripts/bench_train.py --method medusa --repeats 7 --out runs/bench-medusa.json

A drafter trainer runs the frozen verifier on every batch, so the verifier's plain forward is the floor of a
training step's cost; the ratio says how much of the verifier's speed training keeps (1.0: the drafter is free).
Both sides run on the same batches in one process: a warm-up of each, then `--repeats` rounds that time the
verifier forward over the batches and the full training step (verifier features under no-grad, drafter forward,
backward, clipping, optimizer step) over the same batches, alternating which goes first. Reported: the median
ratio of the rounds and its spread (min, max), with both tokens/s; JSON to --out.

On a shared CPU pass `--threads 1`: with other processes running, two OpenMP threads spin against them and both
sides slow down by up to ~9x, unevenly, so the ratio says more about the machine's load than about training.
The EAGLE ratios are bounded by FLOPs: a drafter layer trained forward and backward for each of `eagle.ttt_steps`
steps is a large share of an 8-layer verifier (tiny-code), a small one of a 32-layer Llama-3-8B.

"Verifier forward-only" is the verifier's whole forward with its lm_head (what plain decoding pays per token),
under inference mode. Any option the method's trainer takes (`--verifier`, `--train.batch_size`,
`--data.seq_len`, `--train.mixed_precision`, `--medusa.num_heads`, ...) is passed through to its config.

    python scripts/bench_train.py --method eagle1                        # configs/eagle1-tiny.yaml (goal >= 0.7)
    python scripts/bench_train.py --method eagle3                        # configs/eagle3-tiny.yaml, 7 TTT steps
                                                                         # (goal >= 0.5)
    python scripts/bench_train.py --method eagle3 --across               # what document masks cost: the train
                                                                         # step with them ÷ without (packed rows)

Adding a method: write `def <name>_step(cfg, verifier, batches) -> Callable[[batch], None]` building that
trainer's trainable part and optimizer from its own code, and register it in METHODS with its config class,
default config file and goal; the measurement below is shared.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent

Step = Callable[[dict], None]


# ---- per-method training steps (each from its trainer's own pieces) -------------------------------------------
def medusa_step(cfg, verifier, batches: list[dict]) -> Step:
    """One Medusa optimizer step: train/medusa.py's features, objective, clipping and AdamW (Medusa-1 or -2)."""
    from draftheads.models.medusa import MedusaHeads, MedusaJoint, add_lora_from_config
    from draftheads.train.medusa import HeadsObjective, JointObjective, batch_features
    from draftheads.train.optim import build_optimizer

    heads = MedusaHeads.from_config(cfg.medusa, verifier)
    if cfg.medusa.joint:
        add_lora_from_config(verifier, cfg.medusa)
        joint = MedusaJoint(verifier, heads)
        model = JointObjective(joint, cfg.medusa)
        optimizer = build_optimizer(joint.param_groups(cfg.train.lr, cfg.medusa.head_lr_multiplier), cfg)
    else:
        model = HeadsObjective(heads, cfg.medusa)
        optimizer = build_optimizer(heads, cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: dict) -> None:
        with autocast(cfg, verifier.device):
            loss, _, _ = model(batch_features(verifier, batch, cfg), batch)
        loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def eagle_step(version: int) -> Callable:
    """The builder of one EAGLE-`version` optimizer step: train/eagle.py's online features (frozen verifier under
    no-grad, only the layers the drafter reads), the drafter's loss (EAGLE-3: `eagle.ttt_steps` unrolled steps),
    backward, clipping and AdamW. EAGLE-3's draft vocabulary is counted on the benchmark's batches (the trainer
    counts the whole training set; which tokens are kept does not change the cost)."""

    def build(cfg, verifier, batches: list[dict]) -> Step:
        from draftheads.models.eagle import EagleTrainModule, build_drafter, count_tokens
        from draftheads.train.features import feature_source
        from draftheads.train.optim import build_optimizer

        counts = None
        if version == 3:
            counts = sum(count_tokens(b["input_ids"].cpu(), b["loss_mask"].cpu(), verifier.vocab_size)
                         for b in batches)
        model = EagleTrainModule(build_drafter(verifier, cfg.eagle, token_counts=counts)).train()
        optimizer = build_optimizer(model, cfg)
        features = feature_source(cfg, verifier, layer_ids=model.drafter.feature_layers)
        params = [p for p in model.parameters() if p.requires_grad]

        def step(batch: dict) -> None:
            feats = features(batch)  # outside autocast, as in the trainer
            with autocast(cfg, verifier.device):
                out = model(batch["input_ids"], feats, batch["loss_mask"], batch.get("position_ids"))
            out.loss.backward()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return build


def eagle_version(version: int) -> Callable:
    """A config check: `--method eagle{version}` trains what its name says."""

    def check(cfg) -> None:
        from draftheads.train.config import ConfigError

        if cfg.eagle.version != version:
            raise ConfigError(f"--method eagle{version} with eagle.version={cfg.eagle.version}: use "
                              f"--method eagle{cfg.eagle.version}")

    return check


@dataclass(frozen=True)
class Method:
    config_class: str
    """`module:Class` of the trainer's root config."""
    default_config: str
    """YAML (relative to the repository root) the benchmark starts from."""
    build_step: Callable
    """(cfg, verifier, the benchmark's batches) -> step(batch)."""
    goal: float | None = None
    """The ratio this method should reach (printed next to the measurement)."""
    check_config: Callable | None = None
    """(cfg) -> None, raising ConfigError before anything loads."""


METHODS: dict[str, Method] = {
    "medusa": Method("draftheads.train.medusa:MedusaRunConfig", "configs/medusa-tiny.yaml", medusa_step),
    "eagle1": Method("draftheads.train.eagle:EagleRunConfig", "configs/eagle1-tiny.yaml", eagle_step(1), goal=0.7,
                     check_config=eagle_version(1)),
    "eagle3": Method("draftheads.train.eagle:EagleRunConfig", "configs/eagle3-tiny.yaml", eagle_step(3), goal=0.5,
                     check_config=eagle_version(3)),
}


# ---- the shared measurement ------------------------------------------------------------------------------------
def autocast(cfg, device: torch.device):
    """The trainer's mixed precision (accelerate's autocast) for a step run outside an Accelerator."""
    enabled = cfg.train.mixed_precision != "no"
    dtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype, enabled=enabled)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[dict], object], batches: list[dict], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        fn(batch)
    synchronize(device)
    return time.perf_counter() - start


def verifier_forward(verifier) -> Step:
    """What the train step is measured against: the verifier's plain forward (features and logits), no grad."""

    @torch.inference_mode()
    def forward(batch: dict) -> None:
        verifier.features(batch["input_ids"], batch["attention_mask"], return_logits=True,
                          position_ids=batch.get("position_ids"))

    return forward


def count_flops(fn: Step, batch: dict) -> int:
    """FLOPs of one call (torch.utils.flop_counter: matmuls and attention), whatever the machine's load."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(batch)
    return counter.get_total_flops()


def measure(step: Step, verifier, batches: list[dict], repeats: int, warmup: int,
            baseline: Step | None = None) -> dict:
    """Alternate timed rounds of the verifier forward (or `baseline`) and the train step over the same batches."""
    device = verifier.device
    forward = baseline or verifier_forward(verifier)
    tokens = float(sum(int(b["attention_mask"].sum()) for b in batches))
    for _ in range(warmup):
        timed(forward, batches, device)
        timed(step, batches, device)
    rounds = []
    for r in range(repeats):
        order = ("forward", "train") if r % 2 == 0 else ("train", "forward")  # cancel slow drifts of the machine
        seconds = {name: timed(forward if name == "forward" else step, batches, device) for name in order}
        rounds.append({"forward_tokens_per_s": tokens / seconds["forward"],
                       "train_tokens_per_s": tokens / seconds["train"],
                       "ratio": seconds["forward"] / seconds["train"]})
    ratios = [r["ratio"] for r in rounds]
    return {
        "tokens_per_round": tokens,
        "rounds": rounds,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "forward_tokens_per_s_median": statistics.median(r["forward_tokens_per_s"] for r in rounds),
        "train_tokens_per_s_median": statistics.median(r["train_tokens_per_s"] for r in rounds),
    }


def load_batches(cfg, tokenizer, count: int, device: torch.device) -> list[dict]:
    from draftheads.train.loaders import get_dataloaders

    train_dl, _ = get_dataloaders(cfg, tokenizer)
    batches = []
    for batch in train_dl:
        batches.append({k: v.to(device) for k, v in batch.items()})
        if len(batches) == count:
            return batches
    if not batches:
        raise SystemExit("no training batches: lower --train.batch_size or add data")
    return batches


def run(method: str, argv: list[str], repeats: int = 5, warmup: int = 1, batches: int = 4,
        device: str | None = None, out: str | None = None, flops: bool = False, across: bool = False) -> dict:
    from draftheads.train.config import parse_config
    from draftheads.train.placement import load_verifier

    spec = METHODS[method]
    module, _, name = spec.config_class.partition(":")
    config_class = getattr(importlib.import_module(module), name)
    has_config = any(a == "--config" or a.startswith("--config=") for a in argv)
    config_argv = ([] if has_config else ["--config", str(ROOT / spec.default_config)]) + list(argv)
    cfg = parse_config(config_class, config_argv)
    if spec.check_config is not None:
        spec.check_config(cfg)
    torch.manual_seed(cfg.train.seed)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    verifier, tokenizer = load_verifier(cfg, device)
    data = load_batches(cfg, tokenizer, batches, device)
    step = spec.build_step(cfg, verifier, data)
    baseline = None
    if across:  # the same step on the same batches, without document positions: documents attend across
        def baseline(batch: dict) -> None:
            step({k: v for k, v in batch.items() if k != "position_ids"})

    load_before = os.getloadavg()
    result = measure(step, verifier, data, repeats, warmup, baseline)
    report = {
        "method": method, "goal": spec.goal, "verifier": cfg.verifier, "device": str(device), "threads": torch.get_num_threads(),
        "batch_size": cfg.train.batch_size, "seq_len": cfg.data.seq_len, "batches": len(data),
        "mixed_precision": cfg.train.mixed_precision, "verifier_dtype": cfg.verifier_dtype,
        "repeats": repeats, "warmup": warmup, "argv": config_argv, "baseline": "across" if across else "forward",
        "loadavg_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        **result,
    }
    if flops:  # after the timing: counting runs one more (untimed) train step
        forward_flops, train_flops = count_flops(verifier_forward(verifier), data[0]), count_flops(step, data[0])
        report.update(forward_gflop=forward_flops / 1e9, train_gflop=train_flops / 1e9,
                      flop_ceiling=forward_flops / train_flops)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Other options go to the method's config, e.g. "
        "--verifier, --config, --train.batch_size=8, --data.seq_len=512, --medusa.num_heads=4.")
    parser.add_argument("--method", required=True, choices=sorted(METHODS))
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--batches", type=int, default=4, help="batches per round (the same ones every round)")
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--across", action="store_true",
                        help="time the train step against itself on the same batches without position_ids (packed "
                             "documents attending across) instead of the verifier forward: the cost of document masks")
    parser.add_argument("--flops", action="store_true",
                        help="also count FLOPs of one batch: the ratio the FLOPs alone allow (forward / train step)")
    args, rest = parser.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.method, rest, args.repeats, args.warmup, args.batches, args.device, args.out, args.flops,
                 args.across)
    print(f"[bench] {report['method']} on {report['verifier']} ({report['device']}, {report['threads']} threads, "
          f"B={report['batch_size']} T={report['seq_len']}, {report['batches']} batches x {report['repeats']} rounds)")
    if args.across:
        print(f"[bench] train step, documents attending across {report['forward_tokens_per_s_median']:,.0f} tok/s, "
              f"with document masks {report['train_tokens_per_s_median']:,.0f} tok/s: masked / across = "
              f"{report['ratio_median']:.3f} (min {report['ratio_min']:.3f}, max {report['ratio_max']:.3f})"
              + (f"; JSON: {args.out}" if args.out else ""))
        return report
    print(f"[bench] verifier forward {report['forward_tokens_per_s_median']:,.0f} tok/s, train "
          f"{report['train_tokens_per_s_median']:,.0f} tok/s")
    goal = METHODS[args.method].goal
    verdict = "" if goal is None else (f"; goal >= {goal}: " + ("met" if report["ratio_median"] >= goal else "MISSED"))
    print(f"[bench] train / forward = {report['ratio_median']:.3f} (min {report['ratio_min']:.3f}, "
          f"max {report['ratio_max']:.3f}){verdict}" + (f"; JSON: {args.out}" if args.out else ""))
    if args.flops:
        print(f"[bench] FLOPs per batch: verifier forward {report['forward_gflop']:.1f} G, train step "
              f"{report['train_gflop']:.1f} G: the FLOPs alone allow train / forward = {report['flop_ceiling']:.3f}")
    return report


if __name__ == "__main__":
    from draftheads.train.config import ConfigError

    try:
        main()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
