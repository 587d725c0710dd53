"""`python -m draftheads.models.tiny build|path|generate`: build, locate or sample an embedded verifier (`draftheads
build-verifier` is its `build`)."""

import os
import sys

# libgomp's worker threads spin while they wait; on a shared machine that made training ~6x slower (measured),
# sleeping costs little on a quiet one. Read when torch loads: this package's __init__ imports nothing, so here
# is still before it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from draftheads.models.tiny.cli import main  # noqa: E402

sys.exit(main())
