"""Identity by content: what a run, a feature cache or a drafter was made from, as digests of the bytes read.

    record = files_record(folder, names)                 # {name: {"size", "mtime_ns", "sha256"}}
    again = files_record(folder, names, known=record)    # same size and mtime: the recorded sha256, no re-read
    for line in changes(record, again): ...              # "model.safetensors changed (sha256 1a2b3c4d -> 5e6f7a8b)"
    digest(record)                                       # 16 hex: one name for the whole set of contents

A path says where something was, not what it was: a verifier's weights replaced in place, a data file edited
between a Ctrl-C and the resume, a cache re-dumped under the same name all keep their paths. So the run folder
(train/run_folder.py), the cache index (data/hidden_states.py) and the drafter's `draftheads` block
(models/layouts/folder.py) record the sha256 of every file they read, and compare contents wherever earlier work is
picked up.

Cost: a file is hashed once. Its record keeps its size and mtime beside the hash, and a later look at the same
file with the same size and mtime (in nanoseconds) takes the recorded hash as it is (the fast path, as `make` and
`rsync` judge files); a file whose mtime moved (a copy, a `touch`) is read again, and counts as changed only if its
bytes did. Hashes are also kept by (path, inode, size, mtime): in the process, so that loading what a claim already
hashed reads nothing twice, and for files of 64 MiB and more in `$DRAFTHEADS_HOME/sha256.json` (default
~/.cache/draftheads; written when it can be, never required), so that a verifier of many gigabytes is read once per
machine, not once per eval of a drafter trained elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

#: sha256 of files already read: "real path|inode|size|mtime_ns" -> hex digest (this process's, and the machine's).
_MEMO: dict[str, str] = {}
_DISK_LOADED = False
CHUNK = 1 << 24
DISK_MEMO_MIN_BYTES = 64 << 20


def draftheads_home() -> Path:
    """The machine's draftheads folder: $DRAFTHEADS_HOME, else ~/.cache/draftheads (embedded verifiers, hashes)."""
    return Path(os.environ.get("DRAFTHEADS_HOME") or "~/.cache/draftheads").expanduser()


def _disk_memo() -> Path:
    return draftheads_home() / "sha256.json"


def _remembered(key: str) -> str | None:
    global _DISK_LOADED
    if key not in _MEMO and not _DISK_LOADED:
        _DISK_LOADED = True
        try:
            _MEMO.update({k: v for k, v in json.loads(_disk_memo().read_text()).items() if k not in _MEMO})
        except (OSError, ValueError, AttributeError):  # none yet, unreadable, not ours: hash again
            pass
    return _MEMO.get(key)


def _remember(key: str, sha: str, size: int) -> None:
    _MEMO[key] = sha
    if size < DISK_MEMO_MIN_BYTES:
        return
    try:  # best effort: a read-only HOME only means hashing again next time
        path = _disk_memo()
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        known = known if isinstance(known, dict) else {}
        known = {k: v for k, v in known.items() if os.path.exists(k.split("|")[0])}  # files since deleted go
        known[key] = sha
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)
    except OSError:
        pass


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (read in 16 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def file_record(path: str | os.PathLike, known: dict | None = None) -> dict:
    """{"size", "mtime_ns", "sha256"} of one file; `known` (an earlier record of it) is trusted when the size and
    mtime are unchanged."""
    st = os.stat(path)
    if known and known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns and known.get("sha256"):
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": known["sha256"]}
    key = f"{os.path.realpath(path)}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    sha = _remembered(key)
    if sha is None:
        sha = sha256_file(path)
        _remember(key, sha, st.st_size)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}


def files_record(root: str | os.PathLike, names, known: dict | None = None) -> dict[str, dict]:
    """{name: file_record} for files `names` (relative to `root`), sorted by name."""
    root, known = Path(root), known or {}
    return {name: file_record(root / name, known.get(name)) for name in sorted(names)}


