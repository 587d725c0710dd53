"""Where training text comes from. Every source becomes a `datasets.Dataset` of one shape.

A row is either plain text or a conversation:

    {"text": "def f(x):\\n    ...", "origin": "lib/foo.py"}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}],
     "origin": "chats.jsonl:7"}

Roles are `system`, `user`, `assistant`; content is a non-empty string. `origin` says where the row came from
("file:line", "file row N", "hf:name:split row N") so later errors can name it.

Sources (the `data.source` option):

    stdlib[:drafter|eval|verifier]   the Python standard library's files, one row per file (default `drafter`)
    FILE.jsonl / FILE.json           rows in ShareGPT (`conversations`: [{from, value}]), OpenAI (`messages`:
                                     [{role, content}]) or text (`text`) shape; .json may be a list of rows
    FILE.txt / FILE.py / FILE.md     plain text, one row per file
    FOLDER                           every .json/.jsonl/.txt/.py/.md file under it, sorted
    hf:NAME[:SPLIT]                  a Hugging Face hub dataset (split `train` unless given), any shape above

Malformed rows (not an object, missing field, unknown role, empty conversation, non-string or empty content) are
skipped and counted with one `DataWarning` per source; with `strict` the first one raises `DataError` naming the
file, the row and what was expected.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import datasets

from draftheads.data.config import (
    JSON_SUFFIXES,
    TEXT_SUFFIXES,
    DataConfig,
    DataError,
    DataWarning,
    is_stdlib,
    source_problem,
)
from draftheads.data.progress import datasets_progress
from draftheads.data.stdlib import read_source, stdlib_files, stdlib_root

#: Role names accepted in either shape, mapped to ours (ShareGPT exports use human/gpt; some use model/chatgpt).
ROLES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "bard": "assistant", "bing": "assistant",
}
#: Where the conversation lives in each chat shape.
CONTAINERS = {"openai": "messages", "sharegpt": "conversations"}
#: Fields holding a text row (`content` is what code corpora such as the-stack call it).
TEXT_FIELDS = ("text", "content")

MESSAGE_FEATURES = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]


class RowError(ValueError):
    """Why one row is unusable. `kind` groups rows in the warning's counts; the message says what was expected."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


