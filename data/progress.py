"""Progress bars: on for people, off in tests and CI (`DRAFTHEADS_QUIET=1`)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import datasets


def quiet() -> bool:
    """True when DRAFTHEADS_QUIET is set to anything but an empty / false value."""
    return os.environ.get("DRAFTHEADS_QUIET", "") not in ("", "0", "false", "False")


@contextmanager
def datasets_progress():
    """`datasets`' own bars (map, filter) follow DRAFTHEADS_QUIET inside this block, then are restored."""
    silence = quiet() and not datasets.are_progress_bars_disabled()
    if silence:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if silence:
            datasets.enable_progress_bars()
