"""A run folder belongs to one run.

    folder = claim_run_folder(accelerator, cfg)      # first thing a trainer does, before any model or data is loaded

`{output_dir}/run.json` records what the run trains: its resolved config without the settings that do not change
the result (`NOT_RESULT`: where it logs, how often it checkpoints, the export flavour, ...). A rerun with
`train.resume=auto` (the default) continues only a run whose record matches; anything else stops here, naming every
key that differs and the ways out: another `output_dir`, or `--train.resume=none`, which starts over *safely*: the
earlier run's checkpoints, drafter, logs and record are moved into `{output_dir}/previous-<time>/` (nothing is
deleted; a newer run's checkpoints are never pruned against an older run's, and a later rerun finds only the new
run). A folder written before records existed (checkpoints and config.yaml, no run.json) is compared through its
config.yaml.

One run holds a folder at a time: the main process takes an exclusive lock on `{output_dir}/.lock` (fcntl, held
until the process ends, however it ends: a lock left by a killed run is simply free again) and writes its pid, host
and start time there, which a second run's error names. Every process of a multi-process run learns the outcome
from the main process, so they all stop together. (On a shared filesystem the lock is as good as its fcntl locks;
NFS v4 and Lustre honour them.)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

import yaml

from draftheads.models.atomic import write_json
from draftheads.train.checkpoint import resolve_resume
from draftheads.train.config import ConfigError, config_dict, save_config

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
#: Settings that do not change what is trained (prefix match on dotted keys).
NOT_RESULT = ("output_dir", "feature_cache", "train.resume", "train.log_every", "train.eval_every",
              "train.eval_batches", "train.save_every", "train.keep_last", "train.num_workers", "train.max_bad_steps",
              "data.num_proc", "wandb", "consistency", "engine", "export_dtype", "num_speculative_tokens",
              "medusa.tree_budget", "medusa.tree_max_rank")
#: What a run folder holds besides its lock: moved aside together when a run starts over.
RUN_ARTEFACTS = ("step-", ".step-", "drafter", ".drafter", "metrics.jsonl", RUN_FILE, "config.yaml", "wandb")

_held: dict[str, object] = {}  # folder -> this process's open lock file (the lock lives as long as the handle)


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def signature(config: dict) -> dict:
    """The result-deciding part of a resolved config (a `config_dict`), flattened to dotted keys."""
    return {k: v for k, v in flatten(config).items()
            if not any(k == p or k.startswith(p + ".") for p in NOT_RESULT)}


def differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    missing = object()
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in keys
            if old.get(k, missing) != new.get(k, missing)]


def recorded(folder: Path) -> dict | None:
    """The signature a folder records: run.json, else (a folder from before records) its config.yaml."""
    run = folder / RUN_FILE
    if run.is_file():
        try:
            return json.loads(run.read_text())["signature"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{run}: unreadable run record; move it away to start a new run here") from None
    config = folder / "config.yaml"
    if config.is_file() and any(p.name.startswith("step-") for p in folder.iterdir()):
        try:
            return signature(yaml.safe_load(config.read_text()) or {})
        except yaml.YAMLError:
            raise ConfigError(f"{config}: unreadable; move it away to start a new run here") from None
    return None


def lock(folder: Path) -> None:
    """Take the folder's lock for this process's life, or fail naming who holds it. A process that holds it
    already (a second run in the same Python process, as tests do) keeps it."""
    key = str(folder.resolve())
    if key in _held:
        return
    path = folder / LOCK_FILE
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ConfigError(f"output_dir={str(folder)!r} is in use by another run ({holder}); wait for it to end or "
                          "use another output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held[key] = handle


def move_aside(folder: Path) -> Path | None:
    """Move an earlier run's artefacts into previous-<time>/ (nothing deleted); None when there were none."""
    found = [p for p in folder.iterdir() if p.name.startswith(RUN_ARTEFACTS)]
    if not found:
        return None
    target = folder / time.strftime("previous-%Y%m%d-%H%M%S")
    n = 1
    while target.exists():
        n += 1
        target = folder / f"{time.strftime('previous-%Y%m%d-%H%M%S')}-{n}"
    target.mkdir()
    for path in found:
        shutil.move(str(path), str(target / path.name))
    return target


def check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"output_dir={str(folder)!r} is a file; expected a folder (or a path to create)") from None
    except OSError as err:
        raise ConfigError(f"output_dir={str(folder)!r}: cannot create it ({err.strerror or err})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={str(folder)!r} is not writable by this user")


def claim(cfg) -> str:
    """Main process: check, lock and record the run folder; returns what to tell the user (maybe '')."""
    folder = Path(cfg.output_dir)
    check_writable(folder)
    lock(folder)
    if cfg.train.resume not in ("auto", "none"):
        resolve_resume(cfg.train.resume, folder)  # a bad checkpoint path stops now, not after the data is tokenised
    mine = signature(config_dict(cfg))
    theirs = recorded(folder)
    note = ""
    if cfg.train.resume == "none":
        moved = move_aside(folder)
        if moved is not None:
            note = f"[run] train.resume=none: the earlier run in {folder} was moved to {moved}; starting over"
    elif theirs is not None and theirs != mine:
        diff = differences(theirs, mine)
        shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise ConfigError(
            f"output_dir={str(folder)!r} holds another run (its settings differ: {shown}). Use another output_dir, "
            f"or --train.resume=none to start over here (the earlier run is moved to {folder}/previous-<time>/, "
            "not deleted)")
    write_json(folder / RUN_FILE, {"signature": mine, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                   "host": socket.gethostname()})
    save_config(cfg, folder)
    return note


def claim_run_folder(accelerator, cfg) -> None:
    """`claim` on the main process; every process raises the same ConfigError when it fails (collective)."""
    from accelerate.utils import broadcast_object_list

    outcome = [None, ""]
    if accelerator.is_main_process:
        try:
            outcome = [None, claim(cfg)]
        except ConfigError as err:
            outcome = [str(err), ""]
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome, from_process=0)
    if outcome[0] is not None:
        raise ConfigError(outcome[0])
    if outcome[1]:
        accelerator.print(outcome[1])
