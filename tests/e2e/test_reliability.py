"""The reliability catalogue: bad inputs and faults a user meets, each run through the real command, each ending in one
clear line (no traceback) that names the flag, key, file or row and what to do; faults mid-run end with the last
complete checkpoint intact and a rerun that ends with the uninterrupted run's weights.

The table in docs/reliability-catalogue.md (between the `catalogue` markers) is written from these cases: the test
fails when the page differs, and `DRAFTHEADS_WRITE_DOCS=1 python -m pytest tests/e2e/test_reliability.py` rewrites it.
Commands run in this process (the CLIs' `main` with their argv) so the whole catalogue takes seconds; temporary
paths appear as `<tmp>` in the table.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.utils import reset_accelerate, save_tiny_verifier, save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability-catalogue.md"
BEGIN, END = "<!-- catalogue:begin -->", "<!-- catalogue:end -->"

pytestmark = pytest.mark.usefixtures("fresh_accelerate", "one_thread")


@dataclass
class Case:
    what: str
    """The bad input or fault."""
    command: list[str]
    """The command line as a user types it (`{v}` the verifier, `{tmp}` a fresh folder, `{data}` the data file)."""
    expect: str
    """A regex the one line must match (what it names); for a `behaviour` case, the last line (may be empty)."""
    setup: object = None
    """fn(tmp) -> None: make the bad thing first."""
    code: tuple[int, ...] = (1, 2)
    check: object = None
    """fn(tmp) -> None: asserts what must hold afterwards (nothing lost, nothing non-finite written, ...)."""
    behaviour: str | None = None
    """For a case that must simply work (exit 0): what the user gets, as the table shows it."""
    env: dict | None = None
    """Environment variables for the command (None: unset it)."""


TRAIN = ["python", "train/eagle.py", "--config", "configs/eagle3-tiny.yaml", "--verifier={v}", "--output_dir={tmp}/run",
         "--data.source={data}", "--data.seq_len=32", "--data.eval_rows=2", "--train.batch_size=2",
         "--train.max_steps=3", "--train.warmup_steps=1", "--train.mixed_precision=no", "--wandb.enabled=false",
         "--eagle.ttt_steps=2", "--eagle.draft_vocab_size=200", "--eagle.layer_ids=null", "--consistency.enabled=false"]
MEDUSA = ["python", "train/medusa.py", "--config", "configs/medusa-tiny.yaml", "--verifier={v}",
          "--output_dir={tmp}/run", "--data.source={data}", "--data.seq_len=32", "--data.eval_rows=2",
          "--train.batch_size=2", "--train.max_steps=3", "--train.warmup_steps=1", "--wandb.enabled=false",
          "--consistency.enabled=false"]
EVAL = ["draftheads", "eval", "--verifier={v}", "--prompts", "{tmp}/prompts.jsonl", "--max-new-tokens", "4",
        "--out", "{tmp}/eval"]


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def prompts_file(tmp):
    write(tmp / "prompts.jsonl", json.dumps({"prompt": "def f(x):\n"}) + "\n")


def chat_prompts(tmp):
    write(tmp / "prompts.jsonl", json.dumps({"question": "What is a list?"}) + "\n")


def one_run_first(tmp, extra=()):
    """A finished tiny run in {tmp}/run to rerun against."""
    run_cli([a.format(v=VERIFIER, tmp=tmp, data=DATA) for a in TRAIN + list(extra)])


def holder(tmp, folder="run"):
    """Another process holds {tmp}/{folder} (its lock)."""
    (tmp / folder).mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 777 on "
        "node-3'); f.flush(); print('ok', flush=True); time.sleep(120)"), str(tmp / folder / ".lock")],
        stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    HOLDERS.append(proc)


HOLDERS: list = []
PROGRESS = re.compile(r"\d+%\|.*\|")  # a progress bar (transformers' "Loading weights"): not a message
WANDB_NOISE = re.compile(r"^(\x1b\[[\d;]*m)?wandb|^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")  # wandb's own log lines
VERIFIER = DATA = ROOT_TMP = None  # set by the fixture


def no_tokenizer(tmp):
    save_tiny_verifier(tmp / "bare")


def pickle_only(tmp):
    folder = tmp / "pickled"
    shutil.copytree(VERIFIER, folder)
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "pytorch_model.bin")


def corrupt(tmp):
    folder = tmp / "cut"
    shutil.copytree(VERIFIER, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def bad_rows(tmp):
    write(tmp / "rows.jsonl", '{"text": "def f(x):\\n    return x\\n"}\n{"text": 3}\n' + "not json\n")


def undecodable(tmp):
    write(tmp / "rows.jsonl", b'{"text": "def f(x):\\n    return x\\n"}\n{"text": "caf\xe9 latin-1"}\n')


def chat_rows(tmp):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    write(tmp / "chat.jsonl", (json.dumps(row) + "\n") * 12)


def a_file(tmp):
    write(tmp / "run", "not a folder")
    write(tmp / "eval", "not a folder")


def other_verifier_drafter(tmp):
    from draftheads.models.eagle import EagleConfig, build_drafter
    from draftheads.models.export import export_eagle
    from draftheads.models.verifier import Verifier

    save_tiny_verifier_with_tokenizer(tmp / "other", seed=9)
    other = Verifier.from_pretrained(tmp / "other")
    export_eagle(build_drafter(other, EagleConfig(version=1)), tmp / "drafter", other)
    prompts_file(tmp)


CASES = [
    # ---- trainer: the config
    Case("unknown config key", [*TRAIN, "--train.lrr=0.1"], r"train\.lrr"),
    Case("wrong type for a key", [*TRAIN, "--train.max_steps=ten"], r"max_steps.*ten"),
    Case("warm-up longer than the run", [*TRAIN, "--train.warmup_steps=5"], r"train.warmup_steps=5 >= train.max_steps=3"),
    Case("non-positive batch size", [*TRAIN, "--train.batch_size=0"], r"train.batch_size=0: expected a positive"),
    Case("min_lr_ratio out of [0, 1]", [*TRAIN, "--train.min_lr_ratio=2"], r"train.min_lr_ratio=2.0"),
    Case("fp16 on a machine without a GPU", [*TRAIN, "--train.mixed_precision=fp16"], r"fp16 needs a CUDA GPU"),
    Case("features=offline without a cache", [*TRAIN, "--features=offline"], r"features=offline needs feature_cache"),
    Case("feature_cache that is not a cache", [*TRAIN, "--features=offline", "--feature_cache={tmp}"],
         r"index\.json: no such file"),
    Case("EAGLE-3 layer ids out of the verifier's range", [*TRAIN, "--eagle.layer_ids=[1,2,9]"], r"\[9\] out of range"),
    Case("EAGLE-3 layer ids not increasing", [*TRAIN, "--eagle.layer_ids=[3,1,2]"], r"increasing order"),
    Case("EAGLE-3 layer ids: not three", [*TRAIN, "--eagle.layer_ids=[1,2]"], r"exactly three layer ids"),
    Case("EAGLE-1 fc bias for vLLM (dropped there without a word)",
         [*TRAIN[:3], "configs/eagle1-tiny.yaml", *TRAIN[4:], "--eagle.fc_bias=true"], r"eagle.fc_bias=true with engine vllm"),
    Case("norm_before_residual for SGLang (it has no such option)",
         [*TRAIN, "--engine=sglang", "--eagle.norm_before_residual=true"], r"norm_before_residual=true with engine sglang"),
    Case("EAGLE-1 in the speculators format (there is none)",
         [*TRAIN[:3], "configs/eagle1-tiny.yaml", *TRAIN[4:], "--engine=speculators"], r"no EAGLE-1 format"),
    Case("Medusa-2 from cached features", [*MEDUSA, "--medusa.joint=true", "--features=offline",
                                           "--feature_cache={tmp}"], r"medusa.joint=true"),
    # ---- trainer: the run folder
    Case("output_dir is a file", TRAIN, r"output_dir=.*run': a file is in the way", setup=a_file),
    Case("output_dir cannot be created", [*TRAIN[:5], "--output_dir=/proc/draftheads/run", *TRAIN[6:]],
         r"output_dir='/proc/draftheads/run': cannot create it"),
    Case("rerun of a finished run with other settings", [*TRAIN, "--train.lr=0.01"],
         r"holds another run \(its settings differ: train.lr: 0.006 -> 0.01\)", setup=one_run_first),
    Case("a second run on a folder in use", TRAIN, r"in use by another run \(pid 777 on node-3\)", setup=holder),
    Case("train.resume pointing at no checkpoint", [*TRAIN, "--train.resume={tmp}/nope"],
         r"train.resume=.*nope': not a complete checkpoint folder"),
    # ---- trainer: the verifier
    Case("verifier folder missing", [*TRAIN[:4], "--verifier={tmp}/nope", *TRAIN[5:]], r"nope' does not exist"),
    Case("verifier folder without tokenizer files", [*TRAIN[:4], "--verifier={tmp}/bare", *TRAIN[5:]],
         r"bare' has no tokenizer files", setup=no_tokenizer),
    Case("verifier with pickle weights only", [*TRAIN[:4], "--verifier={tmp}/pickled", *TRAIN[5:]],
         r"no \.safetensors weights \(found pytorch_model\.bin\)", setup=pickle_only),
    Case("verifier weights cut in half", [*TRAIN[:4], "--verifier={tmp}/cut", *TRAIN[5:]], r"cut.*safetensors",
         setup=corrupt),
    Case("seq_len beyond the verifier's context", [*TRAIN, "--data.seq_len=4096"], r"max_position_embeddings=512"),
    # ---- trainer: the data
    Case("data source missing", [*TRAIN[:6], "--data.source={tmp}/missing.jsonl", *TRAIN[7:]], r"missing\.jsonl"),
    Case("every row malformed", [*TRAIN[:6], "--data.source={tmp}/rows.jsonl", *TRAIN[7:], "--data.strict=true"],
         r"rows\.jsonl:2: .*data\.strict=false", setup=bad_rows),
    Case("bytes that are not UTF-8 (strict)", [*TRAIN[:6], "--data.source={tmp}/rows.jsonl", *TRAIN[7:],
                                               "--data.strict=true"], r"rows\.jsonl:2: byte 0xe9 .* is not UTF-8",
         setup=undecodable),
    Case("chat data, verifier without a chat template", [*TRAIN[:6], "--data.source={tmp}/chat.jsonl", *TRAIN[7:]],
         r"chat template", setup=chat_rows),
    Case("batch larger than the data", [*TRAIN, "--train.batch_size=500"], r"fewer than train.batch_size=500"),
    # ---- draftheads eval
    Case("eval: --max-new-tokens 0", [*EVAL, "--max-new-tokens", "0"], r"--max-new-tokens 0: expected a positive"),
    Case("eval: --temperature -1", [*EVAL, "--temperature", "-1"], r"--temperature -1.0: expected >= 0"),
    Case("eval: --top-p 1.5", [*EVAL, "--top-p", "1.5"], r"--top-p 1.5: expected 0 < top_p <= 1"),
    Case("eval: --num-prompts 0", [*EVAL, "--num-prompts", "0"], r"--num-prompts 0: expected a positive"),
    Case("eval: --batch-size 0", [*EVAL, "--batch-size", "0"], r"--batch-size 0: expected a positive"),
    Case("eval: --out is a file", EVAL, r"--out .*eval: a file is in the way", setup=a_file),
    Case("eval: unknown method", [*EVAL, "--method", "lookahead2"], r"unknown method 'lookahead2'"),
    Case("eval: a method that needs a drafter, without one", [*EVAL, "--method", "eagle"], r"needs a --draft"),
    Case("eval: drafter folder that is not one", [*EVAL, "--method", "eagle", "--draft", "{tmp}"],
         r"has no config\.json", setup=prompts_file),
    Case("eval: drafter trained for another verifier", [*EVAL, "--method", "eagle", "--draft", "{tmp}/drafter"],
         r"fingerprint|hidden_size|vocab_size", setup=other_verifier_drafter),
    Case("eval: unknown method option", [*EVAL, "--method", "ngram", "--option", "depth=3"], r"no option 'depth'"),
    Case("eval: method option out of range", [*EVAL, "--method", "ngram", "--option", "num_draft_tokens=-2"],
         r"num_draft_tokens", setup=prompts_file),
    Case("eval: prompts file missing", [*EVAL[:4], "{tmp}/none.jsonl", *EVAL[5:]],
         r"^error: prompt set '.*/none\.jsonl': not humaneval, mt-bench, hf:<dataset>\[:<split>\], or an existing"),
    Case("eval: chat prompts, verifier without a chat template", EVAL, r"chat prompt but the verifier's tokenizer",
         setup=chat_prompts),
    # ---- the feature cache, serve-check, regeneration
    Case("cache: dump is another verb", ["draftheads", "cache", "dump", "--config",
                                         "configs/eagle3-tiny.yaml"], r"`draftheads dump-features` fills one"),
    Case("cache verify: not a cache", ["draftheads", "cache", "verify", "{tmp}"],
         r"index\.json: no such file"),
    Case("dump: no output folder", ["draftheads", "dump-features", *TRAIN[2:]], r"no output folder"),
    Case("serve-check: -k 0", ["draftheads", "serve-check", "--verifier={v}", "--draft", "{tmp}", "-k", "0"],
         r"-k 0: expected a positive number"),
    Case("serve-check: drafter folder missing", ["draftheads", "serve-check", "--verifier={v}", "--draft",
                                                 "{tmp}/none"], r"--draft .*none: no such folder"),
    Case("regenerate: --max-new-tokens 0", ["draftheads", "regenerate", "--verifier={v}", "--source", "{data}",
                                            "--out", "{tmp}/r.jsonl", "--max-new-tokens", "0"],
         r"--max-new-tokens must be positive"),
    Case("regenerate: verifier missing", ["draftheads", "regenerate", "--verifier={tmp}/nope", "--source",
                                          "{data}", "--out", "{tmp}/r.jsonl"], r"nope"),
]


# ---- what the new cases share: a run, a cache, an eval and a drafter, each made once and copied ----------------------
def train(*extra, base=None, **flags):
    """TRAIN (or `base`) with flags replaced (`verifier="{tmp}/v"`, `source=...`, `output_dir=...`), `extra` added."""
    names = {"verifier": "--verifier=", "source": "--data.source=", "output_dir": "--output_dir="}
    out = list(base or TRAIN)
    for key, value in flags.items():
        out = [f"{names[key]}{value}" if a.startswith(names[key]) else a for a in out]
    return [*out, *extra]


def run_ok(argv: list[str]) -> None:
    code, err = run_cli(argv)
    assert code == 0, (argv, err[-3000:])


def fmt(command: list[str], tmp: Path) -> list[str]:
    return [a.format(v=VERIFIER, tmp=tmp, data=DATA) for a in command]


@functools.cache
def own_run() -> Path:
    """A folder holding copies of the verifier (v/) and the data (data.jsonl) and a finished tiny run on them (run/):
    cases that change an input in place copy it whole (mtimes kept) and change their copy."""
    base = ROOT_TMP / "own"
    shutil.copytree(VERIFIER, base / "v", copy_function=shutil.copy2)
    shutil.copy2(DATA, base / "data.jsonl")
    run_ok(fmt(train(verifier="{tmp}/v", source="{tmp}/data.jsonl"), base))
    return base


def copy_own(tmp: Path) -> None:
    for name in ("v", "data.jsonl", "run"):
        src = own_run() / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / name, **(
            {"copy_function": shutil.copy2} if src.is_dir() else {}))


OWN = dict(verifier="{tmp}/v", source="{tmp}/data.jsonl")


@functools.cache
def own_cache() -> Path:
    """A feature cache (float32) dumped from own_run()'s verifier and data, in own_run()'s folder."""
    base = own_run()
    run_ok(fmt(["draftheads", "dump-features", *train(**OWN)[2:], "--out", "{tmp}/cache", "--dtype", "float32"],
               base))
    return base / "cache"


def copy_own_cache(tmp: Path) -> None:
    copy_own(tmp)
    shutil.copytree(own_cache(), tmp / "cache", copy_function=shutil.copy2)


OFFLINE = ["--features=offline", "--feature_cache={tmp}/cache"]
OWN_OFF = {**OWN, "output_dir": "{tmp}/off"}  # an offline run is another run than own_run()'s online one


@functools.cache
def shared_eval() -> Path:
    """An eval's --out (autoregressive, greedy) on the catalogue's verifier, for the re-check cases."""
    folder = ROOT_TMP / "shared-eval"
    prompts_file(folder)
    run_ok(fmt(EVAL, folder))
    return folder / "eval"


def new_weights(path: Path, seed: int = 3) -> None:
    """Replace a verifier folder's weights in place with another tiny verifier's (same shapes)."""
    other = ROOT_TMP / f"weights-{seed}"
    if not other.exists():
        save_tiny_verifier_with_tokenizer(other, seed=seed)
    shutil.copyfile(other / "model.safetensors", path / "model.safetensors")


def nudge_last_row(path: Path) -> None:
    """Change one value in the last row of lm_head: weights that differ where the fingerprint does not look."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"][-1, -1] += 1.0
    save_file(tensors, str(file), metadata={"format": "pt"})


