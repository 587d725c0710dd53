"""kill -9 at random moments of a real run (train/eagle.py, EAGLE-1: its feature noise makes the RNG state part of
what a resume must restore), including inside a checkpoint write; each rerun of the same command (train.resume=auto)
continues from the newest complete checkpoint, and the run ends with the weights of an uninterrupted one.

Landing inside a checkpoint write is deterministic: `DRAFTHEADS_TEST_CHECKPOINT_KILL=<step>:<point>` makes
train/checkpoint.py SIGKILL its own process after every file of that checkpoint is written but before the COMPLETE
marker (`before_marker`), or after the marker but before the folder is renamed into place (`before_rename`).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftheads.train.checkpoint import CRASH_HOOK, complete_checkpoints
from tests.utils import save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def command(verifier, out):
    return [sys.executable, str(ROOT / "train/eagle.py"), "--config", str(ROOT / "configs/eagle1-tiny.yaml"),
            f"--verifier={verifier}", f"--output_dir={out}", "--wandb.enabled=false", "--data.seq_len=32",
            "--data.max_rows=3", "--data.eval_rows=1", "--train.batch_size=2", "--train.max_steps=8",
            "--train.save_every=2", "--train.keep_last=2", "--train.eval_every=0", "--train.eval_batches=1",
            "--train.log_every=1", "--train.warmup_steps=1", "--train.mixed_precision=no", "--eagle.ttt_steps=2"]


def env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "WANDB_MODE": "offline",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "train/loss" in r]


def run_killed_by_hook(cmd, step: int, point: str) -> None:
    result = subprocess.run(cmd, env=env(**{CRASH_HOOK: f"{step}:{point}"}), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]


def test_kill_9_anywhere_then_resume_auto_ends_with_the_uninterrupted_weights(tmp_path):
    verifier = save_tiny_verifier_with_tokenizer(tmp_path / "v")
    subprocess.run(command(verifier, tmp_path / "straight"), env=env(), check=True, capture_output=True, timeout=300)
    out = tmp_path / "killed"
    cmd = command(verifier, out)

    # 1. killed inside the step-4 checkpoint write: files on disk, no COMPLETE marker
    run_killed_by_hook(cmd, 4, "before_marker")
    half = out / ".step-000004.tmp"
    assert half.is_dir() and (half / "model.safetensors").is_file() and not (half / "COMPLETE").exists()
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002"]

    # 2. the rerun resumes from step 2 (not the half-written 4) and is killed again at a random moment
    rng = random.Random(int(os.environ.get("CRASH_TEST_SEED", "0")))
    before = len(logged_steps(out))
    process = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target, delay = rng.randint(3, 7), rng.uniform(0.0, 0.3)  # some time after the target step is logged
    while process.poll() is None and target not in logged_steps(out)[before:]:
        time.sleep(0.01)
    time.sleep(delay)
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    after = logged_steps(out)[before:]
    print(f"random kill {delay:.2f} s after step {target}: exit {process.returncode}, steps logged {after}, "
          f"complete checkpoints {[p.name for p in complete_checkpoints(out)]}")
    assert after[:1] == [3]  # it resumed from step-000002, not the half-written step 4

    # 3. killed after the marker of step 6 but before the rename into place: still never picked up
    newest = complete_checkpoints(out)[-1]
    if newest.name < "step-000006":
        run_killed_by_hook(cmd, 6, "before_rename")
        assert (out / ".step-000006.tmp" / "COMPLETE").is_file() and not (out / "step-000006").exists()
        assert complete_checkpoints(out)[-1].name == "step-000004"

    # 4. the last rerun finishes
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in complete_checkpoints(out)] == ["step-000006", "step-000008"]
    assert not list(out.glob(".step-*.tmp"))  # leftovers of killed writes are cleaned when that step is rewritten

    straight = load_file(tmp_path / "straight" / "drafter" / "model.safetensors")
    final = load_file(out / "drafter" / "model.safetensors")
    assert straight.keys() == final.keys()
    for key in straight:
        torch.testing.assert_close(final[key], straight[key], rtol=0, atol=0)
