"""The offline hidden-state cache's format: what a cache folder holds, how it is verified, how training reads it.

    draftheads dump-features --config configs/eagle3-tiny.yaml --out cache/eagle3-tiny   # writes one
    draftheads cache verify cache/eagle3-tiny            # sizes, headers and sha256 of every shard
    python train/eagle.py --config configs/eagle3-tiny.yaml --features=offline --feature_cache=cache/eagle3-tiny

The program that runs the verifier to fill a cache is train/dump_features.py (it needs the verifier and the
trainers' configs); this module is the format both sides agree on. Per row a cache stores what the method's loss
reads from the verifier, for the rows `data.batching.build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)`
builds (the rows training sees):

    every method   input_ids int32 (N, T), attention_mask int8 (N, T), loss_mask int8 (N, T),
                   position_ids int32 (N, T): restarting at 0 per document in packed rows (`data.document_mask`,
                   data/documents.py; 0..T-1 otherwise), the positions the verifier ran with and the document
                   boundaries the drafter's attention and targets follow
                   final (N, T, H): the last post-norm hidden state, computed with those positions and attention
                   inside each document only
    eagle3         layers (N, 3, T, H): the inputs of the feature layers (`eagle.layer_ids`, default 2, L//2, L-3)
                   argmax int32 (N, T): the verifier's argmax of lm_head(final) over the whole vocabulary, of
                   `final` as stored, in the verifier's dtype (index.json `argmax: true`; version 2 caches have none)
    dflash         layers (N, L, T, H): the outputs of the target layers (`dflash.target_layer_ids`), stored as the
                   inputs of layers id + 1
                   argmax int32 (N, T): as eagle3's (caches dumped before DFlash's stored it have none)

A row's right padding (attention_mask 0, loss_mask 0) is never read as a feature: the drafter's attention is
causal and its losses skip it. index.json records what it holds (`padding`): `joined`, the states of the pad tokens
run as part of the row's last document (what `dump-features` computes, either backend), or `zeros`, not computed
(`regenerate --capture`). A run may train from either: the two agree on every position it reads.

Logits are never stored: wherever a loss reads the verifier's distribution (Medusa `distill`, EAGLE-1's token loss,
EAGLE-3's targets over the draft vocabulary), it is `lm_head(final)`, which the offline source recomputes with the
verifier's own lm_head (the verifier is loaded, never run). That is exact, H values per token instead of V, and keeps
the cache independent of the draft vocabulary chosen at training time. EAGLE-3 and DFlash also read the argmax over
the whole vocabulary; stored (4 bytes a token), it lets an EAGLE-3 run hold only the draft vocabulary's rows of
lm_head and spares a DFlash step the product of lm_head with every position its blocks score.

Layout of a cache folder: `{split}-{i:05d}.safetensors` shards of `rows_per_shard` rows (split `train` or `eval`),
each with a `{split}-{i:05d}.json` sidecar (rows, bytes, sha256) written after the shard was renamed into place
(a shard counts as done only with its sidecar and the size it records, `shard_done`; everything is written
tmp + rename), a `plan.json` fixed at the first start (a restart with other settings is refused), and `index.json`
written at the end. Shard i of a split is done by process i % world_size, so `accelerate launch` splits the work
by index.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from draftheads.data.documents import join_padding
from draftheads.data.identity import sha256_file

FORMAT = "draftheads-hidden-states"
VERSION = 3
#: Older versions still read: version 2 has no `argmax` (an EAGLE-3 run on it holds the verifier's whole lm_head).
READ_VERSIONS = (2, VERSION)
#: What a cache of an older version lacks, for the one-line refusal.
OLD_VERSIONS = {1: "no position_ids (its packed rows' features attended across document boundaries)"}
METHODS = ("medusa", "eagle1", "eagle3", "dflash")
#: What computes a cache's features (recorded in index.json): the verifier's Hugging Face forward, or vLLM's
#: extract_hidden_states (train/vllm_backend.py); both write the same format.
BACKENDS = ("hf", "vllm")
SPLITS = ("train", "eval")
#: What a cache stores at a row's right padding (module docstring); a cache that records none joined it.
PADDINGS = ("joined", "zeros")
#: Feature dtypes a cache may store: name -> (safetensors dtype code, bytes per value).
FEATURE_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
TOKEN_DTYPES = {"input_ids": torch.int32, "attention_mask": torch.int8, "loss_mask": torch.int8,
                "position_ids": torch.int32}
#: Data settings that change which rows are built (num_proc only changes how fast).
DATA_KEYS = ("source", "format", "seq_len", "pack", "packing", "document_mask", "max_rows", "eval_rows", "strict",
             "chat_template")
#: The value a data setting had before a cache recorded it (caches written before data.packing existed streamed).
DATA_KEYS_ADDED = {"packing": "stream"}


class CacheError(ValueError):
    """A feature cache that cannot be used; the message names the file and what is wrong with it."""


# ---- sizes ---------------------------------------------------------------------------------------------------------
def bytes_per_token(hidden_size: int, num_layers: int, dtype: str, argmax: bool = False) -> int:
    """Stored bytes per token: (1 + layers) feature vectors of H values, plus input_ids (4), two masks (1 + 1),
    position_ids (4) and, with `argmax`, the verifier's argmax (4)."""
    return (1 + num_layers) * hidden_size * FEATURE_DTYPES[dtype][1] + 10 + (4 if argmax else 0)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def sidecar_name(shard: str) -> str:
    """The json sidecar of a shard file (rows, bytes, sha256), written once the shard is in place."""
    return shard.replace(".safetensors", ".json")


