#!/usr/bin/env bash
# Set up .venv on first use, then run the whole test suite on the CPU: bash scripts/test.sh [pytest args]
# Tiers (tests/unit, tests/integration, tests/e2e): `bash scripts/test.sh -m unit` is the quick loop (seconds),
# `-m "unit or integration"` adds the in-process runs; CI runs all three.
# The interop suite (tests/e2e/interop: our exports in real vLLM) needs .venv-vllm, which scripts/setup_vllm.sh makes
# once (~3.5 min, 2.7 GB); DRAFTHEADS_INTEROP=0 leaves both out (the interop tests then report themselves skipped).
# The DFlash reference check (tests/e2e/test_dflash_reference.py) needs .venv-dflash (z-lab's `dflash` package),
# which scripts/setup_dflash_reference.sh makes once (about a minute of CPU; torch from the local wheel);
# DRAFTHEADS_DFLASH_REFERENCE=0 leaves it out (the tests then report themselves skipped; without the venv and
# without that setting they error, like the interop suite without vLLM).
# DRAFTHEADS_SGLANG=1 also makes .venv-sglang (scripts/setup_sglang.sh) for the SGLang loader test.
set -euo pipefail
# The three environments are independent and each set-up is mostly one single-threaded pip: on a clean clone they
# run side by side (vLLM's and the DFlash reference's in the background while .venv is made), not one after another.
here=$(dirname "$0")
# A marker expression that names neither e2e nor interop and negates nothing (`-m unit`, `-m "unit or integration"`)
# selects no test that reads those environments: the quick loop does not build them on a fresh clone.
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    -m) expr=${args[i + 1]:-} ;;
    -m*) expr=${args[i]#-m} ;;
    *) continue ;;
  esac
  if [[ $expr != *e2e* && $expr != *interop* && $expr != *not* ]]; then
    : "${DRAFTHEADS_INTEROP:=0}" "${DRAFTHEADS_DFLASH_REFERENCE:=0}"
  fi
done
setups=()
trap 'for pid in "${setups[@]}"; do kill "$pid" 2>/dev/null || true; done' EXIT
if [ "${DRAFTHEADS_INTEROP:-1}" != "0" ]; then
  bash "$here/setup_vllm.sh" &
  setups+=($!)
fi
if [ "${DRAFTHEADS_DFLASH_REFERENCE:-1}" != "0" ]; then
  bash "$here/setup_dflash_reference.sh" &
  setups+=($!)
fi
source "$here/setup_env.sh"
for pid in "${setups[@]}"; do
  wait "$pid"  # a failed set-up has printed its one line; its status ends this script (set -e)
done
setups=()
# SGLang's own loader on our exports (tests/e2e/interop/test_sglang.py): opt-in, its environment is 2.5 GB
if [ "${DRAFTHEADS_SGLANG:-0}" = "1" ]; then
  bash scripts/setup_sglang.sh
fi
# Two workers (pytest-xdist) on the two cores CI has; tests that must not overlap share a group (tests/conftest.py).
# DRAFTHEADS_TEST_WORKERS=0 runs everything in this one process.
python -m pytest -n "${DRAFTHEADS_TEST_WORKERS:-2}" --dist loadgroup "$@"