def reformat_json(path: Path) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4))


def append_row(path: Path) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"text": "def g(y):\n    return y - 1\n" * 4}) + "\n")


def truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def truncate_json(path: Path) -> None:
    """A JSON file cut after its second line (where it is cut does not depend on the temporary paths it holds)."""
    path.write_text("\n".join(path.read_text().splitlines()[:2]))


def no_drafter_written(tmp: Path) -> None:
    assert not (tmp / "run" / "drafter").exists(), "a drafter was exported"
    assert not list((tmp / "run").glob("step-*")), "a checkpoint was written"


def drafter_unchanged(tmp: Path) -> None:
    """The rerun continued the finished run (nothing left to train) and left its drafter as it was."""
    before = (own_run() / "run" / "drafter" / "model.safetensors").read_bytes()
    assert (tmp / "run" / "drafter" / "model.safetensors").read_bytes() == before
    meta = json.loads((tmp / "run" / "drafter" / "config.json").read_text())["draftheads"]
    assert meta["training"]["steps"] == 3


def setup_lr_yaml(tmp):
    write(tmp / "lr.yaml", "train:\n  lr: .nan\n")


def nan_verifier(tmp):
    from safetensors.torch import load_file, save_file

    shutil.copytree(VERIFIER, tmp / "nan")
    tensors = load_file(tmp / "nan" / "model.safetensors")
    tensors["model.norm.weight"][:] = float("nan")
    save_file(tensors, str(tmp / "nan" / "model.safetensors"), metadata={"format": "pt"})


