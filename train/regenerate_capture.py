"""Regenerate and capture in one pass: vLLM answers a source's rows, then captures the verifier's hidden states of the
training rows built from those answers, in one engine, so the verifier runs over each answer once.

    draftheads regenerate --backend vllm --source sharegpt.json --out regen.jsonl --max-new-tokens 512 \\
        --capture cache/regen --config configs/llama3-8b-eagle3.yaml --data.source=regen.jsonl
    python train/eagle.py --config configs/llama3-8b-eagle3.yaml --data.source=regen.jsonl --features=offline \\
        --feature_cache=cache/regen

One vLLM engine does both, with `extract_hidden_states` and vLLM's prefix cache on: the captured states live in a
cache-only layer's KV blocks, so the blocks a conversation filled while its answers were generated are served again
when the training row holding it is captured, and are not computed twice. Only whole blocks are shared, so they are
small: BLOCK_SIZE tokens, the CPU build's smallest preferred size (its default is 128). On tiny-micro's stdlib rows of
~190 tokens the prefix cache served 83% of the captured tokens with 32-token blocks, 66% with 128; a row shorter than
a block shares none. The training rows are built from --out by the trainer's own data code once every answer is
written (as `dump-features` builds them, then written by its machinery: shards, sidecars, plan.json, index.json); a
row's right padding is not run and is stored as zeros (`padding: zeros` in index.json; no loss reads it).

--config (plus the trainer's --key=value overrides, --verifier among them) is the training run the cache is for, and
must agree with this command: its verifier answers, its data.source is --out, its verifier_dtype is --dtype.
DIR/regenerate.json records the settings, the inputs by content, and how far the answers got (source rows answered,
the bytes of DIR/regenerated.jsonl.partial kept, the next request seed); rerunning the same command after a crash
continues from there to the same --out and cache (shards already captured are kept); a rerun with other settings or
inputs is refused, naming what differs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from draftheads.data.hidden_states import CacheError, data_signature
from draftheads.data.identity import data_inputs, input_changes, sha256_file
from draftheads.data.progress import EtaBar, quiet
from draftheads.data.sources import load_source
from draftheads.models.atomic import atomic_path, write_json
from draftheads.models.outputs import CACHE_REGENERATE

RECORD = CACHE_REGENERATE
PARTIAL = "regenerated.jsonl.partial"
RECORD_FORMAT = "draftheads-regenerate-capture"
#: Tokens per KV block: the prefix cache shares whole blocks only (module docstring).
BLOCK_SIZE = 32
#: The flag (or config key) each recorded setting comes from, for the refusal of a rerun that differs.
SETTING_NAMES = {"out": "--out", "format": "--format", "num_rows": "--num-rows", "max_new_tokens": "--max-new-tokens",
                 "batch_size": "--batch-size", "temperature": "--temperature", "prefix_tokens": "--prefix-tokens",
                 "chat_template": "--chat-template", "seed": "--seed", "strict": "--strict", "dtype": "--dtype",
                 "capture_dtype": "--capture-dtype", "rows_per_shard": "--rows-per-shard", "method": "the method"}


def check_config(cfg, verifier_folder: Path, out: Path, dtype: str) -> None:
    """The training config must be this command's: CacheError naming the key that is not."""
    from draftheads.models.verifier import resolve_verifier

    if cfg.verifier != str(verifier_folder) and resolve_verifier(cfg.verifier).resolve() != verifier_folder.resolve():
        raise CacheError(f"--config: verifier={cfg.verifier!r} is not --verifier {str(verifier_folder)!r}; the cache "
                         "must hold the states of the verifier that answers (drop --verifier, or set it alike)")
    if Path(cfg.data.source).expanduser().resolve() != out.expanduser().resolve():
        raise CacheError(f"--config: data.source={cfg.data.source!r} is not --out {str(out)!r}; the run trains on the "
                         f"rows this command writes: add --data.source={out}")
    if cfg.verifier_dtype != dtype:
        raise CacheError(f"--config: verifier_dtype={cfg.verifier_dtype} but --dtype {dtype}; the cache holds the "
                         f"states of the verifier run in --dtype: set both alike")


def settings(args, cfg, dtype: str) -> dict:
    """What decides the answers and the cache, as regenerate.json records it."""
    from draftheads.train.dump_features import method_of

    return {"out": str(Path(args.out).expanduser().resolve()), "format": args.format, "num_rows": args.num_rows,
            "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "temperature": args.temperature,
            "prefix_tokens": args.prefix_tokens, "chat_template": args.chat_template, "seed": args.seed,
            "strict": args.strict, "dtype": dtype, "capture_dtype": args.capture_dtype,
            "rows_per_shard": args.rows_per_shard, "method": method_of(cfg), "data": data_signature(cfg)}


