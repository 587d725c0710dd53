"""How a trainer runs from the command line: parse the config, run, and turn every mistake the user can fix into
one line (no traceback).

    if __name__ == "__main__":
        main_guard(main, EagleRunConfig)
"""

from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path
from typing import TypeVar

from draftheads.train.config import ConfigError, parse_config
from draftheads.train.loop import NonFiniteLossError
from draftheads.train.paths import check_paths

C = TypeVar("C")


def main_guard(fn, cls: type[C], argv: list[str] | None = None, prog: str | None = None):
    """Run `fn(cfg)` after parsing. A ConfigError prints one line and exits 2, like argparse does; a bad input found
    during the run (the project's own errors, which name the file / row / key to fix) or a fault of the environment
    (OSError: disk full, permissions) prints one line and exits 1."""
    try:
        cfg = parse_config(cls, argv, prog=prog or Path(sys.argv[0]).name)
        check_paths(cfg)  # what the config names is there: refused before anything is written or loaded
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:  # a scheduler's SIGTERM ends the run like Ctrl-C: one line (only the main thread may set handlers)
        previous = signal.signal(signal.SIGTERM, _stop)
    except ValueError:
        previous = None
    try:
        result = fn(cfg)
        # The run's objects (the DDP- or FSDP-wrapped model, the accelerator) hold the process group's threads; freed
        # here, while the interpreter is whole, not during its exit, where a 2-process gloo run sometimes aborted
        # after finishing ("terminate called without an active exception": 2 of 12 launches of a bare accelerate
        # DDP script under load, 0 of 14 with this collection).
        gc.collect()
        return result
    except KeyboardInterrupt as err:
        name = "SIGTERM" if isinstance(err, Stopped) else "SIGINT (Ctrl-C)"
        print(f"stopped by {name}: {kept(cfg.output_dir)}", file=sys.stderr)
        raise SystemExit(143 if isinstance(err, Stopped) else 130) from None
    except ConfigError as err:  # found once the run started (e.g. an option this machine cannot honour)
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as err:  # the environment: a full disk, a folder made read-only, a file gone
        print(f"error: {os_error_line(err)}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Stopped(KeyboardInterrupt):
    """SIGTERM, turned into an exception so the run stops like Ctrl-C (checkpoints on disk stay as they are)."""


def _stop(signum, frame):
    raise Stopped()


def kept(output_dir) -> str:
    from draftheads.train.checkpoint import complete_checkpoints

    last = complete_checkpoints(output_dir)
    if not last:
        return f"no checkpoint was written yet in {output_dir}; rerunning the same command starts again"
    return (f"the last complete checkpoint {last[-1]} is intact; rerunning the same command continues from it "
            "(a half-written one is never picked up)")


def os_error_line(err: OSError) -> str:
    """One line for an environment fault during a run: what failed, on which file, and what is kept."""
    from draftheads.train.checkpoint import CheckpointWriteError

    if isinstance(err, CheckpointWriteError):
        return str(err)
    where = f" ({err.filename})" if err.filename else ""
    return (f"{err.strerror or err}{where}; the checkpoints already written are complete, and rerunning the same "
            "command continues from the newest")


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is the whole story (no traceback helps the user)."""
    from draftheads.data.config import DataError
    from draftheads.data.hidden_states import CacheError
    from draftheads.models.dflash import DFlashError
    from draftheads.models.eagle import EagleError
    from draftheads.models.export import DrafterFormatError
    from draftheads.models.layouts.mtp_checkpoint import MtpCheckpointError
    from draftheads.models.mtp import MtpError
    from draftheads.models.verifier import VerifierError
    from draftheads.train.checkpoint import CheckpointError

    return (DataError, CacheError, DrafterFormatError, EagleError, DFlashError, MtpError, MtpCheckpointError,
            VerifierError, NonFiniteLossError, CheckpointError)