def replaced_weights(tmp):
    copy_own(tmp)
    new_weights(tmp / "v")


def replaced_tokenizer(tmp):
    copy_own(tmp)
    reformat_json(tmp / "v" / "tokenizer.json")


def edited_config(tmp):
    copy_own(tmp)
    config = json.loads((tmp / "v" / "config.json").read_text())
    config["rope_theta"] = 5000.0
    (tmp / "v" / "config.json").write_text(json.dumps(config))


def touched_verifier(tmp):
    copy_own(tmp)
    os.utime(tmp / "v" / "model.safetensors")


def verifier_elsewhere(tmp):
    copy_own(tmp)
    shutil.copytree(tmp / "v", tmp / "elsewhere")  # new mtimes: read again, found the same


def edited_data(tmp):
    copy_own(tmp)
    append_row(tmp / "data.jsonl")


def data_folder_grows(tmp):
    folder = tmp / "data"
    folder.mkdir()
    shutil.copy2(DATA, folder / "a.jsonl")
    run_ok(fmt(train(source="{tmp}/data"), tmp))
    shutil.copy2(DATA, folder / "b.jsonl")


def data_moved(tmp):
    copy_own(tmp)
    (tmp / "moved").mkdir()
    os.replace(tmp / "data.jsonl", tmp / "moved" / "rows.jsonl")


CHAT = ["--data.source={tmp}/chat.jsonl", "--data.chat_template={tmp}/chat.jinja"]


def edited_template(tmp):
    from draftheads.data.chat import CHATML_TEMPLATE

    chat_rows(tmp)
    write(tmp / "chat.jinja", CHATML_TEMPLATE)
    run_ok(fmt(train(*CHAT[1:], source="{tmp}/chat.jsonl"), tmp))
    write(tmp / "chat.jinja", CHATML_TEMPLATE.replace("\\n", "\\n\\n", 1))


def foreign_checkpoint(tmp):
    copy_own(tmp)
    run_ok(fmt(train("--train.lr=0.001", **OWN, output_dir="{tmp}/other"), tmp))
    shutil.rmtree(tmp / "run" / "step-000003")
    shutil.copytree(tmp / "other" / "step-000003", tmp / "run" / "step-000003")


def other_shapes_run(tmp):
    copy_own(tmp)
    run_ok(fmt(train("--eagle.draft_vocab_size=100", **OWN, output_dir="{tmp}/other"), tmp))


def same_run_elsewhere(tmp):
    copy_own(tmp)


def damaged_checkpoint(tmp):
    copy_own(tmp)
    shutil.rmtree(tmp / "run" / "drafter")  # as if killed between the last checkpoint and the export
    truncate(tmp / "run" / "step-000003" / "model.safetensors")


def checkpoint_without_record(tmp):
    copy_own(tmp)
    (tmp / "run" / "step-000003" / "run.json").unlink()


def truncated_record(tmp):
    copy_own(tmp)
    truncate(tmp / "run" / "run.json")


def start_over_after_change(tmp):
    edited_data(tmp)


def moved_aside(tmp):
    previous = [p for p in (tmp / "run").iterdir() if p.name.startswith("previous-")]
    assert len(previous) == 1 and (previous[0] / "step-000003").is_dir()
    assert (tmp / "run" / "drafter").is_dir()


def failed_then_fixed(tmp):
    bad_rows(tmp)
    code, _ = run_cli(fmt(train("--data.strict=true", source="{tmp}/rows.jsonl"), tmp))
    assert code == 1
    write(tmp / "rows.jsonl", DATA.read_text())


def cache_in_fp32(tmp):
    copy_own_cache(tmp)


def cache_data_edited(tmp):
    copy_own_cache(tmp)
    append_row(tmp / "data.jsonl")


def cache_verifier_changed(tmp):
    copy_own_cache(tmp)
    nudge_last_row(tmp / "v")


def cache_redumped(tmp):
    copy_own_cache(tmp)
    run_ok(fmt(train(*OFFLINE, **OWN_OFF), tmp))
    shutil.rmtree(tmp / "cache")
    append_row(tmp / "data.jsonl")
    run_ok(fmt(["draftheads", "dump-features", *train(**OWN)[2:], "--out", "{tmp}/cache", "--dtype", "float32"], tmp))


def cache_shard_truncated(tmp):
    copy_own_cache(tmp)
    truncate(tmp / "cache" / "train-00000.safetensors", 0.9)


def cache_shard_deleted(tmp):
    copy_own_cache(tmp)
    (tmp / "cache" / "train-00000.safetensors").unlink()


def cache_bytes_flipped(tmp):
    copy_own_cache(tmp)
    shard = tmp / "cache" / "train-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10:] = bytes(b ^ 0xFF for b in data[-10:])
    shard.write_bytes(bytes(data))


def cache_index_truncated(tmp):
    copy_own_cache(tmp)
    truncate_json(tmp / "cache" / "index.json")


def cache_source_gone(tmp):
    copy_own_cache(tmp)
    (tmp / "data.jsonl").unlink()


def dumped(tmp):
    copy_own(tmp)
    run_ok(fmt(["draftheads", "dump-features", *train(**OWN)[2:], "--out", "{tmp}/cache"], tmp))


def dumped_then_data_edited(tmp):
    dumped(tmp)
    (tmp / "cache" / "index.json").unlink()  # as if stopped before the end
    append_row(tmp / "data.jsonl")


def dumped_twice(tmp):
    copy_own(tmp)
    run_ok(fmt(["draftheads", "dump-features", *train(**OWN)[2:], "--out", "{tmp}/first"], tmp))


def same_bytes_as_first(tmp):
    from draftheads.data.identity import sha256_file

    first, second = tmp / "first", tmp / "cache"
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and "index.json" in names
    assert {n: sha256_file(first / n) for n in names} == {n: sha256_file(second / n) for n in names}


def eval_in_use(tmp):
    prompts_file(tmp)
    write(tmp / "eval" / "results.json", '{"first": "eval"}\n')
    holder(tmp, "eval")


def results_kept(tmp):
    assert (tmp / "eval" / "results.json").read_text() == '{"first": "eval"}\n'


def interrupt_when(path: Path) -> None:
    """Ctrl-C (a real SIGINT to this process) as soon as `path` exists, i.e. once the command is under way."""
    def fire():
        for _ in range(6000):
            if path.exists():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.005)

    threading.Thread(target=fire, daemon=True).start()


def ctrl_c_eval(tmp):
    prompts_file(tmp)
    interrupt_when(tmp / "eval")


def ctrl_c_eval_existing(tmp):
    prompts_file(tmp)
    write(tmp / "eval" / "results.json", '{"first": "eval"}\n')
    interrupt_when(tmp / "eval" / ".lock")


def no_empty_out(tmp):
    assert not (tmp / "eval").exists(), "an empty --out was left behind"


def drafter_for(tmp, change=None):
    """The own run's drafter and a copy of its verifier (changed by `change`), with a prompts file."""
    prompts_file(tmp)
    shutil.copytree(own_run() / "v", tmp / "v", copy_function=shutil.copy2)
    shutil.copytree(own_run() / "run" / "drafter", tmp / "drafter")
    if change:
        change(tmp)


def tokenizer_changed_since(tmp):
    drafter_for(tmp, lambda t: reformat_json(t / "v" / "tokenizer.json"))


def weights_changed_since(tmp):
    drafter_for(tmp, lambda t: nudge_last_row(t / "v"))


def drafter_weights_cut(tmp):
    drafter_for(tmp, lambda t: truncate(t / "drafter" / "model.safetensors"))


def drafter_config_cut(tmp):
    drafter_for(tmp, lambda t: truncate_json(t / "drafter" / "config.json"))


def bad_prompt_row(tmp):
    write(tmp / "prompts.jsonl", json.dumps({"prompt": "def f(x):\n"}) + "\n" + json.dumps({"prompt": ""}) + "\n")


def recheck_cut(tmp):
    shutil.copy(shared_eval() / "results.json", tmp / "results.json")
    truncate_json(tmp / "results.json")


def recheck_no_samples(tmp):
    results = json.loads((shared_eval() / "results.json").read_text())
    del results["samples"]
    write(tmp / "results.json", json.dumps(results))


def recheck_other(tmp):
    save_tiny_verifier_with_tokenizer(tmp / "other", seed=9)
    shutil.copytree(shared_eval(), tmp / "eval")


