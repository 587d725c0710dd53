"""Does an output_dir already hold the drafter these trainer arguments would train? For the scripts that train a
drafter once and reuse it when rerun (scripts/bench_dflash.sh, bench_eagle_recipes.sh, demo.sh): a folder is
reused only when it holds the same run, so another seed, step count or data file named to an old folder is
refused instead of silently decoding the drafters of the earlier settings.

    python scripts/same_run.py train/eagle.py --config configs/eagle3-tiny.yaml --output_dir runs/x [--key=value ...]

The first argument is the trainer (train/medusa.py, train/eagle.py, train/dflash.py, or medusa / eagle / dflash),
the rest exactly what the trainer is given. The trainer's own run record decides (train/run_folder.py
`finished_other_run`): the folder's run.json must have the same result-deciding settings and inputs of the same
contents, as a rerun of the trainer would require to continue it. Exit status:

    0  the folder holds this run's exported drafter: reuse it
    3  it holds no exported drafter (nothing, or an unfinished run of these settings, which the trainer continues):
       train it
    4  it holds another run, finished or not: one line on stderr naming what differs
    2  the arguments do not parse, or an input is missing or unreadable (the trainer's own error, one line)

(1, Python's status for an uncaught exception, is never "another run".)
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftheads.cli import TRAINERS, trainer


def main(argv: list[str]) -> int:
    if not argv or Path(argv[0]).stem not in TRAINERS or (argv[0].endswith(".py") and Path(argv[0]).parent.name
                                                          not in ("train", "")):
        got = f"; got {argv[0]!r}" if argv else ""
        print(f"usage: same_run.py TRAINER [trainer arguments]: TRAINER is one of train/medusa.py, train/eagle.py, "
              f"train/dflash.py (or medusa, eagle, dflash){got}", file=sys.stderr)
        return 2
    cls, _ = trainer(Path(argv[0]).stem)
    from draftheads.train.cli import user_errors
    from draftheads.train.config import ConfigError, parse_config
    from draftheads.train.run_folder import finished_other_run

    try:
        cfg = parse_config(cls, argv[1:], prog=f"same_run.py {argv[0]}")
        why = finished_other_run(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except user_errors() as err:  # a missing verifier or data file: the trainer would stop on it too
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a record or an input that cannot be read (train/cli.py's os_error_line speaks of a run)
        where = f" ({err.filename})" if err.filename else ""
        print(f"error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    if why is None:
        return 3
    if why:
        print(why, file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
