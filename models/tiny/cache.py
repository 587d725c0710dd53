"""Built once, kept current: `build` writes a model folder atomically, `ensure_built` keeps one per recipe in
the cache folder under a file lock and rebuilds it when the recipe or the builder changes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftheads.models.atomic import atomic_dir
from draftheads.models.tiny.pretrain import (
    _bar,
    _cpu_count,
    _deterministic_torch,
    _log,
    _quiet,
    bits_per_byte,
    pack_documents,
    train_model,
)
from draftheads.models.tiny.recipe import BUILD_INFO, BUILDER_VERSION, Recipe, get_recipe
from draftheads.models.tiny.tokenizer import train_tokenizer


# ---- build ------------------------------------------------------------------------------------------------------------
def build(recipe: str | Recipe, out: str | Path, seed: int = 0, device: str | torch.device = "cpu",
          **overrides) -> Path:
    """Train tokenizer + model for a recipe on `device` and write the HF folder `out` (atomically; replaces an
    earlier build).

    `overrides` replace recipe fields (tests use them for cheap builds). A CPU build is the same bit for bit on the
    same machine; a GPU build follows the same recipe and steps but not bit for bit (`_deterministic_torch`).
    Returns `out`.
    """
    from draftheads.data.stdlib import read_source, stdlib_files

    recipe = get_recipe(recipe, **overrides)
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()) and not (out / BUILD_INFO).is_file():
        raise FileExistsError(f"--out {str(out)!r} is a non-empty folder that is not a tiny verifier build; "
                              "pick an empty or new folder")
    begin = time.perf_counter()

    device = torch.device(device)
    with _deterministic_torch(_cpu_count(), device):
        verifier_files = stdlib_files("verifier")
        texts = [read_source(p) for p in _bar(verifier_files, desc="reading stdlib", unit="file", leave=False)]
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(texts[: recipe.tokenizer_files], recipe.vocab_size,
                                    recipe.max_position_embeddings)
        tokenizer_seconds = time.perf_counter() - t0
        train_texts = texts[: recipe.train_files]
        docs = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(train_texts, add_special_tokens=False)]
        stream = pack_documents(docs, tokenizer.eos_token_id)
        _log(f"tokenizer: {len(tokenizer)} tokens in {tokenizer_seconds:.1f}s; corpus {len(train_texts)} files, "
             f"{len(stream)} tokens, {sum(len(t.encode()) for t in train_texts) / len(stream):.2f} bytes/token")

        model, figures = train_model(recipe, tokenizer, stream, seed, device)

        held_out = {}
        if recipe.eval_files != 0:
            t0 = time.perf_counter()
            eval_texts = [read_source(p) for p in stdlib_files("eval")[: recipe.eval_files]]
            held_out = bits_per_byte(model, tokenizer, eval_texts, recipe.seq_len, recipe.eval_batch_size)
            held_out.update(files=len(eval_texts), seconds=round(time.perf_counter() - t0, 2))
        model = model.cpu()

    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, do_sample=False)
    info = {
        "recipe_name": recipe.name, "recipe_hash": recipe.digest(), "seed": seed, "recipe": dataclasses.asdict(recipe),
        "builder_version": BUILDER_VERSION,
        "corpus": {"python": sys.version.split()[0], "train_files": len(train_texts), "train_tokens": len(stream),
                   "tokenizer_files": len(texts[: recipe.tokenizer_files])},
        "figures": {**figures, "tokenizer_seconds": round(tokenizer_seconds, 2),
                    "total_seconds": round(time.perf_counter() - begin, 2)},
        "held_out": held_out,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "tokenizers": _version("tokenizers")},
    }
    with atomic_dir(out) as tmp:  # an older build there is replaced in one rename
        with _transformers_bars_off():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")  # written last: marks a finished build
    return out


@contextlib.contextmanager
def _transformers_bars_off():
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if _quiet():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def read_build_info(folder: str | Path) -> dict | None:
    """The build record of a tiny verifier folder, or None if there is none (or it is unreadable)."""
    try:
        return json.loads((Path(folder) / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def is_current(folder: str | Path, recipe: str | Recipe, seed: int | None = None) -> bool:
    """Whether `folder` holds a finished build of this exact recipe (and seed, unless seed is None)."""
    info = read_build_info(folder)
    return (bool(info) and info.get("recipe_hash") == get_recipe(recipe).digest()
            and (seed is None or info.get("seed") == seed) and (Path(folder) / "model.safetensors").is_file())


def cache_home(home: str | Path | None = None) -> Path:
    """Where embedded verifiers live: `home`, else $DRAFTHEADS_HOME, else ~/.cache/draftheads."""
    from draftheads.data.identity import draftheads_home

    return Path(home).expanduser() if home else draftheads_home()


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes, also if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_built(recipe: str | Recipe = "default", home: str | Path | None = None, seed: int | None = None,
                 force: bool = False) -> Path:
    """The built folder `<home>/<recipe name>`, building it first if it is missing or from another recipe.

    Safe for concurrent callers (pytest workers, accelerate ranks): one builds under a file lock, the rest wait and
    then find it; nobody sees a half-written folder. `seed=None` accepts a cached build of any seed (a new build
    uses seed 0); `force` rebuilds regardless. The build runs in a child process (`draftheads build-verifier`),
    so this process's torch thread settings are untouched.
    """
    r = get_recipe(recipe)
    folder = cache_home(home) / r.name
    if not force and is_current(folder, r, seed):
        return folder
    with _file_lock(folder.parent / f".{r.name}.lock"):
        if not force and is_current(folder, r, seed):  # built by another process while we waited
            return folder
        for stale in [*folder.parent.glob(f".{r.name}.tmp-*"), *folder.parent.glob(f".{r.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed build; we hold the lock
        seed = 0 if seed is None else seed
        _log(f"building the embedded verifier {r.name!r} (seed {seed}) into {folder}; this happens once")
        _build_in_child(r, folder, seed)
    return folder


def _build_in_child(recipe: Recipe, out: Path, seed: int) -> None:
    # libgomp's worker threads spin while they wait; on a shared machine that made training ~6x slower (measured),
    # sleeping costs little on a quiet one. It only takes effect before torch is imported: in the child's env.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    cmd = [sys.executable, "-m", "draftheads.models.tiny", "build", "--recipe-json", json.dumps(dataclasses.asdict(recipe)),
           "--out", str(out), "--seed", str(seed)]
    quiet = _quiet()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE if quiet else None, text=True)
    if proc.returncode != 0:
        detail = f":\n{proc.stderr[-3000:]}" if quiet else " (its error is printed above)"
        raise RuntimeError(f"building the embedded verifier {recipe.name!r} into {str(out)!r} failed with exit code "
                           f"{proc.returncode}{detail}")
    info = read_build_info(out) or {}
    _log(f"built {recipe.name!r} in {info.get('figures', {}).get('total_seconds', 0):.0f}s; held-out "
         f"{info.get('held_out', {}).get('bits_per_byte', float('nan')):.3f} bits per byte")
