"""Resumable checkpoints: `{output_dir}/step-NNNNNN/`, written atomically, newest `keep_last` kept.

A checkpoint is `accelerator.save_state(...)` (drafter weights as safetensors, optimizer, scheduler, every
process's RNG state) plus `train_state.json` (step, epoch, batches consumed in the epoch, bad-step count), a copy of
the run's record `run.json` (its settings and the contents of its inputs: train/run_folder.py refuses to continue
from another run's checkpoint) and a `COMPLETE` marker. It is written into `.step-NNNNNN.tmp/` and renamed into
place only when every process has finished writing, so a crash (even kill -9 mid-write) never leaves a folder that
`resume=auto` would pick up. Loading goes through accelerate, which reads tensors with
`torch.load(weights_only=True)`; a checkpoint that cannot be loaded is a CheckpointError naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from draftheads.models.atomic import fsync_tree, replace_dir, usual_modes
from draftheads.train.config import ConfigError

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
MARKER = "COMPLETE"
STATE_FILE = "train_state.json"
RUN_FILE = "run.json"
"""The run's record, in the run folder and in each checkpoint."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions); the message names it and what is intact."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (damaged, or of other shapes); the message names it and the ways out."""


@dataclass
class TrainState:
    """Where a run is: what a checkpoint needs beyond weights, optimizer and RNG."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Passes over the training data started (0-based index of the current one)."""
    consumed: int = 0
    """Micro-batches this process has consumed in the current epoch."""
    bad_steps: int = 0
    """Steps skipped because the loss was not finite (total)."""


def step_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"step-{step:06d}"


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoints, oldest first. Folders without the COMPLETE marker are ignored."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / MARKER).is_file() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Path | None:
    """`auto` -> newest complete checkpoint or None; `none` -> None; anything else must be a checkpoint folder."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / MARKER).is_file() or not (path / STATE_FILE).is_file():
        raise ConfigError(
            f"train.resume={resume!r}: not a complete checkpoint folder (expected {MARKER} and {STATE_FILE} inside)")
    return path


def save_checkpoint(accelerator, output_dir: str | os.PathLike, state: TrainState, keep_last: int) -> Path:
    """Write step-NNNNNN/ atomically on all processes, then prune old ones. Collective: every process calls it."""
    final = step_dir(output_dir, state.step)
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        _write(accelerator, output_dir, state, keep_last, final, tmp)
    except OSError as err:  # disk full, permissions, quota: name the step and what is still there
        shutil.rmtree(tmp, ignore_errors=True)
        last = complete_checkpoints(output_dir)
        kept = f"the last complete checkpoint {last[-1].name} is intact" if last else "no checkpoint was written yet"
        raise CheckpointWriteError(f"{err.strerror or err} writing {final} ({err.filename or tmp}): {kept}; free the "
                                   "space or fix the folder, then rerun the same command to continue") from None
    return final


def _write(accelerator, output_dir, state: TrainState, keep_last: int, final: Path, tmp: Path) -> None:
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash mid-write
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    _full_disk_hook(state.step)
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank's RNG file is on disk before the rename
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state)))
        record = Path(output_dir) / RUN_FILE
        if record.is_file():  # which run this checkpoint belongs to
            shutil.copyfile(record, tmp / RUN_FILE)
        usual_modes(tmp)  # safetensors writes 0600; a checkpoint is read back by whoever resumes
        fsync_tree(tmp)
        _crash_hook(state.step, "before_marker")
        (tmp / MARKER).write_text("ok\n")
        fsync_tree(tmp)
        _crash_hook(state.step, "before_rename")
        replace_dir(tmp, final)  # an existing one (the same step saved again) is swapped out, never half-replaced
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def run_summary(output_dir) -> dict:
    """What a drafter's metadata keeps of its run's record: the run's digest and each input's (main process;
    {} when the folder has no record, as for a loop run outside a trainer)."""
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {"run": record.get("run"), "inputs": {k: v.get("digest") for k, v in (record.get("inputs") or {}).items()}}


def load_checkpoint(accelerator, path: Path) -> TrainState:
    """Restore weights, optimizer, scheduler and RNG (through accelerate) and return the loop position. A damaged
    checkpoint (a truncated weights file, a bad train_state.json) is a CheckpointError naming it."""
    try:
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        accelerator.load_state(str(path))
    except Exception as err:  # noqa: BLE001 (torch, safetensors and accelerate each raise their own types)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"cannot load checkpoint {path} ({type(err).__name__}: {first[:300]}); it is damaged: "
                              f"move it out of {path.parent} to continue from the checkpoint before it, or "
                              "--train.resume=none to start over") from None
    return state


CRASH_HOOK = "DRAFTHEADS_TEST_CHECKPOINT_KILL"
FULL_DISK_HOOK = "DRAFTHEADS_TEST_CHECKPOINT_ENOSPC"


def _full_disk_hook(step: int) -> None:
    """Tests only: `DRAFTHEADS_TEST_CHECKPOINT_ENOSPC=<step>` makes the checkpoint of `step` fail as a full disk does
    (OSError ENOSPC from the write)."""
    if os.environ.get(FULL_DISK_HOOK) == str(step):
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(step_dir(".", step).name))


def _crash_hook(step: int, point: str) -> None:
    """Tests only: `DRAFTHEADS_TEST_CHECKPOINT_KILL=<step>:<point>` kills this process (SIGKILL, no cleanup) at
    `point` (`before_marker`: every file written but no COMPLETE; `before_rename`: complete but still .tmp) of the
    checkpoint of `step`, so a test can land inside a checkpoint write deterministically."""
    if os.environ.get(CRASH_HOOK) == f"{step}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)
