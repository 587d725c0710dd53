"""Which folder a command may write into: one rule for every command that writes a folder.

    folder = claim_output(args.fix, "drafter", "--fix")   # before anything is loaded or computed

A command writes into a folder that is new, empty, or its own kind of output (what it writes there marks it: a
drafter's config.json with our `draftheads` block, a cache's index.json, an eval's results.json, ...). Anything else
is refused in one line that names the flag, the folder and what it holds, so that an atomic folder write (which
replaces the folder whole) or an eval's files never land on a training run, a cache or a model someone needs.

The kinds are recognised by the files their writers put there; `describe` names what a folder holds for the
message, including the kinds no command here writes (a model folder, another trainer's drafter).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from draftheads.models.atomic import LOCK_FILE

# Files that mark each kind, as their writers name them (the lowest layer that all the writers may import).
RUN_FILE = "run.json"                   # train/run_folder.py: a training run's record
CACHE_INDEX = "index.json"              # data/hidden_states.py: a feature cache's index (and its plan.json)
CACHE_PLAN = "plan.json"
CACHE_REGENERATE = "regenerate.json"   # train/regenerate_capture.py: a cache whose rows are being regenerated first
EVAL_RESULTS = "results.json"           # draftheads eval
TUNE_RESULTS = "tune.json"              # draftheads tune
VERIFIER_BUILD = "draftheads_build.json"  # models/tiny/recipe.py BUILD_INFO: a built embedded verifier
DRAFTER_CONFIG = "config.json"


class OutputInTheWay(ValueError):
    """A command was pointed at a folder (or file) it does not own; the message names the flag and what is there."""


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _is_run(folder: Path) -> bool:
    return (folder / RUN_FILE).is_file() or (folder / "config.yaml").is_file() or any(folder.glob("step-[0-9]*"))


def _is_cache(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (CACHE_INDEX, CACHE_PLAN, CACHE_REGENERATE))


def _is_drafter(folder: Path) -> bool:
    config = _json(folder / DRAFTER_CONFIG)
    return config is not None and isinstance(config.get("draftheads"), dict) and not _is_run(folder)


def _is_verifier_build(folder: Path) -> bool:
    return (folder / VERIFIER_BUILD).is_file()


def _is_model(folder: Path) -> bool:
    return (folder / DRAFTER_CONFIG).is_file()


@dataclass(frozen=True)
class Kind:
    what: str                              # how a message names a folder of this kind
    marks: Callable[[Path], bool]          # the folder holds this kind of output


# Order matters for `describe`: the first kind whose marks match names the folder (a run folder holds a drafter/).
KINDS: dict[str, Kind] = {
    "run": Kind("a training run folder (run.json, checkpoints)", _is_run),
    "cache": Kind("a feature cache (index.json / plan.json)", _is_cache),
    "eval": Kind("a `draftheads eval` output (results.json)", lambda f: (f / EVAL_RESULTS).is_file()),
    "tune": Kind("a `draftheads tune` output (tune.json)", lambda f: (f / TUNE_RESULTS).is_file()),
    "verifier": Kind("a built verifier (draftheads_build.json)", _is_verifier_build),
    "drafter": Kind("a draftheads drafter folder (config.json with a draftheads block)", _is_drafter),
    "model": Kind("a model or another trainer's drafter folder (config.json)", _is_model),
}
WRITABLE = ("run", "cache", "eval", "tune", "verifier", "drafter")  # the kinds a command of ours writes


def _entries(folder: Path) -> list[str]:
    """What a folder holds, less our lock file and the leftovers of a killed atomic write (`.NAME.tmp-*`, `.NAME.old-*`)."""
    return sorted(p.name for p in folder.iterdir()
                  if p.name != LOCK_FILE and not (p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name)))


def _look(folder: Path) -> tuple[str | None, str | None]:
    """(kind, words): the kind of output `folder` holds (a key of KINDS, None for none we know) and what it holds in
    words (None when it does not exist or is empty, our lock file aside). The folder is listed once."""
    if not folder.exists() and not folder.is_symlink():
        return None, None
    if not folder.is_dir():
        return None, "a file"
    try:
        names = _entries(folder)
    except OSError as err:
        return None, f"a folder that cannot be listed ({err.strerror or err})"
    if not names:
        return None, None
    for name, kind in KINDS.items():
        if kind.marks(folder):
            return name, kind.what
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return None, f"a folder of {len(names)} other entr{'y' if len(names) == 1 else 'ies'} ({shown})"


def describe(folder: str | os.PathLike) -> str | None:
    """What `folder` holds, in words; None when it does not exist or is empty (our lock file aside)."""
    return _look(Path(folder))[1]


def kind_of(folder: str | os.PathLike) -> str | None:
    """The kind of output `folder` holds (a key of KINDS), None when it is new or empty or of no kind we know."""
    return _look(Path(folder))[0]


def claim_output(folder: str | os.PathLike, kind: str, flag: str) -> Path:
    """`folder` as the output of a command that writes `kind` (a key of WRITABLE), after checking it is new, empty
    or already that kind of output; OutputInTheWay otherwise, naming `flag`, the folder and what it holds."""
    if kind not in WRITABLE:
        raise ValueError(f"unknown output kind {kind!r}: expected one of {', '.join(WRITABLE)}")
    folder = Path(folder)
    found, there = _look(folder)
    if there is None or found == kind:
        return folder
    where = "a file is in the way" if there == "a file" else f"it holds {there}"
    raise OutputInTheWay(f"{flag} {folder}: {where}, and this command writes {KINDS[kind].what} there; "
                         "choose a new or empty folder (nothing was written)")
