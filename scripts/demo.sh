#!/usr/bin/env bash
# The whole pipeline on the embedded default verifier, on a fresh machine (budget: 30 minutes on 2 CPU cores):
# set up .venv, build tiny-code, train Medusa heads and an EAGLE-3 drafter with EAGLE 3.1's norms (the best learned
# recipe of scripts/bench_eagle_recipes.sh at this budget) on the verifier's own continuations, evaluate both beside
# plain decoding, n-gram lookup and Hugging Face assisted generation on HumanEval prompts, print the table and write
# the report.
#
#   bash scripts/demo.sh                 # DEMO_DIR=runs/demo DEMO_PROMPTS=10 DEMO_STEPS=150 to change
#   DEMO_VERIFIER=tiny-micro bash scripts/demo.sh     # the 4-layer test verifier: the same pipeline in minutes
#
# Every stage is cached: a rerun skips what is already built or trained (a drafter only when it was trained with the
# same settings and inputs: scripts/same_run.sh; another DEMO_STEPS in an old DEMO_DIR stops, naming what differs;
# delete $DEMO_DIR to start over).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
source scripts/same_run.sh  # setup_env.sh has moved to the repository root
VERIFIER=${DEMO_VERIFIER:-tiny-code}
case "$VERIFIER" in
  tiny-code) RECIPE=default; LAYERS="" ;;
  tiny-micro) RECIPE=micro; LAYERS="--eagle.layer_ids=null" ;;  # 4 layers: the default feature layers
  *) echo "DEMO_VERIFIER=$VERIFIER: expected tiny-code or tiny-micro" >&2; exit 2 ;;
esac
DIR=${DEMO_DIR:-runs/demo}
[ "$VERIFIER" = tiny-code ] || DIR=${DEMO_DIR:-runs/demo-$VERIFIER}
PROMPTS=${DEMO_PROMPTS:-10}
STEPS=${DEMO_STEPS:-150}
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "DEMO_STEPS: '$STEPS': expected a positive integer (training steps per" \
  "drafter)" >&2; exit 2; }
# the configs warm up for 20 steps, which needs more than 20; a shorter smoke run warms up for a tenth of its steps
WARMUP=$(( STEPS > 20 ? 20 : STEPS / 10 ))
START=$SECONDS
stage() { printf '\n== [%s, %dm%02ds] %s\n' "$(date +%T)" $(((SECONDS - START) / 60)) $(((SECONDS - START) % 60)) "$*"; }

# The verifier is trained from the Python standard library once (the longest stage), then cached in
# ${DRAFTHEADS_HOME:-~/.cache/draftheads}/$VERIFIER.
stage "1/5 the embedded verifier $VERIFIER, and what it writes after HumanEval-style prompts"
draftheads build-verifier --recipe "$RECIPE"
python -m draftheads.models.tiny generate --recipe "$RECIPE" --max-new-tokens 48 \
  'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' \
  'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same forwards and backwards."""\n'

stage "2/5 training data: what the verifier writes after stdlib functions' docstrings; Medusa heads on it ($STEPS steps)"
# A drafter learns to predict the verifier, so it trains on the verifier's own continuations of stdlib functions cut
# after their docstring (scripts/selfdistill_data.py), the HumanEval shape the evaluation uses; the stdlib text
# itself accepts less.
[ -f "$DIR/selfdistill.jsonl" ] || python scripts/selfdistill_data.py --verifier "$VERIFIER" \
  --out "$DIR/selfdistill.jsonl" --num-prompts 400
# bf16 autocast only where the CPU multiplies bf16 natively (AVX512-BF16 / AMX): elsewhere it is emulated and an
# EAGLE step takes ~10x longer than in fp32
PRECISION=$(python -c "from draftheads.models.tiny import native_bf16; print('bf16' if native_bf16() else 'no')")
DATA=(--data.source="$DIR/selfdistill.jsonl" --train.max_steps="$STEPS" --train.eval_every="$STEPS"
      --train.save_every="$STEPS" --train.warmup_steps="$WARMUP" --train.mixed_precision="$PRECISION")
MEDUSA=(train/medusa.py --config configs/medusa-tiny.yaml --verifier "$VERIFIER" --output_dir "$DIR/medusa-tiny"
        "${DATA[@]}")
if trained "$DIR/medusa-tiny" "use another DEMO_DIR, or delete $DIR/medusa-tiny to train it again" "${MEDUSA[@]}"; then
  echo "cached: $DIR/medusa-tiny/drafter"
else
  python "${MEDUSA[@]}"
fi

stage "3/5 an EAGLE-3 drafter with EAGLE 3.1's fc_norm + norm_output ($STEPS steps of configs/eagle3-tiny.yaml)"
# shellcheck disable=SC2086
EAGLE=(train/eagle.py --config configs/eagle3-tiny.yaml --verifier "$VERIFIER" --output_dir "$DIR/eagle3-tiny"
       "${DATA[@]}" --eagle.fc_norm=true --eagle.norm_output=true $LAYERS)
if trained "$DIR/eagle3-tiny" "use another DEMO_DIR, or delete $DIR/eagle3-tiny to train it again" "${EAGLE[@]}"; then
  echo "cached: $DIR/eagle3-tiny/drafter"
else
  python "${EAGLE[@]}"
fi

stage "4/5 evaluate on $PROMPTS HumanEval prompts beside autoregressive and HF assisted generation"
# One torch thread: on a 2-core machine shared with anything else, two OpenMP threads wait on each other.
draftheads eval --verifier "$VERIFIER" \
  --method medusa --draft "$DIR/medusa-tiny/drafter" --option medusa.chain=3 \
  --method eagle3=eagle --draft "$DIR/eagle3-tiny/drafter" --option eagle3.chain=4 \
  --method ngram --compare hf-assisted \
  --prompts humaneval --num-prompts "$PROMPTS" --max-new-tokens 128 --threads 1 --out "$DIR/eval"

stage "5/5 re-check: every greedy output equals plain greedy decoding of the verifier"
draftheads recheck "$DIR/eval/results.json"

stage "done: report $DIR/eval/report.md, results $DIR/eval/results.json"
