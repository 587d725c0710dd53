"""scripts/bench_dflash.sh refuses a malformed DFLASH_EXTRA_WINDOWS, DFLASH_EXTRA_LAYERS, DFLASH_EXTRA_ANCHORS,
DFLASH_EXTRA_VOCAB, DFLASH_EXTRA_LOSSES, DFLASH_EXTRA_DSPARK, DFLASH_DATA_PROMPTS, DFLASH_SEED or DFLASH_SAVE_EVERY,
and a folder whose rows are not the number asked for, in one line, before it sets anything up or trains anything."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def refusal(tmp_path, variable: str, value: str) -> str:
    """bench_dflash.sh's stderr for `variable=value`; it must stop with status 2 before writing or printing a thing."""
    out = tmp_path / "bench"
    env = {**os.environ, variable: value, "DFLASH_DIR": str(out),
           "DFLASH_VERIFIER": str(tmp_path / "no-verifier")}  # should the check ever let it through: fail fast
    proc = subprocess.run(["bash", str(ROOT / "scripts/bench_dflash.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and not out.exists()
    return proc.stderr.strip()


# each pair variable: (its BLOCK:VALUE name and what the value must be, its example, (value, the part refused) cases)
PAIRS = {
    "DFLASH_EXTRA_WINDOWS": ("BLOCK:WINDOW pairs of integers", "'8:8 16:16'",
                             [("8:8 16", "16"), ("8-8", "8-8"), ("b8:8", "b8:8"), ("8:", "8:")]),
    "DFLASH_EXTRA_LAYERS": ("BLOCK:LAYERS pairs of integers (2 layers or more)", "'4:3'",
                            [("4:3 8", "8"), ("4:1", "4:1"), ("4:0", "4:0"), ("4-3", "4-3"), ("4:l3", "4:l3")]),
    "DFLASH_EXTRA_ANCHORS": ("BLOCK:ANCHORS pairs of integers (1 anchor or more)", "'4:128'",
                             [("4:128 8", "8"), ("4:0", "4:0"), ("4:064", "4:064"), ("4-128", "4-128"),
                              ("4:a128", "4:a128")]),
    "DFLASH_EXTRA_VOCAB": ("BLOCK:VOCAB pairs of integers (a vocabulary of 1 token or more)", "'5:2048'",
                           [("5:2048 8", "8"), ("5:0", "5:0"), ("5-2048", "5-2048"), ("5:v2048", "5:v2048")]),
    "DFLASH_EXTRA_LOSSES": ("BLOCK:LOSS pairs (LOSS one of ce, kl, dpace)", "'5:dpace'",
                            [("5:dpace 8", "8"), ("5:pace", "5:pace"), ("5-dpace", "5-dpace"), ("b5:ce", "b5:ce")]),
    "DFLASH_EXTRA_DSPARK": ("BLOCK:RANK pairs of integers (a Markov rank of 1 or more)", "'5:64'",
                            [("5:64 8", "8"), ("5:0", "5:0"), ("5-64", "5-64"), ("5:m64", "5:m64")]),
}


@pytest.mark.parametrize("variable, value, bad", [(variable, value, bad) for variable, (_, _, cases) in PAIRS.items()
                                                  for value, bad in cases])
def test_malformed_extra_pairs_are_refused_in_one_line(tmp_path, variable, value, bad):
    expected, example, _ = PAIRS[variable]
    assert refusal(tmp_path, variable, value) == (
        f"{variable}: '{bad}': expected {expected} separated by spaces, e.g. {example}")


@pytest.mark.parametrize("value", ["0", "3k", "-800", "800 "])
def test_malformed_data_prompts_are_refused_in_one_line(tmp_path, value):
    assert refusal(tmp_path, "DFLASH_DATA_PROMPTS", value) == (
        f"DFLASH_DATA_PROMPTS: '{value}': expected a positive integer (stdlib functions to continue)")


def test_rows_of_another_size_are_not_reused(tmp_path):
    """A folder made with 3 functions' rows, asked for 800 (the default): the rows would silently be the wrong ones."""
    out = tmp_path / "bench"
    out.mkdir()
    rows = out / "selfdistill.jsonl"
    rows.write_text('{"text": "a"}\n' * 3)
    env = {**os.environ, "DFLASH_DIR": str(out), "DFLASH_VERIFIER": str(tmp_path / "no-verifier")}
    env.pop("DFLASH_DATA_PROMPTS", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts/bench_dflash.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and sorted(p.name for p in out.iterdir()) == ["selfdistill.jsonl"]
    assert proc.stderr.strip() == (f"{rows} holds 3 rows, not DFLASH_DATA_PROMPTS=800: set DFLASH_DATA_PROMPTS to "
                                   "its count, or use another DFLASH_DIR")


@pytest.mark.parametrize("value", ["-1", "1.5", "01", "seed", "1 "])
def test_malformed_seed_is_refused_in_one_line(tmp_path, value):
    assert refusal(tmp_path, "DFLASH_SEED", value) == (
        f"DFLASH_SEED: '{value}': expected a non-negative integer (the trainers' train.seed)")


@pytest.mark.parametrize("value", ["0", "2e2", "-200", "200 "])
def test_malformed_save_every_is_refused_in_one_line(tmp_path, value):
    assert refusal(tmp_path, "DFLASH_SAVE_EVERY", value) == (
        f"DFLASH_SAVE_EVERY: '{value}': expected a positive integer (steps between checkpoints)")
