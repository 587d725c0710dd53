"""Faults during a real run (train/eagle.py, EAGLE-1, whose feature noise makes the RNG state part of a resume): SIGINT
and SIGTERM at random moments and a full disk at a checkpoint each end the run with one line that says what is
intact, and a rerun of the same command ends with the weights of an uninterrupted run. (SIGKILL, also inside a
checkpoint write: tests/e2e/test_crash_safety.py; two runs on one folder, a rerun with other settings, a folder that
cannot be written: tests/e2e/test_run_folder.py and the catalogue in tests/e2e/test_reliability.py.)"""

import os
import random
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from draftheads.train.checkpoint import FULL_DISK_HOOK, complete_checkpoints
from tests.e2e.test_crash_safety import command, env, logged_steps
from tests.utils import save_tiny_verifier_with_tokenizer



@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    verifier = save_tiny_verifier_with_tokenizer(root / "v")
    subprocess.run(command(verifier, root / "straight"), env=env(), check=True, capture_output=True, timeout=300)
    return verifier, load_file(root / "straight" / "drafter" / "model.safetensors")


def finish_and_compare(cmd, out, reference) -> None:
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    final = load_file(out / "drafter" / "model.safetensors")
    assert final.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(final[key], reference[key], rtol=0, atol=0)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_a_random_moment_ends_in_one_line_and_the_rerun_matches(tmp_path, straight, sig, code):
    verifier, reference = straight
    out = tmp_path / "run"
    cmd = command(verifier, out)
    rng = random.Random(int(os.environ.get("CRASH_TEST_SEED", "0")) * 7 + sig)
    process = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    target, delay = rng.randint(2, 6), rng.uniform(0.0, 0.3)
    while process.poll() is None and target not in logged_steps(out):
        time.sleep(0.01)
    time.sleep(delay)
    if process.poll() is None:
        process.send_signal(sig)
    _, stderr = process.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    print(f"{sig.name} {delay:.2f} s after step {target}: exit {process.returncode}: {lines[-1:]}")
    if process.returncode == 0:
        pytest.skip(f"the run finished before the signal ({target}, {delay:.2f} s); rerun with another CRASH_TEST_SEED")
    assert process.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr
    assert lines[-1].startswith(f"stopped by {'SIGTERM' if sig == signal.SIGTERM else 'SIGINT'}")
    assert "is intact; rerunning the same command continues from it" in lines[-1] or "no checkpoint" in lines[-1]
    finish_and_compare(cmd, out, reference)


def test_a_full_disk_at_a_checkpoint_names_it_and_keeps_the_last_one(tmp_path, straight):
    verifier, reference = straight
    out = tmp_path / "run"
    cmd = command(verifier, out)
    result = subprocess.run(cmd, env=env(**{FULL_DISK_HOOK: "4"}), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    line = [x for x in result.stderr.splitlines() if x.strip()][-1]
    assert "Traceback" not in result.stderr
    assert line.startswith("error: No space left on device writing ") and "step-000004" in line, line
    assert "the last complete checkpoint step-000002 is intact" in line, line
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002"] and not list(out.glob(".step-*.tmp"))
    finish_and_compare(cmd, out, reference)
