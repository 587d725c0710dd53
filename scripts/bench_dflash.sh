#!/usr/bin/env bash
# DFlash beside EAGLE-3, P-EAGLE and n-gram lookup on one training budget: the same verifier, self-distilled data
# (the verifier's own continuations of stdlib functions, scripts/selfdistill_data.py), steps, batch and seed for
# every drafter. DFlash at block sizes 4, 5, 8 and 16 (configs/dflash-tiny.yaml; DFLASH_BLOCKS to choose), EAGLE-3
# (configs/eagle3-tiny.yaml) and P-EAGLE (configs/peagle-tiny.yaml) drafting chains of 4, EAGLE-3 also its dynamic
# tree; then one decode benchmark over all of them at T = 0 on HumanEval prompts (scripts/bench_decode.py, methods
# taking turns prompt by prompt), one table (tau, per-position acceptance, tokens/s, the drafter's milliseconds per
# step) and issue 23's goal per block size: tau >= EAGLE-3's chain of 4, tokens/s >= P-EAGLE's.
#
#   bash scripts/bench_dflash.sh      # DFLASH_VERIFIER=tiny-code DFLASH_STEPS=600 DFLASH_DIR=runs/bench-dflash ...
#   DFLASH_VERIFIER=tiny-micro DFLASH_STEPS=20 DFLASH_SEQ_LEN=64 DFLASH_DATA_PROMPTS=32 DFLASH_PROMPTS=2 \
#     DFLASH_MAX_NEW_TOKENS=32 bash scripts/bench_dflash.sh      # a smoke run of the whole pipeline (minutes)
#
# DFLASH_EXTRA_WINDOWS="8:8 16:16" also trains DFlash at block 8 with a first-layer window of 8 (label b8w8), ...:
# with the config's window of 5, block positions 5 and later see only mask tokens in the first layer
# (docs/train-dflash.md#positions-past-the-window).
# DFLASH_EXTRA_LAYERS="4:3" also trains DFlash at block 4 with 3 layers (label b4l3): the first sliding as in the
# config, the others full; the target layers then default to one per drafter layer.
# DFLASH_EXTRA_ANCHORS="4:64" also trains DFlash at block 4 with 64 anchored blocks per row (label b4a64; the
# config has 128): the same rows and steps, fewer blocks trained from each.
# DFLASH_EXTRA_VOCAB="5:2048" also trains DFlash at block 5 with its own lm_head over a 2048-token draft vocabulary
# (label b5v2048; dflash.draft_vocab_size, as EAGLE-3's config has): the config's drafters read the verifier's head.
# DFLASH_EXTRA_LOSSES="5:dpace" also trains DFlash at block 5 with the D-PACE loss (label b5dpace; dflash.loss=dpace,
# weights from the drafter's own confidence) beside the config's cross-entropy with fixed decay (ce, or kl).
# DFLASH_EXTRA_DSPARK="5:64" also trains DSpark at block 5 with a Markov head of rank 64 (label b5m64;
# dflash.markov_rank, with its confidence head) beside DFlash at that block, and the goal lines compare the two.
#
# DFLASH_SEED=N trains every drafter with --train.seed=N (default 0): the rows' order, the initial weights and DFlash's
# anchors change, the rows and the held-out set do not; a second seed in another DFLASH_DIR measures how far one
# training's tau is from another's.
#
# Each drafter is trained once: a rerun reuses a label's folder when it holds that label's drafter trained with the
# same settings and inputs (scripts/same_run.py asks the trainer's run record), and stops before anything trains,
# naming what differs, when it holds another run (another DFLASH_SEED or DFLASH_STEPS in an old DFLASH_DIR); delete
# the folder to retrain. Each training checkpoints every DFLASH_SAVE_EVERY steps (default 200): a bench stopped
# part-way (a closed terminal, the end of a session) continues its trainings from there when run again, not from
# step 0 (how often a run checkpoints does not change its result, so a folder saved at other steps is reused).
# DFLASH_JOBS=N trains up to N drafters at a time (one thread each; their logs in $DIR/<label>.log).
set -euo pipefail
EXTRA_WINDOWS=${DFLASH_EXTRA_WINDOWS:-}
for pair in $EXTRA_WINDOWS; do
  [[ $pair =~ ^[0-9]+:[0-9]+$ ]] || { echo "DFLASH_EXTRA_WINDOWS: '$pair': expected BLOCK:WINDOW pairs of" \
    "integers separated by spaces, e.g. '8:8 16:16'" >&2; exit 2; }
