"""scripts/dflash_block_proposals.py refuses what it cannot read in one line naming the flag, folder or row, before
it loads anything."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts/dflash_block_proposals.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def drafter(tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_refusals(tmp_path, drafter):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "def f():\\n    pass\\n"}\n{"prompt": "x"}\n')
    proc = run(drafter, "--data", data)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].endswith(
        f'{data}:2: expected a JSON object with a string "text"')
    proc = run(tmp_path / "nothing", "--data", data)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].endswith(
        f"{tmp_path / 'nothing'}: no exported drafter there (no config.json)")
    proc = run(drafter, "--data", data, "--anchors", 0)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].endswith("--anchors=0: expected a positive integer")