def recheck_changed_since(tmp):
    shutil.copytree(shared_eval(), tmp / "eval")
    shutil.copytree(VERIFIER, tmp / "v", copy_function=shutil.copy2)
    reformat_json(tmp / "v" / "tokenizer.json")


def recheck_same(tmp):
    shutil.copytree(shared_eval(), tmp / "eval")


NO_KEY = {"WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": "/nonexistent/netrc"}
UNREACHABLE = {"WANDB_MODE": None, "WANDB_API_KEY": "a" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
WANDB = ["--wandb.enabled=true"]


def exported(tmp, folder="run"):
    assert (tmp / folder / "drafter" / "model.safetensors").is_file()


def exported_offline(tmp):
    exported(tmp)
    assert list((tmp / "run" / "wandb").glob("offline-run-*")), "no offline wandb run"


def exported_with_wandb_below_run(tmp):
    exported(tmp)
    assert (tmp / "run" / "wandb" / "data").is_dir()


def csv_source(tmp):
    write(tmp / "rows.csv", "text\nhello\n")


def empty_folder(tmp):
    (tmp / "rows").mkdir()
    write(tmp / "rows" / "notes.bin", b"\x00")


def verifier_file(tmp):
    write(tmp / "v.safetensors", b"not a folder")


def verifier_bad_config(tmp):
    shutil.copytree(VERIFIER, tmp / "v")
    truncate_json(tmp / "v" / "config.json")


DUMP = ["draftheads", "dump-features"]
RECHECK = ["draftheads", "recheck"]

def run_and_peer(tmp):
    """A finished-looking training run folder, and another trainer's drafter folder to import."""
    write(tmp / "run" / "run.json", "{}")
    write(tmp / "run" / "config.yaml", "verifier: x\n")
    write(tmp / "run" / "step-000003" / "COMPLETE", "")
    write(tmp / "run" / "drafter" / "config.json", json.dumps({"draftheads": {"method": "eagle3"}}))
    write(tmp / "peer" / "config.json", json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))


def run_intact(tmp):
    names = sorted(str(p.relative_to(tmp / "run")) for p in (tmp / "run").rglob("*"))
    assert names == ["config.yaml", "drafter", "drafter/config.json", "run.json", "step-000003",
                     "step-000003/COMPLETE"], names


def a_cache(tmp):
    write(tmp / "cache" / "index.json", json.dumps({"format": "draftheads-hidden-states"}))


def a_folder_of_notes(tmp):
    write(tmp / "mine" / "notes.txt", "mine\n")


