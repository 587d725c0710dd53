"""The `draftheads` command: one verb per job, each with its own --help under its own name, one line for a mistake."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftheads.cli import TRAINERS, VERBS, main


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_help_under_its_own_name(verb):
    code, out, _ = run([verb, "--help"])
    assert code == 0 and f"draftheads {verb}" in out.splitlines()[0], out[:300]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_train_help_lists_the_trainers_config_keys(trainer):
    code, out, _ = run(["train", trainer, "--help"])
    assert code == 0 and f"draftheads train {trainer}" in out and "--train.max_steps" in out


def test_overview_lists_every_verb():
    code, out, _ = run(["--help"])
    assert code == 0 and all(f"  {verb} " in out for verb in VERBS)


@pytest.mark.parametrize("argv, expect", [(["evaluate"], "unknown verb 'evaluate'; expected one of train, eval"),
                                          (["train", "dflash3"], "the trainer to run comes first; got 'dflash3'")])
def test_a_mistake_is_one_clear_line(argv, expect):
    code, out, err = run(argv)
    assert code == 2 and expect in err and "Traceback" not in err


def test_the_console_script_and_python_m_are_the_command():
    exe = Path(sys.executable).parent / "draftheads"
    assert exe.is_file() or shutil.which("draftheads"), "pip install -e . puts `draftheads` beside python"
    proc = subprocess.run([sys.executable, "-m", "draftheads", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("draftheads ")
