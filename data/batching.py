"""Fixed-length token rows for the trainers: tokenise the source rows (`Dataset.map`), then pack or pad.

    train, heldout = build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)
    loader = DataLoader(train, batch_size=8, shuffle=True, collate_fn=collate)

Each row has `input_ids`, `attention_mask`, `loss_mask`, `position_ids`, all of length `cfg.seq_len`; the datasets
come back with `.with_format("torch")` (each row's columns are int64 tensors of shape (T,)), and `collate` stacks
them into (B, T) LongTensors.

- `loss_mask[t] = 1` when token t is a training target: every token of a text row (its EOS too), and only the
  assistant turns (content + end-of-turn token) of a chat row. A trainer predicting token t+k from position t
  weights that prediction by `loss_mask[t + k]`. Padding is 0 in `attention_mask` and `loss_mask`.
- Every text document ends in EOS (a target: the model learns where files end).
- Packing (`data.pack`, the default) also appends EOS to each conversation (not a target: the template has
  already ended the turn; it only separates documents) and lays several documents in each row of `seq_len`, by
  `data.packing`:
  - `best_fit` (the default): whole documents, best fit decreasing (each document, longest first, goes into the
    open row it fills most tightly), so no document that fits in a row is split; one longer than `seq_len` is cut
    into `seq_len` pieces, each a document of its own. The room left in a row is padding (on documents of mixed
    lengths a few percent of the positions; `pack_stats` says how much).
  - `stream`: documents end to end in the seed's order, cut into rows of `seq_len` wherever the row ends; only the
    last row is padded, but a document crossing a row's end continues in the next row as a document of its own,
    without its beginning.
  With `data.document_mask` (the default) no token attends across a document boundary: `position_ids` restart at
  0 at every document (and at the first token of a row), and the verifier's forward, the drafters' attention and
  their targets follow them (data/documents.py: the mask and the exact target rule), so a packed document is seen
  as a server sees that prompt alone. `data.document_mask=false` numbers every row 0..T-1: documents attend across
  the EOS between them, as in most pretraining code.
- Padding (`data.pack=false`) keeps one document per row, right-padded (position_ids 0..T-1); longer ones are
  truncated and counted (a `DataWarning`), or raise with `data.strict`. Rows whose targets were all cut off are
  dropped.

Caching: every `map`/`shuffle`/`select` here runs with `keep_in_memory=True`, so building datasets writes nothing
to disk (in particular nothing into ~/.cache/huggingface/datasets); only `hf:` sources use the usual HF download
cache. Tokenising is quick (about 0.5M tokens/s per process on a busy CPU core here), so a cache would save little.
"""

from __future__ import annotations

import bisect
import heapq
import warnings

import datasets
import numpy as np
import pyarrow as pa
import torch

from draftheads.data.chat import resolve_chat_template, tokenize_chats
from draftheads.data.config import DataConfig, DataError, DataWarning
from draftheads.data.documents import join_padding, packed_positions
from draftheads.data.progress import datasets_progress
from draftheads.data.sources import RowError, SkipCounter, train_and_heldout

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "position_ids")

_TOKEN_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "origin": datasets.Value("string"),
    "_kind": datasets.Value("string"),
    "_error": datasets.Value("string"),
})


