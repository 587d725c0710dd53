"""How a trainer runs from the command line: parse the config, run, and turn every mistake the user can fix into
one line (no traceback).

    if __name__ == "__main__":
        main_guard(main, EagleRunConfig)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TypeVar

from train.config import ConfigError, parse_config
from train.loop import NonFiniteLossError

C = TypeVar("C")


def main_guard(fn, cls: type[C], argv: list[str] | None = None):
    """Run `fn(cfg)` after parsing. A ConfigError prints one line and exits 2, like argparse does; a bad input found
    during the run (the project's own errors, which name the file / row / key to fix) prints one line and exits 1."""
    try:
        cfg = parse_config(cls, argv, prog=Path(sys.argv[0]).name)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        return fn(cfg)
    except ConfigError as err:  # found once the run started (e.g. an option this machine cannot honour)
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is the whole story (no traceback helps the user)."""
    from data.config import DataError
    from models.eagle import EagleError
    from models.export import DrafterFormatError
    from models.verifier import VerifierError

    return DataError, DrafterFormatError, EagleError, VerifierError, NonFiniteLossError