# ---------------------------------------------------------------- one row


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """A conversation in ShareGPT or OpenAI shape as [{role, content}] with our role names; raises RowError."""
    if not isinstance(messages, list):
        raise RowError("missing field", f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise RowError("empty conversation", "the conversation has no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError("malformed message", f"message {i} is a {type(m).__name__}, expected an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role is None or "content" not in m and "value" not in m:
            raise RowError("missing field", f"message {i} lacks `role`/`content` (OpenAI) or `from`/`value` "
                                            f"(ShareGPT); it has keys {sorted(m)}")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise RowError("unknown role", f"message {i} has role {role!r}; expected one of "
                                           "system/user/assistant (ShareGPT: system/human/gpt)")
        if not isinstance(content, str):
            raise RowError("non-string content", f"message {i} content is {type(content).__name__}, "
                                                  "expected a string")
        if not content.strip():
            raise RowError("empty content", f"message {i} ({role}) has empty content")
        out.append({"role": ROLES[role.lower()], "content": content})
    return out


def normalize_row(row: Any, fmt: str) -> dict:
    """One raw row as {"text": str} or {"messages": [...]} for format `text`/`sharegpt`/`openai`; raises RowError."""
    if not isinstance(row, dict):
        raise RowError("not an object", f"expected a JSON object, got {type(row).__name__}")
    if fmt == "text":
        field = next((f for f in TEXT_FIELDS if f in row), None)
        if field is None:
            raise RowError("missing field", f"no `text` field (keys: {sorted(row)})")
        text = row[field]
        if not isinstance(text, str):
            raise RowError("non-string content", f"`{field}` is {type(text).__name__}, expected a string")
        if not text.strip():
            raise RowError("empty text", f"`{field}` is empty")
        return {"text": text}
    key = CONTAINERS[fmt]
    if key not in row:
        raise RowError("missing field", f"no `{key}` field ({fmt} shape; keys: {sorted(row)})")
    return {"messages": normalize_messages(row[key])}


def detect_format(rows: Iterable[Any], where: str) -> str:
    """The shape of a file's rows from the first row with a telling key: `openai`, `sharegpt` or `text`."""
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if i >= 1000:
            break
        if not isinstance(row, dict):
            continue
        if "messages" in row:
            return "openai"
        if "conversations" in row:
            return "sharegpt"
        if any(f in row for f in TEXT_FIELDS):
            return "text"
        seen.update(row)
    raise DataError(f"{where}: cannot tell the row format (keys seen: {sorted(seen) or 'none'}); expected "
                    "`messages` (OpenAI), `conversations` (ShareGPT) or `text`; set data.format")


# ---------------------------------------------------------------- skipping and counting


class SkipCounter:
    """Counts skipped rows by kind for one dataset and warns once; raises at the first one when strict."""

    def __init__(self, label: str, strict: bool, what: str = "malformed rows"):
        self.label, self.strict, self.what = label, strict, what
        self.counts: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    def skip(self, origin: str, err: RowError) -> None:
        if self.strict:
            raise DataError(f"{origin}: {err}; fix the row or set data.strict=false to skip {self.what}")
        self.counts[err.kind] += 1
        self.first.setdefault(err.kind, f"{origin}: {err}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return "; ".join(f"{n} {kind} (first: {self.first[kind]})" for kind, n in self.counts.most_common())

    def warn(self, rows_seen: int) -> None:
        if self.total:
            warnings.warn(f"{self.label}: skipped {self.total} of {rows_seen} rows ({self.what}): {self.summary()}; "
                          "set data.strict=true to make these errors", DataWarning, stacklevel=3)


# ---------------------------------------------------------------- local files


def read_user_text(path: Path) -> str:
    """A data file's text. Bytes that are not UTF-8 are kept as lone surrogates (`surrogateescape`), so the rows
    that hold them can be counted and skipped (`undecodable`), never silently replaced by U+FFFD."""
    return path.read_bytes().decode("utf-8", errors="surrogateescape")


def undecodable(value: Any) -> str | None:
    """Where a value (a row: nested dicts, lists, strings) holds text that is not UTF-8 as a RowError detail: bytes
    that were not UTF-8 (kept as surrogates by `read_user_text`), or a lone surrogate that a JSON escape such as
    `\\ud800` wrote, which no UTF-8 encoder (the tokenizer's, Arrow's) accepts."""
    if isinstance(value, str):
        for i, ch in enumerate(value):
            if "\udc80" <= ch <= "\udcff":
                return f"byte 0x{ord(ch) - 0xDC00:02x} at character {i} is not UTF-8"
            if "\ud800" <= ch <= "\udfff":
                return f"a lone surrogate \\u{ord(ch):04x} at character {i} (a JSON escape) is not UTF-8 text"
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for found in map(undecodable, items) if found), None)


def json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(origin, raw row) for a .jsonl file (one object per line) or a .json file (a list of objects, or JSONL).
    A row holding bytes that are not UTF-8 comes back as a RowError (`undecodable`)."""
    for origin, row in _json_rows(path):
        bad = None if isinstance(row, RowError) else undecodable(row)
        yield (origin, RowError("undecodable", bad)) if bad else (origin, row)


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    text = read_user_text(path)
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # several values: JSON Lines under a .json name
                raise DataError(f"{path}: not valid JSON ({e}); expected a list of row objects or JSON Lines") from e
        else:
            if not isinstance(data, list):
                raise DataError(f"{path}: the top level is a {type(data).__name__}; expected a list of row objects")
            for i, row in enumerate(data, 1):
                yield f"{path} row {i}", row
            return
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{i}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path}:{i}", RowError("invalid JSON", f"not valid JSON ({e.msg} at column {e.colno})")


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES | JSON_SUFFIXES
             and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    if not files:
        raise DataError(f"data.source={str(path)!r}: the folder has no .json/.jsonl/.txt/.py/.md files")
    return files


def _local_rows(path: Path, fmt: str, skips: SkipCounter) -> tuple[list[dict], int]:
    """Normalised rows of a local file or folder, and how many raw rows were read."""
    rows, seen = [], 0
    for file in _files_of(path):
        if file.suffix in TEXT_SUFFIXES:
            if fmt not in ("auto", "text"):
                raise DataError(f"{file}: a plain-text file, but data.format={fmt!r}; use data.format=auto or text")
            seen += 1
            text = read_user_text(file)
            bad = undecodable(text)
            if bad:
                skips.skip(str(file), RowError("undecodable", bad))
            elif text.strip():
                rows.append({"text": text, "origin": str(file)})
            else:
                skips.skip(str(file), RowError("empty text", "the file is empty"))
            continue
        raw = list(json_rows(file))
        if not raw:
            continue
        file_fmt = fmt if fmt != "auto" else detect_format((r for _, r in raw), str(file))
        for origin, row in raw:
            seen += 1
            try:
                if isinstance(row, RowError):
                    raise row
                rows.append({**normalize_row(row, file_fmt), "origin": origin})
            except RowError as err:
                skips.skip(origin, err)
    return rows, seen


def _to_dataset(rows: list[dict], label: str) -> datasets.Dataset:
    kinds = {"messages" if "messages" in r else "text" for r in rows}
    if len(kinds) > 1:
        first = {k: next(r["origin"] for r in rows if (k in r)) for k in kinds}
        raise DataError(f"{label} mixes chat rows ({first['messages']}) and text rows ({first['text']}); "
                        "point data.source at one kind")
    if kinds == {"messages"}:
        features = datasets.Features({"messages": MESSAGE_FEATURES, "origin": datasets.Value("string")})
    else:
        features = datasets.Features({"text": datasets.Value("string"), "origin": datasets.Value("string")})
    return datasets.Dataset.from_list(rows, features=features)


# ---------------------------------------------------------------- the hub


def parse_hub(source: str) -> tuple[str, str]:
    """`hf:NAME[:SPLIT]` -> (NAME, SPLIT); split defaults to `train`."""
    spec = source[len("hf:"):]
    name, _, split = spec.partition(":")
    if not name:
        raise DataError(f"data.source={source!r}: expected hf:<dataset name>[:<split>]")
    return name, split or "train"


def load_hub_dataset(source: str) -> datasets.Dataset:
    """The raw rows of `hf:NAME[:SPLIT]` through `datasets.load_dataset` (cached in the usual HF datasets cache)."""
    name, split = parse_hub(source)
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # network, unknown name, unknown split: one message naming the option
        raise DataError(f"data.source={source!r}: could not load hub dataset {name!r} split {split!r} "
                        f"({type(e).__name__}: {e})") from e


def _normalize_batch(batch: dict[str, list], indices: list[int], fmt: str, label: str) -> dict[str, list]:
    payload = "messages" if fmt in CONTAINERS else "text"
    out: dict[str, list] = {payload: [], "origin": [], "_kind": [], "_error": []}
    columns = list(batch)
    for j, i in enumerate(indices):
        row = {c: batch[c][j] for c in columns}
        out["origin"].append(f"{label} row {i + 1}")
        try:
            out[payload].append(normalize_row(row, fmt)[payload])
            out["_kind"].append("")
            out["_error"].append("")
        except RowError as err:
            out[payload].append([] if payload == "messages" else "")
            out["_kind"].append(err.kind)
            out["_error"].append(str(err))
    return out


def _hub_rows(source: str, fmt: str, skips: SkipCounter, num_proc: int) -> tuple[datasets.Dataset, int]:
    raw = load_hub_dataset(source)
    if fmt == "auto":
        fmt = detect_format([dict.fromkeys(raw.column_names)], source)
    payload = "messages" if fmt in CONTAINERS else "text"
    features = datasets.Features({
        payload: MESSAGE_FEATURES if payload == "messages" else datasets.Value("string"),
        "origin": datasets.Value("string"), "_kind": datasets.Value("string"), "_error": datasets.Value("string"),
    })
    rows = raw.map(_normalize_batch, batched=True, with_indices=True, fn_kwargs={"fmt": fmt, "label": source},
                   remove_columns=raw.column_names, features=features, keep_in_memory=True,
                   num_proc=num_proc if num_proc > 1 else None, desc="normalising rows")
    kinds = rows["_kind"]
    bad = [i for i, k in enumerate(kinds) if k]
    if bad:
        errors, origins = rows.select(bad)["_error"], rows.select(bad)["origin"]
        for i, err, origin in zip(bad, errors, origins):
            skips.skip(origin, RowError(kinds[i], err))
        rows = rows.select([i for i, k in enumerate(kinds) if not k], keep_in_memory=True)
    return rows.remove_columns(["_kind", "_error"]), len(kinds)


# ---------------------------------------------------------------- stdlib


def _stdlib_rows(source: str, fmt: str) -> datasets.Dataset:
    _, _, split = source.partition(":")
    split = split or "drafter"
    if fmt not in ("auto", "text"):
        raise DataError(f"data.source={source!r} is text; data.format={fmt!r} does not apply (use auto or text)")
    root = stdlib_root()
    rows = [{"text": read_source(p), "origin": f"stdlib:{p.relative_to(root).as_posix()}"}
            for p in stdlib_files(split)]
    return _to_dataset([r for r in rows if r["text"].strip()], source)


# ---------------------------------------------------------------- public


def load_source(source: str, format: str = "auto", strict: bool = False, num_proc: int = 1) -> datasets.Dataset:
    """All usable rows of one source as a Dataset with `text` or `messages`, plus `origin` (see the module doc).

    Raises DataError for a missing file, an unreadable format, a strict-mode malformed row, or no usable rows.
    """
    if format not in ("auto", "text", *CONTAINERS):
        raise DataError(f"data.format={format!r}: expected auto, text, sharegpt or openai")
    problem = source_problem(source)
    if problem:
        raise DataError(problem)
    if is_stdlib(source):
        return _stdlib_rows(source, format)
    skips = SkipCounter(source, strict)
    if source.startswith("hf:"):
        with datasets_progress():
            ds, seen = _hub_rows(source, format, skips, num_proc)
    else:
        path = Path(source).expanduser()
        rows, seen = _local_rows(path, format, skips)
        ds = _to_dataset(rows, source) if rows else None
    if ds is None or len(ds) == 0:
        why = f"all {seen} rows were malformed: {skips.summary()}" if seen else "it has no rows"
        raise DataError(f"data.source={source!r}: no usable rows ({why})")
    skips.warn(seen)
    return ds


def source_files(source: str) -> tuple[Path, list[str]] | None:
    """The files a source reads, as (root, names relative to it): a file, every data file of a folder (as
    `load_source` takes them), or the stdlib files of the split(s) it trains and holds out on. None for `hf:`
    sources, which the hub names by dataset and split. Raises DataError for a path that does not exist."""
    problem = source_problem(source)
    if problem:
        raise DataError(problem)
    if is_stdlib(source):
        _, _, split = source.partition(":")
        root = stdlib_root()
        files = stdlib_files("drafter") + stdlib_files("eval") if not split else stdlib_files(split)
        return root, [p.relative_to(root).as_posix() for p in files]
    if source.startswith("hf:"):
        return None
    path = Path(source).expanduser()
    if path.is_file():
        return path.parent, [path.name]
    return path, [p.relative_to(path).as_posix() for p in _files_of(path)]


def train_and_heldout(cfg: DataConfig, seed: int = 0) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Source rows for training (shuffled by `seed`, at most `max_rows`) and held out (fixed, not seed-dependent).

    `stdlib` trains on the drafter split and holds out the first `eval_rows` files of the eval split. Any other
    source holds out its last `eval_rows` rows (in file order) and trains on the rest.
    """
    if cfg.source == "stdlib":
        train = load_source("stdlib:drafter", cfg.format)
        heldout = load_source("stdlib:eval", cfg.format)
        heldout = heldout.select(range(min(cfg.eval_rows, len(heldout))))
    else:
        rows = load_source(cfg.source, cfg.format, cfg.strict, cfg.num_proc)
        n = len(rows)
        if cfg.eval_rows >= n:
            raise DataError(f"data.eval_rows={cfg.eval_rows} leaves no training rows: {cfg.source!r} has {n} usable "
                            "rows; lower data.eval_rows")
        cut = n - cfg.eval_rows
        train, heldout = rows.select(range(cut)), rows.select(list(range(cut, n)))  # a list: empty range fails
    train = train.shuffle(seed=seed, keep_in_memory=True)
    if cfg.max_rows is not None:
        train = train.select(range(min(cfg.max_rows, len(train))))
    return train, heldout
