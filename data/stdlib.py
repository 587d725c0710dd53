"""The Python standard library's own source: the corpus of the embedded default verifier and its drafters.

Every Python install has it (found through `sysconfig`), so the whole pipeline runs with no download. Files are
split by a hash of their relative path, so the split is the same on every machine with the same Python:

  - `verifier` (~80%): what the embedded verifier is trained on;
  - `drafter`  (~15%): never seen by the verifier; drafters train here (as they would on a user's own data);
  - `eval`     (~5%):  never seen by either; held-out bits-per-byte of the verifier, held-out drafter accuracy.

Test folders, site-packages and generated files (pydoc topics, codec tables) are left out.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Literal

Split = Literal["verifier", "drafter", "eval", "all"]

_EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
                   "pydoc_data"}
_BUCKETS = 20  # bucket 0 -> eval, 1..3 -> drafter, 4..19 -> verifier


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """Which split a file (path relative to the stdlib root, '/'-separated) belongs to."""
    bucket = int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % _BUCKETS
    return "eval" if bucket == 0 else "drafter" if bucket <= 3 else "verifier"


def stdlib_files(split: Split = "all", root: Path | None = None) -> list[Path]:
    """The stdlib's .py files of one split, sorted (deterministic order)."""
    root = root or stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library folder {str(root)!r} not found (from sysconfig)")
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _EXCLUDED_PARTS.intersection(rel.parts[:-1]):
            continue
        if split == "all" or split_of(rel.as_posix()) == split:
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no .py files of split {split!r} under {str(root)!r}")
    return files


def read_source(path: Path) -> str:
    """A source file's text; undecodable bytes are replaced, not fatal (a few stdlib files carry latin-1)."""
    return path.read_bytes().decode("utf-8", errors="replace")
