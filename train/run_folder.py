"""A run folder belongs to one run.

    claim_run_folder(accelerator, cfg)    # train.tracking.build_accelerator: lock, settings; before anything loads
    claim_run_inputs(accelerator, cfg)    # train.placement.load_verifier, first: contents, the checkpoint to continue

`{output_dir}/run.json` records what the run trains: its resolved config without the settings that do not change
the result (`NOT_RESULT`: where it logs, how often it checkpoints, the export flavour, ...). A rerun with
`train.resume=auto` (the default) continues only a run whose record matches; anything else stops here, naming every
key that differs and the ways out: another `output_dir`, or `--train.resume=none`, which starts over *safely*: the
earlier run's checkpoints, drafter, logs and record are moved into `{output_dir}/previous-<time>/` (nothing is
deleted; a newer run's checkpoints are never pruned against an older run's, and a later rerun finds only the new
run). A folder written before records existed (checkpoints and config.yaml, no run.json) is compared through its
config.yaml.

A run is also what it is made from: run.json records the sha256 of every file it reads (the verifier's weights,
config and tokenizer files, the data source's files, a chat template file, the feature cache's index:
data/identity.py), and a rerun whose inputs' contents differ stops the same way, naming the files (`the verifier:
model.safetensors changed (sha256 1a2b3c4d -> 5e6f7a8b)`). Paths do not count: a verifier or a data file moved or
copied elsewhere with the same bytes is the same input. Checking costs a stat per file (the recorded size and mtime
are the fast path; only a file whose mtime moved is read again). The inputs are recorded by `claim_inputs`, which
the trainers reach through `load_verifier` (train/placement.py), right before the verifier loads: `claim` alone,
which settles the folder, resolves no verifier (a test of the loop machinery builds an Accelerator without one). A
folder that holds nothing trained yet (no checkpoint, no drafter) is simply taken over by the new run.

Each checkpoint carries the run's record (step-NNNNNN/run.json), and the checkpoint a run would continue from (the
newest in the folder, or `train.resume=PATH`) must be of this run, by settings and by content: one copied from
another run, or another run's passed as `train.resume`, is refused before anything is loaded, naming what differs.

One run holds a folder at a time: the main process takes an exclusive lock on `{output_dir}/.lock`
(models/atomic.py `lock_folder`: fcntl, held until the process ends, however it ends: a lock left by a killed run is
simply free again) and writes its pid, host and start time there, which a second run's error names. Every process
of a multi-process run learns the outcome from the main process, so they all stop together. (On a shared
filesystem the lock is as good as its fcntl locks; NFS v4 and Lustre honour them.)
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import yaml

from draftheads.data.identity import input_changes
from draftheads.models.atomic import FolderInUse, folder_problem, lock_folder, write_json
from draftheads.train.checkpoint import RUN_FILE, resolve_resume
from draftheads.train.config import ConfigError, config_dict, save_config
from draftheads.train.paths import check_paths

#: Settings that do not change what is trained (prefix match on dotted keys). The verifier, the data source and the
#: feature cache are compared by content (`run_inputs`), not by path.
NOT_RESULT = ("output_dir", "verifier", "data.source", "feature_cache", "train.resume", "train.log_every",
              "train.eval_every",
              "train.eval_batches", "train.save_every", "train.keep_last", "train.num_workers", "train.max_bad_steps",
              "data.num_proc", "wandb", "consistency", "engine", "export_dtype", "num_speculative_tokens",
              "medusa.tree_budget", "medusa.tree_max_rank")
#: What a run folder holds besides its lock: moved aside together when a run starts over.
RUN_ARTEFACTS = ("step-", ".step-", "drafter", ".drafter", "metrics.jsonl", RUN_FILE, "config.yaml", "wandb")



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
    """'key: old -> new' for each flattened key that differs. A key only one side has, null on the other, is no
    difference: a setting a newer version added at its null default (this project's options default to null or to
    what the code did before them, e.g. dflash.draft_vocab_size) does not make a run started before it another run."""
    keys = sorted(set(old) | set(new))
    missing = object()
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in keys
            if old.get(k, missing) != new.get(k, missing)
            and not (k not in old and new[k] is None) and not (k not in new and old[k] is None)]


def read_record(path: Path) -> dict:
    """A run record (run.json of a folder or a checkpoint): {"signature", "inputs", "run", ...}."""
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record["signature"], dict):
            raise TypeError
        return record
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ConfigError(f"{path}: unreadable run record; move it away to start a new run here") from None


def recorded(folder: Path) -> dict | None:
    """The record of the run a folder holds: run.json, else (a folder from before records) a record built from its
    config.yaml, with no inputs. None when the folder holds no trained state (no checkpoint, no drafter): there is
    nothing to continue, and a new run may take it over."""
    if not any(p.name.startswith(("step-", "drafter")) for p in folder.iterdir()):
        return None
    run = folder / RUN_FILE
    if run.is_file():
        return read_record(run)
    config = folder / "config.yaml"
    if config.is_file() and any(p.name.startswith("step-") for p in folder.iterdir()):
        try:
            return {"signature": signature(yaml.safe_load(config.read_text()) or {})}
        except yaml.YAMLError:
            raise ConfigError(f"{config}: unreadable; move it away to start a new run here") from None
    return None


def run_inputs(cfg, known: dict | None = None) -> dict:
    """What a run is made from, by content (data/identity.py): {"verifier", "data" (+ "chat_template"),
    "feature_cache" (offline)}, each {"source", "files", "digest"}. Resolves the verifier's folder (an embedded one is
    built, a hub id downloaded: what loading would do anyway) without loading it. `known`: an earlier record's inputs,
    trusted for files whose size and mtime are unchanged."""
    from draftheads.data.identity import digest, files_record
    from draftheads.data.identity import data_inputs
    from draftheads.models.verifier import folder_content, resolve_verifier

    known = known or {}
    index = None
    if cfg.features == "offline":
        from draftheads.data.hidden_states import check_for_run, read_index

        cache = Path(cfg.feature_cache)
        index = read_index(cache)
        if not known:  # a new run: what the dump recorded spares hashing the same files again
            known = index.get("inputs") or {}
    folder = resolve_verifier(cfg.verifier)
    inputs = {"verifier": {"source": cfg.verifier,
                           **folder_content(folder, (known.get("verifier") or {}).get("files"))}}
    if index is not None:
        files = files_record(cache, ["index.json"], (known.get("feature_cache") or {}).get("files"))
        inputs["feature_cache"] = {"source": cfg.feature_cache, "files": files, "digest": digest(files)}
        inputs.update(check_for_run(index, cfg, cache, inputs["verifier"], known))
    else:
        inputs.update(data_inputs(cfg.data, known))
    return inputs


def run_digest(record: dict) -> str:
    """The run's identity: its result-deciding settings and its inputs' contents, 16 hex digits. Null settings are
    left out, as `differences` ignores a setting one side lacks and the other has at null."""
    import hashlib

    inputs = {k: v.get("digest") for k, v in (record.get("inputs") or {}).items()}
    settings = {k: v for k, v in record["signature"].items() if v is not None}
    return hashlib.sha256(json.dumps([settings, inputs], sort_keys=True).encode()).hexdigest()[:16]


def what_differs(theirs: dict, mine: dict) -> str:
    """'its settings differ: ...' and / or 'its inputs differ: ...' between two run records ('' if the same run)."""
    parts = []
    diff = differences(theirs["signature"], mine["signature"])
    if diff:
        parts.append("its settings differ: " + "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more"
                                                                       if len(diff) > 8 else ""))
    if "inputs" in theirs:
        changed = input_changes(theirs["inputs"], mine["inputs"])
        if changed:
            parts.append("its inputs differ: " + "; ".join(changed))
    return ", and ".join(parts)


def check_checkpoint(path: Path, mine: dict, folder: Path, legacy: bool, explicit: bool) -> None:
    """The checkpoint a run would continue from must be this run's (by settings and content); else a ConfigError
    naming it and what differs. `legacy`: the folder's record predates content records (its checkpoints carry
    none)."""
    how = ("resume from a checkpoint of this run, or use another output_dir for a new one" if explicit else
           f"move it out of {folder} (the run then continues from the checkpoint before it, if any), or "
           "--train.resume=none to start over")
    where = f"train.resume={str(path)!r}" if explicit else str(path)
    record_path = path / RUN_FILE
    if not record_path.is_file():
        if legacy and not explicit:
            return
        raise ConfigError(f"{where}: the checkpoint carries no run record ({RUN_FILE}), so it cannot be told apart "
                          f"from another run's; {how}")
    theirs = read_record(record_path)
    differs = what_differs(theirs, mine) if "inputs" in theirs else ""
    if differs or ("inputs" not in theirs and not legacy):
        raise ConfigError(f"{where} is another run's checkpoint ({differs or 'it carries no inputs record'}); {how}")


def lock(folder: Path) -> None:
    """Take the folder's lock for this process's life (models/atomic.py), or fail naming who holds it. A process
    that holds it already (a second run in the same Python process, as tests do) keeps it."""
    try:
        lock_folder(folder)
    except FolderInUse as err:
        raise ConfigError(f"output_dir={str(folder)!r} is in use by another run ({err.holder}); wait for it to end or "
                          "use another output_dir") from None


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
    problem = folder_problem(folder, f"output_dir={str(folder)!r}")
    if problem:
        raise ConfigError(problem)


def claim(cfg) -> str:
    """Main process: check, lock and record the run folder (its settings; the inputs follow in `claim_inputs`);
    returns what to tell the user (maybe '')."""
    folder = Path(cfg.output_dir)
    check_paths(cfg)
    check_writable(folder)
    lock(folder)
    mine = {"signature": signature(config_dict(cfg))}
    theirs = recorded(folder)
    note = ""
    if cfg.train.resume == "none":
        moved = move_aside(folder)
        theirs = None
        if moved is not None:
            note = f"[run] train.resume=none: the earlier run in {folder} was moved to {moved}; starting over"
    elif theirs is not None and differences(theirs["signature"], mine["signature"]):
        differs = what_differs({"signature": theirs["signature"]}, mine)
        raise ConfigError(f"output_dir={str(folder)!r} holds another run ({differs}). "
                          f"{START_OVER.format(folder=folder)}")
    if theirs is not None:  # the run continues: what it was made from stays on record until `claim_inputs` compares
        mine.update({k: theirs[k] for k in ("inputs", "run", "legacy", "resolved") if k in theirs})
        if "inputs" not in theirs:  # a folder from before content records: its checkpoints carry none
            mine["legacy"] = True
    write_json(folder / RUN_FILE, {**mine, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                   "host": socket.gethostname()})
    save_config(cfg, folder)
    return note


def claim_inputs(cfg) -> None:
    """Main process, after `claim` and before anything is loaded: record what the run is made from (`run_inputs`),
    refuse a run whose earlier record has other contents, and refuse to continue from another run's checkpoint."""
    folder = Path(cfg.output_dir)
    record = read_record(folder / RUN_FILE)
    earlier = record.get("inputs")
    inputs = run_inputs(cfg, known=earlier)
    if earlier is not None:
        changed = input_changes(earlier, inputs)
        if changed:
            raise ConfigError(f"output_dir={str(folder)!r} holds a run made from other inputs ({'; '.join(changed)}). "
                              f"{START_OVER.format(folder=folder)}")
    record["inputs"] = inputs
    if cfg.train.resume != "none":
        path = resolve_resume(cfg.train.resume, folder)
        if path is not None:
            check_checkpoint(path, record, folder, record.get("legacy", False), explicit=cfg.train.resume != "auto")
    record["run"] = run_digest(record)
    write_json(folder / RUN_FILE, record)


