# Sourced by scripts/demo.sh and scripts/test.sh: create .venv once, (re)install when pyproject.toml changes.
# torch: whatever is already importable in .venv; else `pip install torch==$DRAFTHEADS_TORCH` (default 2.13.0).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.draftheads-installed
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "[setup] installing draftheads and its dependencies into .venv (first run takes a minute or two)"
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${DRAFTHEADS_TORCH:-2.13.0}"
  python -m pip install -q -e ".[dev,cuda,deepspeed]"  # deepspeed: the e2e tier runs ZeRO on the CPU
  echo "$want" > "$stamp"
fi
export TOKENIZERS_PARALLELISM=false