done
EXTRA_LAYERS=${DFLASH_EXTRA_LAYERS:-}
for pair in $EXTRA_LAYERS; do
  [[ $pair =~ ^[0-9]+:([2-9]|[1-9][0-9]+)$ ]] || { echo "DFLASH_EXTRA_LAYERS: '$pair': expected BLOCK:LAYERS pairs" \
    "of integers (2 layers or more) separated by spaces, e.g. '4:3'" >&2; exit 2; }
done
EXTRA_ANCHORS=${DFLASH_EXTRA_ANCHORS:-}
for pair in $EXTRA_ANCHORS; do
  [[ $pair =~ ^[0-9]+:[1-9][0-9]*$ ]] || { echo "DFLASH_EXTRA_ANCHORS: '$pair': expected BLOCK:ANCHORS pairs of" \
    "integers (1 anchor or more) separated by spaces, e.g. '4:128'" >&2; exit 2; }
done
EXTRA_VOCAB=${DFLASH_EXTRA_VOCAB:-}
for pair in $EXTRA_VOCAB; do
  [[ $pair =~ ^[0-9]+:[1-9][0-9]*$ ]] || { echo "DFLASH_EXTRA_VOCAB: '$pair': expected BLOCK:VOCAB pairs of" \
    "integers (a vocabulary of 1 token or more) separated by spaces, e.g. '5:2048'" >&2; exit 2; }
done
EXTRA_LOSSES=${DFLASH_EXTRA_LOSSES:-}
for pair in $EXTRA_LOSSES; do
  [[ $pair =~ ^[0-9]+:(ce|kl|dpace)$ ]] || { echo "DFLASH_EXTRA_LOSSES: '$pair': expected BLOCK:LOSS pairs (LOSS one" \
    "of ce, kl, dpace) separated by spaces, e.g. '5:dpace'" >&2; exit 2; }
done
EXTRA_DSPARK=${DFLASH_EXTRA_DSPARK:-}
for pair in $EXTRA_DSPARK; do
  [[ $pair =~ ^[0-9]+:[1-9][0-9]*$ ]] || { echo "DFLASH_EXTRA_DSPARK: '$pair': expected BLOCK:RANK pairs of" \
    "integers (a Markov rank of 1 or more) separated by spaces, e.g. '5:64'" >&2; exit 2; }
done
# Rows made by an earlier run in this folder are reused only if they are the rows asked for: a folder whose
# selfdistill.jsonl holds another number of functions would train every drafter on other data than the one named.
DATA_PROMPTS=${DFLASH_DATA_PROMPTS:-800}  # stdlib functions continued for the training data
[[ $DATA_PROMPTS =~ ^[1-9][0-9]*$ ]] || { echo "DFLASH_DATA_PROMPTS: '$DATA_PROMPTS': expected a positive integer" \
  "(stdlib functions to continue)" >&2; exit 2; }
SEED=${DFLASH_SEED:-0}
[[ $SEED =~ ^(0|[1-9][0-9]*)$ ]] || { echo "DFLASH_SEED: '$SEED': expected a non-negative integer (the trainers'" \
  "train.seed)" >&2; exit 2; }
SAVE_EVERY=${DFLASH_SAVE_EVERY:-200}
[[ $SAVE_EVERY =~ ^[1-9][0-9]*$ ]] || { echo "DFLASH_SAVE_EVERY: '$SAVE_EVERY': expected a positive integer (steps" \
  "between checkpoints)" >&2; exit 2; }
DIR=${DFLASH_DIR:-runs/bench-dflash}
if [ -f "$DIR/selfdistill.jsonl" ] && held=$(wc -l < "$DIR/selfdistill.jsonl") && [ "$held" -ne "$DATA_PROMPTS" ]; then
  echo "$DIR/selfdistill.jsonl holds $held rows, not DFLASH_DATA_PROMPTS=$DATA_PROMPTS:" \
    "set DFLASH_DATA_PROMPTS to its count, or use another DFLASH_DIR" >&2
  exit 2
