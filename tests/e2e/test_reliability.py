"""The reliability catalogue: bad inputs and faults a user meets, each run through the real command, each ending in one
clear line (no traceback) that names the flag, key, file or row and what to do; faults mid-run end with the last
complete checkpoint intact and a rerun that ends with the uninterrupted run's weights.

The table in docs/reliability.md (between the `catalogue` markers) is written from these cases: the test fails when
the page differs, and `DRAFTHEADS_WRITE_DOCS=1 python -m pytest tests/e2e/test_reliability.py` rewrites it.
Commands run in this process (the CLIs' `main` with their argv) so the whole catalogue takes seconds; temporary
paths appear as `<tmp>` in the table.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.utils import reset_accelerate, save_tiny_verifier, save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- catalogue:begin -->", "<!-- catalogue:end -->"

pytestmark = pytest.mark.usefixtures("fresh_accelerate", "one_thread")


@dataclass
class Case:
    what: str
    """The bad input or fault."""
    command: list[str]
    """The command line as a user types it (`{v}` the verifier, `{tmp}` a fresh folder, `{data}` the data file)."""
    expect: str
    """A regex the one line must match (what it names)."""
    setup: object = None
    """fn(tmp) -> None: make the bad thing first."""
    code: tuple[int, ...] = (1, 2)


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


def holder(tmp):
    """Another process holds {tmp}/run (its lock)."""
    (tmp / "run").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 777 on "
        "node-3'); f.flush(); print('ok', flush=True); time.sleep(120)"), str(tmp / "run" / ".lock")],
        stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    HOLDERS.append(proc)


HOLDERS: list = []
PROGRESS = re.compile(r"\d+%\|.*\|")  # a progress bar (transformers' "Loading weights"): not a message
VERIFIER = DATA = None  # set by the fixture


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
    Case("output_dir is a file", TRAIN, r"output_dir=.*run' is a file", setup=a_file),
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
    Case("eval: prompts file missing", [*EVAL[:4], "{tmp}/none.jsonl", *EVAL[5:]], r"none\.jsonl"),
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


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Run a command line in this process: (exit code, what it printed to stderr)."""
    import importlib

    err = io.StringIO()
    prog = argv[1:]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
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
    global VERIFIER, DATA
    root = tmp_path_factory.mktemp("reliability")
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
            code, err = run_cli(argv)
            lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))
                     and not PROGRESS.search(line)]
            rows.append((case, argv, code, lines, tmp))
    finally:
        for proc in HOLDERS:
            proc.kill()
    return root, rows


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.what for c in CASES])
def test_each_case_ends_in_one_clear_line(catalogue, index):
    _, rows = catalogue
    case, argv, code, lines, _ = rows[index]
    assert code in case.code, (case.what, code, lines)
    assert lines and not any("Traceback" in line for line in lines), (case.what, lines)
    assert len(lines) == 1, (case.what, lines)  # one line (argparse's usage line aside)
    assert re.search(case.expect, lines[0]), (case.what, case.expect, lines[0])


BASES = {"python train/eagle.py <tiny run>": TRAIN, "python train/medusa.py <tiny run>": MEDUSA,
         "draftheads eval <tiny eval>": EVAL}


def shorten(case: Case) -> str:
    """The command as the table shows it: a base named once above the table, then what this case adds."""
    for name, base in BASES.items():
        if case.command[:2] == base[:2] or case.command[:3] == base[:3]:
            extra = [a for a in case.command if a not in base]
            return " ".join([name, *extra])
    return " ".join(case.command)


def table(root: Path, rows) -> str:
    names = dict(v="<verifier>", tmp="<tmp>", data="<data.jsonl>")
    out = ["`<tiny run>` is `" + " ".join(TRAIN[2:]).format(**names) + "` (configs/medusa-tiny.yaml for Medusa); "
           "`<tiny eval>` is `" + " ".join(EVAL[2:]).format(**names) + "`; a case replaces a flag or adds its own.", "",
           "| # | bad input or fault | command | what the user reads |", "|---:|---|---|---|"]
    for i, (case, argv, code, lines, tmp) in enumerate(rows, 1):
        def clean(text: str) -> str:
            return text.replace(str(tmp), "<tmp>").replace(str(VERIFIER), "<verifier>").replace(
                str(DATA), "<data.jsonl>").replace(str(root), "<tmp>")

        shown = clean(shorten(case).format(v="<verifier>", tmp="<tmp>", data="<data.jsonl>"))
        line = clean(lines[0] if lines else "")
        line = re.sub(r"pid \d+ on \S+, since [\d: -]+", "pid N on HOST, since TIME", line)
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
    assert DOC.read_text() == current, ("docs/reliability.md's catalogue is stale: rerun with "
                                        "DRAFTHEADS_WRITE_DOCS=1 python -m pytest tests/e2e/test_reliability.py")
