"""Atomic writes: a file or a folder appears whole under its final name, or not at all.

    with atomic_path(path) as tmp:          # any writer that takes a path (safetensors, a tokenizer, ...)
        save_file(tensors, str(tmp))
    write_text(path, text); write_json(path, value)
    with atomic_dir(folder) as tmp:         # fill tmp/, then it replaces `folder` in one rename
        ...

Everything is written beside its target (same filesystem, so the rename is atomic), fsync-ed before the rename,
and the parent folder is fsync-ed after it, so a crash at any moment (kill -9, power loss) leaves either the old
content or the new one. Temporary names start with a dot: `.{name}.tmp-*` (and `.{name}.old-*` for a folder
being replaced), which is how a caller that holds a lock recognises leftovers of a killed writer.

The one place the project writes files that must not be seen half-written: exports, checkpoints (which add a
COMPLETE marker and a multi-process protocol on top, train/checkpoint.py), the feature cache, the embedded
verifier's build, run configs, eval results. `folder_problem` checks, before any work, that the folder a command
writes into can be made and written.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Iterator


def folder_problem(folder: str | os.PathLike, subject: str, create: bool = True) -> str | None:
    """Create `folder` (with its parents) unless it exists; None when this user can write in it, else one line
    naming `subject` (the flag or key that gave the folder) and what is wrong. `create=False` writes nothing: it
    only looks for a file in the way of the folder or of a parent it would create."""
    if not create:
        path = Path(os.path.abspath(Path(folder).expanduser()))
        while not os.path.lexists(path) and path.parent != path:
            path = path.parent
        return None if path.is_dir() else f"{subject}: a file is in the way; expected a folder (or a path to create)"
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        return f"{subject}: a file is in the way; expected a folder (or a path to create)"
    except OSError as err:
        return f"{subject}: cannot create it ({err.strerror or err})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{subject}: not writable by this user; what is written there would be lost"
    return None


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """fsync every file below `folder`, then every folder (deepest first), `folder` itself last."""
    folder = Path(folder)
    dirs = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            dirs.append(path)
    for path in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(path)
    fsync_dir(folder)


def _temporary_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` to write to; on success it is fsync-ed and renamed onto `path`, on an
    exception it is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)  # created by the writer, with the usual mode (umask), unlike mkstemp's 0600
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | os.PathLike, value, indent: int | None = 1) -> Path:
    return write_text(path, json.dumps(value, indent=indent) + "\n")


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move a finished folder `src` onto `dst`: an existing `dst` is renamed aside first, then deleted, so at every
    moment `dst` is either the old folder or the new one (never a mix)."""
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def usual_modes(folder: Path) -> None:
    """Files 0666 and folders 0777 less the umask, as `open` and `mkdir` make them: some writers (safetensors)
    create files 0600, which a server running under another account could not read."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_dir(folder: str | os.PathLike) -> Iterator[Path]:
    """An empty temporary folder beside `folder` to fill; on success every file in it gets the usual modes (readable
    by others under the usual umask) and is fsync-ed, and it replaces `folder` (`replace_dir`); on an exception it
    is deleted and `folder` is untouched."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _temporary_name(folder)
        try:
            tmp.mkdir()  # the usual mode (umask), unlike mkdtemp's 0700: readable by a server under another account
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        usual_modes(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- one writer per folder -------------------------------------------------------------------------------------------
LOCK_FILE = ".lock"
_held: dict[str, object] = {}  # folder -> this process's open lock file (the lock lives as long as the handle)


class FolderInUse(RuntimeError):
    """Another process holds the folder's lock; `holder` is what it wrote there (pid, host, since when)."""

    def __init__(self, folder: Path, holder: str):
        super().__init__(f"{folder} is in use by another process ({holder})")
        self.folder, self.holder = folder, holder


def lock_folder(folder: str | os.PathLike) -> None:
    """Take `folder`'s lock (an exclusive fcntl lock on `{folder}/.lock`) until `unlock_folder` or the end of the
    process, however it ends (a lock left by a killed process is simply free again), and write this process's pid,
    host and start time there; FolderInUse when another process holds it. A process that holds it already keeps it.
    (On a shared filesystem the lock is as good as its fcntl locks; NFS v4 and Lustre honour them.) The run folders
    of the trainers and the `--out` of `draftheads eval` are held this way."""
    import fcntl
    import socket
    import time

    folder = Path(folder)
    key = str(folder.resolve())
    if key in _held:
        return
    handle = open(folder / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise FolderInUse(folder, holder) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held[key] = handle


def unlock_folder(folder: str | os.PathLike) -> None:
    """Give `folder`'s lock back (no-op when this process does not hold it)."""
    handle = _held.pop(str(Path(folder).resolve()), None)
    if handle is not None:
        handle.close()
