#!/usr/bin/env bash
# EAGLE-3 recipes side by side, one training budget: the same verifier, data, steps, batch, learning rate and seed
# for every drafter; only the recipe differs (autoregressive TTT vs parallel drafting, EAGLE 3.1 norms, each token
# loss, the step weights). Then one decode benchmark over all of them, beside plain decoding, n-gram lookup and
# HF assisted generation (scripts/bench_decode.py --eagle3-extra).
#
#   bash scripts/bench_eagle_recipes.sh     # RECIPES_VERIFIER=tiny-micro RECIPES_STEPS=300 RECIPES_DIR=runs/recipes ...
#
# Each drafter is trained once: a rerun reuses a label's folder when it holds that label's drafter trained with the
# same settings and inputs (scripts/same_run.sh), and stops, naming what differs, when it holds another run's (other
# RECIPES_STEPS in an old RECIPES_DIR); delete the folder to retrain. The
# training data are the verifier's own continuations of stdlib functions (scripts/selfdistill_data.py), the
# bench's default for its drafters.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
source scripts/same_run.sh  # setup_env.sh has moved to the repository root
VERIFIER=${RECIPES_VERIFIER:-tiny-micro}
STEPS=${RECIPES_STEPS:-300}
SEQ_LEN=${RECIPES_SEQ_LEN:-128}
ONLY=${RECIPES_ONLY:-}        # train only these labels (space-separated) and skip the bench: to split the work
DIR=${RECIPES_DIR:-runs/recipes}
PROMPTS=${RECIPES_PROMPTS:-8}
TOKENS=${RECIPES_MAX_NEW_TOKENS:-64}
# tiny-micro has 4 layers: the default feature layers (2, L//2, L-3 made distinct), not tiny-code's [2, 4, 7]
LAYERS=${RECIPES_LAYER_IDS:-$([ "$VERIFIER" = tiny-micro ] && echo null || echo "")}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$DIR"
[ -f "$DIR/selfdistill.jsonl" ] || python scripts/selfdistill_data.py --verifier "$VERIFIER" --out "$DIR/selfdistill.jsonl"

# label: overrides of configs/eagle3-tiny.yaml
RECIPES=(
  "base:"
  "across_documents:--data.document_mask=false"
  "muon:--train.optimizer=muon"
  "parallel:--eagle.parallel=true"
  "parallel_all:--eagle.parallel=true --eagle.parallel_keep=[1,1]"
  "parallel_uniform:--eagle.parallel=true --eagle.step_weights=uniform"
  "eagle31:--eagle.fc_norm=true --eagle.norm_output=true"
  "reverse_kl:--eagle.loss=reverse_kl"
  "jsd:--eagle.loss=jsd"
  "tv:--eagle.loss=tv"
  "lk:--eagle.loss=lk"
  "lk_hybrid:--eagle.loss=lk_hybrid"
  "reach:--eagle.step_weights=reach"
)
EXTRA=()
for entry in "${RECIPES[@]}"; do
  label=${entry%%:*}
  overrides=${entry#*:}
  run="$DIR/$label"
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $label "* ]]; then continue; fi
  # shellcheck disable=SC2086
  args=(train/eagle.py --config configs/eagle3-tiny.yaml --verifier "$VERIFIER" --output_dir "$run"
        --wandb.enabled=false --train.mixed_precision=no --train.max_steps="$STEPS" --train.eval_every="$STEPS"
        --train.save_every="$STEPS" --data.seq_len="$SEQ_LEN" --data.source="$DIR/selfdistill.jsonl" --data.eval_rows=8
        ${LAYERS:+--eagle.layer_ids=$LAYERS} $overrides)
  if trained "$run" "use another RECIPES_DIR, or delete $run to train it again" "${args[@]}"; then
    echo "== reusing $label: $run holds its drafter, trained with these settings and inputs"
  else
    echo "== training $label ($STEPS steps) $overrides"
    python "${args[@]}"
  fi
  EXTRA+=("$label=$run/drafter")
done

[ -z "$ONLY" ] || exit 0
python scripts/bench_decode.py --verifier "$VERIFIER" --out "$DIR/bench" --num-prompts "$PROMPTS" \
  --max-new-tokens "$TOKENS" --temperatures 0 --threads 1 --runs "$DIR" \
  --eagle3 "$DIR/base/drafter" --variants autoregressive ngram hf hf-assisted-lookup eagle3-tree-d7k3n16 \
  --eagle3-extra "${EXTRA[@]}" --extra-chains 1 4 6