CASES += [
    # ---- every setting in range before anything loads
    Case("learning rate 1e999 (inf)", [*TRAIN, "--train.lr=1e999"], r"train\.lr=inf: expected a finite number > 0",
         check=no_drafter_written),
    Case("learning rate `.nan` in the YAML", [*TRAIN, "--config", "{tmp}/lr.yaml"], r"train\.lr=nan: expected a finite",
         setup=setup_lr_yaml),
    Case("learning rate beyond float32", [*TRAIN, "--train.lr=1e39"], r"train\.lr=1e\+39: .*at most 3\.4e\+38"),
    Case("AdamW betas out of [0, 1)", [*TRAIN, "--train.betas=[1.5,0.9]"],
         r"train\.betas=\[1\.5, 0\.9\]: expected two"),
    Case("AdamW betas: one value", [*TRAIN, "--train.betas=[0.9]"], r"train\.betas"),
    Case("negative grad_clip (it used to turn clipping off)", [*TRAIN, "--train.grad_clip=-1"],
         r"train\.grad_clip=-1\.0: expected a finite norm >= 0 \(0 turns clipping off\)"),
    Case("negative weight decay", [*TRAIN, "--train.weight_decay=-0.1"], r"train\.weight_decay=-0\.1: expected"),
    Case("a non-finite value in any section", [*TRAIN, "--consistency.tolerance=1e999"],
         r"consistency\.tolerance=inf: expected a finite number"),
    Case("TTT steps beyond the sequence", [*TRAIN, "--eagle.ttt_steps=40"],
         r"eagle\.ttt_steps=40 with data\.seq_len=32: .*set eagle\.ttt_steps <= 30"),
    Case("Medusa heads beyond the sequence", [*MEDUSA, "--medusa.num_heads=40"],
         r"medusa\.num_heads=40 with data\.seq_len=32: .*never see a target"),
    Case("draft vocabulary smaller than the draft tree's top-k", [*TRAIN, "--eagle.draft_vocab_size=1"],
         r"eagle\.draft_vocab_size=1: .*top 4 draft tokens"),
    Case("data.seq_len below 8", [*TRAIN, "--data.seq_len=4"], r"data\.seq_len=4: expected at least 8"),
    # ---- the numerical guard
    Case("a learning rate whose update overflows float32", [*TRAIN, "--train.lr=1e38"],
         r"step 1: the update (overflows float32|made the drafter's weights non-finite).*stopping without "
         r"checkpointing or exporting",  # torch's fused AdamW writes inf where the loop one raises
         check=no_drafter_written),
    Case("a learning rate whose update overflows float32, bf16 optimizer state", [*TRAIN, "--train.lr=1e38",
         "--train.optimizer_state=bfloat16"],
         r"step 1: the update overflows float32 \(value cannot be converted.*\); stopping without checkpointing or "
         r"exporting", check=no_drafter_written),
    Case("a learning rate that wrecks the weights (the losses turn NaN)", [*TRAIN, "--train.lr=1e20"],
         r"the run's last 2 step\(s\) had a non-finite loss; stopping without checkpointing or exporting",
         check=no_drafter_written),
    Case("a verifier whose weights hold NaN", train(verifier="{tmp}/nan"),
         r"all 3 steps had a non-finite loss, so nothing was trained", setup=nan_verifier, check=no_drafter_written),
    # ---- a run is what it was made from: contents, not paths
    Case("verifier weights replaced in place, then the same command", train(**OWN),
         r"holds a run made from other inputs \(the verifier: model\.safetensors changed \(sha256 \w+ -> \w+\)\)",
         setup=replaced_weights),
    Case("verifier tokenizer rewritten in place", train(**OWN), r"the verifier: tokenizer\.json changed",
         setup=replaced_tokenizer),
    Case("verifier config.json edited in place", train(**OWN), r"the verifier: config\.json changed",
         setup=edited_config),
    Case("verifier touched (same bytes), same command", train(**OWN), r"^$", setup=touched_verifier, code=(0,),
         check=drafter_unchanged, behaviour="continues the run (the bytes are read again and found the same)"),
    Case("verifier copied elsewhere (same bytes), run pointed at the copy", train(**{**OWN, "verifier":
                                                                                   "{tmp}/elsewhere"}),
         r"^$", setup=verifier_elsewhere, code=(0,), check=drafter_unchanged,
         behaviour="continues the run: a verifier is its contents, not its path"),
    Case("data file edited after the run (a row appended)", train(**OWN),
         r"made from other inputs \(data\.source: data\.jsonl changed", setup=edited_data),
    Case("data folder: a file added after the run", train(source="{tmp}/data"),
         r"made from other inputs \(data\.source: b\.jsonl added\)", setup=data_folder_grows),
    Case("data file moved (same bytes), run pointed at the new path", train(**{**OWN, "source":
                                                                              "{tmp}/moved/rows.jsonl"}),
         r"^$", setup=data_moved, code=(0,), check=drafter_unchanged,
         behaviour="continues the run: the data is its contents, not its path"),
    Case("chat template file edited after the run", train(*CHAT[1:], source="{tmp}/chat.jsonl"),
         r"data\.chat_template: chat\.jinja changed", setup=edited_template),
    Case("another run's checkpoint copied into the run folder", train(**OWN),
         r"run/step-000003 is another run's checkpoint \(its settings differ: train\.lr: 0\.001 -> 0\.006\); move it "
         r"out", setup=foreign_checkpoint),
    Case("train.resume= another run's checkpoint of other shapes",
         train("--train.resume={tmp}/other/step-000003", **OWN, output_dir="{tmp}/new"),
         r"train\.resume='.*other/step-000003' is another run's checkpoint \(its settings differ: "
         r"eagle\.draft_vocab_size: 100 -> 200\)", setup=other_shapes_run),
    Case("train.resume= this run's checkpoint, in a new folder", train("--train.resume={tmp}/run/step-000003", **OWN,
                                                                       output_dir="{tmp}/new"),
         r"^$", setup=same_run_elsewhere, code=(0,),
         behaviour="continues from it (the same settings and inputs: the same run)"),
    Case("the checkpoint to continue from is truncated", train(**OWN),
         r"cannot load checkpoint .*run/step-000003 \(.*\); it is damaged: move it out", setup=damaged_checkpoint),
    Case("a checkpoint without its run record (copied by hand)", train(**OWN),
         r"step-000003: the checkpoint carries no run record \(run\.json\)", setup=checkpoint_without_record),
    Case("run.json truncated", train(**OWN), r"run/run\.json: unreadable run record", setup=truncated_record),
    Case("--train.resume=none after the data changed", train("--train.resume=none", **OWN), r"^$",
         setup=start_over_after_change, code=(0,), check=moved_aside,
         behaviour="starts over: the earlier run is moved to previous-<time>/, the new one trains"),
    Case("a first attempt failed on bad rows, the file fixed, the same command", train(source="{tmp}/rows.jsonl"),
         r"^$", setup=failed_then_fixed, code=(0,), check=exported,
         behaviour="trains: a folder with nothing trained in it is taken over"),
    # ---- the offline cache
    Case("cache of fp32 features, run with verifier_dtype=bfloat16",
         train(*OFFLINE, "--verifier_dtype=bfloat16", **OWN_OFF),
         r"index\.json: the cache holds features of the verifier run in float32 .*this run has "
         r"verifier_dtype=bfloat16", setup=cache_in_fp32),
    Case("cache of another seed", train(*OFFLINE, "--train.seed=1", **OWN_OFF),
         r"rows built with train\.seed=0, this run has train\.seed=1", setup=cache_in_fp32),
    Case("cache of another seq_len", train(*OFFLINE, "--data.seq_len=24", **OWN_OFF),
         r"rows built with data\.seq_len=32, this run has data\.seq_len=24", setup=cache_in_fp32),
    Case("cache whose data file changed after the dump", train(*OFFLINE, **OWN_OFF),
         r"index\.json: the cache holds rows of data\.source=.* now differs: data\.jsonl changed",
         setup=cache_data_edited),
    Case("cache whose verifier changed after the dump", train(*OFFLINE, **OWN_OFF),
         r"index\.json: the cache was dumped from verifier .* differs from it: model\.safetensors changed",
         setup=cache_verifier_changed),
    Case("cache dumped again from other data between a run and its rerun", train(*OFFLINE, **OWN_OFF),
         r"made from other inputs \(data\.source: data\.jsonl changed .*; the feature cache: index\.json changed",
         setup=cache_redumped),
    Case("cache shard truncated", train(*OFFLINE, **OWN_OFF),
         r"train-00000\.safetensors: \d+ bytes, index\.json records",
         setup=cache_shard_truncated),
    Case("cache shard deleted", train(*OFFLINE, **OWN_OFF), r"train-00000\.safetensors: shard missing",
         setup=cache_shard_deleted),
    Case("cache verify: shard bytes flipped, same size", ["draftheads", "cache", "verify", "{tmp}/cache"],
         r"train-00000\.safetensors: sha256 differs from index\.json", setup=cache_bytes_flipped),
    Case("cache verify: index.json truncated", ["draftheads", "cache", "verify", "{tmp}/cache"],
         r"index\.json: not valid JSON", setup=cache_index_truncated),
    Case("offline run whose data file is gone since the dump", train(*OFFLINE, **OWN_OFF), r"^$",
         setup=cache_source_gone, code=(0,), check=lambda tmp: exported(tmp, "off"),
         behaviour="trains: the cache holds the rows"),
    # ---- the dump
    Case("dump: verifier missing", [*DUMP, *train(verifier="{tmp}/nope")[2:], "--out", "{tmp}/cache"],
         r"verifier folder '.*nope' does not exist"),
    Case("dump: data source missing", [*DUMP, *train(source="{tmp}/missing.jsonl")[2:], "--out", "{tmp}/cache"],
         r"data\.source='.*missing\.jsonl': no such file"),
    Case("dump: --config file missing", [*DUMP, "--config", "{tmp}/none.yaml", "--out", "{tmp}/cache"],
         r"--config .*none\.yaml: no such file"),
    Case("dump: restarted with another --dtype", [*DUMP, *train(**OWN)[2:], "--out", "{tmp}/cache", "--dtype",
                                                  "float16"],
         r"plan\.json: this cache was started with dtype='bfloat16', this dump has dtype='float16'", setup=dumped),
    Case("dump: restarted after the data changed", [*DUMP, *train(**OWN)[2:], "--out", "{tmp}/cache"],
         r"plan\.json: this cache was started from other inputs \(data\.source: data\.jsonl changed",
         setup=dumped_then_data_edited),
    Case("dump: the same dump twice", [*DUMP, *train(**OWN)[2:], "--out", "{tmp}/cache"], r"^$", setup=dumped_twice,
         code=(0,), check=same_bytes_as_first,
         behaviour="the same bytes, file for file (shards, sidecars, plan and index): caches compare by hash"),
    Case("dump: --rows-per-shard 0", [*DUMP, *train()[2:], "--out", "{tmp}/cache", "--rows-per-shard", "0"],
         r"rows_per_shard=0: expected a positive count"),
    # ---- draftheads eval
    Case("eval: two evals into one --out", EVAL,
         r"--out .*eval is in use by another draftheads eval or tune \(pid 777 on node-3\); wait for it to end",
         setup=eval_in_use, check=results_kept),
    Case("tune: into an --out an eval is writing", ["draftheads", "tune", "--verifier={v}", "--candidate", "ngram",
                                                    "--prompts", "{tmp}/prompts.jsonl", "--out", "{tmp}/eval"],
         r"--out .*eval is in use by another draftheads eval or tune \(pid 777 on node-3\)", setup=eval_in_use,
         check=results_kept),
    Case("eval: Ctrl-C while it runs", EVAL, r"stopped by SIGINT \(Ctrl-C\) before the results were written",
         setup=ctrl_c_eval, code=(130,), check=no_empty_out),
    Case("eval: Ctrl-C, into an --out holding earlier results", EVAL,
         r"stopped by SIGINT \(Ctrl-C\) before the results were written", setup=ctrl_c_eval_existing, code=(130,),
         check=results_kept),
    Case("eval: --wandb, WANDB_MODE=online and no API key", [*EVAL, "--wandb"],
         r"WANDB_MODE=online but no wandb API key is configured", setup=prompts_file,
         env={**NO_KEY, "WANDB_MODE": "online"}, check=no_empty_out),
    Case("eval: --out cannot be created", [*EVAL[:-1], "/proc/draftheads/eval"],
         r"--out /proc/draftheads/eval: cannot create it"),
    Case("eval: the drafter's verifier tokenizer rewritten since training",
         [*EVAL[:2], "--verifier={tmp}/v", *EVAL[3:], "--method", "eagle", "--draft", "{tmp}/drafter"],
         r"verifier '.*v' is not the one drafter '.*drafter' was trained on: tokenizer\.json changed",
         setup=tokenizer_changed_since),
    Case("eval: the drafter's verifier weights changed where the fingerprint does not look",
         [*EVAL[:2], "--verifier={tmp}/v", *EVAL[3:], "--method", "eagle", "--draft", "{tmp}/drafter"],
         r"is not the one drafter .* was trained on: model\.safetensors changed", setup=weights_changed_since),
    Case("eval: the drafter's verifier copied elsewhere (same bytes)",
         [*EVAL[:2], "--verifier={tmp}/v", *EVAL[3:], "--method", "eagle", "--draft", "{tmp}/drafter"],
         r"^$", setup=drafter_for, code=(0,), behaviour="runs: the verifier is the one it was trained on, by content"),
    Case("eval: drafter weights truncated", [*EVAL, "--method", "eagle", "--draft", "{tmp}/drafter"],
         r"drafter/model\.safetensors: corrupt or unreadable safetensors file", setup=drafter_weights_cut),
    Case("eval: drafter config.json truncated", [*EVAL, "--method", "eagle", "--draft", "{tmp}/drafter"],
         r"drafter/config\.json: not valid JSON", setup=drafter_config_cut),
    Case("eval: EAGLE tree wider than the draft vocabulary",
         [*EVAL[:2], "--verifier={tmp}/v", *EVAL[3:], "--method", "eagle", "--draft", "{tmp}/drafter", "--option",
          "top_k=300"], r"top_k=300, but the drafter drafts from a vocabulary of 200 tokens", setup=drafter_for),
    Case("eval: an EAGLE drafter given as --method medusa",
         [*EVAL[:2], "--verifier={tmp}/v", *EVAL[3:], "--method", "medusa", "--draft", "{tmp}/drafter"],
         r"drafter method is 'eagle3', expected 'medusa'", setup=drafter_for),
    Case("eval: a prompt row with an empty prompt", EVAL, r"prompts\.jsonl:2: `prompt` must be a non-empty string",
         setup=bad_prompt_row),
    # ---- draftheads recheck
    Case("recheck: folder missing", [*RECHECK, "{tmp}/nope"], r"nope: no such results file"),
    Case("recheck: results.json truncated", [*RECHECK, "{tmp}/results.json"],
         r"results\.json: not valid JSON .*truncated", setup=recheck_cut),
    Case("recheck: results.json without samples", [*RECHECK, "{tmp}/results.json"],
         r"results\.json: no `samples`", setup=recheck_no_samples),
    Case("recheck: results of another verifier", [*RECHECK, "{tmp}/eval", "--verifier={tmp}/other"],
         r"has fingerprint \w+, the run's had \w+: not the same weights", setup=recheck_other),
    Case("recheck: the run's verifier tokenizer rewritten since", [*RECHECK, "{tmp}/eval", "--verifier={tmp}/v"],
         r"is not the one the run was measured with: tokenizer\.json changed", setup=recheck_changed_since),
    Case("recheck: a greedy run, as it was", [*RECHECK, "{tmp}/eval"], r"^$", setup=recheck_same, code=(0,),
         behaviour="every output equals plain greedy decoding of the verifier"),
    # ---- wandb and HOME
    Case("wandb.mode=online without an API key", train(*WANDB, "--wandb.mode=online"),
         r"wandb\.mode=online but no wandb API key is configured", env=NO_KEY, check=no_drafter_written),
    Case("wandb.mode=online, the wandb server unreachable", train(*WANDB, "--wandb.mode=online"),
         r"wandb\.mode=online but the wandb server is 127\.0\.0\.1:9 unreachable", env=UNREACHABLE,
         check=no_drafter_written),
    Case("wandb auto with an API key, the server unreachable", train(*WANDB), r"^$", env=UNREACHABLE, code=(0,),
         check=exported_offline, behaviour="logs offline (one line says so), trains and exports"),
    Case("HOME not writable, wandb on", train(*WANDB), r"^$", env={"HOME": "/proc/nohome", "WANDB_MODE": "offline"},
         code=(0,), check=exported_with_wandb_below_run,
         behaviour="trains and exports; wandb's folders move under the run folder (one line says so)"),
    # ---- data and verifier
    Case("data.eval_rows leaves no training rows", [*TRAIN, "--data.eval_rows=12"],
         r"data\.eval_rows=12 leaves no training rows"),
    Case("data source of an unsupported type", train(source="{tmp}/rows.csv"), r"unsupported file type '\.csv'",
         setup=csv_source),
    Case("data folder without data files", train(source="{tmp}/rows"), r"the folder has no \.json/\.jsonl",
         setup=empty_folder),
    Case("verifier that is a file", train(verifier="{tmp}/v.safetensors"), r"is a file; expected a model folder",
         setup=verifier_file),
    Case("verifier config.json truncated", train(verifier="{tmp}/v"),
         r"verifier folder '.*v': cannot read config\.json", setup=verifier_bad_config),
    # ---- a command that writes a folder never replaces one it does not own (models/outputs.py)
    Case("import-peer --fix onto a training run folder", ["draftheads", "import-peer", "--verifier={v}", "--draft",
                                                         "{tmp}/peer", "--fix", "{tmp}/run"],
         r"--fix .*run: it holds a training run folder .*nothing was written", setup=run_and_peer, check=run_intact),
    Case("build-verifier --out onto a feature cache", ["draftheads", "build-verifier", "--recipe", "micro", "--out",
                                                      "{tmp}/cache"],
         r"--out .*cache: it holds a feature cache .*nothing was written", setup=a_cache),
    Case("eval --out onto a training run folder", [*EVAL[:-1], "{tmp}/run"],
         r"--out .*run: it holds a training run folder", setup=run_and_peer, check=run_intact),
    Case("dump-features --out onto a folder of other files", ["draftheads", "dump-features", *TRAIN[2:], "--out",
                                                             "{tmp}/mine"],
         r"--out .*mine: it holds a folder of 1 other entry \(notes\.txt\)", setup=a_folder_of_notes),
]



