#!/usr/bin/env bash
# The embedded verifier's build speed with and without AVX-512, side by side on this machine: builds a recipe
# (default micro) twice into a temp folder, once as the CPU is and once made to use only AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, which is how a CPU without AVX-512 runs), and prints each
# build's steps/s, precision and held-out bits per byte, then the ratio. A benchmark, not a test: the ratio, not
# the absolute speed, is the figure (a loaded machine slows both).
#   bash scripts/bench_build.sh [micro|default] [STEPS]
# STEPS cuts both builds to that many optimizer steps (warm-up included), the recipe otherwise unchanged: the
# default recipe's steps/s both ways in minutes instead of ~45 (its bits per byte are then those of a short build).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
recipe=${1:-micro}
steps=${2:-}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
which=(--recipe "$recipe")
if [ -n "$steps" ]; then
  which=(--recipe-json "$(python - "$recipe" "$steps" <<'PY'
import dataclasses, json, sys
from draftheads.models.tiny.recipe import get_recipe
r = get_recipe(sys.argv[1])
steps = int(sys.argv[2])
print(json.dumps(dataclasses.asdict(dataclasses.replace(r, steps=steps, warmup_steps=min(r.warmup_steps, steps - 1)))))
PY
)")
fi
echo "[bench_build] recipe $recipe${steps:+ cut to $steps steps}, $(nproc) CPUs; builds in $out"
draftheads build-verifier "${which[@]}" --out "$out/native" > "$out/native.log" 2>&1
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 draftheads build-verifier "${which[@]}" --out "$out/avx2" \
  > "$out/avx2.log" 2>&1
python - "$out" <<'PY'
import json, sys
from pathlib import Path

rows = {}
for name in ("native", "avx2"):
    info = json.loads((Path(sys.argv[1]) / name / "draftheads_build.json").read_text())
    fig, held = info["figures"], info["held_out"]
    rows[name] = fig["steps_per_s"]
    print(f"{name:>7}: {fig['steps_per_s']:.3f} steps/s (fastest interval {fig['fastest_steps_per_s']:.3f}), "
          f"precision {fig['precision']} (native bf16: {fig.get('native_bf16')}), {fig['threads']} threads, "
          f"held-out {held['bits_per_byte']:.4f} bits per byte, build {fig['total_seconds']:.0f} s")
print(f"ratio native / avx2-only: {rows['native'] / rows['avx2']:.2f}x")
PY