def expected_shapes(index: dict, rows: int) -> dict[str, tuple[list[int], str]]:
    """{key: (shape, safetensors dtype)} of a shard with `rows` rows of this cache."""
    T, H, L = index["seq_len"], index["hidden_size"], len(index["layer_ids"])
    feat = FEATURE_DTYPES[index["dtype"]][0]
    shapes = {"input_ids": ([rows, T], "I32"), "attention_mask": ([rows, T], "I8"), "loss_mask": ([rows, T], "I8"),
              "position_ids": ([rows, T], "I32"), "final": ([rows, T, H], feat)}
    if L:
        shapes["layers"] = ([rows, L, T, H], feat)
    if index.get("argmax"):
        shapes["argmax"] = ([rows, T], "I32")
    return shapes


# ---- what a run's rows are ------------------------------------------------------------------------------------------------
def data_signature(cfg) -> dict:
    """What decides the rows: the data settings that build them and the seed that orders them."""
    data = dataclasses.asdict(cfg.data)
    return {**{k: data[k] for k in DATA_KEYS}, "seed": cfg.train.seed}


def shard_done(folder: Path, name: str, rows: int) -> bool:
    """Done = its sidecar exists (written after the shard's rename) and the shard has the recorded size and rows."""
    side, path = folder / sidecar_name(name), folder / name
    if not side.is_file() or not path.is_file():
        return False
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError:
        return False
    return meta.get("rows") == rows and meta.get("bytes") == path.stat().st_size


# ---- read ----------------------------------------------------------------------------------------------------------
def read_index(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    path = folder / "index.json"
    if not path.is_file():
        hint = " (a dump was started but not finished: rerun it)" if (folder / "plan.json").is_file() else ""
        raise CacheError(f"{path}: no such file; feature_cache must be a folder written by "
                         f"`draftheads dump-features`{hint}")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CacheError(f"{path}: not valid JSON ({err})") from None
    if index.get("format") == FORMAT and index.get("version") in OLD_VERSIONS:
        raise CacheError(f"{path}: a version {index['version']} cache ({OLD_VERSIONS[index['version']]}); this "
                         f"draftheads reads version {VERSION}: dump it again with `draftheads dump-features`")
    if index.get("format") != FORMAT or index.get("version") not in READ_VERSIONS:
        raise CacheError(f"{path}: format {index.get('format')!r} version {index.get('version')!r}; expected "
                         f"{FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}")
    if index.setdefault("padding", PADDINGS[0]) not in PADDINGS:
        raise CacheError(f"{path}: padding={index['padding']!r}; expected one of {PADDINGS}")
    return index


def verify_shards(folder: str | os.PathLike, index: dict, check_hash: bool = False) -> None:
    """Each shard: present, the recorded size (and sha256 with check_hash), the expected keys, shapes and dtypes."""
    from safetensors import safe_open

    folder = Path(folder)
    for split in SPLITS:
        for meta in index["splits"][split]["shards"]:
            path = folder / meta["file"]
            if not path.is_file():
                raise CacheError(f"{path}: shard missing from the feature cache (listed in index.json)")
            size = path.stat().st_size
            if size != meta["bytes"]:
                raise CacheError(f"{path}: {size} bytes, index.json records {meta['bytes']}; the shard is truncated "
                                 "or was rewritten: delete it and its .json sidecar and rerun the dump")
            if check_hash and sha256_file(path) != meta["sha256"]:
                raise CacheError(f"{path}: sha256 differs from index.json; the shard is corrupted: delete it and its "
                                 ".json sidecar and rerun the dump")
            try:
                with safe_open(str(path), framework="pt") as f:
                    found = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
            except Exception as err:  # safetensors raises its own error types for a bad header
                raise CacheError(f"{path}: unreadable safetensors header ({err})") from None
            want = expected_shapes(index, meta["rows"])
            if set(found) != set(want):
                raise CacheError(f"{path}: tensors {sorted(found)}, expected {sorted(want)}")
            for key, (shape, dtype) in want.items():
                if list(found[key][0]) != shape or found[key][1] != dtype:
                    raise CacheError(f"{path}: {key} is {found[key][1]} {list(found[key][0])}, expected "
                                     f"{dtype} {shape}")


def check_verifier(index: dict, verifier, folder: str | os.PathLike) -> None:
    """The cache must come from this verifier: same shape fields and fingerprint."""
    stored, mine = index["verifier"], verifier.describe()
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "fingerprint"):
        if stored.get(key) != mine.get(key):
            raise CacheError(
                f"{Path(folder) / 'index.json'}: the cache was dumped from verifier {stored.get('name')!r} with "
                f"{key}={stored.get(key)!r}, but the training config's verifier {verifier.name!r} has "
                f"{key}={mine.get(key)!r}; dump the cache again with this verifier")