fi
source "$(dirname "$0")/setup_env.sh"
source scripts/same_run.sh  # setup_env.sh has moved to the repository root
VERIFIER=${DFLASH_VERIFIER:-tiny-code}
STEPS=${DFLASH_STEPS:-600}
WARMUP=${DFLASH_WARMUP:-$(( STEPS >= 200 ? 20 : STEPS / 10 + 1 ))}  # the configs' 20 of 600; less for a smoke run
SEQ_LEN=${DFLASH_SEQ_LEN:-256}
PROMPTS=${DFLASH_PROMPTS:-8}
TOKENS=${DFLASH_MAX_NEW_TOKENS:-128}
BLOCKS=${DFLASH_BLOCKS:-4 5 8 16}
JOBS=${DFLASH_JOBS:-1}
# tiny-micro has 4 layers: EAGLE's default feature layers (2, L//2, L-3 made distinct), not tiny-code's [2, 4, 7]
LAYERS=${DFLASH_EAGLE_LAYER_IDS:-$([ "$VERIFIER" = tiny-micro ] && echo null || echo "")}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$DIR"
[ -f "$DIR/selfdistill.jsonl" ] || PYTHONPATH=. python scripts/selfdistill_data.py --verifier "$VERIFIER" \
  --out "$DIR/selfdistill.jsonl" --num-prompts "$DATA_PROMPTS"
COMMON=(--verifier "$VERIFIER" --wandb.enabled=false --train.max_steps="$STEPS" --train.eval_every="$STEPS"
        --train.save_every="$(( SAVE_EVERY < STEPS ? SAVE_EVERY : STEPS ))" --train.warmup_steps="$WARMUP"
        --train.mixed_precision=no --data.seq_len="$SEQ_LEN"
        --data.source="$DIR/selfdistill.jsonl" --data.eval_rows=8 --train.seed="$SEED")

QUEUE=()  # label, overrides, command (quoted): what to train once every label has been checked
train() {  # train LABEL SCRIPT CONFIG [overrides...]: queued, unless $DIR/LABEL holds this very run already
  local label=$1 script=$2 config=$3
  shift 3
  local args=("$script" --config "$config" --output_dir "$DIR/$label" "${COMMON[@]}" "$@")
  # reused only if it is the same run, so another DFLASH_SEED, DFLASH_STEPS or set of rows pointed at an old folder
  # stops here instead of decoding the old drafters
  if trained "$DIR/$label" "use another DFLASH_DIR, or delete $DIR/$label to train it again" "${args[@]}"; then
    echo "== reusing $label: $DIR/$label holds its drafter, trained with these settings and inputs"
    return
  fi
  QUEUE+=("$label" "$*" "$(printf '%q ' "${args[@]}")")
}

train eagle3 train/eagle.py configs/eagle3-tiny.yaml ${LAYERS:+--eagle.layer_ids=$LAYERS}
train peagle train/eagle.py configs/peagle-tiny.yaml ${LAYERS:+--eagle.layer_ids=$LAYERS}
DFLASH=()
LABELS=(eagle3 peagle)
dflash() {  # dflash NAME [overrides...]: one DFlash drafter (label dflash-NAME), trained and decoded
  local name=$1
  shift
  # the data are the verifier's own output: block position k learns the data token (dflash.targets=data)
  train "dflash-$name" train/dflash.py configs/dflash-tiny.yaml "$@" --dflash.targets=data
  DFLASH+=("$name=$DIR/dflash-$name/drafter")
  LABELS+=("dflash-$name")
}
for b in $BLOCKS; do
  dflash "b$b" --dflash.block_size="$b"