def record_resolved(cfg, name: str, values: dict) -> None:
    """Main process, once the model is built: what the run's settings resolved to (`values`: a JSON-able dict,
    e.g. the drafter's config with its nulls filled from the verifier), kept in run.json under resolved/`name`.

    The signature holds the config as written, so a null (a default) looks the same to a newer version whose
    default differs, and a continued run would silently train something else from the checkpoint on (as
    dflash.mask_token_id did: the verifier's pad token, then the lowest id it does not embed as zeros). A run that
    continues must resolve them as it did when it started; the checkpoint it continues from is compared too (it
    carries the record as it was when saved). A ConfigError names each field that differs."""
    folder = Path(cfg.output_dir)
    record = read_record(folder / RUN_FILE)
    values = json.loads(json.dumps(values))  # tuples -> lists, as they read back
    earlier = {"the run's record": (record.get("resolved") or {}).get(name)}
    if cfg.train.resume != "none":
        path = resolve_resume(cfg.train.resume, folder)
        if path is not None and (path / RUN_FILE).is_file():
            earlier[str(path)] = (read_record(path / RUN_FILE).get("resolved") or {}).get(name)
    for where, theirs in earlier.items():
        diff = differences(flatten(theirs), flatten(values)) if theirs is not None else []
        if diff:
            raise ConfigError(
                f"output_dir={str(folder)!r}: {where} resolved the {name} settings otherwise when the run started "
                f"({'; '.join(f'{name}.{d}' for d in diff)}): this version's defaults differ, and continuing would "
                f"change what the run trains. Continue it with the version that started it, or: "
                f"{START_OVER.format(folder=folder)}")
    record.setdefault("resolved", {})[name] = values
    write_json(folder / RUN_FILE, record)