def check_data(index: dict, cfg, folder: str | os.PathLike) -> None:
    """The cached rows must be the rows this run would build: same data settings and seed (the source compared by
    content when the cache records it: `check_for_run`)."""
    mine = data_signature(cfg)
    by_content = bool((index.get("inputs") or {}).get("data"))
    for key, value in mine.items():
        if key == "source" and by_content:
            continue
        cached = index["data"].get(key, DATA_KEYS_ADDED.get(key))
        if cached != value:
            name = "train.seed" if key == "seed" else f"data.{key}"
            raise CacheError(
                f"{Path(folder) / 'index.json'}: the cache holds rows built with {name}={cached!r}, "
                f"this run has {name}={value!r}; set it to the cache's value or dump again with this config")


def check_for_run(index: dict, cfg, folder: str | os.PathLike, verifier: dict, known: dict | None = None) -> dict:
    """Everything a training run checks about its cache before anything is loaded (train/run_folder.py): the data
    settings and seed, the verifier's dtype, and the contents the dump read: the verifier's files (`verifier`, the
    run's `{"files", "digest"}` of its verifier folder) and the data source's files as they are now. Returns the
    run's data inputs (as `data.identity.data_inputs`; the cache's own record when the source is gone: the cache is
    then all there is of it). Raises CacheError naming the file and what changed."""
    from draftheads.data.identity import changes, summarize

    where = Path(folder) / "index.json"
    check_data(index, cfg, folder)
    if index.get("verifier_dtype") not in (None, cfg.verifier_dtype):
        raise CacheError(f"{where}: the cache holds features of the verifier run in {index['verifier_dtype']} "
                         f"(verifier_dtype={index['verifier_dtype']}), this run has verifier_dtype="
                         f"{cfg.verifier_dtype}; set verifier_dtype={index['verifier_dtype']} or dump again with "
                         "this config")
    stored = index.get("inputs") or {}
    theirs = stored.get("verifier") or {}
    if theirs.get("files") and theirs.get("digest") != verifier.get("digest"):
        changed = changes(theirs["files"], verifier["files"])
        raise CacheError(f"{where}: the cache was dumped from verifier {index['verifier'].get('name')!r}, and the "
                         f"verifier {cfg.verifier!r} differs from it: {summarize(changed) or 'other contents'}; dump "
                         "the cache again with this verifier")
    from draftheads.data.config import DataError
    from draftheads.data.identity import data_inputs

    if not stored.get("data"):
        try:
            return data_inputs(cfg.data, known)
        except DataError:
            return {}
    try:
        mine = data_inputs(cfg.data, known if known else {k: stored[k] for k in ("data", "chat_template")
                                                          if k in stored})
    except DataError:  # the source is gone: the cache holds its rows
        return {k: stored[k] for k in ("data", "chat_template") if k in stored}
    for key, name in (("data", "data.source"), ("chat_template", "data.chat_template")):
        a, b = stored.get(key), mine.get(key)
        if (a or {}).get("digest") != (b or {}).get("digest"):
            changed = changes((a or {}).get("files") or {}, (b or {}).get("files") or {})
            raise CacheError(f"{where}: the cache holds rows of {name}={(a or {}).get('source')!r} as it was when "
                             f"dumped; {name}={(b or {}).get('source')!r} now differs: "
                             f"{summarize(changed) or 'other contents'}; dump the cache again (the rows it holds "
                             "are not this data's)")
    return mine


_HASHED: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) of the shards this process has hashed


