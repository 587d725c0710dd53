#!/usr/bin/env bash
# The whole pipeline on the embedded default verifier, on a fresh machine.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
python -m models.tiny build --recipe default
