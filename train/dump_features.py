"""Fill an offline hidden-state cache: run the frozen verifier once over a training run's data and write what the
drafter's loss reads (format: data/hidden_states.py), so training can read files instead of running the verifier.

    draftheads dump-features --config configs/eagle3-tiny.yaml --out cache/eagle3-tiny
    accelerate launch -m draftheads.train.dump_features --config configs/llama3-8b-eagle3.yaml --out /data/cache   # N GPUs
    draftheads dump-features --config configs/eagle3-tiny.yaml --out cache/eagle3-tiny --backend vllm   # vLLM computes
    draftheads cache verify cache/eagle3-tiny            # sizes, headers and sha256 of every shard
    python train/eagle.py --config configs/eagle3-tiny.yaml --features=offline --feature_cache=cache/eagle3-tiny

The same YAML drives the dump and the training run: the dump parses it with the trainer's own config class and
builds the rows with `data.batching.build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)`, the rows training
sees. It works in one process or under `accelerate launch` (shard i by process i % world size, one index at the
end); shards already done are skipped, so rerunning the same command after a crash continues.

Two backends compute the features and write the same cache (the backend recorded in index.json): `hf`, the
verifier's Hugging Face forward in this process (the reference, default), and `vllm`, vLLM's
`extract_hidden_states` in vLLM's own environment (train/vllm_backend.py: which vLLM layer is which of ours, and
packed rows), one vLLM per process, `--tensor-parallel-size` GPUs each.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftheads.data.batching import build_datasets
from draftheads.data.documents import join_padding
from draftheads.data.hidden_states import (
    BACKENDS,
    FEATURE_DTYPES,
    FORMAT,
    METHODS,
    PADDINGS,
    SPLITS,
    TOKEN_DTYPES,
    VERSION,
    CacheError,
    bytes_per_token,
    data_signature,
    human,
    shard_done,
    shard_name,
    sidecar_name,
)
from draftheads.data.identity import data_inputs, input_changes, sha256_file
from draftheads.models.atomic import atomic_path, write_json
from draftheads.models.dtypes import to_dtype
from draftheads.models.outputs import OutputInTheWay, claim_output
from draftheads.models.verifier import folder_content, resolve_verifier
from draftheads.train.config import ConfigError, parse_config
from draftheads.train.placement import load_verifier
from draftheads.train.vllm_backend import VllmFeatures, aux_ids, start_capture

#: What a plan started before a key existed had (a cache started before backends were recorded was HF's, and joined
#: its padding).
PLAN_ADDED = {"backend": "hf", "padding": "joined", "argmax": False}
#: Methods whose caches store the verifier's argmax over the whole vocabulary (data/hidden_states.py): EAGLE-3 reads
#: it beside its draft vocabulary's logits, and with it a run holds only that vocabulary's rows of lm_head; DFlash
#: scores its blocks against it instead of a (positions, V) product of lm_head a step.
ARGMAX_METHODS = ("eagle3", "dflash")


# ---- what a run needs ----------------------------------------------------------------------------------------------
def method_of(cfg) -> str:
    """The cache method a trainer config implies: `medusa`, `eagle1`, `eagle3` or `dflash`."""
    if hasattr(cfg, "medusa"):
        return "medusa"
    if hasattr(cfg, "dflash"):
        return "dflash"
    if hasattr(cfg, "eagle"):
        return f"eagle{cfg.eagle.version}"
    raise CacheError(f"{type(cfg).__name__}: not a Medusa or EAGLE run config")


def layers_for(method: str, cfg, verifier) -> list[int]:
    """Feature layers a method reads besides the final hidden state (EAGLE-3: three; DFlash: its target layers'
    outputs, i.e. the inputs of layers id + 1; others: none)."""
    if method == "dflash":
        ids = [i + 1 for i in cfg.dflash.resolve(verifier.config).target_layer_ids]
        verifier.check_layer_ids(ids, key="dflash.target_layer_ids (+1)")
        return ids
    if method != "eagle3":
        return []
    ids = list(cfg.eagle.layer_ids) if cfg.eagle.layer_ids is not None else verifier.default_eagle3_layers()
    verifier.check_layer_ids(ids, key="eagle.layer_ids")
    return ids


# ---- the dump ----------------------------------------------------------------------------------------------------------
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
         batch_size: int | None = None, say=print, backend: str = "hf", tensor_parallel_size: int = 1,
         padding: str = "joined", engine=None, loaded: tuple | None = None) -> DumpResult:
    """Run the frozen verifier over the run's train and held-out rows and write the cache to `out` (see module doc).

    Works in one process or under `accelerate launch` (shard i by process i % world size). Shards already done are
    skipped, so rerunning the same command after a crash continues. `backend`: "hf" (this process's forward) or
    "vllm" (vLLM's extract_hidden_states, `tensor_parallel_size` devices per process). `padding`: what a row's
    right padding holds (data/hidden_states.py; "zeros" with vllm only). `engine`: a started vLLM capture engine to
    use (the caller's, left running), else one is started at the first shard to compute; `loaded`: the verifier
    (head only with vllm) and tokenizer already loaded for this config.
    """
    from accelerate import PartialState

    if backend not in BACKENDS:
        raise CacheError(f"backend={backend!r}: expected one of {BACKENDS}")
    if tensor_parallel_size < 1 or (tensor_parallel_size > 1 and backend != "vllm"):
        raise CacheError(f"tensor_parallel_size={tensor_parallel_size}: expected 1, or more with backend vllm")

    if dtype not in FEATURE_DTYPES:
        raise CacheError(f"dtype={dtype!r}: expected one of {sorted(FEATURE_DTYPES)}")
    if rows_per_shard < 1:
        raise CacheError(f"rows_per_shard={rows_per_shard}: expected a positive count")
    if padding not in PADDINGS or (padding != "joined" and backend != "vllm"):
        raise CacheError(f"padding={padding!r}: expected 'joined', or one of {PADDINGS} with backend vllm")
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

    plan_path = folder / "plan.json"
    before = json.loads(plan_path.read_text()) if plan_path.is_file() else {}
    # What the dump reads, by content (data/identity.py), before anything is loaded: a restart on changed inputs stops.
    known = before.get("inputs") or {}
    folder_of_verifier = resolve_verifier(cfg.verifier)
    inputs = {"verifier": {"source": cfg.verifier,
                           **folder_content(folder_of_verifier, (known.get("verifier") or {}).get("files"))},
              **data_inputs(cfg.data, known)}
    if before.get("inputs"):
        changed = input_changes(before["inputs"], inputs)
        if changed:
            raise CacheError(f"{plan_path}: this cache was started from other inputs ({'; '.join(changed)}); use a "
                             f"new --out folder or delete {folder}")
    # vLLM holds the verifier on the device; this process reads only its head (shape, fingerprint, final norm)
    verifier, tokenizer = loaded or load_verifier(cfg, "cpu" if backend == "vllm" else state.device,
                                                  head_only=backend == "vllm")
    if cfg.data.pack and cfg.data.document_mask and backend == "hf":
        verifier.check_document_mask()  # one short forward: refuse a model that would attend across documents
    layer_ids = layers_for(method, cfg, verifier)
    datasets = dict(zip(SPLITS, build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)))
    # a resumed dump goes on as it started: a version 2 plan (no argmax) as one, a plan without the argmax (a DFlash
    # cache begun before DFlash's stored it) without it: its shards lack the argmax
    old = bool(before) and before.get("version") == 2
    plan = {"format": FORMAT, "version": 2 if old else VERSION, "method": method, "verifier": verifier.describe(),
            "verifier_dtype": cfg.verifier_dtype, "layer_ids": layer_ids, "dtype": dtype,
            "seq_len": cfg.data.seq_len, "hidden_size": verifier.hidden_size, "rows_per_shard": rows_per_shard,
            "rows": {split: len(ds) for split, ds in datasets.items()}, "data": data_signature(cfg), "inputs": inputs,
            "backend": backend, "padding": padding,
            "argmax": bool(before.get("argmax")) if before else method in ARGMAX_METHODS}
    if before:
        was = {**PLAN_ADDED, **before}
        changed = [k for k in plan if k != "inputs" and was.get(k) != plan[k]]
        if changed:
            k = changed[0]
            raise CacheError(f"{plan_path}: this cache was started with {k}={was.get(k)!r}, this dump has "
                             f"{k}={plan[k]!r}; use a new --out folder or delete {folder}")
        if method in ARGMAX_METHODS and not plan["argmax"] and main:
            say(f"[dump] {folder}: begun by an older version without the verifier's argmax, it goes on without it "
                "(a run on it computes the argmax from lm_head a step); a new --out folder stores it")
    if backend == "vllm":
        from draftheads.eval.interop.vllm_peer import vllm_python

        vllm_python()  # no vLLM: say how to set it up before anything is written
    state.wait_for_everyone()
    if main:
        write_json(plan_path, plan)

    per_token = bytes_per_token(verifier.hidden_size, len(layer_ids), dtype, plan["argmax"])
    tokens = sum(plan["rows"].values()) * cfg.data.seq_len
    estimate = per_token * tokens
    say(f"[dump] {method} features of {plan['rows']['train']} train + {plan['rows']['eval']} held-out rows x "
        f"{cfg.data.seq_len} tokens from {verifier.name} (H={verifier.hidden_size}, layers {layer_ids or 'final'}) "
        f"in {dtype}: {per_token} B/token x {tokens} tokens = {human(estimate)} estimated, into {folder}")

    micro = batch_size or cfg.train.batch_size
    written, skipped = [], []
    started = time.perf_counter()
    # vLLM: the caller's (left running), else ours, started at the first shard to compute (a finished cache costs
    # no start)
    own_engine = engine is None
    head = None  # the lm_head the argmax is computed with, placed at the first shard that needs it
    try:
        for split, ds in datasets.items():
            n_shards = -(-len(ds) // rows_per_shard)
            for s in range(state.process_index, n_shards, state.num_processes):
                name = shard_name(split, s)
                lo, hi = s * rows_per_shard, min(len(ds), (s + 1) * rows_per_shard)
                if shard_done(folder, name, hi - lo):
                    skipped.append(name)
                    continue
                rows = ds[lo:hi]  # {key: (n, T)} int64 tensors
                if backend == "vllm":
                    if engine is None:
                        engine = _start_vllm(cfg, verifier, layer_ids, folder, state, tensor_parallel_size, say)
                    tensors = VllmFeatures(engine, verifier, layer_ids, to_dtype(dtype), padding)(rows)
                else:
                    tensors = _run_verifier(verifier, rows, layer_ids, to_dtype(dtype), micro)
                if plan["argmax"]:
                    if head is None:
                        head = _ArgmaxHead(verifier, _argmax_device(verifier, state, backend, tensor_parallel_size),
                                           say)
                    tensors["argmax"] = head(tensors["final"])
                _write_shard(folder, name, tensors, hi - lo, plan)
                written.append(name)
                say(f"[dump] {name}: {hi - lo} rows ({time.perf_counter() - started:.0f} s)")
    finally:
        if engine is not None and own_engine:
            close_engine(engine)
    state.wait_for_everyone()
    actual = None
    if main:
        index = write_index(folder, plan)
        actual = index["total_bytes"]
        say(f"[dump] done: {len(written)} shards written, {len(skipped)} already done; {human(actual)} on disk "
            f"({actual / max(estimate, 1):.3f} x the estimate of {human(estimate)}); index {folder / 'index.json'}")
    state.wait_for_everyone()
    return DumpResult(folder, written, skipped, estimate, actual)


def _start_vllm(cfg, verifier, layer_ids, folder: Path, state, tensor_parallel_size: int, say):
    """This process's vLLM capture engine; under `accelerate launch` on GPUs, process i gets its own devices."""
    env = {}
    if state.num_processes > 1 and torch.cuda.is_available():
        first = state.local_process_index * tensor_parallel_size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(tensor_parallel_size))
    t0 = time.perf_counter()
    engine = start_capture(cfg, verifier, layer_ids, folder / ".vllm-states" / str(state.process_index),
                           tensor_parallel_size, env)
    say(f"[dump] vLLM {engine.version} started in {time.perf_counter() - t0:.0f} s (extract_hidden_states, aux "
        f"layers {aux_ids(layer_ids, verifier.num_layers)})")
    return engine


def _argmax_device(verifier, state, backend: str, tensor_parallel_size: int) -> torch.device:
    """Where a shard's argmax is computed: the verifier's device (hf); with vllm, whose process reads the head on the
    CPU, the first GPU of this process's engine (`_start_vllm`) on a GPU machine, else the CPU."""
    if backend != "vllm":
        return verifier.device
    if state.device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", state.local_process_index * tensor_parallel_size if state.num_processes > 1 else 0)


class _ArgmaxHead:
    """The verifier's argmax of lm_head(final) for a shard (`Verifier.head_argmax`) on `device` (`_argmax_device`):
    with the vLLM backend the verifier's head is read on the CPU, and on a GPU machine a copy of lm_head goes to the
    GPU beside vLLM (the product is V x H a token, 0.5 GFLOP at Llama-3's vocabulary). A GPU without room for it:
    the CPU, said once."""

    def __init__(self, verifier, device, say=print):
        self.verifier, self.say = verifier, say
        self.weight = verifier.lm_head.weight
        if torch.device(device) != self.weight.device:
            try:
                self.weight = self.weight.to(device)
            except torch.OutOfMemoryError:
                say(f"[dump] no room for a copy of lm_head on {device}: the argmax runs on {self.weight.device}")

    def __call__(self, final: torch.Tensor) -> torch.Tensor:
        try:
            return self.verifier.head_argmax(final, weight=self.weight)
        except torch.OutOfMemoryError:
            self.say(f"[dump] out of memory for the argmax on {self.weight.device}: computed on the CPU from here on")
            self.weight = self.verifier.lm_head.weight.to("cpu")
            return self.verifier.head_argmax(final, weight=self.weight)


@torch.no_grad()
def _run_verifier(verifier, rows: dict, layer_ids: list[int], dtype: torch.dtype, micro: int) -> dict:
    """One shard's tensors: token columns plus the verifier's features, computed micro-batch by micro-batch."""
    ids, attn, positions = rows["input_ids"], rows["attention_mask"], rows["position_ids"]
    finals, layers = [], []
    for i in range(0, len(ids), micro):
        b_ids = ids[i:i + micro].to(verifier.device)
        b_attn = attn[i:i + micro].to(verifier.device)
        # packed rows: restarting per document; the padding joins the last one (the causal fast path)
        b_pos = join_padding(positions[i:i + micro].to(verifier.device), b_attn)
        feats = verifier.features(b_ids, attention_mask=b_attn, layer_ids=layer_ids, position_ids=b_pos)
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

    with atomic_path(folder / name) as tmp:
        # One metadata entry: safetensors writes a map of several in no fixed order, and the same dump must give the
        # same bytes (caches are compared by hash).
        meta = json.dumps({"fingerprint": plan["verifier"]["fingerprint"], "method": plan["method"], "rows": rows},
                          sort_keys=True)
        save_file(tensors, str(tmp), metadata={FORMAT: meta})
        meta = {"file": name, "rows": rows, "bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
    write_json(folder / sidecar_name(name), meta)  # after the rename: the shard counts as done from here on


def close_engine(engine) -> None:
    """Stop a vLLM capture engine and remove its hidden-state files; the last process out removes their folder."""
    engine.close()
    shutil.rmtree(engine.storage, ignore_errors=True)
    with contextlib.suppress(OSError):
        engine.storage.parent.rmdir()


def write_index(folder: Path, plan: dict) -> dict:
    """index.json from the plan and the shard sidecars; every shard must be done."""
    splits, total = {}, 0
    for split in SPLITS:
        shards = []
        n_shards = -(-plan["rows"][split] // plan["rows_per_shard"])
        for s in range(n_shards):
            side = folder / sidecar_name(shard_name(split, s))
            if not side.is_file():
                raise CacheError(f"{side}: missing; shard {shard_name(split, s)} was not finished (rerun the dump)")
            meta = json.loads(side.read_text())
            shards.append(meta)
            total += meta["bytes"]
        splits[split] = {"rows": plan["rows"][split], "shards": shards}
    index = {**{k: v for k, v in plan.items() if k != "rows"}, "splits": splits,
             "bytes_per_token": bytes_per_token(plan["hidden_size"], len(plan["layer_ids"]), plan["dtype"],
                                                plan.get("argmax", False)),
             "total_bytes": total}
    write_json(folder / "index.json", index)
    return index


# ---- CLI -----------------------------------------------------------------------------------------------------------
def config_class(method: str | None, argv: list[str]):
    """The trainer's config class: from --method, else from the YAML's method section."""
    if method is None:
        import yaml

        path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"),
                    next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None))
        if path and not Path(path).is_file():
            raise CacheError(f"--config {path}: no such file")
        keys = set(yaml.safe_load(Path(path).read_text()) or {}) if path else set()
        method = ("medusa" if "medusa" in keys else "eagle3" if "eagle" in keys else "dflash" if "dflash" in keys
                  else None)
        if method is None:
            raise CacheError("cannot tell the method: pass --method medusa|eagle1|eagle3|dflash or a trainer --config")
    if method == "medusa":
        from draftheads.train.medusa import MedusaRunConfig

        return MedusaRunConfig
    if method == "dflash":
        from draftheads.train.dflash import DFlashRunConfig

        return DFlashRunConfig
    from draftheads.train.eagle import EagleRunConfig

    return EagleRunConfig


def parser() -> argparse.ArgumentParser:
    """The verb's own flags; the rest of the command line is the trainer's config (`parse_config`)."""
    p = argparse.ArgumentParser(prog="draftheads dump-features", description=__doc__.split("\n\n")[0],
                                epilog="Other arguments: --config FILE.yaml and the trainer's --key=value "
                                       "overrides (the run the cache is for).")
    p.add_argument("--method", choices=METHODS, help="default: what the config trains")
    p.add_argument("--out", help="cache folder (default: the config's feature_cache)")
    p.add_argument("--dtype", choices=sorted(FEATURE_DTYPES), default="bfloat16", help="feature dtype on disk")
    p.add_argument("--rows-per-shard", "--rows_per_shard", dest="rows_per_shard", type=int, default=256, help="rows per safetensors shard")
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, help="verifier micro-batch (default train.batch_size)")
    p.add_argument("--backend", choices=BACKENDS, default="hf",
                   help="what computes the features: hf (this process's forward, the reference) or vllm (vLLM's "
                        "extract_hidden_states in .venv-vllm: bash scripts/setup_vllm.sh)")
    p.add_argument("--tensor-parallel-size", "--tensor_parallel_size", dest="tensor_parallel_size", type=int,
                   default=1, help="vllm backend: devices per vLLM process")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["dump"]:  # the old `python -m draftheads.data.hidden_states dump ...` spelling, with the module swapped
        argv = argv[1:]
    args, rest = parser().parse_known_args(argv)
    from draftheads.eval.interop.vllm_data import VllmError
    from draftheads.eval.interop.vllm_peer import VllmUnavailable
    from draftheads.train.cli import user_errors

    try:
        cfg = parse_config(config_class(args.method, rest), rest, prog="draftheads dump-features")
        out = args.out or cfg.feature_cache
        if not out:
            raise CacheError("no output folder: pass --out DIR (or set feature_cache in the config)")
        claim_output(out, "cache", "--out" if args.out else "feature_cache")
        dump(cfg, out, args.method, args.dtype, args.rows_per_shard, args.batch_size, backend=args.backend,
             tensor_parallel_size=args.tensor_parallel_size)
        # as train/cli.py main_guard does after a run: the accelerator's process-group threads are freed while the
        # interpreter is whole, not during its exit (where a 2-process gloo run sometimes aborted after finishing)
        gc.collect()
    except (CacheError, ConfigError, OutputInTheWay, VllmUnavailable, VllmError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except user_errors() as err:  # a verifier or data file that cannot be used
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped by SIGINT (Ctrl-C): the shards written so far are complete; rerunning the same command "
              "continues", file=sys.stderr)
        return 130
    except OSError as err:  # a full disk, a folder that cannot be written
        where = f" ({err.filename})" if err.filename else ""
        print(f"error: {err.strerror or err}{where}; the shards already written are complete, and rerunning the same "
              "command continues", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