def pad_id_of(tokenizer) -> int:
    """The id used for padding: pad, else EOS, else 0 (padding is masked out either way)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def _tokenize_batch(batch: dict[str, list], tokenizer, template: str | None, pack: bool) -> dict[str, list]:
    if "messages" in batch:
        results = tokenize_chats(batch["messages"], tokenizer, template)
        eos_loss = 0
        eos = tokenizer.eos_token_id if pack else None  # a separator only; the template already ended the turn
    else:  # the tokenizer's own special tokens (BOS for Llama-style tokenizers), every token a target
        results = [(ids, [1] * len(ids)) for ids in tokenizer(batch["text"], verbose=False)["input_ids"]]
        eos_loss = 1
        eos = tokenizer.eos_token_id
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "origin": batch["origin"], "_kind": [], "_error": []}
    for result in results:
        if isinstance(result, RowError):
            ids, mask, kind, error = [], [], result.kind, str(result)
        else:
            (ids, mask), kind, error = result, "", ""
            if eos is not None and (not ids or ids[-1] != eos):
                ids, mask = [*ids, eos], [*mask, eos_loss]
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["_kind"].append(kind)
        out["_error"].append(error)
    return out


def tokenize_rows(rows: datasets.Dataset, tokenizer, template: str | None, label: str, strict: bool = False,
                  num_proc: int = 1, pack: bool = True) -> datasets.Dataset:
    """Source rows -> variable-length `input_ids`, `loss_mask` (+ `origin`); unusable rows skipped and counted.

    Text rows end in EOS (a target); chat rows get an EOS separator (not a target) only when packing.
    """
    tokens = rows.map(_tokenize_batch, batched=True,
                      fn_kwargs={"tokenizer": tokenizer, "template": template, "pack": pack},
                      remove_columns=rows.column_names, features=_TOKEN_FEATURES, keep_in_memory=True,
                      num_proc=num_proc if num_proc > 1 else None, desc=f"tokenising {label}")
    kinds = tokens["_kind"]
    bad = [i for i, kind in enumerate(kinds) if kind]
    if bad:
        skips = SkipCounter(label, strict, what="unusable conversations")
        failed = tokens.select(bad)
        for kind, error, origin in zip(failed["_kind"], failed["_error"], failed["origin"]):
            skips.skip(origin, RowError(kind, error))
        if len(bad) == len(kinds):
            raise DataError(f"{label}: no usable rows after tokenising: {skips.summary()}")
        skips.warn(len(kinds))
        tokens = tokens.select([i for i, kind in enumerate(kinds) if not kind], keep_in_memory=True)
        tokens = tokens.flatten_indices(keep_in_memory=True)  # _ragged reads the Arrow table directly
    return tokens.remove_columns(["_kind", "_error"])


def _ragged(ds: datasets.Dataset, column: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, row offsets) without Python lists: row i is values[offsets[i]:offsets[i+1]]."""
    assert ds._indices is None, "flatten_indices() first: the Arrow table is not in the dataset's row order"
    array = ds.data.table.column(column).combine_chunks()
    offsets = array.offsets.to_numpy()
    return array.flatten().to_numpy(zero_copy_only=False), offsets - offsets[0]


def _fixed_rows(input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray,
                position_ids: np.ndarray | None = None) -> datasets.Dataset:
    """(R, T) arrays -> a Dataset of fixed-size list columns; position_ids default to 0..T-1 (one document a row)."""
    rows, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len))
    columns = {name: pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(array).reshape(-1)), seq_len)
               for name, array in (("input_ids", input_ids.astype(np.int32)),
                                   ("attention_mask", attention_mask.astype(np.int8)),
                                   ("loss_mask", loss_mask.astype(np.int8)),
                                   ("position_ids", position_ids.astype(np.int32)))}
    return datasets.Dataset(datasets.table.InMemoryTable(pa.table(columns)))