done
extra() {  # extra TAG KEY "BLOCK:VALUE ...": per pair, a drafter dflash-b<BLOCK><TAG><VALUE> with dflash.KEY=VALUE
  local tag=$1 key=$2 pair
  for pair in $3; do
    dflash "b${pair%:*}$tag${pair#*:}" --dflash.block_size="${pair%:*}" "--dflash.$key=${pair#*:}"
  done
}
extra w sliding_window "$EXTRA_WINDOWS"
for pair in $EXTRA_LAYERS; do
  b=${pair%:*} n=${pair#*:}
  types=sliding_attention
  for ((i = 1; i < n; i++)); do types+=,full_attention; done
  dflash "b${b}l$n" --dflash.block_size="$b" --dflash.num_hidden_layers="$n" --dflash.layer_types="[$types]"
done
extra a num_anchors "$EXTRA_ANCHORS"
extra v draft_vocab_size "$EXTRA_VOCAB"
extra "" loss "$EXTRA_LOSSES"
extra m markov_rank "$EXTRA_DSPARK"
# every label checked: nothing has started training yet if one of them was refused
for ((i = 0; i < ${#QUEUE[@]}; i += 3)); do
  label=${QUEUE[i]}
  echo "== training $label ($STEPS steps) ${QUEUE[i + 1]}"
  if [ "$JOBS" -le 1 ]; then
    eval "python ${QUEUE[i + 2]}"
  else
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    eval "python ${QUEUE[i + 2]}" >"$DIR/$label.log" 2>&1 &
  fi
done
wait
for label in "${LABELS[@]}"; do  # a parallel training that failed: name its log
  [ -f "$DIR/$label/drafter/config.json" ] || { echo "training $label failed: see $DIR/$label.log" >&2; exit 1; }
done

# Each run decodes into $DIR/bench; the previous run's decode there is kept beside it (bench.<its UTC time>), not
# replaced: a rerun over a folder (more drafters, another machine) leaves the earlier figures readable.
if [ -e "$DIR/bench" ]; then
  kept="$DIR/bench.$(date -u -r "$DIR/bench" +%Y%m%dT%H%M%SZ)"
  mv -T "$DIR/bench" "$kept"
  echo "== the previous decode run in $DIR/bench is kept as $kept"
fi
# EAGLE-3 decodes twice: as a chain of 4 (like with like: DFlash verifies a chain too) and as the dynamic tree
# that gives it its best tau on tiny-code (docs/benchmarks.md: d7 k3 n16)
python scripts/bench_decode.py --verifier "$VERIFIER" --out "$DIR/bench" --num-prompts "$PROMPTS" \
  --max-new-tokens "$TOKENS" --temperatures 0 --threads 1 --runs "$DIR" \
  --variants autoregressive ngram eagle3-tree-d7k3n16 --eagle3 "$DIR/eagle3/drafter" \
  --eagle3-extra "tiny=$DIR/eagle3/drafter" "peagle=$DIR/peagle/drafter" --extra-chains 4 \
  --dflash-extra "${DFLASH[@]}"

python - "$DIR/bench/bench.json" <<'EOF'
import json, sys
bench = json.load(open(sys.argv[1]))
res = bench["results"]["0.0"]
print(f"\n## DFlash beside EAGLE-3, P-EAGLE and n-gram ({bench['verifier']}, {bench['settings']['num_prompts']} "
      f"HumanEval prompts, {bench['settings']['max_new_tokens']} new tokens, T = 0)\n")
print("| method | tau | per-position acceptance | tokens/s | speedup | drafter ms / step |")
print("|---|---:|---|---:|---:|---:|")
for label, row in res["summary"].items():
    pos = " ".join(f"{p:.2f}" for p in row.get("per_position_acceptance") or []) or "-"
    ms = res["step_profile"].get(label, {}).get("draft_ms")
    print(f"| {label} | {row['tau']:.2f} | {pos} | {row['tokens_per_s']:.1f} | {row['speedup'] or 0:.2f}x | "
          f"{'-' if ms is None else f'{ms:.2f}'} |")
# issue 23's goal, like with like: DFlash's tau against EAGLE-3's chain of 4, its tokens/s against P-EAGLE's
eagle, peagle = res["summary"].get("eagle3-tiny-chain4"), res["summary"].get("eagle3-peagle-chain4")
if eagle and peagle:
    print(f"\nGoal: tau >= EAGLE-3 chain 4 ({eagle['tau']:.2f}) and tokens/s >= P-EAGLE chain 4 "
          f"({peagle['tokens_per_s']:.1f})")
    for label, row in res["summary"].items():
        if label.startswith("dflash-"):
            tau_ok, speed_ok = row["tau"] >= eagle["tau"], row["tokens_per_s"] >= peagle["tokens_per_s"]
            print(f"- {label}: tau {row['tau']:.2f} {'met' if tau_ok else 'MISSED'}, tokens/s "
                  f"{row['tokens_per_s']:.1f} {'met' if speed_ok else 'MISSED'}")
# issue 46's goal: DSpark (dflash-b<B>m<R>) against DFlash at the same block (dflash-b<B>), tau and tokens/s
import re
for label, row in res["summary"].items():
    found = re.fullmatch(r"dflash-b(\d+)m(\d+)", label)
    base = found and res["summary"].get(f"dflash-b{found[1]}")
    if base:
        print(f"- DSpark {label} against dflash-b{found[1]}: tau {row['tau']:.2f} vs {base['tau']:.2f} "
              f"({'met' if row['tau'] >= base['tau'] else 'MISSED'}), tokens/s {row['tokens_per_s']:.1f} vs "
              f"{base['tokens_per_s']:.1f} ({'met' if row['tokens_per_s'] >= base['tokens_per_s'] else 'MISSED'})")
EOF
