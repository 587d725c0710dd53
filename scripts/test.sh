#!/usr/bin/env bash
# Set up .venv on first use, then run the whole test suite on the CPU: bash scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
python -m pytest "$@"
