#!/usr/bin/env bash
# The prepared check for a lent GPU (an H200; see /work/.library/device/README.md): the CUDA tests, then the decode
# benchmark (scripts/bench_gpu.py). Nothing is fetched from the network; packages the device image lacks or has in
# another version travel as wheels in .whl/, the embedded verifier as a built folder in .cache-gpu/.
#
#   here, once:     PYTHON=.venv/bin/python bash scripts/gpu_check.sh --prepare   # wheels into .whl/, tiny-micro
#                   into .cache-gpu/
#   here, smoke:    PYTHON=.venv/bin/python bash scripts/gpu_check.sh --dry-run   # CPU, toy shapes
#   as the device:  GPU_CHECK_INSTALL=1 PYTHON=<py3.12 venv with only torch triton numpy pyyaml packaging tqdm pytest
#                   psutil scipy>/bin/python bash scripts/gpu_check.sh --dry-run   # the device's install, on the CPU
#   on the device:  bash scripts/gpu_check.sh              # device `run`: carry [".whl", ".cache-gpu"], timeout_s 400
#   a rerun:        bash scripts/gpu_check.sh --tests      # the CUDA tests alone, after a fix (carry [".whl"])
#                   (2026-12-04 on an H200: 274 s, the machine's start not counted)
#   realistic:      bash scripts/gpu_check.sh --realistic  # carry [".whl"], timeout_s 480: no tests; builds the
#                   100.7M-parameter code-100m verifier on the GPU (models/tiny/recipe.py; at most
#                   GPU_VERIFIER_BUILD_S, default 240) and runs the decode benchmark on it alone, its EAGLE drafter
#                   fitted on 1,024 self-distilled rows of the stdlib's drafter split and timed on held-out eval-split
#                   prompts; all within 420 s, so a 15-minute device session also holds the machine's start and
#                   gpu_train_check.sh's scale stage (GPU_SCALE_ONLY=1 GPU_SCALE_S=240), not the whole check
#   its smoke:      PYTHON=.venv/bin/python bash scripts/gpu_check.sh --realistic-dry-run   # CPU: 3 build steps
#
# The trainers on the GPU are scripts/gpu_train_check.sh's (its own carry; run it after this one when time is left).
# Writes docs/benchmarks/gpu-<date>-<gpu>.{json,md}; when $OUT is set (the device tool) copies them there with the
# logs, so they come back. Budget: under 400 s (tests <= 120 s a file; the benchmark in what is left of 380 s).
# Exit status: 0 when the tests pass and the float32 exactness checks hold; --realistic: 0 when the benchmark timed
# the verifier and its float32 exactness held, 3 when a step ran out of its time (124 stays the device tool's own).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-run}
case $MODE in
  run|--prepare|--dry-run|--tests|--realistic|--realistic-dry-run) ;;
  *) echo "scripts/gpu_check.sh: unknown mode '$MODE'; expected --prepare, --dry-run, --tests, --realistic or" \
       "--realistic-dry-run (none: the whole check)" >&2; exit 2 ;;
esac
start=$SECONDS
# shellcheck source=scripts/gpu_wheels.sh
source scripts/gpu_wheels.sh  # $PY, the wheels

if [ "$MODE" = "--prepare" ]; then
  # shellcheck disable=SC2086
  download_wheels .whl $GPU_WHEELS || exit 1  # scripts/gpu_wheels.sh says which and why
  if "$PY" -c "import draftheads.models.tiny" 2>/dev/null; then
    [ -f .cache-gpu/tiny-micro/config.json ] || DRAFTHEADS_HOME=$PWD/.cache-gpu "$PY" -m draftheads.models.tiny build \
      --recipe micro || exit 1
  else
    echo "[prepare] draftheads.models.tiny is not in this build: the benchmark will skip the embedded verifier"
  fi
  du -sh .whl .cache-gpu 2>/dev/null
  exit 0
fi

LOG=${OUT:-runs/gpu-check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH=$PWD
DRY=; case $MODE in --dry-run|--realistic-dry-run) DRY=1 ;; esac
if [ -n "$DRY" ]; then
  DEVICE=cpu
  BENCH_ARGS=(--device cpu --dry-run --out runs/bench)
  [ -d .whl ] && echo "[gpu_check] dry run: would install $(ls .whl | tr '\n' ' ')"
else
  DEVICE=cuda
  BENCH_ARGS=(--device cuda --out docs/benchmarks)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$LOG/nvidia-smi.txt"
fi
# The device's own Python gets the carried wheels (and the dry run too with GPU_CHECK_INSTALL=1, in an environment
# made to look like the device's: scripts/gpu_check.sh's header).
if [ -z "$DRY" ] || [ -n "${GPU_CHECK_INSTALL:-}" ]; then
  install_wheels .whl /tmp/site || exit 1
fi
"$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available()); import triton; print('triton', \
triton.__version__)" 2>&1 | tee "$LOG/versions.txt"

