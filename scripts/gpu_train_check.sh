#!/usr/bin/env bash
# The trainers on a lent GPU (an H200; /work/.library/device/README.md), in one device call:
#   1. smoke: train/medusa.py, train/eagle.py (EAGLE-3) and train/dflash.py on tiny-code for a few steps each, on
#      CUDA, with the end-of-run train/serve check and the export; the EAGLE-3 run is killed (SIGKILL) once its
#      mid-run checkpoint is on disk and the same command resumes it (CUDA RNG and optimizer state restored);
#   2. budget: EAGLE-3 (configs/eagle3-tiny.yaml) and DFlash (configs/dflash-tiny.yaml, block 5) side by side on
#      the self-distilled rows of scripts/bench_dflash.sh, as many steps as the time left allows (the same steps and
#      tokens for both, measured from the smoke runs' own tokens/s), each drafter copied back to $OUT to be decoded
#      here by scripts/bench_decode.py (docs/benchmarks.md#gpu-h200);
#   3. scale: scripts/bench_scale.py at 8B shapes on CUDA in bf16, offline features: EAGLE-3 (Llama-3.1-8B) and
#      DFlash (Qwen3-8B, 5 layers, block 16, 512 anchors) up the seq ladder from 4096 until a row no longer fits
#      GPU_SCALE_GIB (default 70) or GPU_SCALE_S seconds (default 200) are spent: peak allocated memory, tokens/s,
#      the largest seq that fits; its table and JSON in the logs archive (scale/). GPU_SCALE=0 skips it; the dry
#      run measures the tiny shapes on the CPU.
#
#   here, once:   PYTHON=.venv/bin/python bash scripts/gpu_train_check.sh --prepare   # .whl-train/, .cache-gpu/
#   here, smoke:  PYTHON=/tmp/devsim/bin/python bash scripts/gpu_train_check.sh --dry-run   # CPU, a few steps
#   other rows:   GPU_TRAIN_DATA=FILE.jsonl PYTHON=.venv/bin/python bash scripts/gpu_train_check.sh --prepare
#   on device:    bash scripts/gpu_train_check.sh    # device `run`: carry [".whl-train", ".cache-gpu/tiny-code",
#                                                    #   ".cache-gpu/selfdistill.jsonl"]; GPU_TRAIN_BUDGET_S seconds
#                                                    #   (default 240) for everything but the install
#   the pair alone: GPU_TRAIN_STEPS=N bash scripts/gpu_train_check.sh   # no smoke; N steps each (N >= 4)
#   scale alone:  GPU_SCALE_ONLY=1 GPU_SCALE_S=240 bash scripts/gpu_train_check.sh   # carry [".whl-train"]; stage 3
#                                                  # only (over GPU_TRAIN_STEPS); timeout_s 330
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-run}
start=$SECONDS
# shellcheck source=scripts/gpu_wheels.sh
source scripts/gpu_wheels.sh  # $PY, the wheels

if [ -n "${GPU_TRAIN_STEPS:-}" ] && ! { [[ $GPU_TRAIN_STEPS =~ ^[1-9][0-9]*$ ]] && [ "$GPU_TRAIN_STEPS" -ge 4 ]; }; then
  echo "GPU_TRAIN_STEPS='$GPU_TRAIN_STEPS': expected an integer of at least 4 (the budget runs' steps)" >&2
  exit 2
fi
if [ "$MODE" = "--prepare" ] && [ -n "${GPU_TRAIN_DATA:-}" ] && [ ! -f "$GPU_TRAIN_DATA" ]; then
  echo "GPU_TRAIN_DATA='$GPU_TRAIN_DATA': no such file (a JSONL of rows, e.g. from scripts/selfdistill_data.py)" >&2
  exit 2
