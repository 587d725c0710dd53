"""The `data` section of a run config: where text comes from and how it becomes token batches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TEXT_SUFFIXES = {".txt", ".py", ".md"}
JSON_SUFFIXES = {".json", ".jsonl"}
STDLIB_SPLITS = ("drafter", "eval", "verifier")
#: `data.chat_template` names of the templates data/chat.py carries (besides a .jinja file or the template text).
BUILTIN_TEMPLATE_NAMES = ("chatml", "llama3")


class DataError(ValueError):
    """Data that cannot be used: a missing file, a malformed row (strict), an empty dataset, a missing chat template.

    The message names the file / row / config option to fix.
    """


class DataWarning(UserWarning):
    """Rows that were skipped or truncated; one warning per dataset, with counts and the first offending row."""


@dataclass
class DataConfig:
    """Training data for a drafter."""

    source: str = "stdlib"
    """`stdlib` (the Python standard library's source: `drafter` files train, `eval` files are held out;
    `stdlib:<split>` reads one split), a local file or folder (.json/.jsonl chat or text rows, .txt/.py/.md text),
    or `hf:<dataset name>[:<split>]` on the Hugging Face hub."""
    format: Literal["auto", "text", "sharegpt", "openai"] = "auto"
    """Row shape: plain `text`, ShareGPT `conversations` (from/value), OpenAI `messages` (role/content); `auto` detects."""
    seq_len: int = 512
    """Tokens per training sequence (packed rows are cut to this length)."""
    pack: bool = True
    """Pack several documents into each sequence (no padding); off pads each row to seq_len."""
    packing: Literal["best_fit", "stream"] = "best_fit"
    """With pack: `best_fit` lays whole documents in rows (best fit decreasing; one longer than seq_len is cut into
    seq_len pieces), so no document that fits in a row is split, at the cost of some padding; `stream` cuts the
    concatenated documents into rows wherever a row ends (no padding, but a document crossing a row's end continues
    in the next row without its beginning). data/batching.py says more."""
    document_mask: bool = True
    """With pack: no token attends across a document boundary and positions restart at 0 per document, in the
    verifier's features and the drafter's attention, and no prediction is trained on another document's token
    (data/documents.py); false lets packed documents attend across the EOS between them. No effect with pack=false
    (one document per row)."""
    max_rows: int | None = None
    """Use at most this many source rows (documents / conversations) for training; None uses all."""
    eval_rows: int = 64
    """Held-out source rows for per-head / per-step accuracy (stdlib: the first files of the `eval` split, at most
    this many; else the last this many rows of the source, which are then not trained on)."""
    strict: bool = False
    """Malformed rows and over-long sequences are errors instead of being skipped/truncated with a warning count."""
    num_proc: int = 1
    """Processes for `datasets.map` tokenisation."""
    chat_template: str | None = None
    """Chat template for chat rows: `chatml`, `llama3`, a .jinja file or template text; None: the tokenizer's own."""

    def __post_init__(self):
        if self.seq_len < 8:
            raise ValueError(f"data.seq_len={self.seq_len}: expected at least 8 tokens")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"data.max_rows={self.max_rows}: expected a positive count or null")
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc={self.num_proc}: expected a positive integer")
        if self.packing not in ("best_fit", "stream"):
            raise ValueError(f"data.packing={self.packing!r}: expected 'best_fit' or 'stream'")
        if self.eval_rows < 0:
            raise ValueError(f"data.eval_rows={self.eval_rows}: expected >= 0")
        problem = source_problem(str(self.source), files=False) or (
            None if self.chat_template is None else chat_template_problem(self.chat_template, files=False))
        if problem:
            raise ValueError(problem)
        if is_stdlib(self.source) and self.format not in ("auto", "text"):
            raise ValueError(f"data.format={self.format}: data.source={self.source!r} is text; expected auto or text")


def is_stdlib(source: str) -> bool:
    return source == "stdlib" or source.startswith("stdlib:")


def source_problem(source: str, files: bool = True) -> str | None:
    """What is wrong with a `data.source` value, in one line naming it, or None. `files`: also whether a local path
    is there as a data file or a folder (what a folder holds is checked when it is read)."""
    expected = "expected stdlib, a .json/.jsonl/.txt/.py/.md file, a folder of them, or hf:<dataset name>[:<split>]"
    if not source.strip():
        return f"data.source={source!r}: {expected}"
    if is_stdlib(source):
        split = source.partition(":")[2] or "drafter"
        if split not in STDLIB_SPLITS:
            return f"data.source={source!r}: unknown stdlib split {split!r}; expected one of {STDLIB_SPLITS}"
        return None
    if source.startswith("hf:"):
        return None if source[3:].partition(":")[0] else f"data.source={source!r}: expected hf:<dataset name>[:<split>]"
    if not files:
        return None
    path = Path(source).expanduser()
    if not path.exists():
        return f"data.source={source!r}: no such file or folder ({expected})"
    if path.is_file() and path.suffix not in TEXT_SUFFIXES | JSON_SUFFIXES:
        return f"data.source={source!r}: unsupported file type {path.suffix!r}; expected .json, .jsonl, .txt, .py or .md"
    return None


def template_file(option: str) -> Path | None:
    """The file a chat-template option names: None for a builtin name or template text (Jinja markup)."""
    if option in BUILTIN_TEMPLATE_NAMES or "{{" in option or "{%" in option:
        return None
    return Path(option).expanduser()


def chat_template_problem(option: str, option_name: str = "data.chat_template", files: bool = True) -> str | None:
    """What is wrong with a chat-template option (a builtin name, a .jinja file or template text), in one line naming
    `option_name`, or None. `files`: also whether a file it names is there."""
    expected = f"a builtin template ({', '.join(BUILTIN_TEMPLATE_NAMES)}), an existing .jinja file, or template text"
    if not option.strip():
        return f"{option_name}={option!r}: expected {expected} (null: the tokenizer's own)"
    path = template_file(option)
    if files and path is not None and not path.is_file():
        return f"{option_name}={option!r}: not {expected}"
    return None
