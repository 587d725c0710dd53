#!/usr/bin/env bash
# Create the peer trainers' environments for the peer bench (scripts/bench_peers.sh), each pinned, each separate
# from .venv (their pins fight ours and each other's). Idempotent: once a stamp matches this script, a rerun
# returns at once. On failure it prints one line naming the step and the log.
#   bash scripts/setup_peers.sh [speculators] [specforge]     # default: both
#
#   .venv-speculators  speculators 0.9.0 (Python 3.11). A constraint file keeps torch at 2.13.0 (the CPU build from
#                      PIP_FIND_LINKS, as .venv has): unconstrained, pip takes a CUDA torch 2.14 that the package
#                      allows. torchvision and torchaudio come in as its requirements but its EAGLE-3 trainer
#                      imports neither, and builds made for another torch break `import transformers`' vision
#                      probes: uninstalled.
#   .venv-specforge    SpecForge 0.2.0 (Python 3.11) with --no-deps: it pins torch 2.11 and sglang 0.5.14 (CUDA
#                      only; its online capture needs an SGLang server, so the bench feeds it offline features),
#                      then the dependencies its offline EAGLE-3 training imports, torch kept at 2.13.0 and
#                      transformers at its own pin.
# Overrides: PEERS_PYTHON (default python3.11), DRAFTHEADS_SPECULATORS, DRAFTHEADS_SPECFORGE (versions).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

py=${PEERS_PYTHON:-python3.11}
torch_version=2.13.0
speculators_version=${DRAFTHEADS_SPECULATORS:-0.9.0}
specforge_version=${DRAFTHEADS_SPECFORGE:-0.2.0}
specforge_transformers=5.8.1
# SpecForge's requirements that its offline EAGLE-3 path imports (from its METADATA, less torch, sglang, wandb,
# tensorboard and yunchang: a pin we override, a CUDA server, and trackers / sequence parallelism it imports lazily)
specforge_deps=(datasets tqdm accelerate huggingface-hub numpy openai-harmony pydantic psutil pyyaml safetensors
                requests typing-extensions)
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(speculators specforge)

# shellcheck source=scripts/setup_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_step.sh" setup_peers  # $log and step
command -v "$py" >/dev/null 2>&1 || { echo "[setup_peers] FAILED: $py not found (set PEERS_PYTHON to a Python 3.11)" >&2; exit 1; }
constraints=$(mktemp "${TMPDIR:-/tmp}/peers-constraints.XXXXXX.txt")
echo "torch==$torch_version" >"$constraints"

venv_for() {  # venv_for NAME PIN...: create .venv-NAME unless its stamp matches; then run the install steps
  local venv=.venv-$1
  local want
  want=$( { cat scripts/setup_peers.sh; echo "$py $1 $speculators_version $specforge_version"; } | sha256sum | cut -c1-16)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.draftheads-peer-installed" 2>/dev/null || true)" = "$want" ]; then
    echo "[setup_peers] $venv is ready (stamp $want)"
    return 1
  fi
  rm -f "$venv/.draftheads-peer-installed"
  if [ -e "$venv" ] && ! "$venv/bin/python" -c "" >/dev/null 2>&1; then rm -rf "$venv"; fi
  [ -x "$venv/bin/python" ] || step "create $venv" "$py" -m venv "$venv"
  echo "$want" >"$venv/.stamp-want"
  return 0
}
finish() {  # finish NAME: stamp it
  mv ".venv-$1/.stamp-want" ".venv-$1/.draftheads-peer-installed"
  echo "[setup_peers] ready: .venv-$1 ($(tail -n 1 "$log"))"
}

for peer in "${peers[@]}"; do
  case $peer in
    speculators)
      if venv_for speculators; then
        echo "[setup_peers] installing speculators==$speculators_version into .venv-speculators; log: $log"
        pip=(.venv-speculators/bin/python -m pip)
        step "pip install speculators" "${pip[@]}" install -q -c "$constraints" "torch==$torch_version" \
          "speculators==$speculators_version"
        step "remove torchvision/torchaudio" "${pip[@]}" uninstall -y -q torchvision torchaudio
        step "import check" .venv-speculators/bin/python -c \
          "import importlib.metadata as m, torch, transformers; from speculators.train import trainer; print('speculators', m.version('speculators'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
        finish speculators
      fi ;;
    specforge)
      if venv_for specforge; then
        echo "[setup_peers] installing specforge==$specforge_version (--no-deps) into .venv-specforge; log: $log"
        pip=(.venv-specforge/bin/python -m pip)
        step "pip install torch + SpecForge's dependencies" "${pip[@]}" install -q -c "$constraints" \
          "torch==$torch_version" "transformers==$specforge_transformers" "${specforge_deps[@]}"
        step "pip install specforge --no-deps" "${pip[@]}" install -q --no-deps "specforge==$specforge_version"
        step "import check" env SPECFORGE_DEVICE=cpu .venv-specforge/bin/python -c \
          "import specforge, torch, transformers; from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3; print('specforge', '$specforge_version', 'torch', torch.__version__, 'transformers', transformers.__version__)"
        finish specforge
      fi ;;
    *) echo "[setup_peers] unknown peer $peer (expected speculators or specforge)" >&2; exit 2 ;;
  esac
done
rm -f "$constraints" "$log"