# ---- the surfaces added since: import-peer, the output rule on every writing verb, the cache, regenerate, config keys
def snap(path: Path):
    """What `path` holds, byte for byte: a file's bytes, a folder's {relative path: bytes or None for a folder}."""
    if path.is_file():
        return path.read_bytes()
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


SNAPSHOTS: dict = {}


def kept(setup, *names):
    """setup= and check= for a case whose command must leave {tmp}/<name> (each of `names`) as it was: `setup`, then a
    snapshot of each; the check compares byte for byte."""
    def first(tmp):
        setup(tmp)
        SNAPSHOTS[tmp] = {name: snap(tmp / name) for name in names}

    def same(tmp):
        for name in names:
            assert (tmp / name).exists() and snap(tmp / name) == SNAPSHOTS[tmp][name], f"{name} was changed"

    return dict(setup=first, check=same)


def other_seed_drafter(tmp):
    """The own run's drafter, with a verifier of the same shapes but other weights (another seed) beside it."""
    drafter_for(tmp, lambda t: new_weights(t / "v"))


def short_d2t(tmp):
    """The own run's drafter with its d2t cut to fewer ids than lm_head has rows."""
    from safetensors.torch import load_file, save_file

    drafter_for(tmp)
    file = tmp / "drafter" / "model.safetensors"
    tensors = load_file(file)
    tensors["d2t"] = tensors["d2t"][:150].contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def peer_and(kind):
    """A drafter folder to import, and {tmp}/out holding `kind`: a cache, an eval's results or a file."""
    def setup(tmp):
        drafter_for(tmp)
        if kind == "cache":
            write(tmp / "out" / "index.json", json.dumps({"format": "draftheads-hidden-states"}))
        elif kind == "eval":
            shutil.copytree(shared_eval(), tmp / "out")
        else:
            write(tmp / "out", "not a folder")
    return setup


def eval_results(tmp):
    prompts_file(tmp)
    shutil.copytree(shared_eval(), tmp / "eval")


def run_and_prompts(tmp):
    run_and_peer(tmp)
    prompts_file(tmp)


def cache_and_prompts(tmp):
    a_cache(tmp)
    prompts_file(tmp)


def cache_negative_id(tmp):
    """A shard whose row 1 starts with token id -7, its sidecar and index.json rewritten to the new sha256 (as a
    dump with a bug, or a hand edit, would leave it: every hash agrees)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from draftheads.data.identity import sha256_file

    copy_own_cache(tmp)
    shard = tmp / "cache" / "train-00000.safetensors"
    old = sha256_file(shard)
    with safe_open(shard, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(shard)
    tensors["input_ids"][1, 0] = -7
    save_file(tensors, str(shard), metadata=metadata)  # the same header: the same size
    new = sha256_file(shard)
    for name in ("index.json", "train-00000.json"):
        path = tmp / "cache" / name
        if path.exists():
            path.write_text(path.read_text().replace(old, new))


def surrogate_rows(tmp):
    write(tmp / "rows.jsonl", "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) + "\n"
                                      for i in range(12)) + '{"text": "caf\\ud800 def g(y):\\n    return y\\n"}\n')


def mixed_dflash(tmp):
    """A DFlash export whose two layers are one sliding, one full (vLLM serves that only with its V2 runner, on a
    GPU)."""
    from draftheads.models.dflash import DFlashConfig, build_drafter
    from draftheads.models.export import export_dflash
    from draftheads.models.verifier import Verifier

    prompts_file(tmp)
    verifier = Verifier.from_pretrained(VERIFIER)
    cfg = DFlashConfig(num_hidden_layers=2, block_size=5, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=5)
    export_dflash(build_drafter(verifier, cfg), tmp / "dflash", verifier)


def not_judged(why: str):
    """The check of a serve-check case: its one report (--json) is not passed and says why it was not run (`why`, a
    regex), so no vLLM was asked (a start would have ended in `DRAFTHEADS_VLLM_PYTHON=...: no such file`)."""
    def check(tmp):
        reports = json.loads((tmp / "report.json").read_text())
        assert len(reports) == 1 and not reports[0]["passed"], reports
        said = f"{reports[0]['not_run'] or ''} {reports[0]['unjudged'] or ''}"
        assert re.search(why, said), said
    return check


def medusa_replaced(tmp):
    """An eval's results.json whose Medusa-2 drafter folder was replaced after the run (the recorded digest is not
    the folder's)."""
    write(tmp / "medusa" / "config.json", json.dumps({"draftheads": {"method": "medusa"}}))
    results = json.loads((shared_eval() / "results.json").read_text())
    results["config"]["methods"] = [{"label": "medusa", "method": "medusa", "draft": str(tmp / "medusa"),
                                     "draft_digest": "0000000000000000", "options": {}}]
    write(tmp / "results.json", json.dumps(results))


def eagle1_drafter(tmp):
    """An EAGLE-1 drafter exported for the catalogue's verifier."""
    from draftheads.models.eagle import EagleConfig, build_drafter
    from draftheads.models.export import export_eagle
    from draftheads.models.verifier import Verifier

    verifier = Verifier.from_pretrained(VERIFIER)
    export_eagle(build_drafter(verifier, EagleConfig(version=1)), tmp / "eagle1", verifier)


IMPORT = ["draftheads", "import-peer", "--verifier={tmp}/v", "--draft", "{tmp}/drafter"]
SERVE = ["draftheads", "serve-check", "--verifier={v}", "--prompts", "{tmp}/prompts.jsonl", "--num-prompts", "1",
         "--max-new-tokens", "4", "--json", "{tmp}/report.json", "--draft"]
NO_VLLM = {"DRAFTHEADS_VLLM_PYTHON": "/nonexistent/python"}
REGEN = ["draftheads", "regenerate", "--verifier={v}", "--source", "{data}", "--out", "{tmp}/r.jsonl",
         "--max-new-tokens", "2"]
