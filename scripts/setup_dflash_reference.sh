#!/usr/bin/env bash
# Create .venv-dflash: z-lab's reference DFlash (the `dflash` package, model + generate loop) for the reference
# check (tests/e2e/test_dflash_reference.py runs tests/dflash_reference_runner.py there). Its own venv: the package
# pins transformers 5.15 (ours is newer) and datasets/requests it only needs for its benchmark, so it goes in with
# --no-deps beside torch 2.13.0 (the CPU wheel from PIP_FIND_LINKS, as .venv has) and transformers at its pin.
# Idempotent: once the stamp matches this script, a rerun returns at once. On failure: one line naming the step.
#   bash scripts/setup_dflash_reference.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

py=${PYTHON:-python3}
venv=.venv-dflash
dflash_version=0.1.0
transformers_version=5.15.0
torch_version=2.13.0
want=$( { cat scripts/setup_dflash_reference.sh; echo "$py"; } | sha256sum | cut -c1-16)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.draftheads-installed" 2>/dev/null || true)" = "$want" ]; then
  exit 0
fi
# shellcheck source=scripts/setup_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_step.sh" setup_dflash  # $log and step
echo "[setup_dflash] installing dflash==$dflash_version into $venv; log: $log"
rm -f "$venv/.draftheads-installed"
if [ -e "$venv" ] && ! "$venv/bin/python" -c "" >/dev/null 2>&1; then rm -rf "$venv"; fi
[ -x "$venv/bin/python" ] || step "create $venv" "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
step "pip install torch" "${pip[@]}" "torch==$torch_version"
step "pip install transformers" "${pip[@]}" "torch==$torch_version" "transformers==$transformers_version"
step "pip install dflash" "${pip[@]}" --no-deps "dflash==$dflash_version"
step "import check" "$venv/bin/python" -c "from dflash.model import DFlashDraftModel, dflash_generate"
echo "$want" >"$venv/.draftheads-installed"
echo "[setup_dflash] ready: $venv"
