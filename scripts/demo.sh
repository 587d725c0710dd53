#!/usr/bin/env bash
# The whole pipeline on the embedded default verifier, on a fresh machine (budget: 30 minutes on 2 CPU cores):
# set up .venv, build tiny-code, train Medusa heads and an EAGLE-3 drafter briefly, evaluate both beside plain
# decoding and Hugging Face assisted generation on HumanEval prompts, print the table and write the report.
#
#   bash scripts/demo.sh                 # DEMO_DIR=runs/demo DEMO_PROMPTS=10 DEMO_STEPS=150 to change
#
# Every stage is cached: a rerun skips what is already built or trained (delete $DEMO_DIR to start over).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
DIR=${DEMO_DIR:-runs/demo}
PROMPTS=${DEMO_PROMPTS:-10}
STEPS=${DEMO_STEPS:-150}
START=$SECONDS
stage() { printf '\n== [%s, %dm%02ds] %s\n' "$(date +%T)" $(((SECONDS - START) / 60)) $(((SECONDS - START) % 60)) "$*"; }

# The verifier is trained from the Python standard library once (the longest stage), then cached in
# ${DRAFTHEADS_HOME:-~/.cache/draftheads}/tiny-code.
stage "1/5 the embedded verifier tiny-code, and what it writes after HumanEval-style prompts"
python -m models.tiny build --recipe default
python -m models.tiny generate --recipe default --max-new-tokens 48 \
  'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' \
  'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same forwards and backwards."""\n'

stage "2/5 Medusa heads ($STEPS steps of configs/medusa-tiny.yaml)"
if [ -f "$DIR/medusa-tiny/drafter/config.json" ]; then echo "cached: $DIR/medusa-tiny/drafter"; else
  python train/medusa.py --config configs/medusa-tiny.yaml --output_dir "$DIR/medusa-tiny" \
    --train.max_steps="$STEPS" --train.eval_every="$STEPS" --train.save_every="$STEPS"
fi

stage "3/5 an EAGLE-3 drafter ($STEPS steps of configs/eagle3-tiny.yaml)"
if [ -f "$DIR/eagle3-tiny/drafter/config.json" ]; then echo "cached: $DIR/eagle3-tiny/drafter"; else
  python train/eagle.py --config configs/eagle3-tiny.yaml --output_dir "$DIR/eagle3-tiny" \
    --train.max_steps="$STEPS" --train.eval_every="$STEPS" --train.save_every="$STEPS"
fi

stage "4/5 evaluate on $PROMPTS HumanEval prompts beside autoregressive and HF assisted generation"
# One torch thread: on a 2-core machine shared with anything else, two OpenMP threads wait on each other.
python -m eval --verifier tiny-code \
  --method medusa --draft "$DIR/medusa-tiny/drafter" --option medusa.chain=3 \
  --method eagle3=eagle --draft "$DIR/eagle3-tiny/drafter" --option eagle3.chain=4 \
  --method ngram --compare hf-assisted \
  --prompts humaneval --num-prompts "$PROMPTS" --max-new-tokens 128 --threads 1 --out "$DIR/eval"

stage "5/5 re-check: every greedy output equals plain greedy decoding of the verifier"
python -m eval.verify "$DIR/eval/results.json"

stage "done: report $DIR/eval/report.md, results $DIR/eval/results.json"
