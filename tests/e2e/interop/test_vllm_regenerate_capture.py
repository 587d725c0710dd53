"""`draftheads regenerate --backend vllm --capture DIR --config TRAIN.yaml`: one vLLM engine answers chat rows and
captures the training rows built from the answers (the CPU build of 0.32 in .venv-vllm).

The cache it writes against `draftheads dump-features --backend vllm` over the same --out: the same token columns and
features at every real token (its padding zeros), the prefix cache serving part of the capture, `cache verify`
passing, and EAGLE-3 training from it with the losses of the dump's cache. A run killed while answering continues to
the same --out and the same shard bytes. A config or a rerun that disagrees is refused in one line.

    pytest tests/e2e/interop/test_vllm_regenerate_capture.py -s     # prints the differences and the prefix reuse
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftheads.data.hidden_states import read_index
from draftheads.data.hidden_states import main as cache_cli
from draftheads.data.identity import sha256_file
from draftheads.train.config import parse_config
from draftheads.train.dump_features import dump
from draftheads.train.regenerate import main as regenerate_cli
from tests.utils import reset_accelerate, tiny_eagle3_args

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[3]
SIZE = dict(hidden_size=128, initializer_range=0.1)  # vLLM's CPU attention needs head_dim >= 32 (4 heads)
ASK = ("how do I read every line of a file into a list? Answer in a few short sentences, show a small example "
       "where it helps, and name the standard library module you use.")


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny chat verifier (ChatML) and chat rows whose prompts span more than one 32-token KV block, each its own
    from the first tokens on (the prefix cache can serve a row's blocks only from its own answering)."""
    from tests.chat_tokenizers import chatml_tokenizer
    from tests.utils import save_tiny_verifier

    root = tmp_path_factory.mktemp("one-pass")
    tok = chatml_tokenizer()
    verifier = save_tiny_verifier(root / "verifier", "llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **SIZE)
    tok.save_pretrained(verifier)
    rows = [{"messages": [{"role": "user", "content": f"Question {i} ({i} * {i + 3} = {i * (i + 3)}): {ASK}"},
                          {"role": "assistant", "content": "old answer"}]} for i in range(12)]
    source = root / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, verifier, source


def flags(verifier, source, out, capture, *extra) -> list[str]:
    return ["--backend", "vllm", "--source", str(source), "--out", str(out), "--max-new-tokens", "24",
            "--batch-size", "2", "--capture", str(capture), "--capture-dtype", "float32", "--rows-per-shard", "4",
            *tiny_eagle3_args(verifier, out, capture.parent / "unused", seq_len=96), *extra]


def eagle_cfg(*args):
    from draftheads.train.eagle import EagleRunConfig

    return parse_config(EagleRunConfig, list(args))


@pytest.fixture(scope="module")
def caches(setup, vllm_ready):
    """The one-pass cache and, over its --out, dump-features --backend vllm's: each written once."""
    root, verifier, source = setup
    out, one_pass = root / "regen.jsonl", root / "one-pass"
    reset_accelerate()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        regenerate_cli(flags(verifier, source, out, one_pass))
    reset_accelerate()
    dumped = root / "dumped"
    dump(eagle_cfg(*tiny_eagle3_args(verifier, out, root / "unused", seq_len=96)), dumped, dtype="float32",
         rows_per_shard=4, say=quiet, backend="vllm")
    reset_accelerate()
    return out, one_pass, dumped, printed.getvalue()


def shards(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {path.name: load_file(path) for path in sorted(folder.glob("*.safetensors"))}


def test_the_one_pass_cache_is_dump_features_cache_with_zero_padding(caches):
    out, one_pass, dumped, printed = caches
    served = int(printed.split("prefix cache served ")[1].split("%")[0])
    a, b = read_index(one_pass), read_index(dumped)
    assert (a["padding"], b["padding"]) == ("zeros", "joined") and a["backend"] == b["backend"] == "vllm"
    assert {k: v for k, v in a.items() if k not in ("padding", "splits", "total_bytes")} == \
        {k: v for k, v in b.items() if k not in ("padding", "splits", "total_bytes")}
    ours, theirs = shards(one_pass), shards(dumped)
    assert ours.keys() == theirs.keys() and len(ours) >= 3
    worst, padded = 0.0, 0
    for name, x in ours.items():
        y = theirs[name]
        for key in ("input_ids", "attention_mask", "loss_mask", "position_ids"):
            assert torch.equal(x[key], y[key]), (name, key)
        real = x["attention_mask"].bool()  # (N, T)
        padded += int((~real).sum())
        for key in ("final", "layers"):
            states = x[key] if key == "final" else x[key].transpose(1, 2)  # (N, T, ...)
            other = y[key] if key == "final" else y[key].transpose(1, 2)
            assert not states[~real].any(), f"{name} {key}: padding not zeros"
            worst = max(worst, float((states[real] - other[real]).abs().max()))
    print(f"\none pass vs dump-features --backend vllm: max abs difference {worst:.3g} at real tokens; "
          f"{padded} padding positions zeros; prefix cache served {served}% of the captured tokens")
    assert padded > 0, "some rows must end in padding for the comparison to cover it"
    assert worst <= 1e-5
    assert served > 0, printed
    assert cache_cli(["verify", str(one_pass)]) == 0
    assert not (one_pass / ".vllm-states").exists() and not (one_pass / "regenerated.jsonl.partial").exists()


def test_eagle3_trains_from_it_with_the_losses_of_the_dumped_cache(caches, setup, tmp_path):
    from draftheads.train.eagle import main

    out, one_pass, dumped, _ = caches
    _, verifier, _ = setup
    losses = {}
    for name, folder in (("one-pass", one_pass), ("dumped", dumped)):
        reset_accelerate()
        main(eagle_cfg(*tiny_eagle3_args(verifier, out, tmp_path / name, "--features=offline",
                                         f"--feature_cache={folder}", seq_len=96)))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [{k: v for k, v in r.items() if "loss" in k} for r in records]
        losses[name] = [r for r in losses[name] if r]
    reset_accelerate()
    assert sum("train/loss" in r for r in losses["one-pass"]) == 3
    for a, b in zip(losses["one-pass"], losses["dumped"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_a_run_killed_while_answering_continues_to_the_same_rows_and_shards(caches, setup, tmp_path):
    out, one_pass, _, _ = caches
    _, verifier, source = setup
    mine, folder = tmp_path / "regen.jsonl", tmp_path / "one-pass"
    args = flags(verifier, source, mine, folder)
    proc = subprocess.Popen([sys.executable, "-m", "draftheads", "regenerate", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record, deadline = folder / "regenerate.json", time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                answered = json.loads(record.read_text())["answered"]["rows"]
            except (OSError, ValueError, KeyError):
                answered = 0
            if answered >= 2:
                proc.send_signal(signal.SIGKILL)  # as a machine lost mid-run: nothing is cleaned up
                break
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    state = json.loads(record.read_text())
    assert state["out"] is None and 2 <= state["answered"]["rows"] < 12, state["answered"]
    assert not mine.exists() and not (folder / "index.json").exists()
    reset_accelerate()
    regenerate_cli(args)
    reset_accelerate()
    assert mine.read_bytes() == out.read_bytes()
    for name in shards(one_pass):
        assert sha256_file(folder / name) == sha256_file(one_pass / name), name
    assert not (folder / "regenerated.jsonl.partial").exists()


def test_a_finished_capture_run_again_changes_nothing_and_starts_no_engine(caches, setup, capsys):
    out, one_pass, _, _ = caches
    _, verifier, source = setup
    before = {p.name: p.read_bytes() for p in one_pass.iterdir()}
    started = time.perf_counter()
    reset_accelerate()
    regenerate_cli(flags(verifier, source, out, one_pass))
    reset_accelerate()
    assert "(0 shards captured, 6 already done)" in capsys.readouterr().out.splitlines()[-1]
    assert time.perf_counter() - started < 10  # vLLM alone takes ~15 s to start
    assert {p.name: p.read_bytes() for p in one_pass.iterdir()} == before


def run_cli(args, capsys) -> tuple[int, list[str]]:
    reset_accelerate()
    try:
        regenerate_cli(args)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    reset_accelerate()
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    return code, [line for line in lines if line.strip() and "it/s]" not in line and "examples/s]" not in line]


def test_a_config_or_rerun_that_disagrees_is_refused_in_one_line(caches, setup, tmp_path, capsys):
    out, one_pass, _, _ = caches
    _, verifier, source = setup
    folder = tmp_path / "copy"
    shutil.copytree(one_pass, folder)
    cases = [  # (flags, what the one line names)
        (flags(verifier, source, out, tmp_path / "a", f"--data.source={source}"), "data.source="),
        (flags(verifier, source, out, tmp_path / "b", "--verifier_dtype=bfloat16"), "verifier_dtype=bfloat16"),
        ([*flags(verifier, source, out, folder), "--max-new-tokens", "8"], "--max-new-tokens 24"),
        (flags(verifier, source, out, folder, "--data.seq_len=64"), "data.seq_len=96"),
    ]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    cases.append((flags(verifier, source, out, tmp_path / "d"), "--capture"))
    for args, named in cases:
        code, err = run_cli(args, capsys)
        assert code != 0 and len(err) == 1 and named in err[0], (named, err)
    code, err = run_cli([a for a in flags(verifier, source, out, tmp_path / "c") if a not in ("--backend", "vllm")],
                        capsys)  # argparse's own: the usage, then the line
    assert code == 2 and "--capture needs --backend vllm" in err[-1], err
    assert not any((tmp_path / name).exists() for name in "abc")
    assert json.loads((folder / "regenerate.json").read_text()) == json.loads((one_pass / "regenerate.json")
                                                                                .read_text())