class CachedRows(torch.utils.data.Dataset):
    """One split of a cache as a map-style dataset: row i -> {input_ids, attention_mask, loss_mask, position_ids
    (T,), final (T, H), layers (L, T, H) when stored}. Shards are opened lazily (memory-mapped), per worker process.

    What is cheap to verify is verified as it is read: each shard's sha256 against index.json the first time a
    process opens it (one more sequential read of the shard per process, the first epoch only; a flipped byte in a
    feature otherwise trains to the end without a word), and every row's token ids inside the verifier's
    vocabulary. Either ends in a CacheError naming the shard (and the row)."""

    def __init__(self, folder: str | os.PathLike, index: dict, split: str):
        self.folder, self.split = Path(folder), split
        self.shards = [meta["file"] for meta in index["splits"][split]["shards"]]
        self.sha256 = [meta.get("sha256") for meta in index["splits"][split]["shards"]]
        self.vocab_size = (index.get("verifier") or {}).get("vocab_size")
        counts = [meta["rows"] for meta in index["splits"][split]["shards"]]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]
        self.length = sum(counts)
        self.keys = list(expected_shapes(index, 1))
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return self.length

    def __getstate__(self):  # DataLoader workers reopen shards themselves
        return {**self.__dict__, "_open": {}}

    def _handle(self, s: int):
        if s not in self._open:
            from safetensors import safe_open

            path = self.folder / self.shards[s]
            st = path.stat()
            key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
            if self.sha256[s] and key not in _HASHED:
                if sha256_file(path) != self.sha256[s]:
                    raise CacheError(f"{path}: sha256 differs from index.json; the shard is corrupted: delete it and "
                                     "its .json sidecar and rerun the dump (`draftheads cache verify` lists them all)")
                _HASHED.add(key)
            self._open[s] = safe_open(str(path), framework="pt")
        return self._open[s]

    def _check_ids(self, ids: torch.Tensor, s: int, first_row: int) -> torch.Tensor:
        """`ids` (n, T) of shard `s` from its row `first_row` on, when every id is inside the vocabulary."""
        bad = (ids < 0) | (ids >= self.vocab_size) if self.vocab_size else ids < 0
        if bad.any():
            row, pos = (int(x) for x in bad.nonzero()[0])
            raise CacheError(f"{self.folder / self.shards[s]}: row {first_row + row} holds token id "
                             f"{int(ids[row, pos])} at position {pos}, outside the verifier's vocabulary "
                             f"(0..{(self.vocab_size or 0) - 1}); the shard is corrupted: delete it and its .json "
                             "sidecar and rerun the dump")
        return ids

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(f"row {i} of {self.length} in {self.folder} ({self.split})")
        s = bisect.bisect_right(self.starts, i) - 1
        f, j = self._handle(s), i - self.starts[s]
        row = {key: f.get_slice(key)[j] for key in self.keys}
        self._check_ids(row["input_ids"].unsqueeze(0), s, j)
        if "argmax" in row:
            self._check_ids(row["argmax"].unsqueeze(0), s, j)
        return row

    def iter(self, batch_size: int = 1024, columns: tuple[str, ...] = ("input_ids", "loss_mask")):
        """Token columns shard by shard, as {key: (n, T)} (the `datasets.Dataset.iter` the trainers use)."""
        for s in range(len(self.shards)):
            f = self._handle(s)
            out = {key: f.get_tensor(key) for key in columns}
            if "input_ids" in out:
                self._check_ids(out["input_ids"], s, 0)
            yield out


def collate_cached(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Cached rows -> a batch: token columns as (B, T) int64 (as `data.batching.collate`), features stacked."""
    batch = {key: torch.stack([row[key] for row in rows]).long() for key in TOKEN_DTYPES}
    batch["position_ids"] = join_padding(batch["position_ids"], batch["attention_mask"])  # as `collate` does
    for key in rows[0].keys() - TOKEN_DTYPES.keys():
        batch[key] = torch.stack([row[key] for row in rows])  # final (B, T, H), layers (B, L, T, H)
    return batch


def cached_datasets(cfg, check_hash: bool = False) -> tuple[CachedRows, CachedRows]:
    """(train, held-out) rows of `cfg.feature_cache`, checked against the run's data settings and the shards."""
    folder = Path(cfg.feature_cache)
    index = read_index(folder)
    check_data(index, cfg, folder)
    verify_shards(folder, index, check_hash)
    return CachedRows(folder, index, "train"), CachedRows(folder, index, "eval")




# ---- CLI -----------------------------------------------------------------------------------------------------------
MOVED = ("`draftheads cache` checks a cache; `draftheads dump-features` fills one (same arguments; "
         "`accelerate launch -m draftheads.train.dump_features ...` for several processes)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftheads cache", description=__doc__.split("\n\n")[0], epilog=MOVED)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check every shard of a cache: size, header, sha256")
    v.add_argument("folder")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["dump"]:
        print(f"error: {MOVED}", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    try:
        index = read_index(args.folder)
        verify_shards(args.folder, index, check_hash=True)
    except CacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(len(index["splits"][s]["shards"]) for s in SPLITS)
    print(f"{args.folder}: {n} shards OK ({human(index['total_bytes'])}, {index['method']}, "
          f"verifier {index['verifier']['name']} {index['verifier']['fingerprint']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
