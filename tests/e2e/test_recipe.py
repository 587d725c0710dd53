"""The Llama-3.1-8B recipes of docs/train-eagle.md and docs/train-medusa.md, run as written on local stand-ins: the
commands are read from the pages (so the pages cannot drift from the code), the model id is replaced by a tiny local
verifier with a chat template, the downloaded ShareGPT file by a tiny one, MT-bench by a tiny question file, and the
run is cut to test size by overrides appended to each command (steps, rows, lengths, one process, the CPU). Nothing
else is changed: the configs, the flags and the data flow (ShareGPT -> regenerate -> train on `messages` rows ->
evaluate -> serve-check; Medusa: ShareGPT -> train -> evaluate -> serve-check) are the recipes'."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
pytestmark = [pytest.mark.usefixtures("fresh_accelerate", "one_thread")]

SIZE = {  # appended to the recipe's commands (later flags win)
    "train/eagle.py": ["--data.seq_len=64", "--data.max_rows=6", "--data.eval_rows=2", "--train.batch_size=2",
                       "--train.grad_accum=1", "--train.max_steps=2", "--train.warmup_steps=1", "--train.save_every=2",
                       "--train.eval_every=0", "--train.eval_batches=1", "--train.mixed_precision=no",
                       "--verifier_dtype=float32", "--eagle.ttt_steps=2", "--eagle.draft_vocab_size=128",
                       "--eagle.layer_ids=null", "--wandb.enabled=false"],
    "train/medusa.py": ["--data.seq_len=64", "--data.max_rows=6", "--data.eval_rows=2", "--train.batch_size=2",
                        "--train.grad_accum=1", "--train.max_steps=2", "--train.warmup_steps=1",
                        "--train.save_every=2", "--train.eval_every=0", "--train.eval_batches=1",
                        "--train.mixed_precision=no", "--verifier_dtype=float32", "--medusa.tree_budget=4",
                        "--wandb.enabled=false"],
    "draftheads.train.regenerate": ["--max-new-tokens", "8", "--num-rows", "8", "--batch-size", "4", "--device", "cpu"],
    "eval": ["--num-prompts", "2", "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32"],
}


#: the `draftheads` verbs the recipe uses -> the module each runs (draftheads/cli.py)
VERB_MODULES = {"regenerate": "draftheads.train.regenerate", "eval": "draftheads.eval",
                "serve-check": "draftheads.eval.interop.serve_check"}


#: page -> the first words of its recipe's commands, in order
RECIPES = {"train-eagle.md": ["hf", "draftheads", "accelerate", "draftheads", "draftheads"],
           "train-medusa.md": ["hf", "accelerate", "draftheads", "draftheads"]}


def recipe_commands(page: str) -> list[list[str]]:
    text = (ROOT / "docs" / page).read_text()
    block = re.search(r"## Recipe: Llama-3.1-8B-Instruct.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    return [shlex.split(line) for line in lines]


def flag(cmd: list[str], name: str) -> str | None:
    """The value of `--name=V` or `--name V` in cmd, else None."""
    for i, a in enumerate(cmd):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(cmd):
            return cmd[i + 1]
    return None


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    from tests.chat_tokenizers import chatml_tokenizer
    from tests.utils import save_tiny_verifier

    root = tmp_path_factory.mktemp("recipe")
    tok = chatml_tokenizer()
    vocab = -(-len(tok) // 64) * 64
    verifier = save_tiny_verifier(root / "model", vocab_size=vocab, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.eos_token_id, initializer_range=0.1)
    tok.save_pretrained(verifier)
    sharegpt = [{"id": str(i), "conversations": [{"from": "human", "value": f"Write f{i} in Python."},
                                                  {"from": "gpt", "value": f"def f{i}(x):\n    return x + {i}\n"}]}
                for i in range(12)]
    questions = [{"question_id": i, "category": "coding", "turns": [f"Explain list item {i}."]} for i in range(3)]
    (root / "mt_bench.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    return root, verifier, sharegpt


@pytest.mark.parametrize("page", list(RECIPES))
def test_the_recipe_runs_as_written(page, stand_ins, monkeypatch):
    from draftheads.eval.__main__ import main as eval_main
    from draftheads.eval.interop.serve_check import parser as serve_check_parser
    from draftheads.train.cli import main_guard
    from draftheads.train.regenerate import main as regenerate_main
    from tests.utils import reset_accelerate

    root, verifier, sharegpt = stand_ins
    monkeypatch.chdir(root)
    commands = recipe_commands(page)
    assert [c[0] for c in commands] == RECIPES[page], commands
    for cmd in commands:
        cmd = [str(verifier) if a == MODEL else a for a in cmd]
        if cmd[0] == "draftheads":  # a verb of the command: the module it runs, as `python -m` would name it
            cmd = ["python", "-m", VERB_MODULES[cmd[1]], *cmd[2:]]
        if cmd[0] == "hf":  # the download: the file where the command puts it
            assert cmd[1:2] == ["download"] and "--local-dir" in cmd
            folder = Path(cmd[cmd.index("--local-dir") + 1])
            folder.mkdir(parents=True, exist_ok=True)
            (folder / cmd[3]).write_text(json.dumps(sharegpt))
        elif cmd[0] == "accelerate":  # one process here: the launch config is the 8-GPU one
            assert cmd[1:4] == ["launch", "--config_file", "configs/accelerate/multi_gpu.yaml"]
            assert (ROOT / cmd[3]).is_file()
            script, args = cmd[4], cmd[5:]
            args = [a.replace("configs/", f"{ROOT}/configs/") if a.startswith("configs/") else a for a in args]
            reset_accelerate()
            from draftheads.train import eagle as train_eagle
            from draftheads.train import medusa as train_medusa

            trainer = train_eagle if script == "train/eagle.py" else train_medusa
            cls = trainer.EagleRunConfig if script == "train/eagle.py" else trainer.MedusaRunConfig
            main_guard(trainer.main, cls, [*args, f"--verifier={verifier}", *SIZE[script]])
            out = root / "runs" / ("llama3-8b-eagle3" if script == "train/eagle.py" else "llama3-8b-medusa")
            assert (out / "drafter" / "model.safetensors").is_file()
            meta = json.loads((out / "drafter" / "config.json").read_text())["draftheads"]
            config = ROOT / flag(cmd, "--config")
            data = flag(cmd, "--data.source") or re.search(r"^  source: (\S+)", config.read_text(), re.M).group(1)
            assert meta["training"]["data"] == data  # trained on the rows the recipe names
        elif cmd[1:3] == ["-m", "draftheads.train.regenerate"]:
            regenerate_main([*cmd[3:], *SIZE["draftheads.train.regenerate"]])
            rows = [json.loads(line) for line in Path("regen.jsonl").read_text().splitlines()]
            assert rows and all("messages" in r for r in rows)
        elif cmd[1:3] == ["-m", "draftheads.eval"]:
            args = [str(root / "mt_bench.jsonl") if a == "mt-bench" else a for a in cmd[3:]]
            args = [a for i, a in enumerate(args) if not (a == "--num-prompts" or args[i - 1] == "--num-prompts")]
            args = [a for i, a in enumerate(args) if not (a in ("--device", "--dtype") or
                                                          args[i - 1] in ("--device", "--dtype"))]
            assert eval_main([*args, *SIZE["eval"]]) == 0
            assert (root / flag(cmd, "--out") / "results.json").is_file()
        elif cmd[1:3] == ["-m", "draftheads.eval.interop.serve_check"]:  # vLLM is the interop suite's; here: the flags parse
            serve_check_parser().parse_args(cmd[3:])
        else:
            pytest.fail(f"a recipe command this test does not know: {cmd}")