DFLASH = ["draftheads", "train", "dflash", "--config", "configs/dflash-tiny.yaml", "--verifier={v}",
          "--output_dir={tmp}/run", "--data.source={data}", "--data.seq_len=32", "--data.eval_rows=2",
          "--train.batch_size=2", "--train.max_steps=3", "--train.warmup_steps=1", "--train.mixed_precision=no",
          "--wandb.enabled=false"]
EAGLE1 = [*TRAIN[:3], "configs/eagle1-tiny.yaml", *TRAIN[4:]]

CASES += [
    # ---- import-peer
    Case("import-peer: a draftheads drafter trained for another verifier (same shapes, other weights)", IMPORT,
         r"--draft .*drafter: trained for verifier .*\(fingerprint \w+\), not --verifier .*\(fingerprint \w+\): "
         r".*--retarget", setup=other_seed_drafter),
    Case("import-peer: the same, with --retarget", [*IMPORT, "--retarget", "--fix", "{tmp}/fixed"], r"^$",
         setup=other_seed_drafter, code=(0,), check=lambda tmp: (tmp / "fixed" / "model.safetensors").is_file(),
         behaviour="writes the fixed folder for this verifier (the user says the drafter is meant for it)"),
    Case("import-peer --fix: a d2t shorter than lm_head's rows", [*IMPORT, "--fix", "{tmp}/fixed"],
         r"d2t maps 150 draft ids but lm_head\.weight has 200 rows", setup=short_d2t),
    Case("import-peer --fix onto a feature cache", [*IMPORT, "--fix", "{tmp}/out"],
         r"--fix .*out: it holds a feature cache .*nothing was written", **kept(peer_and("cache"), "out")),
    Case("import-peer --fix onto an eval's output", [*IMPORT, "--fix", "{tmp}/out"],
         r"--fix .*out: it holds a `draftheads eval` output .*nothing was written", **kept(peer_and("eval"), "out")),
    Case("import-peer --fix onto a file", [*IMPORT, "--fix", "{tmp}/out"], r"--fix .*out: a file is in the way",
         **kept(peer_and("file"), "out")),
    # ---- the output rule on every writing verb (models/outputs.py)
    Case("build-verifier --out onto a training run folder", ["draftheads", "build-verifier", "--recipe", "micro",
                                                            "--out", "{tmp}/run"],
         r"--out .*run: it holds a training run folder .*nothing was written", **kept(run_and_peer, "run")),
    Case("build-verifier --out onto a drafter folder", ["draftheads", "build-verifier", "--recipe", "micro", "--out",
                                                       "{tmp}/drafter"],
         r"--out .*drafter: it holds a draftheads drafter folder .*nothing was written", **kept(drafter_for,
                                                                                              "drafter")),
    Case("dump-features --out onto an eval's output", [*DUMP, *TRAIN[2:], "--out", "{tmp}/eval"],
         r"--out .*eval: it holds a `draftheads eval` output .*nothing was written", **kept(eval_results, "eval")),
    Case("dump-features --out onto a file", [*DUMP, *TRAIN[2:], "--out", "{tmp}/run"],
         r"--out .*run: a file is in the way", **kept(a_file, "run")),
    Case("tune --out onto a training run folder", ["draftheads", "tune", "--verifier={v}", "--candidate", "ngram",
                                                  "--prompts", "{tmp}/prompts.jsonl", "--out", "{tmp}/run"],
         r"--out .*run: it holds a training run folder .*nothing was written", **kept(run_and_prompts, "run")),
    Case("eval --out onto a feature cache", [*EVAL[:-1], "{tmp}/cache"],
         r"--out .*cache: it holds a feature cache .*nothing was written", **kept(cache_and_prompts, "cache")),
    # ---- the feature cache
    Case("offline run on a cache shard with one byte flipped (same size)", train(*OFFLINE, **OWN_OFF),
         r"train-00000\.safetensors: sha256 differs from index\.json", setup=cache_bytes_flipped),
    Case("offline run on a shard holding token id -7 (its hashes rewritten to match)", train(*OFFLINE, **OWN_OFF),
         r"row 1 holds token id -7", setup=cache_negative_id),
    Case("dump: an hf cache continued with --backend vllm", [*DUMP, *train(**OWN)[2:], "--out", "{tmp}/cache",
                                                             "--backend", "vllm"],
         r"plan\.json: this cache was started with backend='hf', this dump has backend='vllm'", setup=dumped,
         env=NO_VLLM, check=lambda tmp: (tmp / "cache" / "index.json").is_file()),
    Case("dump: --backend vllm without vLLM", [*DUMP, *train()[2:], "--out", "{tmp}/cache", "--backend", "vllm"],
         r"DRAFTHEADS_VLLM_PYTHON='/nonexistent/python': no such file", env=NO_VLLM),
    Case("dump: --backend vllm --tensor-parallel-size 0", [*DUMP, *train()[2:], "--out", "{tmp}/cache", "--backend",
                                                          "vllm", "--tensor-parallel-size", "0"],
         r"tensor_parallel_size=0: expected 1, or more with backend vllm", env=NO_VLLM),
    Case("dump: --tensor-parallel-size 2 with the hf backend", [*DUMP, *train()[2:], "--out", "{tmp}/cache",
                                                               "--tensor-parallel-size", "2"],
         r"tensor_parallel_size=2: expected 1, or more with backend vllm"),
    # ---- regenerate
    Case("regenerate: --backend vllm with --device", [*REGEN, "--backend", "vllm", "--device", "cpu"],
         r"--device is the hf backend's", env=NO_VLLM),
    Case("regenerate: --tensor-parallel-size with the hf backend", [*REGEN, "--tensor-parallel-size", "2"],
         r"--tensor-parallel-size and --max-model-len are the vllm backend's"),
    Case("regenerate: --out in a folder that cannot be created", [*REGEN[:6], "/proc/draftheads/r.jsonl", *REGEN[7:]],
         r"--out /proc/draftheads/r\.jsonl"),
    Case("a text row with a lone surrogate escape (strict)", train("--data.strict=true", source="{tmp}/rows.jsonl"),
         r"rows\.jsonl:13: .*a lone surrogate", setup=surrogate_rows),
    Case("a text row with a lone surrogate escape (not strict)", train(source="{tmp}/rows.jsonl"), r"^$",
         setup=surrogate_rows, code=(0,), check=exported,
         behaviour="trains on the other 12 rows; a warning names the skipped row (rows.jsonl:13, a lone surrogate)"),
    # ---- config keys of the newer drafters and sections
    Case("dflash.hidden_act not an activation vLLM knows", [*DFLASH, "--dflash.hidden_act=swishy"],
         r"dflash\.hidden_act='swishy': expected"),
    Case("dflash.loss misspelt", [*DFLASH, "--dflash.loss=dpace2"], r"dflash\.loss.*dpace2"),
    Case("dflash.dpace_alpha above 1", [*DFLASH, "--dflash.loss=dpace", "--dflash.dpace_alpha=2"],
         r"dflash\.dpace_alpha=2(\.0)?: expected a number in \(0, 1\]"),
    Case("eagle.checkpoint_layers not a boolean", [*TRAIN, "--eagle.checkpoint_layers=maybe"],
         r"checkpoint_layers.*maybe"),
    Case("eagle.checkpoint_layers with EAGLE-1", [*EAGLE1, "--eagle.checkpoint_layers=true"],
         r"checkpoint_layers"),
    Case("a negative train.seed", [*TRAIN, "--train.seed=-1"], r"train\.seed=-1"),
    Case("wandb.project with a character wandb refuses", [*TRAIN, "--wandb.project=a/b"], r"wandb\.project='?a/b"),
    Case("data.chat_template file missing", [*TRAIN, "--data.chat_template=nope.jinja"],
         r"data\.chat_template.*nope\.jinja"),
    Case("EAGLE-3 layer ids below 0", [*TRAIN, "--eagle.layer_ids=[-1,0,1]"], r"\[-1\] out of range|layer_ids"),
    Case("output_dir empty", [*TRAIN, "--output_dir="], r"output_dir"),
    Case("dflash.targets not data or verifier", [*DFLASH, "--dflash.targets=teacher"], r"dflash\.targets.*teacher"),
    Case("dflash.block_size of 1 (no token to draft)", [*DFLASH, "--dflash.block_size=1"], r"dflash\.block_size=1"),
    # ---- more of import-peer, regenerate and the writing verbs
    Case("import-peer --layer-ids: two ids", [*IMPORT, "--layer-ids", "1,2"],
         r"--layer-ids 1,2: expected three distinct layer ids", setup=drafter_for),
    Case("import-peer --layer-ids: not numbers", [*IMPORT, "--layer-ids", "a,b,c"],
         r"--layer-ids a,b,c: expected comma-separated layer ids", setup=drafter_for),
    Case("import-peer --layer-ids beyond the verifier's layers", [*IMPORT, "--layer-ids", "1,2,99"],
         r"--layer-ids.*99", setup=drafter_for),
    Case("import-peer: an EAGLE-1 drafter (import-peer reads EAGLE-3 folders)",
         ["draftheads", "import-peer", "--verifier={v}", "--draft", "{tmp}/eagle1"], r"not an EAGLE-3 drafter",
         setup=eagle1_drafter),
    Case("regenerate: --backend vllm --tensor-parallel-size 0", [*REGEN, "--backend", "vllm",
                                                                 "--tensor-parallel-size", "0"],
         r"--tensor-parallel-size must be positive", env=NO_VLLM),
    Case("tune --out onto a feature cache", ["draftheads", "tune", "--verifier={v}", "--candidate", "ngram",
                                            "--prompts", "{tmp}/prompts.jsonl", "--out", "{tmp}/cache"],
         r"--out .*cache: it holds a feature cache .*nothing was written", **kept(cache_and_prompts, "cache")),
    # ---- recheck and serve-check
    Case("recheck: a Medusa-2 run whose drafter folder was replaced since", [*RECHECK, "{tmp}/results.json"],
         r"--draft .*medusa: the drafter folder the run decoded with had content digest 0000000000000000, the "
         r"folder there now has \w+ \(replaced since\)", setup=medusa_replaced),
    Case("serve-check: a DFlash drafter with mixed sliding and full layers, on a machine without a GPU",
         [*SERVE, "{tmp}/dflash"], r"^$", setup=mixed_dflash, code=(1,), env=NO_VLLM,
         check=not_judged(r"mix sliding and full attention"),
         behaviour="VERDICT NOT JUDGED, exit 1, before vLLM starts: vLLM serves mixed layers only with its V2 runner, "
                   "on a GPU"),
    Case("serve-check: drafter weights truncated", [*SERVE, "{tmp}/drafter"], r"^$", setup=drafter_weights_cut,
         code=(1,), env=NO_VLLM, check=not_judged(r"model\.safetensors: unreadable"),
         behaviour="VERDICT NOT JUDGED (the safetensors file is unreadable), exit 1, before vLLM starts"),
]