fi
if [ "$MODE" = "--prepare" ]; then
  # The wheels of scripts/gpu_check.sh's --prepare (transformers >= 5.20 and hub 2.x for the device image) without
  # hf_xet and tokenizers, which the image has in usable versions (the carried tree must stay under 64 MiB with the
  # verifier), plus what the trainers import and the image lacks: datasets (and its dill, multiprocess, fsspec pins)
  # and jsonargparse (with its signatures extra).
  # shellcheck disable=SC2046
  download_wheels .whl-train $(printf '%s\n' $GPU_WHEELS | grep -vx -e hf_xet -e tokenizers) datasets dill \
    multiprocess fsspec jsonargparse docstring_parser typeshed_client || exit 1
  home=${DRAFTHEADS_HOME:-$HOME/.cache/draftheads}
  [ -f "$home/tiny-code/config.json" ] || "$PY" -m draftheads.models.tiny build --recipe default || exit 1
  mkdir -p .cache-gpu && rm -rf .cache-gpu/tiny-code && cp -r "$home/tiny-code" .cache-gpu/tiny-code || exit 1
  if [ -n "${GPU_TRAIN_DATA:-}" ]; then
    data=$GPU_TRAIN_DATA  # checked above
  else
    data=runs/bench-dflash-600/selfdistill.jsonl  # scripts/bench_dflash.sh's rows: 800 functions continued
    [ -f "$data" ] || PYTHONPATH=. "$PY" scripts/selfdistill_data.py --verifier tiny-code --out "$data" \
      --num-prompts 800 || exit 1
  fi
  cp "$data" .cache-gpu/selfdistill.jsonl
  du -shc .whl-train .cache-gpu/tiny-code .cache-gpu/selfdistill.jsonl
  exit 0
fi