def pack(tokens: datasets.Dataset, seq_len: int, pad_id: int, document_mask: bool = True,
         packing: str = "best_fit") -> datasets.Dataset:
    """Documents (each already ending in EOS) -> rows of seq_len, by `packing` (the module docstring):
    `best_fit` places whole documents (`best_fit_rows`), `stream` concatenates them and cuts the stream into rows.

    document_mask: position_ids restart at 0 at every document (and at a row's first token; data/documents.py);
    else 0..T-1 in every row (documents attend across the EOS between them)."""
    ids, offsets = _ragged(tokens, "input_ids")
    mask, _ = _ragged(tokens, "loss_mask")
    if packing == "best_fit":
        return _best_fit(ids, mask, offsets, seq_len, pad_id, document_mask)
    n = len(ids)
    rows = -(-n // seq_len)
    pad = rows * seq_len - n
    ids = np.concatenate([ids, np.full(pad, pad_id, dtype=ids.dtype)]).reshape(rows, seq_len)  # (R, T)
    attn = np.concatenate([np.ones(n, np.int8), np.zeros(pad, np.int8)]).reshape(rows, seq_len)
    mask = np.concatenate([mask, np.zeros(pad, mask.dtype)]).reshape(rows, seq_len)
    positions = packed_positions(offsets[:-1], n, seq_len).reshape(rows, seq_len) if document_mask else None
    return _fixed_rows(ids, attn, mask, positions)


def best_fit_rows(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Best fit decreasing: pieces of the given lengths (each <= seq_len) -> rows, each a list of piece indices in
    the order they are laid out, the rows ordered by their lowest piece index (so the rows keep the pieces' order
    as far as packing allows). Longest piece first (ties: lower index first), into the open row with the least room
    that still holds it (ties: the row opened first), else into a new row; O(n log n) for n pieces."""
    by_room: dict[int, list[int]] = {}  # room left -> heap of the open rows with that room
    rooms: list[int] = []  # the distinct rooms of open rows, sorted (at most seq_len of them)
    rows: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-int(lengths[j]), j)):
        n = int(lengths[i])
        at = bisect.bisect_left(rooms, n)
        if at < len(rooms):
            room = rooms[at]
            r = heapq.heappop(by_room[room])
            if not by_room[room]:
                del by_room[room], rooms[at]
        else:
            room, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n:
            if room - n not in by_room:
                bisect.insort(rooms, room - n)
            heapq.heappush(by_room.setdefault(room - n, []), r)
    return sorted(rows, key=min)


def _best_fit(ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, seq_len: int, pad_id: int,
              document_mask: bool) -> datasets.Dataset:
    """`best_fit` packing of the flat documents ids[offsets[i]:offsets[i+1]]: documents longer than seq_len are
    cut into seq_len pieces first (each then a document of its own), then `best_fit_rows` places the pieces."""
    starts, ends = [], []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        for piece in range(start, end, seq_len):
            starts.append(piece)
            ends.append(min(piece + seq_len, end))
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    rows = best_fit_rows(ends - starts, seq_len)
    out_ids = np.full((len(rows), seq_len), pad_id, dtype=ids.dtype)  # (R, T)
    out_attn = np.zeros((len(rows), seq_len), dtype=np.int8)
    out_mask = np.zeros((len(rows), seq_len), dtype=mask.dtype)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (len(rows), seq_len)).copy()
    for r, pieces in enumerate(rows):
        at = 0
        for i in pieces:
            n = int(ends[i] - starts[i])
            out_ids[r, at: at + n] = ids[starts[i]: ends[i]]
            out_mask[r, at: at + n] = mask[starts[i]: ends[i]]
            positions[r, at: at + n] = np.arange(n, dtype=np.int32)
            at += n
        out_attn[r, :at] = 1
        positions[r, at:] = np.arange(seq_len - at, dtype=np.int32)  # the padding: a document of its own
    return _fixed_rows(out_ids, out_attn, out_mask, positions if document_mask else None)


def pack_stats(rows: datasets.Dataset) -> dict[str, float]:
    """Packed rows at a glance: {rows, tokens (non-padding), padding (its share of all positions),
    documents_per_row (read from position_ids restarts; 1.0 where data.document_mask=false numbers rows 0..T-1)}."""
    attn = np.asarray(rows.with_format("numpy")["attention_mask"])
    positions = np.asarray(rows.with_format("numpy")["position_ids"])
    starts = (positions[:, 1:] != positions[:, :-1] + 1) & (attn[:, 1:] > 0)
    return {"rows": len(attn), "tokens": int(attn.sum()), "padding": float(1 - attn.mean()) if attn.size else 0.0,
            "documents_per_row": float(1 + starts.sum() / len(attn)) if len(attn) else 0.0}


def pad(tokens: datasets.Dataset, seq_len: int, pad_id: int, label: str, strict: bool = False) -> datasets.Dataset:
    """One document per row, right-padded to seq_len; longer ones truncated and counted (or an error if strict)."""
    ids, offsets = _ragged(tokens, "input_ids")
    mask, _ = _ragged(tokens, "loss_mask")
    lengths = np.diff(offsets)
    over = np.flatnonzero(lengths > seq_len)
    if strict and len(over):
        i = int(over[0])
        raise DataError(f"{tokens[i]['origin']}: {lengths[i]} tokens, longer than data.seq_len={seq_len}; raise "
                        "data.seq_len, or set data.strict=false to truncate (counted), or data.pack=true")
    rows = len(lengths)
    out_ids = np.full((rows, seq_len), pad_id, dtype=np.int32)  # (R, T)
    out_attn = np.zeros((rows, seq_len), dtype=np.int8)
    out_mask = np.zeros((rows, seq_len), dtype=np.int8)
    for r in range(rows):
        start, length = offsets[r], min(int(lengths[r]), seq_len)
        out_ids[r, :length] = ids[start: start + length]
        out_attn[r, :length] = 1
        out_mask[r, :length] = mask[start: start + length]
    keep = out_mask.any(axis=1)
    dropped = rows - int(keep.sum())
    if len(over) or dropped:
        first = tokens[int(over[0])]["origin"] if len(over) else ""
        gone = f"; dropped {dropped} left with no target token" if dropped else ""
        warnings.warn(f"{label}: truncated {len(over)} of {rows} rows longer than data.seq_len={seq_len} "
                      f"(first: {first}){gone}; raise data.seq_len, set data.pack=true, or data.strict=true to "
                      "make this an error", DataWarning, stacklevel=3)
    if not keep.any():
        raise DataError(f"{label}: no row has a target token within data.seq_len={seq_len}; raise data.seq_len")
    return _fixed_rows(out_ids[keep], out_attn[keep], out_mask[keep])


def to_token_rows(rows: datasets.Dataset, tokenizer, cfg: DataConfig, template: str | None,
                  label: str) -> datasets.Dataset:
    """Source rows -> fixed-length rows (`input_ids`, `attention_mask`, `loss_mask`) by cfg.pack."""
    if len(rows) == 0:
        empty = np.zeros((0, cfg.seq_len), dtype=np.int32)
        return _fixed_rows(empty, empty, empty, empty)
    tokens = tokenize_rows(rows, tokenizer, template, label, cfg.strict, cfg.num_proc, cfg.pack)
    if cfg.pack:
        if tokenizer.eos_token_id is None:
            raise DataError("data.pack=true separates documents with EOS, but the tokenizer has no eos_token; "
                            "set data.pack=false or give the tokenizer an eos_token")
        return pack(tokens, cfg.seq_len, pad_id_of(tokenizer), cfg.document_mask, cfg.packing)
    return pad(tokens, cfg.seq_len, pad_id_of(tokenizer), label, cfg.strict)


def build_datasets(cfg: DataConfig, tokenizer, seed: int = 0) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, held-out) fixed-length token rows in torch format; deterministic for a seed (see the module doc).

    The held-out set may be empty (data.eval_rows=0). Raises DataError for a missing file, no usable rows,
    a chat source with a tokenizer without chat template (names data.chat_template), and strict-mode problems.
    """
    with datasets_progress():
        train_rows, heldout_rows = train_and_heldout(cfg, seed)
        template = None
        if "messages" in train_rows.column_names:
            template = resolve_chat_template(tokenizer, cfg.chat_template, where=f"data.source={cfg.source!r}")
        train = to_token_rows(train_rows, tokenizer, cfg, template, f"{cfg.source} (train)")
        heldout = to_token_rows(heldout_rows, tokenizer, cfg, template, f"{cfg.source} (held-out)")
    return train.with_format("torch"), heldout.with_format("torch")


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Rows (tensors or lists of length T) -> {input_ids, attention_mask, loss_mask, position_ids}: (B, T)
    LongTensors; each row's right padding joins its last document (`data.documents.join_padding`: a row of one
    document then attends causally, the fast path, with nothing changed for its real tokens)."""
    if not rows:
        raise ValueError("collate: empty batch")
    batch = {key: torch.stack([torch.as_tensor(row[key]) for row in rows]).long() for key in BATCH_KEYS}
    batch["position_ids"] = join_padding(batch["position_ids"], batch["attention_mask"])
    return batch
