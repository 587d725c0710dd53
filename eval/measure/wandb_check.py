"""wandb settled before anything loads: which mode a run logs in, and where wandb may write.

    mode, notes = prepare_wandb("auto", "runs/x", "wandb.mode")   # the trainers (train/tracking.py), `eval --wandb`

wandb fails late and slowly when it cannot work: with no API key an online run raises at `wandb.init` (after the
verifier and the data were loaded), with no network it waits 90 s before giving up, and with a read-only HOME it
fails at the first table it logs (the end of a training run). So a run settles all of that first, in seconds:
  - `auto`: online only when an API key is configured (WANDB_API_KEY or ~/.netrc), else offline; WANDB_MODE wins;
  - online (asked for, or `auto` with a key): the wandb server must answer a TCP connect within a few seconds;
    otherwise `auto` logs offline (`wandb sync` uploads it later) and an explicit `online` stops, in one line;
    an explicit `online` without an API key stops too;
  - wandb's own folders (WANDB_DATA_DIR, WANDB_CACHE_DIR, WANDB_CONFIG_DIR, under HOME by default) must take a file;
    one that does not (a read-only HOME) is moved under the run's folder, unless the user set it, which stops.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

#: wandb's folders outside the run's own, and where they are by default.
WANDB_DIRS = {"WANDB_DATA_DIR": ("~/.local/share/wandb", "data"), "WANDB_CACHE_DIR": ("~/.cache/wandb", "cache"),
              "WANDB_CONFIG_DIR": ("~/.config/wandb", "config")}
PROBE_TIMEOUT_S = 5.0


class TrackingError(ValueError):
    """wandb cannot run as asked; the message names the setting and the ways out."""


def api_key_configured() -> bool:
    """An API key in the environment or in ~/.netrc (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    except OSError:
        return False


def wandb_mode() -> str:
    """wandb mode `auto` (trainers and `draftheads eval --wandb`): online only when an API key is configured (env or
    ~/.netrc), so a run never blocks on a login; WANDB_MODE wins."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if api_key_configured() else "offline"


def server() -> tuple[str, int]:
    """(host, port) of the wandb server: WANDB_BASE_URL, else api.wandb.ai."""
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def unreachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the wandb server cannot be reached (None when a TCP connect succeeds within `timeout`)."""
    host, port = server()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:
        return f"{host}:{port} unreachable ({err.strerror or type(err).__name__})"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def prepare_wandb(mode: str, folder: str | os.PathLike, key: str) -> tuple[str, list[str]]:
    """The mode to log in (`online`, `offline` or `disabled`) and lines to tell the user, after the checks of the
    module docstring; `mode` is the run's setting (`auto`, `online`, `offline`) named `key` in messages, `folder` the
    run's own folder (wandb's folders go below it when HOME's cannot be written). Raises TrackingError."""
    notes = []
    from_env = mode == "auto" and os.environ.get("WANDB_MODE") == "online"
    explicit = mode == "online" or from_env
    name, offline = (("WANDB_MODE", "WANDB_MODE=offline, or unset it") if from_env else
                     (key, f"{key}=offline or auto"))
    resolved = wandb_mode() if mode == "auto" else mode
    if resolved == "online":
        if not api_key_configured():
            raise TrackingError(f"{name}=online but no wandb API key is configured (WANDB_API_KEY or `wandb login`); "
                                f"log in, or log offline ({offline}; `wandb sync` uploads it later)")
        why = unreachable()
        if why is not None:
            if explicit:
                raise TrackingError(f"{name}=online but the wandb server is {why}; log offline ({offline}; "
                                    "`wandb sync` uploads it later) or fix the network")
            resolved = "offline"
            notes.append(f"[wandb] {why}: logging offline into {folder} (`wandb sync` uploads it later)")
    if resolved == "disabled":
        return resolved, notes
    for var, (default, name) in WANDB_DIRS.items():
        path = Path(os.environ.get(var) or default).expanduser()
        if _writable(path):
            continue
        if os.environ.get(var):
            raise TrackingError(f"{var}={os.environ[var]!r} cannot be written, and wandb stages its files there; set "
                                f"it to a writable folder or unset it")
        moved = Path(folder).resolve() / "wandb" / name
        os.environ[var] = str(moved)
        notes.append(f"[wandb] {default} cannot be written (HOME={os.environ.get('HOME', '')!r}): wandb uses {moved} "
                     f"instead ({var})")
    return resolved, notes