def setting_change(before: dict, now: dict) -> str | None:
    """The first recorded setting that differs, as 'NAME=old, this run has NAME=new'; None when all agree."""
    for key, value in now.items():
        was = before.get(key)
        if key == "data":
            for k, v in value.items():
                if (was or {}).get(k) != v:
                    name = "train.seed" if k == "seed" else f"data.{k}"
                    return f"{name}={(was or {}).get(k)!r}, this run has {name}={v!r}"
        elif was != value:
            name = SETTING_NAMES.get(key, key)
            return f"{name} {was!r}, this run has {name} {value!r}"
    return None


def inputs_of(verifier_folder: Path, args, known: dict | None = None) -> dict:
    """The verifier's and the source's files by content (data/identity.py), keyed by the flag that names them."""
    from draftheads.models.verifier import folder_content

    known = known or {}
    found = data_inputs(SimpleNamespace(source=args.source, chat_template=args.chat_template),
                        {"data": known.get("--source"), "chat_template": known.get("--chat-template")})
    out = {"--verifier": {"source": str(verifier_folder),
                          **folder_content(verifier_folder, (known.get("--verifier") or {}).get("files"))},
           "--source": found["data"]}
    if "chat_template" in found:
        out["--chat-template"] = found["chat_template"]
    return out


def new_record(now: dict, inputs: dict) -> dict:
    """DIR/regenerate.json of a capture that has answered nothing yet."""
    return {"format": RECORD_FORMAT, "settings": now, "inputs": inputs,
            "answered": {"rows": 0, "bytes": 0, "written": 0, "seed": now["seed"], "skipped": {}}, "out": None}


def earlier_record(folder: Path, now: dict, inputs: dict) -> dict | None:
    """DIR/regenerate.json when an earlier start wrote it with these settings and inputs (None when there is none);
    CacheError naming what differs otherwise."""
    path = folder / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CacheError(f"{path}: not valid JSON ({err}); delete {folder} to start again") from None
    if record.get("format") != RECORD_FORMAT:
        raise CacheError(f"{path}: not a `regenerate --capture` record; use a new --capture folder")
    change = setting_change(record["settings"], now)
    if change:
        raise CacheError(f"{path}: this capture was started with {change}; rerun it as it was, or use a new --capture "
                         f"folder (or delete {folder})")
    changed = input_changes(record["inputs"], inputs)
    if changed:
        raise CacheError(f"{path}: this capture was started from other inputs ({'; '.join(changed)}); use a new "
                         f"--capture folder (or delete {folder})")
    return record


@dataclass
class CaptureResult:
    """What one `regenerate --capture` did."""

    rows: int
    """Rows in --out."""
    answered: int
    """Source rows answered by this process (the rest by an earlier one)."""
    shards_written: list[str]
    shards_skipped: list[str]
    captured_tokens: int
    """Tokens this process's capture requests held, and how many of them vLLM's prefix cache served."""
    cached_tokens: int
    skipped: dict


