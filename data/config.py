"""The `data` section of a run config: where text comes from and how it becomes token batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