def finished_other_run(cfg) -> str | None:
    """Whether `cfg.output_dir` holds the finished run `cfg` describes, for a script that reuses a trained folder
    instead of training it again. The answer is what the trainer's own `claim` and `claim_inputs` would decide on a
    rerun: its record's result-deciding settings and its inputs' contents against `cfg`'s.

    - None: train it. The folder holds nothing trained, or an unfinished run of these settings and inputs (no
      exported drafter yet: the trainer continues it from its newest checkpoint).
    - '': reuse it. It holds the exported drafter of this run. A folder recorded before inputs were (a run.json
      without them, or only config.yaml and checkpoints) counts as this run when its settings match, as the trainer
      continues it.
    - else: it holds another run, finished or not (the trainer would refuse it): one line naming what differs, or
      saying that a drafter without any record cannot be told apart from another run's.

    Not compared: the defaults a run filled in when it started (run.json `resolved`, which a continuation checks
    once the model is built); a reused drafter carries its own config, so it decodes as it was trained. Writes
    nothing and takes no lock; resolving the verifier is what `run_inputs` does (an embedded verifier missing from
    the cache is built)."""
    folder = Path(cfg.output_dir)
    finished = (Path(cfg.drafter_dir) / "config.json").is_file()
    theirs = recorded(folder) if folder.is_dir() else None
    if theirs is None:
        if not finished:
            return None
        return (f"{folder} holds a drafter without a record of what it was trained from ({RUN_FILE}), so it cannot "
                "be told apart from another run's")
    mine = {"signature": signature(config_dict(cfg))}
    if "inputs" in theirs:
        mine["inputs"] = run_inputs(cfg, known=theirs["inputs"])
    differs = what_differs(theirs, mine)
    if differs:
        return f"{folder} holds another{'' if finished else ' unfinished'} run ({differs})"
    return "" if finished else None


