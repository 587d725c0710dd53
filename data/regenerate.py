"""Moved: self-distillation data is written by `python -m eval.regenerate` (same arguments). It runs the verifier,
which `data/` (below models/ in the import order) never imports; this stub only says where the command went."""

import sys

if __name__ == "__main__":
    sys.exit("error: `python -m data.regenerate` is now `python -m eval.regenerate` (same arguments)")
