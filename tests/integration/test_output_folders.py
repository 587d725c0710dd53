"""One rule for every command that writes a folder (models/outputs.py): it writes into a folder that is new, empty
or its own kind of output, and refuses anything else in one line naming the flag and what is there, before it
loads or writes anything. Each writing command is walked through the same folders in the way: a training run, a
feature cache, an eval output, a file, a folder of unknown things, another trainer's drafter; each must be left
exactly as it was."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest

from draftheads.models.outputs import KINDS, OutputInTheWay, claim_output, describe, kind_of
from tests.utils import save_tiny_verifier

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def run_folder(p: Path):
    write(p / "run.json", json.dumps({"signature": {}}))
    write(p / "config.yaml", "verifier: x\n")
    write(p / "step-000010" / "COMPLETE", "")
    write(p / "drafter" / "config.json", json.dumps({"draftheads": {"method": "eagle3"}}))
    write(p / "metrics.jsonl", "{}\n")


def cache_folder(p: Path):
    write(p / "index.json", json.dumps({"format": "draftheads-hidden-states"}))
    write(p / "plan.json", "{}")
    write(p / "train-00000.safetensors", "x")


def eval_folder(p: Path):
    write(p / "results.json", "{}")
    write(p / "report.md", "# report\n")


def a_file(p: Path):
    write(p, "not a folder\n")


def unknown_folder(p: Path):
    write(p / "notes.txt", "mine\n")
    write(p / "data" / "rows.jsonl", "{}\n")


def peer_drafter(p: Path):
    write(p / "config.json", json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    write(p / "model.safetensors", "x")


OCCUPANTS = {"run": (run_folder, "a training run folder"), "cache": (cache_folder, "a feature cache"),
             "eval": (eval_folder, "a `draftheads eval` output"), "file": (a_file, "a file is in the way"),
             "unknown": (unknown_folder, "a folder of 2 other entries"),
             "peer": (peer_drafter, "another trainer's drafter folder")}


def snapshot(p: Path) -> dict:
    if p.is_file():
        return {"": hashlib.sha256(p.read_bytes()).hexdigest()}
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else "dir"
            for f in sorted(p.rglob("*"))}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    return save_tiny_verifier(tmp_path_factory.mktemp("v") / "v")


def commands(verifier: Path, tmp: Path, out: Path) -> dict:
    """Each writing command as a user types it, with `out` as its output (main(argv) of the verb)."""
    draft = tmp / "draft"
    peer_drafter(draft)
    return {
        "import-peer --fix": ("draftheads.eval.interop.peer_folder",
                              ["--verifier", str(verifier), "--draft", str(draft), "--fix", str(out)], "--fix"),
        "build-verifier --out": ("draftheads.models.tiny.cli", ["build", "--recipe", "micro", "--out", str(out)],
                                 "--out"),
        "dump-features --out": ("draftheads.train.dump_features",
                                ["--config", str(ROOT / "configs/eagle3-tiny.yaml"), f"--verifier={verifier}",
                                 "--out", str(out)], "--out"),
        "eval --out": ("draftheads.eval.__main__", ["--verifier", str(verifier), "--prompts", "humaneval",
                                                    "--out", str(out)], "--out"),
        "tune --out": ("draftheads.eval.__main__", ["tune", "--verifier", str(verifier), "--candidate", "ngram",
                                                    "--prompts", "humaneval",
                                                    "--out", str(out)], "--out"),
    }


COMMANDS = ["import-peer --fix", "build-verifier --out", "dump-features --out", "eval --out", "tune --out"]
OWN = {("dump-features --out", "cache"), ("eval --out", "eval")}  # its own kind of output: taken up, not refused
PAIRS = [(c, o) for c in COMMANDS for o in sorted(OCCUPANTS) if (c, o) not in OWN]


@pytest.mark.parametrize("command,occupant", PAIRS)
def test_a_writing_command_refuses_a_folder_it_does_not_own(verifier, tmp_path, command, occupant):
    import importlib

    out = tmp_path / "out"
    make, named = OCCUPANTS[occupant]
    make(out)
    before = snapshot(out)
    module, argv, flag = commands(verifier, tmp_path, out)[command]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = importlib.import_module(module).main(argv)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert code not in (0, None), (command, occupant, lines)
    assert len(lines) == 1, lines
    assert f"{flag} {out}" in lines[0] and named in lines[0] and "nothing was written" in lines[0], lines[0]
    assert snapshot(out) == before  # nothing lost, nothing added


def test_each_kind_is_recognised_and_its_own_output_is_writable(tmp_path):
    for kind, make in (("run", run_folder), ("cache", cache_folder), ("eval", eval_folder)):
        make(tmp_path / kind)
        assert kind_of(tmp_path / kind) == kind
        assert claim_output(tmp_path / kind, kind, "--out") == tmp_path / kind
    drafter = tmp_path / "drafter"
    write(drafter / "config.json", json.dumps({"draftheads": {"method": "eagle3"}}))
    assert kind_of(drafter) == "drafter" and claim_output(drafter, "drafter", "--fix") == drafter
    # a run folder holds a drafter/, but it is a run folder: a drafter write there would replace the run
    with pytest.raises(OutputInTheWay, match="a training run folder"):
        claim_output(tmp_path / "run", "drafter", "--fix")
    # new, empty (our lock file and a killed writer's temporaries aside): writable by any command
    assert describe(tmp_path / "new") is None and claim_output(tmp_path / "new", "eval", "--out")
    write(tmp_path / "empty" / ".lock", "pid 1")
    (tmp_path / "empty" / ".out.tmp-12-ab").mkdir()
    assert describe(tmp_path / "empty") is None and claim_output(tmp_path / "empty", "drafter", "--fix")
    with pytest.raises(ValueError, match="unknown output kind"):
        claim_output(tmp_path / "new", "model", "--out")
    assert set(KINDS) >= {"run", "cache", "eval", "tune", "verifier", "drafter", "model"}