START_OVER = ("Use another output_dir, or --train.resume=none to start over here (the earlier run is moved to "
              "{folder}/previous-<time>/, not deleted)")


def on_main_process(accelerator, check):
    """Run `check()` on the main process only and hand every process its outcome: the value it returned, or the
    same error (a ConfigError or one of the project's user errors, re-raised as it was on the main process and as a
    ConfigError with its message elsewhere), so all processes stop together. Collective."""
    from accelerate.utils import broadcast_object_list

    from draftheads.train.cli import user_errors

    outcome, error = [None, None], None
    if accelerator.is_main_process:
        try:
            outcome = [None, check()]
        except (ConfigError, *user_errors()) as err:  # a missing verifier or data file, a cache that does not fit
            outcome, error = [str(err), None], err
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome, from_process=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise ConfigError(outcome[0])
    return outcome[1]


def claim_run_folder(accelerator, cfg) -> None:
    """`claim` on the main process; every process raises the same error when it fails (collective)."""
    note = on_main_process(accelerator, lambda: claim(cfg))
    if note:
        accelerator.print(note)


def record_run_resolved(accelerator, cfg, name: str, values: dict) -> None:
    """`record_resolved` on the main process (collective)."""
    on_main_process(accelerator, lambda: record_resolved(cfg, name, values))


def claim_run_inputs(accelerator, cfg) -> None:
    """`claim_inputs` on the main process (collective): train.placement.load_verifier calls it first thing, so every
    trainer records and checks its inputs right before anything is loaded."""
    on_main_process(accelerator, lambda: claim_inputs(cfg))