@contextlib.contextmanager
def environment(env: dict | None):
    """os.environ with `env` applied (None unsets a variable), restored afterwards."""
    saved = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt while a command runs, as in a terminal, however the suite was started: a shell
    that starts a job in the background without job control (`cmd &` in a script) hands it SIGINT ignored, and
    Python keeps an inherited SIG_IGN, so the Ctrl-C cases would see the command run to its end."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_cli(argv: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run a command line in this process: (exit code, what it printed to stderr)."""
    import importlib

    err = io.StringIO()
    prog = argv[1:]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), environment(env), \
            ctrl_c_raises():
        code = 0
        try:
            if argv[0] == "draftheads":  # the command, as a user types it
                from draftheads.cli import main

                code = main(prog) or 0
            elif prog[0] == "-m":
                module, args = prog[1], prog[2:]
                if module == "eval":
                    module = "draftheads.eval.__main__"
                main = importlib.import_module(module).main
                if module.startswith("train.") and module != "draftheads.train.dump_features":
                    raise ValueError(module)
                result = main(args)
                code = result or 0
            else:
                script, args = prog[0], prog[1:]
                from draftheads.train.cli import main_guard

                reset_accelerate()
                if script == "train/eagle.py":
                    import draftheads.train.eagle as trainer

                    main_guard(trainer.main, trainer.EagleRunConfig, args)
                else:
                    import draftheads.train.medusa as trainer

                    main_guard(trainer.main, trainer.MedusaRunConfig, args)
        except SystemExit as exit_:
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
                code = 1
            else:
                code = exit_.code or 0
        except Exception as exc:  # what a user would see as a traceback: recorded, and the case fails
            print(f"Traceback (most recent call last): {type(exc).__name__}: {exc}", file=sys.stderr)
            code = -1
    return code, err.getvalue()


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    global VERIFIER, DATA, ROOT_TMP
    root = ROOT_TMP = tmp_path_factory.mktemp("reliability")
    VERIFIER = save_tiny_verifier_with_tokenizer(root / "verifier")
    DATA = write(root / "data.jsonl", "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) + "\n"
                                              for i in range(12)))
    os.chdir(ROOT)  # the commands name configs/... relative to the checkout, as a user runs them
    rows = []
    try:
        for i, case in enumerate(CASES):
            tmp = root / f"case{i:02d}"
            tmp.mkdir()
            if case.setup:
                case.setup(tmp)
            argv = [a.format(v=VERIFIER, tmp=tmp, data=DATA) for a in case.command]
            started = time.perf_counter()
            code, err = run_cli(argv, case.env)
            seconds = time.perf_counter() - started
            lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))
                     and not PROGRESS.search(line) and not WANDB_NOISE.search(line)]
            checked = None
            if case.check is not None:
                try:
                    case.check(tmp)
                except AssertionError as failure:
                    checked = f"check failed: {failure}"
            rows.append((case, argv, code, lines, tmp, checked, seconds))
    finally:
        for proc in HOLDERS:
            proc.kill()
    return root, rows


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.what for c in CASES])
def test_each_case_ends_in_one_clear_line_or_works(catalogue, index):
    _, rows = catalogue
    case, argv, code, lines, _, checked, _ = rows[index]
    assert code in case.code, (case.what, code, lines)
    assert not any("Traceback" in line for line in lines), (case.what, lines)
    assert checked is None, (case.what, checked)
    if case.behaviour is not None:  # it must simply work: no error line
        assert not any(line.startswith(("error", "config error")) for line in lines), (case.what, lines)
        return
    assert len(lines) == 1, (case.what, lines)  # one line (argparse's usage line aside)
    assert re.search(case.expect, lines[0]), (case.what, case.expect, lines[0])


def test_the_catalogue_is_large_and_quick(catalogue):
    """At least 170 cases, each a clear line or a working command, in a time a CI can afford (the heaviest named)."""
    _, rows = catalogue
    assert len(rows) >= 170, len(rows)
    total = sum(row[6] for row in rows)
    slowest = sorted(rows, key=lambda row: -row[6])[:3]
    print(f"{len(rows)} cases in {total:.1f} s; slowest: " + ", ".join(f"{r[0].what} ({r[6]:.1f} s)" for r in slowest))


BASES = {"python train/eagle.py <tiny run>": TRAIN, "python train/medusa.py <tiny run>": MEDUSA,
         "draftheads eval <tiny eval>": EVAL, "draftheads dump-features <tiny run>": ["draftheads", "dump-features",
                                                                                       *TRAIN[2:]]}


def shorten(case: Case) -> str:
    """The command as the table shows it: a base named once above the table, then what this case adds (a flag it
    replaces shows with its new value)."""
    command = case.command
    for name, base in BASES.items():
        if command[:2] != base[:2] or sum(a in command for a in base) < len(base) - 3:
            continue
        if command[:len(base)] == base:
            extra = command[len(base):]
        else:  # flags replaced: each new value, with its flag when the flag is a separate word
            extra = []
            for i, a in enumerate(command):
                if a not in base:
                    if i and command[i - 1].startswith("--") and "=" not in command[i - 1] and command[i - 1] in base:
                        extra.append(command[i - 1])
                    extra.append(a)
        return " ".join([name, *extra])
    return " ".join(command)


def table(root: Path, rows) -> str:
    names = dict(v="<verifier>", tmp="<tmp>", data="<data.jsonl>")
    out = ["`<tiny run>` is `" + " ".join(TRAIN[2:]).format(**names) + "` (configs/medusa-tiny.yaml for Medusa); "
           "`<tiny eval>` is `" + " ".join(EVAL[2:]).format(**names) + "`; a case replaces a flag or adds its own.", "",
           "| # | bad input or fault | command | what the user reads |", "|---:|---|---|---|"]
    for i, (case, argv, code, lines, tmp, _, _) in enumerate(rows, 1):
        def clean(text: str) -> str:
            return text.replace(str(tmp), "<tmp>").replace(str(VERIFIER), "<verifier>").replace(
                str(DATA), "<data.jsonl>").replace(str(root), "<tmp>")

        shown = clean(shorten(case).format(v="<verifier>", tmp="<tmp>", data="<data.jsonl>"))
        line = case.behaviour if case.behaviour is not None else clean(lines[0] if lines else "")
        line = re.sub(r"pid \d+ on \S+, since [\d: -]+", "pid N on HOST, since TIME", line)
        line = re.sub(r"sha256 [0-9a-f]{8} -> [0-9a-f]{8}", "sha256 OLD -> NEW", line)  # files holding tmp paths
        out.append(f"| {i} | {case.what} | `{shown}` | exit {code}: {line.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def test_docs_table_is_current(catalogue):
    root, rows = catalogue
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC}: the {BEGIN} ... {END} markers are missing"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    current = f"{head}{BEGIN}\n{table(root, rows)}{END}{tail}"
    if os.environ.get("DRAFTHEADS_WRITE_DOCS") == "1":
        DOC.write_text(current)
    assert DOC.read_text() == current, ("docs/reliability-catalogue.md is stale: rerun with "
                                        "DRAFTHEADS_WRITE_DOCS=1 python -m pytest tests/e2e/test_reliability.py")
