#!/usr/bin/env bash
# DFlash2 beside DFlash on one training budget and several seeds: the same verifier, self-distilled data
# (scripts/selfdistill_data.py), config (configs/dflash-tiny.yaml), steps, block and seed for both; DFlash2 is
# `--dflash.variant=dflash2` with its defaults (convolutions of 2 taps over groups of 16 channels, a rank-256
# selector over the top 16). Then one decode benchmark at T = 0 on HumanEval prompts (scripts/bench_decode.py,
# methods taking turns prompt by prompt): tau, per-position acceptance, tokens/s per drafter and seed.
#
#   DFLASH2_VERIFIER=tiny-micro DFLASH2_STEPS=300 DFLASH2_SEEDS="0 1 2" bash scripts/bench_dflash2.sh
#
# A label's folder ($DIR/<variant>-s<seed>) holding a drafter is reused; delete it to train again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}  # the checkout's venv (scripts/setup_env.sh makes it)
export TOKENIZERS_PARALLELISM=false
VERIFIER=${DFLASH2_VERIFIER:-tiny-micro}
STEPS=${DFLASH2_STEPS:-300}
SEEDS=${DFLASH2_SEEDS:-0 1 2}
BLOCK=${DFLASH2_BLOCK:-5}
SEQ_LEN=${DFLASH2_SEQ_LEN:-128}
DATA_PROMPTS=${DFLASH2_DATA_PROMPTS:-200}
PROMPTS=${DFLASH2_PROMPTS:-16}
TOKENS=${DFLASH2_MAX_NEW_TOKENS:-96}
DIR=${DFLASH2_DIR:-runs/bench-dflash2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for value in "$STEPS" "$BLOCK" "$SEQ_LEN" "$DATA_PROMPTS" "$PROMPTS" "$TOKENS"; do
  [[ $value =~ ^[1-9][0-9]*$ ]] || { echo "bench_dflash2: '$value': expected a positive integer" >&2; exit 2; }
done
mkdir -p "$DIR"
[ -f "$DIR/selfdistill.jsonl" ] || PYTHONPATH=. "$PY" scripts/selfdistill_data.py --verifier "$VERIFIER" \
  --out "$DIR/selfdistill.jsonl" --num-prompts "$DATA_PROMPTS"
DRAFTERS=()
for seed in $SEEDS; do
  for variant in dflash dflash2; do
    label=$variant-s$seed
    if [ ! -f "$DIR/$label/drafter/config.json" ]; then
      echo "== training $label ($STEPS steps, block $BLOCK)"
      "$PY" train/dflash.py --config configs/dflash-tiny.yaml --output_dir "$DIR/$label" --verifier "$VERIFIER" \
        --wandb.enabled=false --train.max_steps="$STEPS" --train.eval_every="$STEPS" --train.save_every="$STEPS" \
        --train.warmup_steps="$(( STEPS / 10 + 1 ))" --train.mixed_precision=no --data.seq_len="$SEQ_LEN" \
        --data.source="$DIR/selfdistill.jsonl" --data.eval_rows=8 --train.seed="$seed" \
        --dflash.block_size="$BLOCK" --dflash.targets=data --dflash.variant="$variant"
    fi
    DRAFTERS+=("$label=$DIR/$label/drafter")
  done
done
rm -rf "$DIR/bench"
PYTHONPATH=. "$PY" scripts/bench_decode.py --verifier "$VERIFIER" --out "$DIR/bench" --num-prompts "$PROMPTS" \
  --max-new-tokens "$TOKENS" --temperatures 0 --threads 1 --runs "$DIR" --variants autoregressive \
  --dflash-extra "${DRAFTERS[@]}"
