"""A run folder belongs to one run (train/run_folder.py): a rerun continues only the run it holds, starting over
moves the earlier run aside instead of mixing the two, one run holds a folder at a time, and the drafter is
readable by other users."""

import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

from draftheads.train.checkpoint import complete_checkpoints
from draftheads.train.config import ConfigError, RunConfig, WandbConfig
from tests.e2e.test_train_eagle import (
    ROOT,
    records,
    run,
    tiny_args,
    verifier_dirs,  # noqa: F401  (the module's fixture)
)

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def claim(folder, **train):
    from draftheads.train.config import TrainConfig
    from draftheads.train.tracking import build_accelerator
    from tests.utils import reset_accelerate

    reset_accelerate()
    return build_accelerator(RunConfig(output_dir=str(folder), wandb=WandbConfig(enabled=False),
                                       train=TrainConfig(**{"max_steps": 10, "warmup_steps": 1, **train})))


def test_a_rerun_with_other_settings_stops_before_loading_anything(tmp_path, verifier_dirs, monkeypatch):
    from draftheads.train import eagle as train_eagle

    out = tmp_path / "run"
    run(*tiny_args(verifier_dirs["llama"], out, 1))
    before = (out / "drafter" / "model.safetensors").read_bytes(), len(records(out))
    monkeypatch.setattr(train_eagle, "load_verifier", lambda *a, **k: pytest.fail("loaded the verifier"))
    with pytest.raises(ConfigError, match=r"holds another run \(its settings differ: train.lr: 0.006 -> 0.001\)\. "
                                          r"Use another output_dir, or --train.resume=none"):
        run(*tiny_args(verifier_dirs["llama"], out, 1, "--train.lr=0.001"))
    assert ((out / "drafter" / "model.safetensors").read_bytes(), len(records(out))) == before
    # settings that do not change the result may differ: the run continues (here: finished, nothing to train)
    monkeypatch.undo()
    assert run(*tiny_args(verifier_dirs["llama"], out, 1, "--train.log_every=3", "--engine=sglang"))["steps"] == 4


def test_starting_over_moves_the_earlier_run_aside(tmp_path, verifier_dirs):
    out = tmp_path / "run"
    run(*tiny_args(verifier_dirs["llama"], out, 1, "--train.max_steps=6"))  # checkpoints at 4 and 6
    assert [p.name for p in complete_checkpoints(out)] == ["step-000004", "step-000006"]
    run(*tiny_args(verifier_dirs["llama"], out, 1, "--train.max_steps=2", "--train.resume=none"))
    # the new run's checkpoint stands (not pruned against the older, longer run's), the old run is kept aside
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002"]
    previous = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert len(previous) == 1 and [p.name for p in complete_checkpoints(previous[0])] == ["step-000004", "step-000006"]
    assert (previous[0] / "drafter" / "model.safetensors").is_file()
    assert json.loads((out / "drafter" / "config.json").read_text())["draftheads"]["training"]["steps"] == 2
    # a later default rerun of the new settings continues the new run, not the old one
    assert run(*tiny_args(verifier_dirs["llama"], out, 1, "--train.max_steps=2"))["steps"] == 2
    with pytest.raises(ConfigError, match="train.max_steps: 2 -> 6"):
        run(*tiny_args(verifier_dirs["llama"], out, 1, "--train.max_steps=6"))


def test_a_bad_resume_path_stops_at_once(tmp_path):
    with pytest.raises(ConfigError, match=r"train.resume='.*nope': not a complete checkpoint folder"):
        claim(tmp_path / "run", resume=str(tmp_path / "nope"))