# At most 8 files come back from $OUT: the logs go there as one archive (remade after each stage, so a run cut
# short still returns what it wrote), each budget drafter as one more.
BACK=${OUT:-runs/gpu-train}
LOG=runs/gpu-train-logs
RUNS=runs/gpu-train-runs
rm -rf "$LOG" "$RUNS" && mkdir -p "$BACK" "$LOG" "$RUNS"
[ -z "${OUT:-}" ] && rm -f "$BACK"/*.tar "$BACK"/logs.tgz  # a local run: no earlier run's files beside this one's
pack() { tar -czf "$BACK/logs.tgz" -C "$LOG" . ; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export DRAFTHEADS_HOME=$PWD/.cache-gpu WANDB_MODE=disabled
if [ "$MODE" = "--dry-run" ]; then
  SMOKE_STEPS=4 BUDGET=${GPU_TRAIN_BUDGET_S:-60} MAX_STEPS=12 ROUND=2
else
  SMOKE_STEPS=40 BUDGET=${GPU_TRAIN_BUDGET_S:-240} MAX_STEPS=12000 ROUND=100
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$LOG/nvidia-smi.txt"
fi
export PYTHONPATH=$PWD
install_wheels .whl-train /tmp/site-train || exit 1
"$PY" -c "import sys, torch, transformers, accelerate, datasets; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', \
datasets.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee "$LOG/versions.txt"

DATA=.cache-gpu/selfdistill.jsonl
# scripts/bench_dflash.sh's settings: the self-distilled rows, 8 held out, fp32, no wandb
COMMON=(--verifier tiny-code --wandb.enabled=false --train.mixed_precision=no --data.seq_len=256
        --data.source="$DATA" --data.eval_rows=8)
declare -A CFG=([medusa]=configs/medusa-tiny.yaml [eagle3]=configs/eagle3-tiny.yaml [dflash]=configs/dflash-tiny.yaml)
declare -A SCRIPT=([medusa]=train/medusa.py [eagle3]=train/eagle.py [dflash]=train/dflash.py)
declare -A EXTRA=([medusa]="" [eagle3]="" [dflash]="--dflash.block_size=5 --dflash.targets=data")

trainer() {  # trainer LABEL NAME STEPS WARMUP [overrides...]: one run into $RUNS/LABEL, its log in $LOG/LABEL.log
  local label=$1 name=$2 steps=$3 warmup=$4
  shift 4
  # shellcheck disable=SC2086
  "$PY" "${SCRIPT[$name]}" --config "${CFG[$name]}" --output_dir "$RUNS/$label" "${COMMON[@]}" ${EXTRA[$name]} \
    --train.max_steps="$steps" --train.warmup_steps="$warmup" --train.save_every="$steps" \
    --train.eval_every="$steps" --train.log_every=10 "$@" > "$LOG/$label.log" 2>&1
}

smoke_rc=0
if [ "${GPU_SCALE_ONLY:-0}" != 0 ]; then  # stage 3 alone: no smoke, no budget runs
  steps=0
elif [ -n "${GPU_TRAIN_STEPS:-}" ]; then  # the budget runs alone, at this many steps (a rerun on other data)
  steps=$GPU_TRAIN_STEPS
else
# 1. Smoke: the three trainers at once (one process each; the GPU is shared). EAGLE-3 is killed (SIGKILL) once its
# step-$half checkpoint is on disk, then the same command resumes it to the end (the crash-resume contract on CUDA).
half=$(( SMOKE_STEPS / 2 ))
trainer smoke-medusa medusa "$SMOKE_STEPS" 1 & p1=$!
trainer smoke-dflash dflash "$SMOKE_STEPS" 1 & p3=$!
trainer smoke-eagle3 eagle3 "$SMOKE_STEPS" 1 --train.save_every="$half" & p2=$!
ckpt=$RUNS/smoke-eagle3/step-$(printf %06d "$half")
while kill -0 $p2 2>/dev/null && [ ! -d "$ckpt" ]; do sleep 0.2; done
if [ -d "$ckpt" ]; then pkill -9 -f "output_dir $RUNS/smoke-eagle3" ; fi
declare -A RC
wait $p2; rc=$?
RC[smoke-eagle3-killed]=$(( rc == 137 ? 0 : 1 ))  # 137: killed as meant; else it ended on its own (or failed) first
echo "[gpu_train] smoke-eagle3 killed at $(ls -d "$RUNS"/smoke-eagle3/step-* 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
cp "$LOG/smoke-eagle3.log" "$LOG/smoke-eagle3-killed.log"
trainer smoke-eagle3 eagle3 "$SMOKE_STEPS" 1 --train.save_every="$half"
RC[smoke-eagle3]=$?
# the resumed run must say where it continued from (a run that started over would pass the rest)
grep -a "\[resume\] continuing from" "$LOG/smoke-eagle3.log" | head -1 | grep . || { echo "[gpu_train] smoke-eagle3" \
  "did not resume from its checkpoint"; RC[smoke-eagle3]=1; }
wait $p1; RC[smoke-medusa]=$?
wait $p3; RC[smoke-dflash]=$?
cp "$RUNS/smoke-eagle3/metrics.jsonl" "$LOG/smoke-eagle3-metrics.jsonl" 2>/dev/null
for k in smoke-medusa smoke-eagle3-killed smoke-eagle3 smoke-dflash; do
  echo "[gpu_train] $k rc=${RC[$k]}"; [ "${RC[$k]}" -ne 0 ] && smoke_rc=1
done
for k in smoke-medusa smoke-eagle3 smoke-dflash; do
  [ "${RC[$k]}" -ne 0 ] && tail -n 25 "$LOG/$k.log"
done
pack

# 2. The budget: steps from the smoke runs' measured step rate (the slower of the two trainers), same for both.
if [ "$smoke_rc" -ne 0 ]; then
  echo "[gpu_train] a smoke run failed: no budget runs"; steps=0
else
rate() {  # rate LABEL: the median train/tokens_per_s the run logged
  "$PY" - "$RUNS/$1/metrics.jsonl" <<'EOF'
import json, statistics, sys
rates = [r["train/tokens_per_s"] for r in map(json.loads, open(sys.argv[1])) if "train/tokens_per_s" in r]
print(statistics.median(rates[1:] or rates) if rates else 0)
EOF
}
left=$(( BUDGET - (SECONDS - start) ))
rate_e=$(rate smoke-eagle3) rate_d=$(rate smoke-dflash)
steps=$("$PY" - "$rate_e" "$rate_d" "$left" "$MAX_STEPS" "$ROUND" <<'EOF'
import sys
e, d, left, cap, rnd = (float(x) for x in sys.argv[1:])
slow = min(e, d) / 2048  # steps per second of the slower (8 rows of 256 tokens a step), run side by side
print(0 if slow <= 0 else int(min(cap, slow * max(0, left - 45) * 0.8) // rnd * rnd))
EOF
)
echo "[gpu_train] smoke rates (tokens/s): eagle3 $rate_e dflash $rate_d; ${left}s left:" \
  "$steps steps each"
[ "${steps:-0}" -ge 4 ] || echo "[gpu_train] no time left for the budget runs"
fi
fi
pack  # what the smoke wrote (or the versions alone) comes back even if the budget runs are cut short
budget_rc=0
if [ "${steps:-0}" -ge 4 ]; then
  warm=$(( steps >= 200 ? 20 : steps / 10 + 1 ))
  export TQDM_DISABLE=1  # no progress bars in these logs (the status lines stay)
  trainer "eagle3-$steps" eagle3 "$steps" "$warm" & q1=$!
  trainer "dflash-b5-$steps" dflash "$steps" "$warm" & q2=$!
  declare -A RC
  wait $q1; RC[eagle3-$steps]=$?
  wait $q2; RC[dflash-b5-$steps]=$?
  for label in "eagle3-$steps" "dflash-b5-$steps"; do
    d=$RUNS/$label/drafter
    if [ "${RC[$label]}" -ne 0 ]; then tail -n 25 "$LOG/$label.log"; budget_rc=1; fi
    if [ -f "$d/model.safetensors" ]; then
      cp "$RUNS/$label/metrics.jsonl" "$LOG/$label-metrics.jsonl"
      tar -cf "$BACK/$label.tar" -C "$RUNS/$label" drafter config.yaml metrics.jsonl
    else
      budget_rc=1
    fi
  done
elif [ "${GPU_SCALE_ONLY:-0}" = 0 ]; then
  budget_rc=1
fi
pack

# 3. The scale bench: 8B shapes (random-weight stand-ins), bf16, offline features, the seq ladder while it fits; each
# row is saved as it is measured, so a stage cut short by its time limit still returns the rows it finished.
scale_rc=0
if [ "${GPU_SCALE:-1}" != 0 ] || [ "${GPU_SCALE_ONLY:-0}" != 0 ]; then
  if [ "$MODE" = "--dry-run" ]; then
    scale=(--tiny --device cpu --threads 1 --seqs 64 128)
  else
    scale=(--device cuda --seqs 4096 8192 16384 32768 65536 --memory-gib "${GPU_SCALE_GIB:-70}" --timeout 120)
  fi
  for pair in "eagle3 llama3-8b" "dflash qwen3-8b"; do
    read -r name model <<< "$pair"
    timeout "$(( ${GPU_SCALE_S:-200} / 2 ))" "$PY" scripts/bench_scale.py --trainers "$name" --models "$model" \
      --features offline --steps 2 --warmup 1 --out "$LOG/scale" --work /tmp/scale-work --reuse "${scale[@]}" \
      > "$LOG/scale-$name.log" 2>&1
    rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then tail -n 15 "$LOG/scale-$name.log"; scale_rc=1; fi
  done
  cat "$LOG"/scale/scale-*.md 2>/dev/null
  compgen -G "$LOG/scale/scale-*.json" > /dev/null && "$PY" - "$LOG"/scale/scale-*.json <<'EOF'
import json, sys
for path in sys.argv[1:]:
    rows = json.load(open(path))["rows"]
    for trainer in sorted({r["trainer"] for r in rows}):
        fit = [r for r in rows if r["trainer"] == trainer and r["status"] == "ok"]
        best = max(fit, key=lambda r: r["seq"], default=None)
        print(f"[gpu_train] scale {trainer}: largest seq that fits {best['seq'] if best else None}"
              + (f", {best['tokens_per_s']:.0f} tokens/s, peak {best['peak_gib']:.1f} GiB" if best else ""))
EOF
  pack
fi
echo "[gpu_train] smoke_rc=$smoke_rc budget_rc=$budget_rc scale_rc=$scale_rc steps=$steps elapsed=$((SECONDS - start))s"
[ "$smoke_rc" -eq 0 ] && [ "$budget_rc" -eq 0 ] && [ "$scale_rc" -eq 0 ]
