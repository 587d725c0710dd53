"""A drafter folder on disk: `config.json` + `model.safetensors` (+ extra files), written atomically, read with
errors that name the file and key. Shared by every layout in this package:
  - the `draftheads` metadata block inside config.json (method, verifier name + fingerprint + shape, layer ids,
    engine layout, training summary, anything method-specific such as the Medusa tree);
  - the atomic write (models/atomic.py: a temporary folder renamed into place, so a crash never leaves half a
    drafter);
  - reads and key/shape checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from draftheads.models.atomic import atomic_dir

METADATA_KEY = "draftheads"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class DrafterFormatError(ValueError):
    """A drafter folder that is missing, corrupt or of the wrong kind; the message names the file or key."""


def metadata_block(method: str, verifier, **extra) -> dict:
    """The `draftheads` block: what produced this drafter and for which verifier (its shape, fingerprint and, for a
    verifier loaded from a folder, the sha256 of every file it is made of, which loading compares)."""
    from draftheads import __version__

    content = verifier.content() if hasattr(verifier, "content") else None
    return {"method": method, "version": __version__, "verifier": {**verifier.describe(), **(content or {})},
            **extra}


def write_drafter(folder: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor],
                 extra_files: dict[str, bytes | str] | None = None) -> Path:
    """Write config.json + model.safetensors (+ extra files) into `folder`, replacing it atomically."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:  # the last line of defence: a drafter with NaN or inf weights is never written
        raise DrafterFormatError(f"refusing to write {folder}: {len(bad)} of {len(tensors)} weights hold non-finite "
                                 f"values ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); the training "
                                 "diverged: lower train.lr and train again")
    with atomic_dir(folder) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(config, f, indent=2, sort_keys=False)
            f.write("\n")
        for name, content in (extra_files or {}).items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode() if isinstance(content, str) else content)
    return folder


def read_config(folder: str | os.PathLike) -> dict:
    """A drafter folder's config.json (ours or another trainer's); errors name the folder or file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DrafterFormatError(f"drafter folder {str(folder)!r} does not exist")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise DrafterFormatError(f"drafter folder {str(folder)!r} has no {CONFIG_NAME}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DrafterFormatError(f"{path}: not valid JSON ({err})") from None


def read_drafter(folder: str | os.PathLike, expect_method: str | tuple[str, ...] | None = None
                 ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a drafter folder: (config dict, tensors on CPU). Errors name the file and what was expected."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not weights_path.is_file():
        raise DrafterFormatError(f"drafter folder {str(folder)!r} has no {weights_path.name}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise DrafterFormatError(f"{weights_path}: corrupt or unreadable safetensors file ({err})") from None
    if expect_method is not None:
        method = read_metadata(config, config_path).get("method")
        allowed = (expect_method,) if isinstance(expect_method, str) else expect_method
        if method not in allowed:
            raise DrafterFormatError(
                f"{config_path}: drafter method is {method!r}, expected {' or '.join(map(repr, allowed))}")
    return config, tensors


def read_metadata(config: dict, where: str | os.PathLike = CONFIG_NAME) -> dict:
    block = config.get(METADATA_KEY)
    if not isinstance(block, dict):
        raise DrafterFormatError(
            f"{where}: no `{METADATA_KEY}` block; this folder was not written by draftheads (or was edited)")
    return block


def require_keys(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Check a state dict has exactly the expected keys and shapes; names the first key that differs."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise DrafterFormatError(f"{where}: missing weight {missing[0]!r} (and {len(missing) - 1} more)"
                                 if len(missing) > 1 else f"{where}: missing weight {missing[0]!r}")
    if unexpected:
        raise DrafterFormatError(f"{where}: unexpected weight {unexpected[0]!r}")
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise DrafterFormatError(
                f"{where}: weight {key!r} has shape {tuple(tensors[key].shape)}, expected {tuple(shape)}")
