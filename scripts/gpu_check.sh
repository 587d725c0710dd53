#!/usr/bin/env bash
# The prepared check for a lent GPU (an H200; see /work/.library/device/README.md): the CUDA tests, then the decode
# benchmark (scripts/bench_gpu.py). Nothing is fetched from the network; packages the device image lacks or has in
# another version travel as wheels in .whl/, the embedded verifier as a built folder in .cache-gpu/.
#
#   here, once:     bash scripts/gpu_check.sh --prepare   # wheels into .whl/, embedded verifier into .cache-gpu/
#   here, smoke:    PYTHON=/work/venv/bin/python bash scripts/gpu_check.sh --dry-run   # CPU, toy shapes
#   on the device:  bash scripts/gpu_check.sh              # device `run`: carry [".whl", ".cache-gpu"], timeout_s 560
#
# Writes docs/benchmarks/gpu-<date>-<gpu>.{json,md}; when $OUT is set (the device tool) copies them there with the
# logs, so they come back. Budget: under 8 minutes (tests <= 200 s, benchmark the rest, cut by --budget-s).
# Exit status: 0 when the tests pass and the float32 exactness checks hold.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-run}
start=$SECONDS

if [ "$MODE" = "--prepare" ]; then
  tf=$("$PY" -c "import transformers; print(transformers.__version__)")
  rx=$("$PY" -c "import importlib.metadata as m; print(m.version('regex'))")
  # transformers: the device image's is older than pyproject's floor (the v5 layer signature changed); regex: its
  # import-time version check. Both for the device's Python 3.12, x86-64.
  mkdir -p .whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "transformers==$tf" "regex==$rx" || exit 1
  if "$PY" -c "import draftheads.models.tiny" 2>/dev/null; then
    DRAFTHEADS_HOME=$PWD/.cache-gpu "$PY" -m draftheads.models.tiny build --recipe micro || exit 1
  else
    echo "[prepare] draftheads.models.tiny is not in this build: the benchmark will skip the embedded verifier"
  fi
  ls -la .whl .cache-gpu 2>/dev/null
  exit 0
fi

LOG=${OUT:-runs/gpu-check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH=$PWD
if [ "$MODE" = "--dry-run" ]; then
  DEVICE=cpu
  BENCH_ARGS=(--device cpu --dry-run --out runs/bench)
  [ -d .whl ] && echo "[gpu_check] dry run: would install $(ls .whl | tr '\n' ' ')"
else
  DEVICE=cuda
  BENCH_ARGS=(--device cuda --out docs/benchmarks)
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$LOG/nvidia-smi.txt"
fi
"$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available()); import triton; print('triton', \
triton.__version__)" 2>&1 | tee "$LOG/versions.txt"

# 1. The CUDA tests: only the files that have some (collecting the rest would need packages the image lacks).
files=$(grep -l "mark.cuda" tests/*/test_*.py tests/e2e/interop/test_*.py | tr '\n' ' ')
echo "[gpu_check] pytest -m cuda $files"
timeout 200 "$PY" -m pytest -q -m cuda -p no:cacheprovider $files 2>&1 | tee "$LOG/pytest-cuda.log"
tests_rc=${PIPESTATUS[0]}

# 2. The embedded verifier: carried in .cache-gpu/micro, else built here if there is time (never blocks the rest).
EMB=none
if [ -f .cache-gpu/micro/config.json ]; then
  EMB=.cache-gpu/micro
elif "$PY" -c "import draftheads.models.tiny" 2>/dev/null && [ "$MODE" != "--dry-run" ]; then
  if DRAFTHEADS_HOME=$PWD/.cache-gpu timeout 90 "$PY" -m draftheads.models.tiny build --recipe micro > "$LOG/tiny-build.log" 2>&1
  then EMB=.cache-gpu/micro; else echo "[gpu_check] embedded verifier not built in 90 s; skipped"; fi
fi

# 3. The benchmark, in what is left of 470 s (the rest is margin for the device tool).
left=$(( 470 - (SECONDS - start) ))
echo "[gpu_check] benchmark with ${left}s left (embedded: $EMB)"
timeout "$left" "$PY" scripts/bench_gpu.py "${BENCH_ARGS[@]}" --embedded "$EMB" --budget-s $(( left - 90 )) \
  2>&1 | tee "$LOG/bench.log"
bench_rc=${PIPESTATUS[0]}

outdir=docs/benchmarks; [ "$MODE" = "--dry-run" ] && outdir=runs/bench
newest=$(ls -t "$outdir"/gpu-*.json 2>/dev/null | head -1)
if [ -n "$newest" ] && [ -n "${OUT:-}" ]; then cp "$newest" "${newest%.json}.md" "$OUT/"; fi
echo "[gpu_check] device=$DEVICE tests_rc=$tests_rc bench_rc=$bench_rc report=${newest:-none} elapsed=$((SECONDS - start))s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