def digest(record: dict[str, dict]) -> str:
    """One short name for a set of contents: sha256 over (name, sha256) pairs, 16 hex digits. Sizes and times do not
    enter: the same bytes under the same names give the same digest on any machine. A single file's name does not
    enter either (a data file renamed is the same data)."""
    pairs = sorted((name if len(record) > 1 else "", entry["sha256"]) for name, entry in record.items())
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def folder_digest(folder: str | os.PathLike) -> str:
    """A folder by content: `digest` over every file below it (hidden files, such as a lock, aside). What an eval's
    results.json records of each drafter folder it decoded with, and what a re-check compares."""
    folder = Path(folder)
    return digest(files_record(folder, [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
                                        if p.is_file() and not p.name.startswith(".")]))


def content(record: dict[str, dict]) -> dict[str, str]:
    """{name: sha256}: what a record says about contents only (for comparing two records)."""
    return {name: entry["sha256"] for name, entry in record.items()}


def changes(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """What differs between two records, one phrase per file: changed (with both hashes), added or removed. Two
    records of one file each are that file (renamed or not)."""
    if len(old) == len(new) == 1:
        (a,), (name, b) = old.values(), *new.items()
        return [] if a["sha256"] == b["sha256"] else [f"{name} changed (sha256 {a['sha256'][:8]} -> {b['sha256'][:8]})"]
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out.append(f"{name} removed")
        elif name not in old:
            out.append(f"{name} added")
        elif old[name]["sha256"] != new[name]["sha256"]:
            out.append(f"{name} changed (sha256 {old[name]['sha256'][:8]} -> {new[name]['sha256'][:8]})")
    return out


def summarize(phrases: list[str], limit: int = 3) -> str:
    """The first `limit` phrases of `changes`, and how many more."""
    shown = ", ".join(phrases[:limit])
    return shown + (f" and {len(phrases) - limit} more" if len(phrases) > limit else "")


def data_inputs(cfg, known: dict | None = None) -> dict:
    """What a run's data (a `DataConfig`) is made of, by content: {"data": the source's files, and "chat_template":
    the template file when data.chat_template names one}, each {"source", "files", "digest"}. `known`: an earlier
    result, trusted for files whose size and mtime are unchanged. DataError for a source that does not exist."""
    from draftheads.data.config import template_file
    from draftheads.data.sources import source_files

    known = known or {}
    found = source_files(cfg.source)
    files = {} if found is None else files_record(found[0], found[1], (known.get("data") or {}).get("files"))
    # A hub dataset is named by its dataset and split (the hub pins its files); local ones by their bytes.
    out = {"data": {"source": cfg.source, "files": files, "digest": digest(files) if found else f"hub:{cfg.source}"}}
    path = template_file(cfg.chat_template) if cfg.chat_template else None
    if path is not None and path.is_file():
        record = files_record(path.parent, [path.name], (known.get("chat_template") or {}).get("files"))
        out["chat_template"] = {"source": cfg.chat_template, "files": record, "digest": digest(record)}
    return out


#: How a message names each input of a run (the keys of `train.run_folder.run_inputs`).
INPUT_NAMES = {"verifier": "the verifier", "data": "data.source", "chat_template": "data.chat_template",
               "feature_cache": "the feature cache"}


def input_changes(old: dict, new: dict) -> list[str]:
    """What differs between two sets of inputs ({key: {"source", "files", "digest"}}), one phrase per input:
    "the verifier's model.safetensors changed (sha256 1a2b3c4d -> 5e6f7a8b)"."""
    out = []
    for key in [k for k in INPUT_NAMES if k in old or k in new] + sorted((set(old) | set(new)) - set(INPUT_NAMES)):
        name = INPUT_NAMES.get(key, key)
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            out.append(f"{name} {'added' if a is None else 'removed'}")
        elif a.get("digest") != b.get("digest"):
            phrases = changes(a.get("files") or {}, b.get("files") or {})
            sources = f"{a.get('source')!r} -> {b.get('source')!r}"  # a hub dataset: its name is what there is
            out.append(f"{name}: {summarize(phrases) if phrases else sources}")
    return out
