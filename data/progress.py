"""Progress bars: on for people, off in tests and CI (`DRAFTHEADS_QUIET=1`); long stages also say their remaining
time in one line (`EtaBar`)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from tqdm.auto import tqdm


def quiet() -> bool:
    """True when DRAFTHEADS_QUIET is set to anything but an empty / false value."""
    return os.environ.get("DRAFTHEADS_QUIET", "") not in ("", "0", "false", "False")


@contextmanager
def datasets_progress():
    """`datasets`' own bars (map, filter) follow DRAFTHEADS_QUIET inside this block, then are restored."""
    import datasets  # here, not at the top: the engine and the tests import this module where `datasets` is absent

    silence = quiet() and not datasets.are_progress_bars_disabled()
    if silence:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if silence:
            datasets.enable_progress_bars()


def _clock(seconds: float) -> str:
    """A duration as a person reads it: 45 s, 12 min, 1 h 05 min."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def eta_line(desc: str, done: int, total: int, rate: float, unit: str = "it", now: float | None = None) -> str:
    """One line saying how long a stage has left: `done` of `total` units, `rate` units per second so far."""
    left = (total - done) / rate
    finish = time.strftime("%H:%M", time.localtime((time.time() if now is None else now) + left))
    speed = f"{1 / rate:.2f} s a {unit}" if rate < 2 else f"{rate:.1f} {unit}/s"
    return f"[{desc}] {done}/{total} {unit}s: about {_clock(left)} left at {speed}, done near {finish}"


class EtaBar(tqdm):
    """A tqdm bar that also writes one line with the stage's remaining time once its first units are timed.

    The bar itself shows a remaining time on a terminal; the line is for logs and piped output, and comes early, so a
    person on a slow machine knows at once. The first unit is left out of the rate (it pays one-off warm-up costs);
    the line comes after `min_units` more units and at least `min_seconds`, and never for a stage that will end soon.
    """

    def __init__(self, *args, min_units: int = 3, min_seconds: float = 10.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._eta_from: tuple[int, float] | None = None  # (n, time) after the first unit
        self._eta_said = self.disable or not self.total
        self._eta_min_units, self._eta_min_seconds = min_units, min_seconds

    def update(self, n: float | None = 1):
        shown = super().update(n)
        if not self._eta_said:
            now = time.perf_counter()
            if self._eta_from is None:
                self._eta_from = (self.n, now)
            elif self.n - self._eta_from[0] >= self._eta_min_units and now - self._eta_from[1] >= self._eta_min_seconds:
                rate = (self.n - self._eta_from[0]) / (now - self._eta_from[1])
                self._eta_said = True
                if (self.total - self.n) / rate >= self._eta_min_seconds:
                    self.write(eta_line(self.desc or "progress", int(self.n), int(self.total), rate, self.unit),
                               file=self.fp)
        return shown
