"""data/progress.py: a long stage says its remaining time in one line, once, after its first units are timed."""

from __future__ import annotations

import io
import time

import pytest

from draftheads.data.progress import EtaBar, eta_line


def test_eta_line_reads_as_a_person_would_say_it():
    now = time.mktime((2026, 12, 2, 6, 0, 0, 0, 0, -1))
    assert eta_line("training tiny-code", 12, 900, 1 / 0.9, "step", now=now) == (
        "[training tiny-code] 12/900 steps: about 13 min left at 0.90 s a step, done near 06:13")
    assert eta_line("eval", 4, 40, 2.0, "prompt", now=now) == (
        "[eval] 4/40 prompts: about 18 s left at 2.0 prompt/s, done near 06:00")
    assert "about 2 h 05 min left" in eta_line("x", 0, 7500, 1.0, now=now)


def run_bar(units: int, seconds_each: float, **kwargs) -> list[str]:
    out = io.StringIO()
    bar = EtaBar(total=units, desc="stage", unit="step", file=out, mininterval=1e9, **kwargs)
    for _ in range(units):
        time.sleep(seconds_each)
        bar.update(1)
    bar.close()
    return [line for line in out.getvalue().replace("\r", "\n").splitlines() if line.startswith("[stage]")]


def test_the_line_comes_once_after_the_first_units(capsys):
    lines = run_bar(40, 0.01, min_units=3, min_seconds=0.02)
    assert len(lines) == 1
    done = int(lines[0].split()[1].split("/")[0])
    assert 4 <= done < 40  # after the first unit (warm-up, not counted) and three more, long before the end
    assert "about" in lines[0] and "left at" in lines[0]


@pytest.mark.parametrize("kwargs", [{"disable": True}, {"min_seconds": 60.0}])
def test_no_line_when_disabled_or_the_stage_ends_soon(kwargs):
    assert run_bar(8, 0.001, min_units=2, **{"min_seconds": 0.0, **kwargs}) == []
