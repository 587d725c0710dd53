"""The offline hidden-state cache: run the frozen verifier over a run's data once, train drafters from the files.

    python -m data.hidden_states dump --config configs/eagle3-tiny.yaml --out cache/eagle3-tiny
    accelerate launch -m data.hidden_states dump --config configs/llama3-8b-eagle3.yaml --out /data/cache   # N GPUs
    python -m data.hidden_states verify cache/eagle3-tiny            # sizes, headers and sha256 of every shard
    python train/eagle.py --config configs/eagle3-tiny.yaml --features=offline --feature_cache=cache/eagle3-tiny

The same YAML drives the dump and the training run: the dump parses it with the trainer's own config class, builds
the rows with `data.batching.build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)` (the rows training sees),
and stores per row what the method's loss reads from the verifier:

    every method   input_ids int32 (N, T), attention_mask int8 (N, T), loss_mask int8 (N, T)
                   final (N, T, H): the last post-norm hidden state
    eagle3         layers (N, 3, T, H): the inputs of the feature layers (`eagle.layer_ids`, default 2, L//2, L-3)

Logits are never stored: wherever a loss reads the verifier's distribution (Medusa `distill`, EAGLE-1's token loss,
EAGLE-3's targets over the draft vocabulary and its full-vocabulary argmax), it is `lm_head(final)`, which the
offline source recomputes with the verifier's own lm_head (the verifier is loaded, never run). That is exact,
H values per token instead of V, and keeps the cache independent of the draft vocabulary chosen at training time.

Layout of a cache folder: `{split}-{i:05d}.safetensors` shards of `rows_per_shard` rows (split `train` or `eval`),
each with a `{split}-{i:05d}.json` sidecar (rows, bytes, sha256) written after the shard was renamed into place
(a shard counts as done only with its sidecar and the size it records; everything is written tmp + rename), a
`plan.json` fixed at the first start (a restart with other settings is refused), and `index.json` written at the
end. Shard i of a split is done by process i % world_size, so `accelerate launch` splits the work by index.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "draftheads-hidden-states"
VERSION = 1
METHODS = ("medusa", "eagle1", "eagle3")
SPLITS = ("train", "eval")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKEN_DTYPES = {"input_ids": torch.int32, "attention_mask": torch.int8, "loss_mask": torch.int8}
#: Data settings that change which rows are built (num_proc only changes how fast).
DATA_KEYS = ("source", "format", "seq_len", "pack", "max_rows", "eval_rows", "strict", "chat_template")


class CacheError(ValueError):
    """A feature cache that cannot be used; the message names the file and what is wrong with it."""


# ---- sizes ---------------------------------------------------------------------------------------------------------
def bytes_per_token(hidden_size: int, num_layers: int, dtype: str) -> int:
    """Stored bytes per token: (1 + layers) feature vectors of H values, plus input_ids (4) and two masks (1 + 1)."""
    return (1 + num_layers) * hidden_size * DTYPES[dtype].itemsize + 6


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def expected_shapes(index: dict, rows: int) -> dict[str, tuple[list[int], str]]:
    """{key: (shape, safetensors dtype)} of a shard with `rows` rows of this cache."""
    T, H, L = index["seq_len"], index["hidden_size"], len(index["layer_ids"])
    feat = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[index["dtype"]]
    shapes = {"input_ids": ([rows, T], "I32"), "attention_mask": ([rows, T], "I8"), "loss_mask": ([rows, T], "I8"),
              "final": ([rows, T, H], feat)}
    if L:
        shapes["layers"] = ([rows, L, T, H], feat)
    return shapes


def _atomic_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ---- what a run needs -----------------------------------------------------------------------------------------------
def method_of(cfg) -> str:
    """The cache method a trainer config implies: `medusa`, `eagle1` or `eagle3`."""
    if hasattr(cfg, "medusa"):
        return "medusa"
    if hasattr(cfg, "eagle"):
        return f"eagle{cfg.eagle.version}"
    raise CacheError(f"{type(cfg).__name__}: not a Medusa or EAGLE run config")


def layers_for(method: str, cfg, verifier) -> list[int]:
    """Feature layers a method reads besides the final hidden state (EAGLE-3: three; others: none)."""
    if method != "eagle3":
        return []
    ids = list(cfg.eagle.layer_ids) if cfg.eagle.layer_ids is not None else verifier.default_eagle3_layers()
    verifier.check_layer_ids(ids, key="eagle.layer_ids")
    return ids


def data_signature(cfg) -> dict:
    """What decides the rows: the data settings that build them and the seed that orders them."""
    data = dataclasses.asdict(cfg.data)
    return {**{k: data[k] for k in DATA_KEYS}, "seed": cfg.train.seed}


# ---- dump ----------------------------------------------------------------------------------------------------------
@dataclass
class DumpResult:
    """What a dump did (this process's part of it, plus the totals on the main process)."""

    folder: Path
    written: list[str]
    """Shard files this process wrote."""
    skipped: list[str]
    """Shard files this process found done and left alone."""
    estimate_bytes: int
    actual_bytes: int | None
    """Total size of all shards (main process, after all processes finished); None elsewhere."""


def dump(cfg, out: str | os.PathLike, method: str | None = None, dtype: str = "bfloat16", rows_per_shard: int = 256,
         batch_size: int | None = None, say=print) -> DumpResult:
    """Run the frozen verifier over the run's train and held-out rows and write the cache to `out` (see module doc).

    Works in one process or under `accelerate launch` (shard i by process i % world size). Shards already done are
    skipped, so rerunning the same command after a crash continues.
    """
    from accelerate import PartialState

    from data.batching import build_datasets
    from train.loop import load_verifier

    if dtype not in DTYPES:
        raise CacheError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    if rows_per_shard < 1:
        raise CacheError(f"rows_per_shard={rows_per_shard}: expected a positive count")
    implied = method_of(cfg)
    method = method or implied
    if method not in METHODS:
        raise CacheError(f"method={method!r}: expected one of {METHODS}")
    if method != implied:
        raise CacheError(f"--method {method} does not match the config, which trains {implied}; drop --method or "
                         "use the trainer config of that method")
    if method == "medusa" and cfg.medusa.joint:
        raise CacheError("medusa.joint=true (Medusa-2) trains through the verifier itself; there is nothing to cache")
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator reads `launch --cpu`
    main = state.is_main_process
    say = say if main else (lambda *a, **k: None)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)

    verifier, tokenizer = load_verifier(cfg, state.device)
    layer_ids = layers_for(method, cfg, verifier)
    datasets = dict(zip(SPLITS, build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)))
    plan = {"format": FORMAT, "version": VERSION, "method": method, "verifier": verifier.describe(),
            "verifier_dtype": cfg.verifier_dtype, "layer_ids": layer_ids, "dtype": dtype,
            "seq_len": cfg.data.seq_len, "hidden_size": verifier.hidden_size, "rows_per_shard": rows_per_shard,
            "rows": {split: len(ds) for split, ds in datasets.items()}, "data": data_signature(cfg)}
    plan_path = folder / "plan.json"
    if plan_path.is_file():
        before = json.loads(plan_path.read_text())
        changed = [k for k in plan if before.get(k) != plan[k]]
        if changed:
            k = changed[0]
            raise CacheError(f"{plan_path}: this cache was started with {k}={before.get(k)!r}, this dump has "
                             f"{k}={plan[k]!r}; use a new --out folder or delete {folder}")
    state.wait_for_everyone()
    if main:
        _atomic_json(plan_path, plan)

    per_token = bytes_per_token(verifier.hidden_size, len(layer_ids), dtype)
    tokens = sum(plan["rows"].values()) * cfg.data.seq_len
    estimate = per_token * tokens
    say(f"[dump] {method} features of {plan['rows']['train']} train + {plan['rows']['eval']} held-out rows x "
        f"{cfg.data.seq_len} tokens from {verifier.name} (H={verifier.hidden_size}, layers {layer_ids or 'final'}) "
        f"in {dtype}: {per_token} B/token x {tokens} tokens = {human(estimate)} estimated, into {folder}")

    micro = batch_size or cfg.train.batch_size
    written, skipped = [], []
    started = time.perf_counter()
    for split, ds in datasets.items():
        n_shards = -(-len(ds) // rows_per_shard)
        for s in range(state.process_index, n_shards, state.num_processes):
            name = shard_name(split, s)
            lo, hi = s * rows_per_shard, min(len(ds), (s + 1) * rows_per_shard)
            if _shard_done(folder, name, hi - lo):
                skipped.append(name)
                continue
            rows = ds[lo:hi]  # {key: (n, T)} int64 tensors
            tensors = _run_verifier(verifier, rows, layer_ids, DTYPES[dtype], micro)
            _write_shard(folder, name, tensors, hi - lo, plan)
            written.append(name)
            say(f"[dump] {name}: {hi - lo} rows ({time.perf_counter() - started:.0f} s)")
    state.wait_for_everyone()
    actual = None
    if main:
        index = write_index(folder, plan)
        actual = index["total_bytes"]
        say(f"[dump] done: {len(written)} shards written, {len(skipped)} already done; {human(actual)} on disk "
            f"({actual / max(estimate, 1):.3f} x the estimate of {human(estimate)}); index {folder / 'index.json'}")
    state.wait_for_everyone()
    return DumpResult(folder, written, skipped, estimate, actual)


def _shard_done(folder: Path, name: str, rows: int) -> bool:
    """Done = its sidecar exists (written after the shard's rename) and the shard has the recorded size and rows."""
    side, path = folder / name.replace(".safetensors", ".json"), folder / name
    if not side.is_file() or not path.is_file():
        return False
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError:
        return False
    return meta.get("rows") == rows and meta.get("bytes") == path.stat().st_size


@torch.no_grad()
def _run_verifier(verifier, rows: dict, layer_ids: list[int], dtype: torch.dtype, micro: int) -> dict:
    """One shard's tensors: token columns plus the verifier's features, computed micro-batch by micro-batch."""
    ids, attn = rows["input_ids"], rows["attention_mask"]
    finals, layers = [], []
    for i in range(0, len(ids), micro):
        b_ids = ids[i:i + micro].to(verifier.device)
        b_attn = attn[i:i + micro].to(verifier.device)
        feats = verifier.features(b_ids, attention_mask=b_attn, layer_ids=layer_ids)
        finals.append(feats.final.to("cpu", dtype))  # (b, T, H)
        if layer_ids:
            layers.append(torch.stack(feats.layers, dim=1).to("cpu", dtype))  # (b, L, T, H)
    out = {key: rows[key].to(TOKEN_DTYPES[key]).contiguous() for key in TOKEN_DTYPES}
    out["final"] = torch.cat(finals).contiguous()
    if layer_ids:
        out["layers"] = torch.cat(layers).contiguous()
    return out


def _write_shard(folder: Path, name: str, tensors: dict, rows: int, plan: dict) -> None:
    from safetensors.torch import save_file

    path = folder / name
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "fingerprint": plan["verifier"]["fingerprint"],
                                           "method": plan["method"], "rows": str(rows)})
    meta = {"file": name, "rows": rows, "bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
    os.replace(tmp, path)
    _atomic_json(folder / name.replace(".safetensors", ".json"), meta)


def write_index(folder: Path, plan: dict) -> dict:
    """index.json from the plan and the shard sidecars; every shard must be done."""
    splits, total = {}, 0
    for split in SPLITS:
        shards = []
        n_shards = -(-plan["rows"][split] // plan["rows_per_shard"])
        for s in range(n_shards):
            side = folder / shard_name(split, s).replace(".safetensors", ".json")
            if not side.is_file():
                raise CacheError(f"{side}: missing; shard {shard_name(split, s)} was not finished (rerun the dump)")
            meta = json.loads(side.read_text())
            shards.append(meta)
            total += meta["bytes"]
        splits[split] = {"rows": plan["rows"][split], "shards": shards}
    index = {**{k: v for k, v in plan.items() if k != "rows"}, "splits": splits,
             "bytes_per_token": bytes_per_token(plan["hidden_size"], len(plan["layer_ids"]), plan["dtype"]),
             "total_bytes": total}
    _atomic_json(folder / "index.json", index)
    return index


# ---- read ----------------------------------------------------------------------------------------------------------
def read_index(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    path = folder / "index.json"
    if not path.is_file():
        hint = " (a dump was started but not finished: rerun it)" if (folder / "plan.json").is_file() else ""
        raise CacheError(f"{path}: no such file; feature_cache must be a folder written by "
                         f"`python -m data.hidden_states dump`{hint}")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CacheError(f"{path}: not valid JSON ({err})") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CacheError(f"{path}: format {index.get('format')!r} version {index.get('version')!r}; expected "
                         f"{FORMAT!r} version {VERSION}")
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
    """The cached rows must be the rows this run would build: same data settings and seed."""
    mine = data_signature(cfg)
    for key, value in mine.items():
        if index["data"].get(key) != value:
            name = "train.seed" if key == "seed" else f"data.{key}"
            raise CacheError(
                f"{Path(folder) / 'index.json'}: the cache holds rows built with {name}={index['data'].get(key)!r}, "
                f"this run has {name}={value!r}; set it to the cache's value or dump again with this config")


class CachedRows(torch.utils.data.Dataset):
    """One split of a cache as a map-style dataset: row i -> {input_ids, attention_mask, loss_mask (T,), final
    (T, H), layers (L, T, H) when stored}. Shards are opened lazily (memory-mapped), per worker process."""

    def __init__(self, folder: str | os.PathLike, index: dict, split: str):
        self.folder, self.split = Path(folder), split
        self.shards = [meta["file"] for meta in index["splits"][split]["shards"]]
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

            self._open[s] = safe_open(str(self.folder / self.shards[s]), framework="pt")
        return self._open[s]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(f"row {i} of {self.length} in {self.folder} ({self.split})")
        s = bisect.bisect_right(self.starts, i) - 1
        f, j = self._handle(s), i - self.starts[s]
        return {key: f.get_slice(key)[j] for key in self.keys}

    def iter(self, batch_size: int = 1024, columns: tuple[str, ...] = ("input_ids", "loss_mask")):
        """Token columns shard by shard, as {key: (n, T)} (the `datasets.Dataset.iter` the trainers use)."""
        for s in range(len(self.shards)):
            f = self._handle(s)
            yield {key: f.get_tensor(key) for key in columns}


def collate_cached(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Cached rows -> a batch: token columns as (B, T) int64 (as `data.batching.collate`), features stacked."""
    batch = {key: torch.stack([row[key] for row in rows]).long() for key in TOKEN_DTYPES}
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
def _config_class(method: str | None, argv: list[str]):
    """The trainer's config class: from --method, else from the YAML's method section."""
    if method is None:
        import yaml

        path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"),
                    next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None))
        keys = set(yaml.safe_load(Path(path).read_text()) or {}) if path else set()
        method = "medusa" if "medusa" in keys else "eagle3" if "eagle" in keys else None
        if method is None:
            raise CacheError("cannot tell the method: pass --method medusa|eagle1|eagle3 or a trainer --config")
    if method == "medusa":
        from train.medusa import MedusaRunConfig

        return MedusaRunConfig
    from train.eagle import EagleRunConfig

    return EagleRunConfig


def main(argv: list[str] | None = None) -> int:
    from train.config import ConfigError, parse_config

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m data.hidden_states", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="run the verifier over a run config's data and write the cache "
                                    "(other arguments: --config FILE.yaml and the trainer's --key=value overrides)")
    d.add_argument("--method", choices=METHODS, help="default: what the config trains")
    d.add_argument("--out", help="cache folder (default: the config's feature_cache)")
    d.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="feature dtype on disk")
    d.add_argument("--rows_per_shard", type=int, default=256, help="rows per safetensors shard")
    d.add_argument("--batch_size", type=int, help="verifier micro-batch (default train.batch_size)")
    v = sub.add_parser("verify", help="check every shard of a cache: size, header, sha256")
    v.add_argument("folder")
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "verify":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            index = read_index(args.folder)
            verify_shards(args.folder, index, check_hash=True)
            n = sum(len(index["splits"][s]["shards"]) for s in SPLITS)
            print(f"{args.folder}: {n} shards OK ({human(index['total_bytes'])}, {index['method']}, "
                  f"verifier {index['verifier']['name']} {index['verifier']['fingerprint']})")
            return 0
        cfg = parse_config(_config_class(args.method, rest), rest, prog="python -m data.hidden_states dump")
        out = args.out or cfg.feature_cache
        if not out:
            raise CacheError("no output folder: pass --out DIR (or set feature_cache in the config)")
        dump(cfg, out, args.method, args.dtype, args.rows_per_shard, args.batch_size)
    except (CacheError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
