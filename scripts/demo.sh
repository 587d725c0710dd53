#!/usr/bin/env bash
# The whole pipeline on the embedded default verifier, on a fresh machine.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"

# 1. The embedded default verifier: trained once from the Python standard library (about 13 minutes on 2 CPU
#    cores), then cached in ${DRAFTHEADS_HOME:-~/.cache/draftheads}/tiny-code. Prints its held-out bits per byte.
python -m models.tiny build --recipe default

# 2. What it writes: greedy continuations of HumanEval-style prompts.
python -m models.tiny generate --recipe default --max-new-tokens 64 \
  'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' \
  'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same forwards and backwards."""\n' \
  'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'