# --realistic: a verifier at a realistic size, built here, and the decode benchmark on it alone (no tests).
if [ "$MODE" = "--realistic" ] || [ "$MODE" = "--realistic-dry-run" ]; then
  REAL=.cache-gpu/code-100m SETS=()
  if [ -n "$DRY" ]; then  # the same code on the CPU: the full shapes, 3 steps of 2 x 64 tokens
    REAL=runs/code-100m-dry SETS=(--set steps=3 --set batch_size=2 --set seq_len=64 --set warmup_steps=1 \
      --set eval_files=1)
  fi
  build_s=${GPU_VERIFIER_BUILD_S:-240}
  echo "[gpu_check] building code-100m on $DEVICE into $REAL (at most ${build_s}s)"
  timeout "$build_s" "$PY" -m draftheads.models.tiny build --recipe code-100m --out "$REAL" \
    --device "$DEVICE" ${SETS[@]+"${SETS[@]}"} > "$LOG/code-100m-build.log" 2>&1
  build_rc=$?
  tr '\r' '\n' < "$LOG/code-100m-build.log" | grep -v '^ *$' | tail -n 6  # progress bars redraw with \r
  [ -f "$REAL/draftheads_build.json" ] && cp "$REAL/draftheads_build.json" "$LOG/code-100m-build.json"
  if [ "$build_rc" -ne 0 ]; then
    [ "$build_rc" -eq 124 ] && build_rc=3
    echo "[gpu_check] device=$DEVICE code-100m build failed (rc $build_rc; 3: over ${build_s}s)" \
      "elapsed=$((SECONDS - start))s"
    exit "$build_rc"
  fi
  left=$(( 420 - (SECONDS - start) ))
  if [ "$left" -lt 120 ]; then
    echo "[gpu_check] device=$DEVICE only ${left}s of 420 left after the build: no benchmark" \
      "elapsed=$((SECONDS - start))s"
    exit 3
  fi
  echo "[gpu_check] benchmark on code-100m with ${left}s left"
  timeout "$left" "$PY" scripts/bench_gpu.py "${BENCH_ARGS[@]}" --embedded "$REAL" --skip-1b --fit-data stdlib \
    --fit-sequences 1024 --fit-seq-len 272 --fit-batch 16 --fit-steps 800 --prompt-source stdlib --prompts 8 \
    --prompt-len 128 --budget-s $(( left - 45 )) 2>&1 | tee "$LOG/bench.log"
  bench_rc=${PIPESTATUS[0]}
  [ "$bench_rc" -eq 124 ] && bench_rc=3
  outdir=docs/benchmarks; [ -n "$DRY" ] && outdir=runs/bench
  # this run's report only: a checkout's older reports are not newer than this run's versions.txt
  newest=$(find "$outdir" -maxdepth 1 -name 'gpu-*.json' -newer "$LOG/versions.txt" 2>/dev/null | sort | tail -1)
  if [ -n "$newest" ] && [ -n "${OUT:-}" ]; then cp "$newest" "${newest%.json}.md" "$OUT/"; fi
  # the budget may have skipped the timing, which is the point of this mode: no timing, no success
  if [ "$bench_rc" -eq 0 ] && ! { [ -n "$newest" ] && "$PY" -c "import json, sys; \
sys.exit(0 if 'timing' in json.load(open(sys.argv[1]))['verifiers'].get('embedded', {}) else 1)" "$newest"; }; then
    echo "[gpu_check] the benchmark wrote no timing for code-100m (time budget spent)"; bench_rc=3
  fi
  echo "[gpu_check] device=$DEVICE realistic bench_rc=$bench_rc report=${newest:-none} elapsed=$((SECONDS - start))s"
  exit "$bench_rc"
fi

# 1. The CUDA tests: only the files that have some (collecting the rest would need packages the image lacks).
# One process per file: a device-side assert poisons the CUDA context, and every later test in that process would
# then error at its set-up and hide its own result.
tests_rc=0
for f in $(grep -l "mark.cuda" tests/*/test_*.py tests/e2e/interop/test_*.py); do
  echo "[gpu_check] pytest -m cuda $f" | tee -a "$LOG/pytest-cuda.log"
  timeout 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider "$f" 2>&1 | tee -a "$LOG/pytest-cuda.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && tests_rc=$rc
done

if [ "$MODE" = "--tests" ]; then  # a rerun after a fix: the tests alone (about 60 s of device time)
  echo "[gpu_check] device=$DEVICE tests_rc=$tests_rc (tests only) elapsed=$((SECONDS - start))s"
  exit "$tests_rc"
fi

# 2. The embedded verifier: carried in .cache-gpu/tiny-micro, else built here if there is time (never blocks the rest).
EMB=none
if [ -f .cache-gpu/tiny-micro/config.json ]; then
  EMB=.cache-gpu/tiny-micro
elif "$PY" -c "import draftheads.models.tiny" 2>/dev/null && [ -z "$DRY" ]; then
  if DRAFTHEADS_HOME=$PWD/.cache-gpu timeout 90 "$PY" -m draftheads.models.tiny build --recipe micro > "$LOG/tiny-build.log" 2>&1
  then EMB=.cache-gpu/tiny-micro; else echo "[gpu_check] embedded verifier not built in 90 s; skipped"; fi
fi

# 3. The benchmark, in what is left of 380 s (the rest is margin for the device tool).
left=$(( 380 - (SECONDS - start) ))
echo "[gpu_check] benchmark with ${left}s left (embedded: $EMB)"
timeout "$left" "$PY" scripts/bench_gpu.py "${BENCH_ARGS[@]}" --embedded "$EMB" --budget-s $(( left - 90 )) \
  2>&1 | tee "$LOG/bench.log"
bench_rc=${PIPESTATUS[0]}

outdir=docs/benchmarks; [ -n "$DRY" ] && outdir=runs/bench
newest=$(ls -t "$outdir"/gpu-*.json 2>/dev/null | head -1)
if [ -n "$newest" ] && [ -n "${OUT:-}" ]; then cp "$newest" "${newest%.json}.md" "$OUT/"; fi
echo "[gpu_check] device=$DEVICE tests_rc=$tests_rc bench_rc=$bench_rc report=${newest:-none} elapsed=$((SECONDS - start))s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
