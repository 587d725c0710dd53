#!/usr/bin/env bash
# The peer bench, end to end from a clean clone: draftheads, speculators 0.9.0 and SpecForge 0.2.0 train EAGLE-3 on
# the same rows with matched settings, vLLM (CPU) serves all three, and one table per verifier lands in
# docs/peers.md (what the bench does and what it matches: scripts/bench_peers.py's docstring and docs/peers.md).
#   bash scripts/bench_peers.sh                          # tiny-micro, then tiny-code (built on first use)
#   bash scripts/bench_peers.sh tiny-micro /path/to/verifier
#   BENCH_PEERS_ARGS="--seed 1 --variant 'stream packing=--data.packing=stream'" bash scripts/bench_peers.sh tiny-micro
# BENCH_PEERS_ARGS is split as a shell would split it (quotes keep a --variant label with spaces in one piece).
# Opt-in, not part of the test suite: about 20 minutes for tiny-micro and 40 for tiny-code on two shared cores (the
# default budget: 400 documents of ~254 tokens, one epoch, 4 per optimizer step; --rows/--epochs/--batch scale it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
source scripts/setup_env.sh
bash scripts/setup_vllm.sh
bash scripts/setup_peers.sh
extra=()
if [ -n "${BENCH_PEERS_ARGS:-}" ]; then
  python -c 'import os, shlex; shlex.split(os.environ["BENCH_PEERS_ARGS"])' 2>/dev/null \
    || { echo "[bench_peers] BENCH_PEERS_ARGS: cannot split it as a shell would (an unbalanced quote?)" >&2; exit 2; }
  mapfile -d '' extra < <(python -c 'import os, shlex, sys
for a in shlex.split(os.environ["BENCH_PEERS_ARGS"]): sys.stdout.write(a + "\0")')
fi
verifiers=("$@")
[ ${#verifiers[@]} -gt 0 ] || verifiers=(tiny-micro tiny-code)
for verifier in "${verifiers[@]}"; do
  out=runs/peers-$(basename "$verifier")
  echo "[bench_peers] $verifier -> $out"
  nice -n 10 python scripts/bench_peers.py --verifier "$verifier" --out "$out" --docs docs/peers.md "${extra[@]}"
done