def test_one_run_per_folder_and_a_stale_lock_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 4242 on "
        "elsewhere'); f.flush(); print('locked', flush=True); time.sleep(60)"), str(folder / ".lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=r"is in use by another run \(pid 4242 on elsewhere\)"):
            claim(folder)
    finally:
        holder.kill()
        holder.wait()
    # killed (as by kill -9): its lock went with it; the next run takes the folder
    claim(folder)
    assert f"pid {os.getpid()}" in (folder / ".lock").read_text()


def test_output_dir_that_is_a_file_or_read_only(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="a file is in the way; expected a folder"):
        claim(tmp_path / "file")
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: nothing to check here
            pytest.skip("running as a user that can write anywhere")
        with pytest.raises(ConfigError, match="not writable by this user"):
            claim(locked)
    finally:
        locked.chmod(0o700)


def test_the_exported_drafter_is_readable_by_others(tmp_path, verifier_dirs):
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        run(*tiny_args(verifier_dirs["llama"], out, 1, "--train.max_steps=2"))
    finally:
        os.umask(old)
    for path in [out / "drafter", *(out / "drafter").iterdir()]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o044 == 0o044, (path, oct(mode))  # group and others may read (and list the folder)
    assert time.time() - (out / "drafter").stat().st_mtime < 600


def test_finished_other_run_tells_this_run_from_another(tmp_path, verifier_dirs):
    """What the scripts that reuse a trained folder ask first (train/run_folder.py `finished_other_run`, through
    scripts/same_run.py): the same settings and inputs reuse it, another seed or data of other contents do not, and
    an unfinished run is trained (continued) only if it is this one, as the trainer itself decides."""
    from draftheads.train.config import parse_config
    from draftheads.train.eagle import EagleRunConfig
    from draftheads.train.run_folder import finished_other_run

    def ask(*extra, folder=None):
        return finished_other_run(parse_config(EagleRunConfig, tiny_args(verifier_dirs["llama"], folder or out, 3,
                                                                         *extra)))

    out = tmp_path / "run"
    assert ask() is None  # nothing there: train it
    run(*tiny_args(verifier_dirs["llama"], out, 3))
    assert ask() == ""
    assert ask("--train.log_every=3", "--train.save_every=4") == ""  # settings that do not change what is trained
    assert ask("--train.seed=1") == f"{out} holds another run (its settings differ: train.seed: 0 -> 1)"
    # the same path, other contents
    rows = verifier_dirs["llama"].parent / "rows.jsonl"
    copy = tmp_path / "rows.jsonl"
    copy.write_text(rows.read_text().replace("number 3", "number three"))
    assert ask(f"--data.source={copy}").startswith(f"{out} holds another run (its inputs differ: ")
    # an unfinished run (checkpoints, no drafter): trained on if it is this run, refused if not
    unfinished = tmp_path / "unfinished"
    shutil.copytree(out, unfinished)
    shutil.rmtree(unfinished / "drafter")
    assert ask(folder=unfinished) is None
    assert ask("--train.seed=1", folder=unfinished) == (
        f"{unfinished} holds another unfinished run (its settings differ: train.seed: 0 -> 1)")
    # a folder recorded before inputs were: its settings decide, as the trainer continues it
    legacy = tmp_path / "legacy"
    shutil.copytree(out, legacy)
    record = json.loads((legacy / "run.json").read_text())
    del record["inputs"]
    (legacy / "run.json").write_text(json.dumps(record))
    assert ask(folder=legacy) == ""
    assert ask("--train.seed=1", folder=legacy) == (
        f"{legacy} holds another run (its settings differ: train.seed: 0 -> 1)")
    (legacy / "run.json").unlink()
    for step in legacy.glob("step-*"):
        shutil.rmtree(step)
    assert ask(folder=legacy) == (f"{legacy} holds a drafter without a record of what it was trained from (run.json), "
                                  "so it cannot be told apart from another run's")
    # the script's exit status and its one line
    script = [sys.executable, "scripts/same_run.py", "train/eagle.py"]
    base = tiny_args(verifier_dirs["llama"], out, 3)
    for extra, status, stderr in (([], 0, ""), (["--train.seed=1"], 4, f"{out} holds another run (its settings "
                                                                        "differ: train.seed: 0 -> 1)\n"),
                                  (["--train.lr=x"], 2, "config error: ")):
        proc = subprocess.run(script + base + extra, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert (proc.returncode, proc.stderr[:len(stderr)]) == (status, stderr), proc.stderr
    proc = subprocess.run(script + tiny_args(verifier_dirs["llama"], tmp_path / "fresh", 3), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and not (tmp_path / "fresh").exists(), proc.stderr  # reads only
    # and scripts/bench_dflash.sh checks every label before it trains any: another run in a later label's folder
    # stops it with nothing trained
    bench = tmp_path / "bench"
    bench.mkdir()
    shutil.copytree(out, bench / "dflash-b4")
    (bench / "selfdistill.jsonl").write_text(rows.read_text().splitlines()[0] + "\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}, "DFLASH_DIR": str(bench),
           "DFLASH_DATA_PROMPTS": "1", "DFLASH_VERIFIER": str(verifier_dirs["llama"]), "DFLASH_STEPS": "4",
           "DFLASH_BLOCKS": "4"}
    proc = subprocess.run(["bash", "scripts/bench_dflash.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{bench}/dflash-b4 holds another run (its settings differ: ") and lines[0].endswith(
        f"; use another DFLASH_DIR, or delete {bench}/dflash-b4 to train it again"), lines[0]
    assert sorted(p.name for p in bench.iterdir()) == ["dflash-b4", "selfdistill.jsonl"]  # eagle3, peagle: not begun