def run(args, cfg, verifier_folder: Path, dtype: str, answer, say=print) -> CaptureResult:
    """Answer the source into args.out and capture the training rows' states into args.capture (module docstring).
    `args`: `draftheads regenerate`'s parsed flags; `cfg`: the training run's config; `dtype`: the verifier's;
    `answer(generator, rows, stats)`: the rows written for source `rows` (train/regenerate.py's `regenerate` with
    the flags' settings), skips counted in the Counter `stats`."""
    from draftheads.eval.interop.vllm_data import VllmEngine
    from draftheads.eval.interop.vllm_peer import vllm_python
    from draftheads.models.outputs import claim_output
    from draftheads.train.dump_features import close_engine, dump, layers_for, method_of
    from draftheads.train.placement import load_verifier
    from draftheads.train.vllm_backend import VllmGenerator, aux_ids

    folder, out = Path(args.capture), Path(args.out)
    check_config(cfg, verifier_folder, out, dtype)
    claim_output(folder, "cache", "--capture")
    now = settings(args, cfg, dtype)
    inputs = inputs_of(verifier_folder, args, _recorded_inputs(folder))
    record = earlier_record(folder, now, inputs)
    done = record and record["out"]
    if done and (not out.is_file() or sha256_file(out) != done["sha256"]):
        raise CacheError(f"--out {out}: not the rows this capture wrote (sha256 {done['sha256'][:8]} in "
                         f"{folder / RECORD}); put them back, or delete {folder} to start again")
    vllm_python()  # no vLLM: say how to set it up before anything is loaded
    verifier, tokenizer = load_verifier(cfg, "cpu", head_only=True)  # vLLM holds the verifier; this, its head
    layer_ids = layers_for(method_of(cfg), cfg, verifier)
    context = json.loads((verifier_folder / "config.json").read_text()).get("max_position_embeddings")
    max_model_len = args.max_model_len or context or 2048
    if max_model_len < cfg.data.seq_len + 1:
        raise CacheError(f"--config: data.seq_len={cfg.data.seq_len} does not fit vLLM's context of {max_model_len} "
                         "tokens (--max-model-len) with the one token a capture generates")
    if record is None:  # written once what can be refused without vLLM was: the folder is this command's from here
        record = new_record(now, inputs)
        write_json(folder / RECORD, record)
    storage = folder / ".vllm-states" / "0"  # where dump-features' own engine puts them
    engine = None  # with the answers all written, dump-features starts one if a shard is left to capture
    answered_here = 0
    try:
        if not done:
            engine = VllmEngine(verifier_folder, dtype=dtype, max_model_len=max_model_len,
                                capture_layers=aux_ids(layer_ids, verifier.num_layers), storage=storage,
                                tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, prefix_caching=True,
                                block_size=BLOCK_SIZE).start()
            say(f"[regenerate] vLLM {engine.version} started in {engine.start_s:.0f} s (answers, then the states "
                f"of layers {aux_ids(layer_ids, verifier.num_layers)})")
            generator = VllmGenerator(engine, max_model_len, record["answered"]["seed"])
            answered_here = _answer(args, record, folder, out, generator, answer)
        (folder / PARTIAL).unlink(missing_ok=True)
        if not record["out"]["rows"]:
            skipped = record["answered"]["skipped"]
            why = "; ".join(f"{n} {what}" for what, n in skipped.items()) or "the source has no rows"
            raise CacheError(f"--out {out}: no rows were answered ({why}); nothing to capture")
        result = dump(cfg, folder, dtype=args.capture_dtype, rows_per_shard=args.rows_per_shard, say=say,
                      backend="vllm", tensor_parallel_size=args.tensor_parallel_size, padding="zeros",
                      engine=engine, loaded=(verifier, tokenizer))
    finally:
        if engine is not None:
            close_engine(engine)
    used = engine or SimpleNamespace(captured_tokens=0, cached_tokens=0)
    return CaptureResult(record["out"]["rows"], answered_here, result.written, result.skipped,
                         used.captured_tokens, used.cached_tokens, record["answered"]["skipped"])


def _answer(args, record: dict, folder: Path, out: Path, generator, answer) -> int:
    """Answer the source rows not answered yet, --batch-size at a time, each batch appended to the partial file and
    counted in the record; then the whole onto --out. Returns the source rows answered here."""
    rows = load_source(args.source, args.format, args.strict)
    if args.num_rows is not None:
        rows = rows.select(range(min(args.num_rows, len(rows))))
    partial, answered = folder / PARTIAL, record["answered"]
    with partial.open("ab") as f:  # what the record counts: a crash between an append and the record left more
        f.truncate(answered["bytes"])
    first = answered["rows"]
    bar = EtaBar(total=len(rows), initial=first, desc="regenerating", unit="row", disable=quiet())
    for start in range(first, len(rows), args.batch_size):
        batch = rows.select(range(start, min(start + args.batch_size, len(rows))))
        skipped: Counter = Counter(answered["skipped"])
        new = list(answer(generator, batch, skipped))
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in new).encode()
        with partial.open("ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        answered.update(rows=start + len(batch), bytes=answered["bytes"] + len(data),
                        written=answered["written"] + len(new), seed=generator.seed, skipped=dict(skipped))
        write_json(folder / RECORD, record)
        bar.update(len(batch))
    bar.close()
    with atomic_path(out) as tmp:
        shutil.copyfile(partial, tmp)
    record["out"] = {"rows": answered["written"], "sha256": sha256_file(out)}
    write_json(folder / RECORD, record)
    return len(rows) - first


def _recorded_inputs(folder: Path) -> dict | None:
    """The inputs an earlier start recorded (files whose size and mtime are unchanged are not hashed again)."""
    try:
        return json.loads((folder / RECORD).read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        return None




