#!/usr/bin/env bash
# What bf16 AdamW state (train.optimizer_state: bfloat16) costs in acceptance: the tiny Medusa, EAGLE-3 and DFlash
# configs trained with the same budget, data and seed twice, once with fp32 moments and once with bf16 ones, over a
# few seeds; then one table of the end-of-run check's tau (our engine, greedy, the run's held-out rows) and the last
# held-out loss of each run.
#
#   bash scripts/bench_optimizer_state.sh    # STATE_VERIFIER=tiny-micro STATE_STEPS=200 STATE_SEEDS="0 1" ...
#
# Each run is trained once: a rerun reuses a folder that holds its drafter (delete STATE_DIR to train again).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
VERIFIER=${STATE_VERIFIER:-tiny-micro}
STEPS=${STATE_STEPS:-200}
SEEDS=${STATE_SEEDS:-0 1}
METHODS=${STATE_METHODS:-medusa eagle3 dflash}
DIR=${STATE_DIR:-runs/optimizer-state}
PROMPTS=${STATE_PROMPTS:-16}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$DIR"
for method in $METHODS; do
  case $method in
    medusa) script=train/medusa.py; extra=() ;;
    eagle3) script=train/eagle.py; extra=(--eagle.layer_ids=null) ;;  # tiny-micro's 4 layers: the defaults
    dflash) script=train/dflash.py; extra=() ;;
    *) echo "STATE_METHODS: unknown method $method (expected medusa eagle3 dflash)" >&2; exit 2 ;;
  esac
  [ "$VERIFIER" = tiny-micro ] || extra=()
  for seed in $SEEDS; do
    for state in float32 bfloat16; do
      run="$DIR/$method-seed$seed-$state"
      if [ -f "$run/drafter/config.json" ]; then echo "== reusing $run"; continue; fi
      echo "== $method seed $seed optimizer_state $state ($STEPS steps)"
      python "$script" --config "configs/$method-tiny.yaml" --verifier "$VERIFIER" --output_dir "$run" \
        --wandb.enabled=false --train.mixed_precision=no --train.max_steps="$STEPS" --train.eval_every="$STEPS" \
        --train.save_every="$STEPS" --train.seed="$seed" --train.optimizer_state="$state" --data.seq_len=128 \
        --consistency.num_prompts="$PROMPTS" --consistency.max_new_tokens=64 "${extra[@]}" > "$run.log" 2>&1 \
        || { echo "failed: $run.log" >&2; tail -3 "$run.log" >&2; exit 1; }
    done
  done
done
python - "$DIR" <<'EOF'
import json, statistics, sys
from pathlib import Path

runs = {}
for metrics in sorted(Path(sys.argv[1]).glob("*/metrics.jsonl")):
    method, seed, state = metrics.parent.name.rsplit("-", 2)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    tau = next(r["eval/tau"] for r in reversed(rows) if "eval/tau" in r)
    loss = next(r["eval/loss"] for r in reversed(rows) if "eval/loss" in r)
    runs.setdefault(method, {}).setdefault(state, []).append((seed, tau, loss))
print("| method | optimizer state | tau per seed | mean tau | held-out loss per seed |")
print("|---|---|---|---:|---|")
for method, states in runs.items():
    for state in ("float32", "bfloat16"):
        got = sorted(states.get(state, []))
        if got:
            print(f"| {method} | {state} | {' '.join(f'{t:.2f}' for _, t, _ in got)} | "
                  f"{statistics.mean(t for _, t, _ in got):.2f} | {' '.join(f'{l:.3f}' for _, _, l in got)} |")
EOF
